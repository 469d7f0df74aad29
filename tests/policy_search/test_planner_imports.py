"""The planner is pure: importing and running it never pulls in torch or the runtime packages."""
import subprocess
import sys

CODE = """
import sys
import policy_search
from policy_search import HardwareSpec, ModelSpec, Workload, search
search(ModelSpec.from_name("opt-125m"), HardwareSpec.preset("t4"), Workload(prompt_len=32, gen_len=8),
       scheduler="block", compress_weight=False, compress_kv=False, cpu_attention=False)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "offload", "quant", "flexsarathi"))
print(",".join(bad))
"""


def test_planner_imports_no_runtime():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""

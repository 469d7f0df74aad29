"""flexsarathi/machine/cpu_info.py: the benchmark header names the core generation."""
from __future__ import annotations

from flexsarathi.machine.cpu_info import cpu_generation, cpu_line

# Two processors as a 2-vCPU VM lists them: "model name" says only "AMD EPYC".
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu avx2 fma f16c

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 49
model name\t: AMD EPYC
"""


def test_family_and_model_of_the_first_processor(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpu_generation(str(path)) == "family 25 model 1"  # "model name" is not "model"
    path.write_text("processor\t: 0\nmodel name\t: QEMU Virtual CPU\n")
    assert cpu_generation(str(path)) == ""
    assert cpu_generation(str(tmp_path / "absent")) == ""


def test_the_header_carries_it_where_listed():
    generation = cpu_generation()
    assert (f"({generation})," in cpu_line()) if generation else ("(family" not in cpu_line())

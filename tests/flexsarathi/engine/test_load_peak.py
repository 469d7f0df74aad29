"""A load never holds more memory than the engine reports: the peak of each tier's use in its tracker
(what it holds once loaded, plus the load's own reservation, "loading (layers in flight)": the layer
placed and the one read ahead as the source gives them, and one weight's read).

Measured in a child process by the kernel's count of its resident pages (VmHWM, anonymous and
file-backed: a checkpoint read through a mapping counts too), after a warm-up load of a small
checkpoint of the same format (imports, C kernels: not the load's) and a reset of the peak
(/proc/self/clear_refs),
for a llama with a large vocabulary and an untied head: safetensors, GGUF (Q4_0, its embedding and
head kept as codes), the GGUF with half of each layer on disk (the store written by this load), and
the safetensors with a LoRA adapter of every linear and the head merged as it loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import REPO
from tests.gguf_files import write_gguf


def save_adapter(base: str, folder: str, targets: list[str]) -> None:
    from tests.flexsarathi.formats.test_lora_adapter import save_adapter as save

    pytest.importorskip("peft")
    save(base, folder, targets)

MiB = 1 << 20
# What the load allocates that no tracker counts: Python objects (the plan, per-layer dicts, the
# GGUF reader's metadata), the reader and pool threads' stacks as far as touched, and the part of
# glibc's heaps malloc_trim cannot hand back (free chunks not spanning whole pages, M_TOP_PAD's 128
# KiB per arena). Measured 0.4-2 MiB at these sizes (the llama-3-8b GGUF: 0.08 GB of 5.0 held).
SLACK = 8 * MiB
CONFIG = dict(vocab_size=65536, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5)

PROGRAM = textwrap.dedent("""
    import gc, json, os, shutil, sys
    from flexsarathi import LLM
    from offload.host_malloc import release_free_heap
    from policy_search import Policy

    model, warm, disk, folder, lora = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5] or None
    policy = Policy(w_gpu=1 - disk, w_cpu=0.0, w_disk=disk, kv_gpu=1.0, kv_cpu=0.0, kv_disk=0.0,
                    compress_weight=disk > 0) if disk else None

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    def load(path, offload, adapter=None):
        return LLM(path, policy=policy, cpu_matmul="int8", offload_dir=offload, lora=adapter)

    llm = load(warm, os.path.join(folder, "warm"))
    llm.close()
    del llm
    gc.collect()
    release_free_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    llm = load(model, os.path.join(folder, "measured"), lora)  # a fresh store: written by this load
    peak = status("VmHWM") - base
    report = llm.engine.memory.report()
    print(json.dumps({"peak": peak, "report": report}))
""")


def write_checkpoints(folder, **changes) -> dict[str, str]:
    """{format: model path} of one llama of CONFIG with `changes`, bf16 safetensors and Q4_0 GGUF."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**CONFIG, **changes})
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder / "safetensors", safe_serialization=True)
    write_gguf(model.float(), folder / "model.gguf", weight_type="Q4_0", embed_type="Q4_0")
    return {"safetensors": str(folder / "safetensors"), "gguf": str(folder / "model.gguf")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the measured checkpoints, their small twins for the warm-up: vocabulary 512, one layer)."""
    return (write_checkpoints(tmp_path_factory.mktemp("load_peak")),
            write_checkpoints(tmp_path_factory.mktemp("load_peak_warm"), vocab_size=512, num_hidden_layers=1))


def measure(model: str, warm: str, disk: float, folder, lora: str = "") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PROGRAM, model, warm, str(disk), str(folder), lora], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs "
                    "(VmHWM reset)")
@pytest.mark.parametrize("kind, disk", [("safetensors", 0.0), ("gguf", 0.0), ("gguf", 0.5), ("lora", 0.0)])
def test_load_peak_within_what_the_engine_reports(checkpoints, tmp_path, kind, disk):
    big, warm = checkpoints
    lora = ""
    if kind == "lora":  # the safetensors with an adapter of every linear and the 65536-row head
        lora = str(tmp_path / "adapter")
        save_adapter(big["safetensors"], lora, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj", "lm_head"])
    model = big["safetensors" if kind == "lora" else kind]
    got = measure(model, warm["safetensors" if kind == "lora" else kind], disk, tmp_path, lora)
    report = got["report"]
    held = report["gpu"]["in_use"] + report["cpu"]["in_use"]
    bound = report["gpu"]["peak"] + report["cpu"]["peak"]
    loading = bound - held
    print(f"\n{kind} disk {disk}: load peak {got['peak'] / MiB:.1f} MiB; held {held / MiB:.1f}, "
          f"+ loading {loading / MiB:.1f} = {bound / MiB:.1f} MiB reported")
    # the load's reservation is what its source tells from the headers: nonzero, gone once loaded
    assert loading > 0 and "loading (layers in flight)" not in report["cpu"]["by_what"]
    assert got["peak"] <= bound + SLACK, (
        f"{kind}: the load peaked {(got['peak'] - bound) / MiB:.1f} MiB above what the engine reports "
        f"(held {held / MiB:.1f} MiB + its load reservation {loading / MiB:.1f} MiB) + {SLACK // MiB} MiB slack")


def test_load_reads_ahead_only_where_the_cpu_budget_has_room(checkpoints, tmp_path):
    """The load's reservation: two layers in flight and one weight's read where the cpu tier has room
    for them, else one layer (no read ahead), else one MemoryBudgetError with the arithmetic."""
    from flexsarathi.engine.llm_engine import EngineConfig, LLMEngine
    from flexsarathi.formats.opened_model import open_model
    from offload.memory import MemoryBudgetError, TierBudget
    from offload.tiered_weights import LOADING

    model = checkpoints[0]["gguf"]
    source = open_model(model).source
    source.use_for(compress_weight=False, weights_on_disk=False)  # as the engine below: all in RAM, default policy
    layer, read = source.load_bytes(torch.float32)
    for cpu, reads_ahead in ((2 * layer + read, True), (2 * layer + read - 1, False), (layer + read, False)):
        engine = LLMEngine(EngineConfig(model, dtype=torch.float32, device="cpu", budget=TierBudget(cpu=cpu),
                                        offload_dir=str(tmp_path)))
        assert engine.weights.placed.read_ahead is reads_ahead
        assert engine.memory.peak_by_what("cpu")[LOADING] == (2 if reads_ahead else 1) * layer + read
        assert engine.memory.in_use("cpu") == 0
        engine.close()
    with pytest.raises(MemoryBudgetError, match="reserving 'loading"):
        LLMEngine(EngineConfig(model, dtype=torch.float32, device="cpu", budget=TierBudget(cpu=layer + read - 1),
                               offload_dir=str(tmp_path)))

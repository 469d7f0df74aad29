"""The GPU's decode route over a compressed KV pool (KVPool.attend_decode through
quant/triton_kv_attention.py, its indices from one DecodePlan per pass) run on the CPU in Triton's
interpreter (`triton_decodes_on_cpu`): the pool call against the gather route it replaces (sliding
windows included), and whole engines, every placement giving the all-on-device tokens. Run in a
subprocess: TRITON_INTERPRET=1 must be set before triton is imported. A GPU runs the compiled kernel
through the same code (tests/offload/test_cuda.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernel "
                                 "(tests/offload/test_cuda.py); the interpreter stands in only without a GPU")]


def _run(script: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                            timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


_COUNTED = """
    from quant import triton_kv_attention
    calls = [0]
    _kernel = triton_kv_attention.decode_attention
    def _counted(*args, **kwargs):
        calls[0] += 1
        return _kernel(*args, **kwargs)
    triton_kv_attention.decode_attention = _counted
"""


def test_the_pool_attends_a_decode_as_the_gather_route_does():
    out = _run(_COUNTED + """
    from offload.kv_cache import KVCompression, triton_decodes_on_cpu
    from tests.offload.test_kv_cache import BS, test_decode_attention_in_the_pool_equals_gather_then_attend as check
    with triton_decodes_on_cpu():
        for lengths, window in [([11, 4, 7], None), ([1, 12, 8], None), ([11, 4, 7], 5), ([15, 3, 9], 2)]:
            check(lengths, window, KVCompression(bits=4, block_size=BS, value_group=8))
    print("calls", calls[0])
    """)
    assert out.split()[-1] == "4"  # each pool call took the kernel


def test_every_placement_gives_the_all_on_device_tokens():
    """The reference runs the CPU's own route (quant/cpu_kv_attention.py); each placement here takes
    the Triton kernel for every decode over a compressed pool (its own parts; delegated CPU attention
    of host parts too, since every pool is on the CPU here): the same greedy tokens, and logprobs
    equal within fp32 rounding of a different summation order."""
    out = _run(_COUNTED + """
    import tempfile, torch
    from conftest import build_hf_model
    from flexsarathi import LLM, SamplingParams
    from offload.kv_cache import triton_decodes_on_cpu
    from policy_search import Policy

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (3, 13, 7, 20, 5)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    base = dict(gpu_batch_size=2, prefill_budget=6, compress_kv=True)

    def run(folder, **placement):
        llm = LLM(folder, dtype="float32", policy=Policy(**base, **placement), kv_block_size=8,
                  cpu_matmul="dequantize", offload_dir=tempfile.mkdtemp())
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [o.token_ids for o in outs], [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]

    for kind in ("llama_gqa_untied", "opt"):
        folder = tempfile.mkdtemp()
        build_hf_model(kind).save_pretrained(folder, safe_serialization=True)
        tokens, logprobs = run(folder)
        with triton_decodes_on_cpu():
            for placement in [{}, dict(kv_gpu=0.3, kv_cpu=0.4, kv_disk=0.3, cpu_attention=True),
                              dict(num_gpu_batches=2), dict(scheduler="block", w_gpu=0.5, w_cpu=0.5)]:
                before = calls[0]
                got, got_logprobs = run(folder, **placement)
                assert got == tokens, (kind, placement)
                diff = max(abs(a - b) for x, y in zip(got_logprobs, logprobs) for a, b in zip(x, y))
                assert diff < 1e-4, (kind, placement, diff)
                assert calls[0] > before, (kind, placement)
    print("ok")
    """)
    assert out.strip().endswith("ok")

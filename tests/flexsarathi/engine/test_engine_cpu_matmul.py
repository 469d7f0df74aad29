"""The engine's `cpu_matmul` choice for 4-bit weights on the CPU: the int8 kernel's passes give the
greedy tokens of dequantize + matmul (int8x2, the default where the kernel builds) on the real
stories260K checkpoint, and every placement of a 4-bit model gives the all-on-device tokens under
each choice (the kernel's arithmetic does not depend on where a weight's rows came from)."""
from __future__ import annotations

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from flexsarathi.errors import FlexSarathiError
from policy_search import Policy
from quant import cpu_int8_matmul
from tests.prompt_logits import prompt_logits

needs_kernel = pytest.mark.skipif(not cpu_int8_matmul.available(),
                                  reason=f"int8 kernel not available: {cpu_int8_matmul.unavailable_reason()}")
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _stories_prompts(text: str) -> list[str]:
    return [story.strip()[:160] for story in text.split("<|endoftext|>")[:8] if story.strip()]


def _run(model: str, mode: str, prompts, tmp_path, **policy):
    llm = LLM(model, dtype="float32", device="cpu", policy=Policy(compress_weight=True, **policy),
              offload_dir=str(tmp_path / "offload"), cpu_matmul=mode)
    tokens = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    return tokens, llm


@needs_kernel
def test_int8x2_passes_give_the_dequantizing_tokens_on_stories260k(stories_dir, tinystories_text, tmp_path,
                                                                   monkeypatch):
    prompts = _stories_prompts(tinystories_text)
    exact, exact_llm = _run(stories_dir, "dequantize", prompts, tmp_path)
    planes = []
    kernel = cpu_int8_matmul.int8_linear
    monkeypatch.setattr(cpu_int8_matmul, "int8_linear", lambda *a, **k: planes.append(a[3]) or kernel(*a, **k))
    fast, fast_llm = _run(stories_dir, "auto", prompts, tmp_path)
    assert planes and set(planes) == {2}  # the kernel ran, with two planes
    assert fast_llm.engine.cpu_matmul == "int8x2" and exact_llm.engine.cpu_matmul == "dequantize"
    assert fast == exact
    # decode-sized passes (a few rows) ran the kernel: their logits are close, not identical
    ids = [exact_llm.tokenizer.encode(p)[:6] for p in prompts[:2]]
    a, b = prompt_logits(exact_llm, ids), prompt_logits(fast_llm, ids)
    for x, y in zip(a, b):
        assert (x - y).abs().max() < 1e-3 * max(1.0, float(x.abs().max()))


@needs_kernel
@pytest.mark.parametrize("mode", ["int8x2", "int8"])
def test_every_placement_gives_the_all_on_device_tokens_under_the_kernel(stories_dir, tinystories_text, tmp_path,
                                                                         mode):
    prompts = _stories_prompts(tinystories_text)[:4]
    reference, _ = _run(stories_dir, mode, prompts, tmp_path / "ref")
    for name, placement in {"cpu_disk": dict(w_gpu=0.0, w_cpu=0.5, w_disk=0.5),
                            "split_rows": dict(w_gpu=0.3, w_cpu=0.4, w_disk=0.3, num_gpu_batches=2)}.items():
        tokens, _ = _run(stories_dir, mode, prompts, tmp_path / name, **placement)
        assert tokens == reference, name


@needs_kernel
def test_int8_passes_multiply_resident_weights_from_the_kernels_panels(stories_dir, tmp_path):
    """With cpu_matmul="int8" every pass runs the kernel, so each 4-bit weight's rows on the compute
    tier are stored in its panels at load (quant/panels.py): the resident layers' weights, and the
    in-place rows of a weight split over tiers. int8x2 dequantizes prompt-sized matmuls instead and
    keeps them row-major. (Their tokens equal the row-major placements' above.)"""
    def panelled(mode, **policy):
        llm = LLM(stories_dir, dtype="float32", device="cpu", policy=Policy(compress_weight=True, **policy),
                  offload_dir=str(tmp_path / f"{mode}{len(policy)}"), cpu_matmul=mode)
        weights = llm.engine.executor.weights
        layer = weights.get(0)
        weights.release(0)
        return {name: tuple(getattr(part, "panels", None) for part in getattr(w, "parts", (w,)))
                for name, w in layer.items()}, weights._panelled

    layer, stored = panelled("int8")
    assert layer["qkv_proj.weight"] == (True,) and layer["gate_up_proj.weight"] == (True,)
    assert layer["down_proj.weight"] == (False,)  # K = 172: not a case the kernel covers, kept as it is
    assert len(stored) == 3 * 5  # qkv, o, gate_up of each of the 5 layers
    layer, _ = panelled("int8", w_gpu=0.3, w_cpu=0.4, w_disk=0.3, num_gpu_batches=2)
    assert layer["gate_up_proj.weight"] == (True, False)  # its compute-tier rows in place, the rest streamed
    assert not panelled("int8x2")[1]


def test_an_unknown_choice_is_one_clear_error(stories_dir, tmp_path):
    with pytest.raises(FlexSarathiError, match="cpu_matmul='fast'.*auto, int8x2, int8, dequantize"):
        LLM(stories_dir, dtype="float32", offload_dir=str(tmp_path), cpu_matmul="fast")


def test_on_a_gpu_compute_device_auto_is_dequantize_and_int8_is_refused():
    """The weights' matmuls run on the GPU there (found on an H200: an engine on CUDA reported
    cpu_matmul='int8x2' though the kernel never ran)."""
    from flexsarathi.engine.llm_engine import resolve_cpu_matmul

    assert resolve_cpu_matmul("auto", "cuda") == "dequantize"
    assert resolve_cpu_matmul("dequantize", "cuda") == "dequantize"
    for mode in ("int8", "int8x2"):
        with pytest.raises(FlexSarathiError, match=f"cpu_matmul='{mode}' is for a CPU compute device"):
            resolve_cpu_matmul(mode, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_on_cuda_runs_no_cpu_kernel(stories_dir, tinystories_text, tmp_path, monkeypatch):
    prompts = _stories_prompts(tinystories_text)[:2]
    calls = []
    monkeypatch.setattr(cpu_int8_matmul, "int8_linear", lambda *a, **k: calls.append(1))
    llm = LLM(stories_dir, dtype="float32", device="cuda", policy=Policy(compress_weight=True),
              offload_dir=str(tmp_path / "offload"))
    assert llm.engine.cpu_matmul == "dequantize"
    llm.generate(prompts, PARAMS, use_tqdm=False)
    assert not calls
    with pytest.raises(FlexSarathiError, match="is for a CPU compute device"):
        LLM(stories_dir, dtype="float32", device="cuda", cpu_matmul="int8", offload_dir=str(tmp_path / "o2"))

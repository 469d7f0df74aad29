"""`compress_head`: the LM head kept 4-bit on the compute device. Its logits are those of the
dequantized head (transformers with the head replaced by dequantize(quantize(head)) gives the same
greedy tokens); the int8 kernel's passes give the dequantizing route's tokens; the tracker counts
the head's 4-bit bytes and the planner prices them; a model whose head is its tied embeddings is
one clear error."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from flexsarathi import LLM, SamplingParams
from flexsarathi.engine.llm_engine import HEAD
from flexsarathi.errors import FlexSarathiError
from policy_search import Policy
from quant import cpu_int8_matmul, dequantize, quantize
from quant.panels import from_panels
from quant.config import WEIGHT_QUANT
from tests.flexsarathi.models.test_models import hf_greedy

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42, 7], [120, 8, 8, 64], [33] * 9]


def _engine(folder: str, tmp_path, **options) -> LLM:
    return LLM(folder, dtype="float32", device="cpu", policy=Policy(), offload_dir=str(tmp_path / "offload"),
               **options)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_the_compressed_head_gives_transformers_tokens_with_the_dequantized_head(tiny_checkpoint, tmp_path):
    folder, model = tiny_checkpoint("llama_gqa_untied")
    reference = copy.deepcopy(model)
    with torch.no_grad():
        head = reference.lm_head.weight
        head.copy_(dequantize(quantize(head.detach().clone(), WEIGHT_QUANT), torch.float32))
    llm = _engine(folder, tmp_path, compress_head=True, cpu_matmul="dequantize")
    try:
        assert _tokens(llm) == [hf_greedy(reference, p, PARAMS.max_tokens) for p in PROMPTS]
        assert _tokens(llm) != [hf_greedy(model, p, PARAMS.max_tokens) for p in PROMPTS]  # the head really is the 4-bit one
    finally:
        llm.close()


def test_the_tracker_counts_the_heads_4bit_bytes(tiny_checkpoint, tmp_path):
    folder, model = tiny_checkpoint("llama_gqa_untied")
    plain, small = _engine(folder, tmp_path), _engine(folder, tmp_path, compress_head=True)
    try:
        head = model.lm_head.weight.detach()
        saved = head.nbytes - quantize(head.clone(), WEIGHT_QUANT).nbytes
        before = plain.engine.memory.in_use_by_what("gpu")["embeddings and head"]
        assert small.engine.memory.in_use_by_what("gpu")["embeddings and head"] == before - saved > 0
    finally:
        plain.close()
        small.close()


@pytest.fixture(scope="module")
def untied128(tmp_path_factory) -> str:
    """An untied llama whose head has 128 inputs: whole groups of 64 (no padding), and a shape the
    int8 kernel covers."""
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=128, intermediate_size=192,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("untied128")
    AutoModelForCausalLM.from_config(config).float().eval().save_pretrained(folder, safe_serialization=True)
    return str(folder)


@pytest.mark.parametrize("compress_head", [False, True])
def test_the_planner_prices_the_bytes_the_engine_reserves(untied128, tmp_path, compress_head):
    """`policy="auto"` with compress_head plans the head's 4-bit bytes: the planner's embeddings and
    head are exactly what the engine reserves for them (fp32 here), with and without it."""
    from flexsarathi.engine.planner_spec import planner_model_spec

    llm = _engine(untied128, tmp_path, compress_head=compress_head)
    try:
        spec = planner_model_spec(untied128, "float32", compress_head=compress_head)
        assert spec.embedding_bytes == llm.engine.memory.in_use_by_what("gpu")["embeddings and head"]
    finally:
        llm.close()


@pytest.mark.skipif(not cpu_int8_matmul.available(),
                    reason=f"int8 kernel not available: {cpu_int8_matmul.unavailable_reason()}")
def test_the_int8_kernels_head_gives_the_dequantizing_tokens(untied128, tmp_path, monkeypatch):
    """A head the kernel covers (128 inputs): `auto` multiplies it with the int8 kernel (two planes
    at these row counts), with the tokens of dequantize + matmul."""
    folder = untied128
    exact = _engine(str(folder), tmp_path, compress_head=True, cpu_matmul="dequantize")
    shapes = []
    kernel = cpu_int8_matmul.int8_linear
    monkeypatch.setattr(cpu_int8_matmul, "int8_linear", lambda x, w, *a, **k: shapes.append(w.shape) or kernel(x, w, *a, **k))
    fast = _engine(str(folder), tmp_path, compress_head=True, cpu_matmul="auto")
    try:
        assert _tokens(fast) == _tokens(exact)
        assert (256, 128) in shapes  # the head went through the kernel
    finally:
        exact.close()
        fast.close()


@pytest.mark.skipif(not cpu_int8_matmul.available(),
                    reason=f"int8 kernel not available: {cpu_int8_matmul.unavailable_reason()}")
def test_under_int8_the_head_is_stored_in_the_kernels_panels(untied128, tmp_path):
    """cpu_matmul="int8": the compressed head is stored in the int8 kernel's panels at load
    (quant/panels.py), holding the row-major head's codes, scales and minimums (those of the int8x2
    engine, which keeps it row-major), and the kernel gives the row-major head's bits from it."""
    stored = _engine(str(untied128), tmp_path / "a", compress_head=True, cpu_matmul="int8")
    plain = _engine(str(untied128), tmp_path / "b", compress_head=True, cpu_matmul="int8x2")
    try:
        head, rows = (e.engine.executor.weights.global_weights()[HEAD] for e in (stored, plain))
        assert head.panels and not rows.panels
        back = from_panels(head)
        assert all(torch.equal(a, b) for a, b in zip((back.data, back.scale, back.minimum),
                                                      (rows.data, rows.scale, rows.minimum)))
        x = torch.randn(6, head.shape[1], generator=torch.Generator().manual_seed(0))
        assert torch.equal(cpu_int8_matmul.int8_linear(x, head), cpu_int8_matmul.int8_linear(x, rows))
    finally:
        stored.close()
        plain.close()


def test_a_tied_head_is_one_clear_error(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama_tied_headdim")
    with pytest.raises(FlexSarathiError, match="no LM head of its own"):
        _engine(folder, tmp_path, compress_head=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_on_cuda_the_compressed_head_gives_the_dequantized_heads_tokens(tiny_checkpoint, tmp_path, dtype):
    """On a GPU the 4-bit head goes through quant/fused.py (Triton at these rows where it runs, else
    dequantize into the scratch the engine now reserves for it): the tokens of the same engine on a
    checkpoint whose head holds dequantize(quantize(head))."""
    folder, model = tiny_checkpoint("llama_gqa_untied")
    reference = copy.deepcopy(model)
    with torch.no_grad():
        head = reference.lm_head.weight
        head.copy_(dequantize(quantize(head.detach().clone(), WEIGHT_QUANT), torch.float32))
    reference.save_pretrained(tmp_path / "dequantized_head", safe_serialization=True)
    options = dict(dtype=dtype, device="cuda", policy=Policy())
    small = LLM(folder, offload_dir=str(tmp_path / "o1"), compress_head=True, **options)
    exact = LLM(str(tmp_path / "dequantized_head"), offload_dir=str(tmp_path / "o2"), **options)
    try:
        assert "dequantize scratch" in small.engine.memory.in_use_by_what("gpu")
        assert _tokens(small) == _tokens(exact)
    finally:
        small.close()
        exact.close()

"""Dummy models whose 4-bit weights are drawn directly as codes (`dummy_weight_codes`, what
scripts/bench_70b.py uses to write a 70B store quickly): the store holds exactly the drawn codes, the
store is keyed apart from the quantized normal draws, and every placement gives the tokens of the
all-on-device run."""
import pytest
import torch

from flexsarathi import LLM, SamplingParams
from flexsarathi.formats.checkpoint import DummyWeights
from quant.config import WEIGHT_QUANT
from flexsarathi.errors import FlexSarathiError
from offload.placed_layers import store_key
from policy_search import Policy
from policy_search.model_registry import KNOWN_MODELS, known_config
from quant import QTensor, dequantize
from quant.cpu_matmul import layout_matches_torch, pack_for_cpu_kernel

TINY = "tiny-llama-codes"  # llama-2-70b's proportions (GQA 8:1), small enough for a test
ON_DISK = dict(w_gpu=0.0, w_cpu=0.0, w_disk=1.0)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def tiny_model(monkeypatch):
    monkeypatch.setitem(KNOWN_MODELS, TINY, {**known_config("llama-2-70b"), "hidden_size": 256, "num_hidden_layers": 4,
                                             "num_attention_heads": 8, "num_key_value_heads": 1,
                                             "intermediate_size": 512, "vocab_size": 512})


def test_codes_are_deterministic_uniform_and_spread_like_the_normal_draws():
    src = DummyWeights(TINY, codes=WEIGHT_QUANT)
    a, b = src.layer_weights(2, torch.float32), DummyWeights(TINY, codes=WEIGHT_QUANT).layer_weights(2, torch.float32)
    for key, shape in src.model.layer_shapes().items():
        if len(shape) == 2:
            assert isinstance(a[key], QTensor) and a[key].config == WEIGHT_QUANT and a[key].shape == shape
            assert torch.equal(a[key].data, b[key].data)
        else:  # norms and biases as the plain dummy's
            assert torch.equal(a[key], DummyWeights(TINY).layer_weights(2, torch.float32)[key])
    values = dequantize(a["gate_up_proj.weight"], torch.float32)
    assert values.std().item() == pytest.approx(0.02, rel=0.02)
    assert abs(values.mean().item()) < 1e-3
    assert DummyWeights(TINY, codes=WEIGHT_QUANT).fingerprint != DummyWeights(TINY).fingerprint


def _tokens(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_store_holds_the_drawn_codes_and_placements_agree(tmp_path):
    compressed = Policy(compress_weight=True)
    with LLM(f"dummy:{TINY}", dtype="float32", policy=compressed, dummy_weight_codes=True) as llm:
        reference = _tokens(llm)
    for fractions in (ON_DISK, dict(w_gpu=0.3, w_cpu=0.3, w_disk=0.4)):
        with LLM(f"dummy:{TINY}", dtype="float32", policy=compressed.replace(**fractions),
                 offload_dir=str(tmp_path), dummy_weight_codes=True) as llm:
            assert _tokens(llm) == reference
            store, plan = llm.engine.weights.store, llm.engine.weights.plan
            drawn = DummyWeights(TINY, codes=WEIGHT_QUANT).layer_weights(3, torch.float32)
            for tensor in plan.tensors:
                for component, part in zip(tensor.components, ("data", "scale", "minimum")):
                    stored = store.read_tensor(store_key(3, tensor.name, component))
                    assert torch.equal(stored, getattr(drawn[tensor.name], part))
    with LLM(f"dummy:{TINY}", dtype="float32", policy=compressed.replace(**ON_DISK), offload_dir=str(tmp_path)) as llm:
        plain_key = llm.engine.weights.store.key  # the quantized normal draws: another store
        assert _tokens(llm) != reference
    assert "codes4g64" not in plain_key


def test_codes_need_a_dummy_model(tiny_checkpoint):
    with pytest.raises(FlexSarathiError, match="dummy models only"):
        LLM(tiny_checkpoint("opt")[0], policy=Policy(compress_weight=True), dummy_weight_codes=True)


@pytest.mark.skipif(not layout_matches_torch(), reason="this machine's int4 kernel layout is not ours "
                    "(quant/cpu_matmul.py layout_matches_torch): bf16 codes stay in the row-major format")
def test_drawn_codes_are_packed_into_the_kernel_layout_in_bf16(tmp_path):
    """bf16 on the CPU stores 4-bit weights in the int4 kernel's layout: drawn codes must be packed
    into it like quantized ones (bench_70b writes its store this way), not stored row-major under it."""
    compressed = Policy(compress_weight=True)
    # cpu_matmul="dequantize": on a VNNI CPU the int8 modes keep weights row-major for the int8 kernel
    with LLM(f"dummy:{TINY}", dtype="bfloat16", device="cpu", policy=compressed, dummy_weight_codes=True,
             cpu_matmul="dequantize") as llm:
        reference = _tokens(llm)
    with LLM(f"dummy:{TINY}", dtype="bfloat16", device="cpu", policy=compressed.replace(**ON_DISK),
             offload_dir=str(tmp_path), dummy_weight_codes=True, cpu_matmul="dequantize") as llm:
        assert _tokens(llm) == reference
        store, plan = llm.engine.weights.store, llm.engine.weights.plan
        drawn = DummyWeights(TINY, codes=WEIGHT_QUANT).layer_weights(1, torch.bfloat16)
        packed = [t for t in plan.tensors if t.kernel_layout]
        assert packed, "no weight of the tiny model took the kernel layout"
        for tensor in packed:
            expected = pack_for_cpu_kernel(drawn[tensor.name]).components()
            for component, part in zip(tensor.components, expected):
                assert torch.equal(store.read_tensor(store_key(1, tensor.name, component)).view(-1),
                                   part.reshape(-1))

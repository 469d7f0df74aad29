import dataclasses
import json

import pytest

from policy_search import ModelSpec, SpecError
from policy_search.model_registry import KNOWN_MODELS, known_config
from policy_search.quant_format import WEIGHT_FORMAT, KVFormat

QUANT_BYTES_PER_VALUE = WEIGHT_FORMAT.bytes_per_value


@pytest.mark.parametrize("name, published_params", [
    ("opt-175b", 175e9), ("opt-30b", 30e9), ("opt-6.7b", 6.7e9),
    ("llama-2-7b", 6.74e9), ("llama-2-70b", 68.98e9), ("llama-3-8b", 8.03e9),
])
def test_parameter_count_matches_the_published_size(name, published_params):
    assert ModelSpec.from_name(name).num_params == pytest.approx(published_params, rel=0.015)


def test_opt_layer_is_twelve_h_squared_and_mha():
    spec = ModelSpec.from_name("opt-30b")
    h = spec.hidden_size
    assert spec.layer_matrix_params == 12 * h * h  # q, k, v, o (4 h^2) + fc1, fc2 (2 x 4h x h)
    assert spec.num_kv_heads == spec.num_heads and spec.kv_dim == h
    assert spec.ffn_kind == "mlp" and spec.linear_bias and spec.learned_positions and spec.tie_embeddings


def test_llama_gqa_shapes():
    spec = ModelSpec.from_name("llama-2-70b")
    cfg = known_config("llama-2-70b")
    assert spec.kv_dim == cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"]
    h, ffn = spec.hidden_size, spec.ffn_size
    assert spec.layer_matrix_params == 2 * h * h + 2 * h * spec.kv_dim + 3 * h * ffn
    assert spec.kv_values_per_token == 2 * spec.kv_dim
    assert not spec.tie_embeddings and spec.ffn_kind == "gated"


def test_compressed_sizes_follow_the_4bit_group64_layout():
    spec = ModelSpec.from_name("opt-1.3b")
    assert QUANT_BYTES_PER_VALUE == 0.5 + 2 * 2 / 64
    assert spec.layer_weight_bytes(True) == (spec.layer_matrix_params * QUANT_BYTES_PER_VALUE
                                             + spec.layer_vector_params * 2)
    assert spec.kv_bytes_per_token(True) / spec.kv_bytes_per_token(False) == QUANT_BYTES_PER_VALUE / 2
    # the embeddings stay fp16 whatever the layers do
    diff = spec.weight_bytes(False) - spec.weight_bytes(True)
    assert diff == spec.num_layers * (spec.layer_weight_bytes(False) - spec.layer_weight_bytes(True))


def test_names_prefixes_and_every_registered_model():
    assert ModelSpec.from_name("dummy:opt-30b") == ModelSpec.from_name("facebook/opt-30b")
    for name in KNOWN_MODELS:
        assert ModelSpec.from_name(name).num_layers == known_config(name)["num_hidden_layers"]


def test_checkpoint_folder(tmp_path):
    cfg = known_config("llama-2-7b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = ModelSpec.from_name(str(tmp_path))
    assert spec.hidden_size == cfg["hidden_size"] and spec.name == tmp_path.name
    assert dataclasses.replace(ModelSpec.from_config(cfg), name=spec.name) == spec


def test_dtype_sets_bytes_per_value():
    cfg = known_config("opt-125m") | {"torch_dtype": "float32"}
    assert ModelSpec.from_config(cfg).bytes_per_value == 4
    assert ModelSpec.from_config(cfg, bytes_per_value=2).bytes_per_value == 2


def test_errors_name_the_field(tmp_path):
    cfg = known_config("opt-125m")
    del cfg["ffn_dim"]
    with pytest.raises(SpecError, match="'ffn_dim'"):
        ModelSpec.from_config(cfg)
    with pytest.raises(SpecError, match="model_type 'gpt2'"):
        ModelSpec.from_config({"model_type": "gpt2"})
    with pytest.raises(SpecError, match="opt-30b"):  # lists the known names
        ModelSpec.from_name("opt-31b")
    with pytest.raises(SpecError, match="no config.json"):
        ModelSpec.from_name(str(tmp_path))
    with pytest.raises(SpecError, match="num_heads"):
        ModelSpec.from_config(known_config("llama-2-7b") | {"num_key_value_heads": 5})


@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_kv_bytes_follow_the_kv_format(bits):
    spec = dataclasses.replace(ModelSpec.from_name("opt-1.3b"), kv_format=KVFormat(bits=bits))
    fmt = spec.kv_format
    assert spec.head_dim % fmt.value_group == 0  # no padded V groups in this model
    # K: a `bits` code per value plus an fp16 scale and minimum per channel and block of tokens;
    # V: a code per value plus an fp16 scale and minimum per `value_group` values of a head.
    k = spec.kv_dim * (bits / 8 + 2 * 2 / fmt.block_size)
    v = spec.kv_dim * (bits / 8 + 2 * 2 / fmt.value_group)
    assert spec.kv_bytes_per_token(True) == k + v


def test_planner_prices_an_8bit_kv_cache_at_8_bits():
    """The estimate's disk tier holds the whole KV cache: its size follows the KV format's bits (each
    of the 8 lifetimes in whole 64-token blocks, and the open block's K in fp16 beside)."""
    from policy_search import HardwareSpec, Policy, Workload, estimate

    policy = Policy(gpu_batch_size=4, num_gpu_batches=2, w_gpu=0.0, w_cpu=1.0, kv_gpu=0.0, kv_disk=1.0,
                    act_gpu=0.0, act_cpu=1.0, compress_kv=True, scheduler="block")
    workload = Workload(prompt_len=64, gen_len=16)
    peaks = {}
    for bits in (4, 8):
        spec = dataclasses.replace(ModelSpec.from_name("opt-1.3b"), kv_format=KVFormat(bits=bits))
        peaks[bits] = estimate(policy, spec, HardwareSpec.preset("t4"), workload).peak_memory["disk"]
        group = spec.kv_format.block_size  # == value_group: one group size for K and V here
        per_token = spec.kv_values_per_token * (bits / 8 + 2 * 2 / group)
        residual = 8 * 64 * spec.kv_dim * spec.bytes_per_value * spec.num_layers  # K's open blocks
        assert peaks[bits] == pytest.approx(8 * 128 * spec.num_layers * per_token + residual)  # 80 -> 128 slots
    # 4 more bits per value of the quantized cache, nothing more (the fp16 open blocks are alike)
    assert peaks[8] - peaks[4] == pytest.approx(8 * 128 * spec.num_layers * spec.kv_values_per_token * 4 / 8)


def test_register_variant_names_a_cut_or_small_copy_of_a_known_model(monkeypatch):
    from policy_search import model_registry  # noqa: PLC0415

    monkeypatch.setattr(model_registry, "KNOWN_MODELS", dict(model_registry.KNOWN_MODELS))  # leave no names behind
    full = known_config("llama-2-7b")
    assert model_registry.register_variant("llama-2-7b") == "llama-2-7b"
    assert model_registry.register_variant("llama-2-7b", full["num_hidden_layers"]) == "llama-2-7b"
    cut = model_registry.register_variant("llama-2-7b", 3)
    assert cut == "llama-2-7b-3l" and known_config(cut) == {**full, "num_hidden_layers": 3}
    small = model_registry.register_variant("llama-2-7b", 3, {"hidden_size": 64})
    assert small == "llama-2-7b-tiny" and known_config(small) == {**full, "hidden_size": 64}


def test_a_cut_name_resolves_without_being_registered():
    """`dummy:<name>-<N>l` in a fresh process (a CLI subprocess, a Ray actor): the known model's
    shapes with N layers; a cut of an unknown name, or of zero layers, is the unknown-name error, and
    one of more layers than the model has says so."""
    from policy_search import model_registry  # noqa: PLC0415

    assert "opt-125m-2l" not in model_registry.KNOWN_MODELS
    assert known_config("dummy:OPT-125m-2l") == {**known_config("opt-125m"), "num_hidden_layers": 2}
    for name in ("opt-124m-2l", "opt-125m-0l", "opt-125m-l", "opt-125m-2"):
        with pytest.raises(KeyError, match="unknown model name"):
            known_config(name)
    assert known_config("opt-125m-12l") == known_config("opt-125m")
    with pytest.raises(KeyError, match="opt-125m has 12 layers, so <name>-<N>l takes N from 1 to 12"):
        known_config("dummy:opt-125m-13l")

"""The GGUF container: metadata -> the engine's config, llama.cpp's tensor names and q/k order
undone, split files, and one clear error for a corrupt, truncated or unsupported file."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from flexsarathi.formats.gguf_checkpoint import GGUFCheckpoint  # noqa: E402
from flexsarathi.errors import CheckpointError  # noqa: E402
from flexsarathi.formats.gguf_file import GGUFFile, hf_config, unpermute_rows  # noqa: E402
from flexsarathi.models.model_config import ModelConfig  # noqa: E402
from tests.gguf_files import build_model, permute_qk, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    model = build_model("llama")
    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    write_gguf(model, path, weight_type="F32")
    return path, model


def test_metadata_gives_the_config_transformers_has(llama_file):
    path, model = llama_file
    ours = ModelConfig.from_hf(hf_config(GGUFFile(str(path))))
    ref = ModelConfig.from_hf(model.config.to_dict())
    for field in ("model_type", "family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "max_position_embeddings", "norm_eps", "tie_word_embeddings",
                  "qkv_bias", "rope"):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.dtype_name == "float32"


def test_unpermute_undoes_llama_cpp_permutation():
    w = np.arange(4 * 2 * 3 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 2, 4):
        assert torch.equal(torch.from_numpy(permute_qk(w, heads))[unpermute_rows(24, heads)], torch.from_numpy(w))


def test_weights_are_the_hf_weights(llama_file):
    path, model = llama_file
    source = GGUFCheckpoint(str(path))
    state = model.state_dict()
    layer = source.layer_weights(1, torch.float32)
    p = "model.layers.1."
    qkv = torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(layer["qkv_proj.weight"], qkv)
    assert torch.equal(layer["gate_up_proj.weight"], torch.cat([state[p + "mlp.gate_proj.weight"],
                                                                state[p + "mlp.up_proj.weight"]]))
    g = source.global_weights(torch.float32)
    assert torch.equal(g["lm_head.weight"], state["lm_head.weight"])


def test_split_file_reads_as_the_single_file(llama_file, tmp_path):
    path, model = llama_file
    parts = write_gguf(model, tmp_path / "split.gguf", split_max_tensors=7)
    assert len(parts) > 2 and parts[0].name == f"split-00001-of-{len(parts):05d}.gguf"
    single, split = GGUFCheckpoint(str(path)), GGUFCheckpoint(str(parts[1]))  # any part names the model
    assert split.config == single.config
    for i in range(split.config.num_layers):
        a, b = single.layer_weights(i, torch.float32), split.layer_weights(i, torch.float32)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match=f"part.*{parts[-1].name}.* missing"):
        GGUFCheckpoint(str(parts[0]))


def _one_line_error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        GGUFCheckpoint(str(path))
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_flipped_magic_is_one_clear_error(llama_file, tmp_path):
    data = bytearray(llama_file[0].read_bytes())
    data[0:4] = b"FUGG"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    assert "not a readable GGUF file" in _one_line_error(bad)


@pytest.mark.parametrize("keep", [0.05, 0.5, 0.999])
def test_truncated_file_is_one_clear_error(llama_file, tmp_path, keep):
    data = llama_file[0].read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[:int(len(data) * keep)])
    assert "not a readable GGUF file" in _one_line_error(bad)


@pytest.mark.parametrize("cut", [40, 200], ids=["in-metadata", "in-metadata-later"])
def test_a_header_cut_short_says_so_not_numpys_index_error(llama_file, tmp_path, cut):
    """It said "IndexError: index 0 is out of bounds for axis 0 with size 0"."""
    bad = tmp_path / "short.gguf"
    bad.write_bytes(llama_file[0].read_bytes()[:cut])
    message = _one_line_error(bad)
    assert f"its header (metadata and tensor list) reads past the end of the file ({cut} bytes)" in message
    assert "IndexError" not in message


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_and_qwen3_metadata_give_the_config_transformers_has(kind, tmp_path):
    """Expert count, top-k, widths, renormalisation (llama.cpp's per architecture), the dense layers
    (those without a router), qwen3's head_dim and q/k norms: as the model the file was written from."""
    model = build_model(kind)
    write_gguf(model, tmp_path / "m.gguf")
    ours = ModelConfig.from_hf(hf_config(GGUFFile(str(tmp_path / "m.gguf"))))
    ref = ModelConfig.from_hf(model.config.to_dict())
    for field in ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "qkv_bias", "qk_norm", "moe"):
        assert getattr(ours, field) == getattr(ref, field), field


def test_experts_in_metadata_but_not_in_tensors(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(build_model("llama"), path, tokenizer={"llama.expert_count": 4, "llama.expert_used_count": 2})
    assert "metadata llama.expert_count=4 but no layer has experts (tensors blk.N.ffn_gate_inp.weight" in \
        _one_line_error(path)


def test_unsupported_architecture_and_tensor_type(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    assert "GGUF architecture 'mamba' is not supported; supported: llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma3, " \
        "phi3, granite, glm4moe (llama with experts: mixtral)" in _one_line_error(tmp_path / "mamba.gguf")

    model = build_model("llama")
    path = tmp_path / "iq2.gguf"
    write_gguf(model, path, weight_type="F32", type_of=lambda name: "IQ2_XXS" if "ffn_up" in name else None)
    assert "blk.0.ffn_up.weight has GGUF type IQ2_XXS, which is not supported; supported: F32" in _one_line_error(path)


def test_a_phi3_file_with_long_context_rope_is_refused_by_name(tmp_path):
    path = tmp_path / "phi3-128k.gguf"
    write_gguf(build_model("phi3"), path, extra={"rope_factors_long.weight": np.ones(32, dtype=np.float32),
                                                 "rope_factors_short.weight": np.ones(32, dtype=np.float32)})
    assert "phi3's long-context RoPE (longrope: tensors rope_factors_long / rope_factors_short) is not supported" \
        in _one_line_error(path)


def test_missing_file():
    with pytest.raises(CheckpointError, match="nowhere.gguf does not exist"):
        GGUFCheckpoint("/nowhere.gguf")


def test_end_of_turn_tokens_stop_generation(tmp_path):
    """llama-3 style files name <|eot_id|> apart from EOS: both end a generation."""
    path = tmp_path / "eot.gguf"
    write_gguf(build_model("llama"), path, tokenizer={"tokenizer.ggml.eos_token_id": 2,
                                                      "tokenizer.ggml.eot_token_id": 7})
    assert GGUFCheckpoint(str(path)).config.eos_token_ids == (2, 7)


def test_planner_sees_the_gguf_model(llama_file):
    """policy="auto" prices the model the GGUF's metadata describes."""
    from flexsarathi.engine.planner_spec import planner_model_spec
    from policy_search import ModelSpec

    path, model = llama_file
    spec = planner_model_spec(str(path), dtype="float32")
    expected = ModelSpec.from_config(model.config.to_dict(), name="llama.gguf", bytes_per_value=4)
    fields = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
    assert [getattr(spec, f) for f in fields] == [getattr(expected, f) for f in fields] == [2, 256, 4, 2, 64, 128]


def test_quantized_formats_name_each_matrix_held_as_codes(tmp_path):
    """What an engine storing each tensor in its own format keeps: a matrix whose codes take one
    format in every layer (fused Q4_K and Q6_K parts: 8-bit groups of 16, which holds both exactly);
    a part in floats, or K-quants left as values, make it None."""
    from quant import QuantConfig

    path = tmp_path / "mixed.gguf"
    mixed = {"attn_v": "Q6_K", "ffn_down": "Q8_0", "attn_output": "F16"}
    write_gguf(build_model("llama"), path, weight_type="Q4_K",
               type_of=lambda name: next((t for part, t in mixed.items() if part in name), None))
    q4, q8, q8_16 = QuantConfig(bits=4, group_size=32), QuantConfig(bits=8, group_size=32), QuantConfig(8, 16)
    source = GGUFCheckpoint(str(path))
    assert source.quantized_formats() == {"qkv_proj.weight": q8_16, "o_proj.weight": None,
                                          "gate_up_proj.weight": q4, "down_proj.weight": q8}
    source.convert_k_quants = False
    assert source.quantized_formats() == {"qkv_proj.weight": None, "o_proj.weight": None,
                                          "gate_up_proj.weight": None, "down_proj.weight": q8}
    layer = source.layer_weights(0, torch.float32)
    assert layer["down_proj.weight"].config == q8 and isinstance(layer["gate_up_proj.weight"], torch.Tensor)

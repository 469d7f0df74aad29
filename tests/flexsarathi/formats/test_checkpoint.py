"""Loading checkpoints: both config.json dialects, sharded files, dummy weights, and clear errors
for every way a checkpoint can be broken."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from flexsarathi import LLM, CheckpointError
from flexsarathi.formats.checkpoint import DummyWeights
from flexsarathi.models.model_config import ModelConfig
from policy_search.model_registry import KNOWN_MODELS
from tests.prompt_logits import prompt_logits


def _copy(folder: str, tmp_path, name="ckpt") -> str:
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    return str(dst)


def _edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    json.dump(cfg, open(path, "w"))


def test_transformers4_and_5_configs_give_the_same_model(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama_tied_headdim")  # saved by transformers 5: rope_parameters, dtype
    v5 = json.load(open(os.path.join(folder, "config.json")))
    assert "rope_parameters" in v5 and "dtype" in v5
    old = _copy(folder, tmp_path)
    params = dict(v5["rope_parameters"])
    _edit_config(old, rope_parameters=None, dtype=None, torch_dtype="float32",
                 rope_theta=params.pop("rope_theta"), rope_scaling=params)
    assert ModelConfig.from_folder(old).rope == ModelConfig.from_folder(folder).rope
    assert ModelConfig.from_folder(old).rope.kind == "llama3"
    ids = [[5, 9, 17, 33, 2, 7]]
    torch.testing.assert_close(prompt_logits(LLM(old), ids)[0],
                               prompt_logits(LLM(folder), ids)[0], atol=0, rtol=0)


def test_sharded_checkpoint_loads_like_single_file(tiny_checkpoint, tmp_path):
    folder, model = tiny_checkpoint("qwen2")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    ids = [[3, 4, 5, 6, 7, 8]]
    torch.testing.assert_close(prompt_logits(LLM(str(sharded)), ids)[0],
                               prompt_logits(LLM(folder), ids)[0], atol=0, rtol=0)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_model_type_names_the_supported_ones(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint("opt")[0], tmp_path)
    _edit_config(folder, model_type="gpt2")
    with pytest.raises(CheckpointError, match="'gpt2' is not supported; supported: opt, llama, mistral, qwen2"):
        LLM(folder)


def test_missing_weights_file(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint("opt")[0], tmp_path)
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no weights in"):
        LLM(folder)


def test_corrupt_and_truncated_safetensors(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint("opt")[0], tmp_path, "corrupt")
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.write(b"\xff" * 16)  # garbage header length
    with pytest.raises(CheckpointError, match="cannot read safetensors file .*model.safetensors"):
        LLM(folder)
    folder = _copy(tiny_checkpoint("opt")[0], tmp_path, "truncated")
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(folder)


def test_tensor_shapes_must_match_config(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint("llama_gqa_untied")[0], tmp_path)
    _edit_config(folder, intermediate_size=40)
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj.* does not match config.json|rows in total"):
        LLM(folder)


def test_missing_tensor_and_missing_shard(tiny_checkpoint, tmp_path):
    folder, model = tiny_checkpoint("llama_gqa_untied")
    untied = _copy(folder, tmp_path, "untied")
    _edit_config(untied, num_hidden_layers=3)  # layer 2 is not in the file
    with pytest.raises(CheckpointError, match="model.layers.2.* is missing"):
        LLM(untied)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    os.remove(sorted(sharded.glob("*.safetensors"))[-1])
    with pytest.raises(CheckpointError, match="lists shard .* which is missing"):
        LLM(str(sharded))


def test_dummy_weights_have_the_registered_shapes_and_are_deterministic():
    for name, hf in KNOWN_MODELS.items():
        src = DummyWeights(name)
        assert src.config.num_layers == hf["num_hidden_layers"]
        assert src.config.hidden_size == hf["hidden_size"]
    src = DummyWeights("opt-350m")
    a, b = src.layer_weights(3, torch.float16), DummyWeights("opt-350m").layer_weights(3, torch.float16)
    assert a.keys() == src.model.layer_shapes().keys()
    for key, tensor in a.items():
        assert tuple(tensor.shape) == src.model.layer_shapes()[key]
        assert torch.equal(tensor, b[key])
    assert not torch.equal(a["fc1.weight"], src.layer_weights(4, torch.float16)["fc1.weight"])
    with pytest.raises(CheckpointError, match="unknown model name 'opt-7b'"):
        LLM("dummy:opt-7b")


def test_dummy_weights_are_seeded_normal_draws_scaled_by_0_02():
    """The values every dummy store was written with (a store is keyed by the fingerprint, not the
    values): torch.randn from a generator seeded by crc32("seed:layer.name"), times 0.02, cast."""
    import zlib

    src = DummyWeights("opt-125m")
    shapes = src.model.layer_shapes()
    name = next(k for k, s in shapes.items() if len(s) == 2)
    got = src.layer_weights(1, torch.bfloat16)[name]
    gen = torch.Generator().manual_seed(zlib.crc32(f"0:1.{name}".encode()))
    assert torch.equal(got, (torch.randn(shapes[name], generator=gen) * 0.02).to(torch.bfloat16))


def test_a_large_dummy_tensor_is_drawn_in_seeded_chunks(monkeypatch):
    """A tensor over DRAW_CHUNK values: chunk i from a generator seeded by crc32("seed:layer.name:i")
    (chunk 0 as a one-chunk tensor's), so the chunks are drawn side by side and the whole is the same
    every time; the fingerprint names the chunking (a store of other draws is not taken for it)."""
    import zlib

    from flexsarathi.formats import checkpoint

    monkeypatch.setattr(checkpoint, "DRAW_CHUNK", 1000)
    src = DummyWeights("opt-125m")
    shapes = src.model.layer_shapes()
    name = next(k for k, s in shapes.items() if len(s) == 2)
    got = src.layer_weights(1, torch.float32)[name].reshape(-1)
    for i, start in enumerate(range(0, got.numel(), 1000)):
        seed = f"0:1.{name}" + (f":{i}" if i else "")
        want = torch.randn(min(1000, got.numel() - start), generator=torch.Generator().manual_seed(
            zlib.crc32(seed.encode()))) * 0.02
        assert torch.equal(got[start:start + 1000], want), i
    assert torch.equal(got, src.layer_weights(1, torch.float32)[name].reshape(-1))
    assert "chunks1000" in src.fingerprint


def test_dummy_model_generates(tmp_path):
    llm = LLM("dummy:opt-125m")
    from flexsarathi import SamplingParams

    out = llm.generate([[10, 20, 30, 40]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 4 and out[0].text == ""

"""Hostile safetensors checkpoints: each one a copy of stories260K the test edits. Every fault is one
CheckpointError naming the file and tensor or entry; a rewritten file is never read through a
store written from its old bytes."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexsarathi import LLM, CheckpointError, SamplingParams
from policy_search import Policy

STORIES = "/work/shared/models/stories260K"
PROMPT = [[1, 403, 407, 261, 378]]  # token ids; the greedy run's tokens are compared, not the text
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ON_DISK = dict(w_gpu=0.0, w_cpu=0.0, w_disk=1.0)

pytestmark = pytest.mark.skipif(not os.path.isdir(STORIES), reason="stories260K is not in /work/shared/models")


def _copy(tmp_path, name="ckpt") -> str:
    dst = tmp_path / name
    shutil.copytree(STORIES, dst)
    return str(dst)


def _edit_weights(folder: str, edit) -> str:
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    edit(weights)
    save_file(weights, path, metadata={"format": "pt"})
    return path


def _edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def _tokens(folder: str, offload_dir=None, **placement) -> list[list[int]]:
    policy = Policy(gpu_batch_size=2, **placement) if placement else None
    with LLM(folder, dtype="float32", device="cpu", policy=policy,
             offload_dir=None if offload_dir is None else str(offload_dir)) as llm:
        return [o.token_ids for o in llm.generate(PROMPT, GREEDY, use_tqdm=False)]


Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.bool])
def test_integer_weights_in_a_plain_checkpoint_are_refused(tmp_path, dtype):
    folder = _copy(tmp_path)
    path = _edit_weights(folder, lambda w: w.update({Q: (w[Q] * 100).to(dtype)}))
    kind = {torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}[dtype]
    with pytest.raises(CheckpointError, match=f"{path}: tensor {Q} is stored as {kind}, not as floats"):
        LLM(folder, dtype="float32", device="cpu")


def test_fp8_weights_are_refused_as_unsupported(tmp_path):
    folder = _copy(tmp_path)

    def to_fp8(w):
        w[Q] = w[Q].to(torch.float8_e4m3fn)
        w[Q.replace(".weight", ".weight_scale")] = torch.ones(1)
    path = _edit_weights(folder, to_fp8)
    with pytest.raises(CheckpointError, match=f"{path}: tensor {Q} is stored as F8_E4M3: fp8 checkpoints"):
        LLM(folder, dtype="float32", device="cpu")


def test_more_layers_in_the_file_than_config_json_asks_for_are_refused(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"not used by the model .*model\.layers\.3\..*num_hidden_layers is 3, "
                                              r"but the files hold layer 4"):
        LLM(folder, dtype="float32", device="cpu")


def test_biases_config_json_says_there_are_none_of_are_refused(tmp_path):
    folder = _copy(tmp_path)
    bias = Q.replace(".weight", ".bias")
    _edit_weights(folder, lambda w: w.update({bias: torch.full((w[Q].shape[0],), 0.5)}))
    with pytest.raises(CheckpointError, match=rf"1 tensor\(s\) .*\({bias}\): config.json's attention_bias"):
        LLM(folder, dtype="float32", device="cpu")


def test_a_rope_table_in_the_file_is_ignored(tmp_path):
    folder = _copy(tmp_path)
    _edit_weights(folder, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    assert _tokens(folder) == _tokens(STORIES)


def test_a_rewrite_keeping_size_and_mtime_rebuilds_the_store(tmp_path):
    folder = _copy(tmp_path)
    _tokens(folder, tmp_path / "off", **ON_DISK)  # the store of the intact model
    path = os.path.join(folder, "model.safetensors")
    before = os.stat(path)
    # every layer's MLP output negated (layer weights: those the disk store holds): the same size, another model
    _edit_weights(folder, lambda w: w.update({k: -v for k, v in w.items() if k.endswith("down_proj.weight")}))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.path.getsize(path) == before.st_size
    reference = _tokens(folder, tmp_path / "fresh", **ON_DISK)  # another store folder: built from the new bytes
    assert reference != _tokens(STORIES)
    assert _tokens(folder, tmp_path / "off", **ON_DISK) == reference


def test_a_weight_file_that_is_a_fifo_is_refused(tmp_path):
    folder = _copy(tmp_path)
    path = os.path.join(folder, "model.safetensors")
    os.remove(path)
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match=f"weight file {path} is not a regular file"):
        LLM(folder, dtype="float32", device="cpu")


def _shard(tmp_path, index_edit=None, raw: bytes | None = None) -> tuple[str, str]:
    """stories260K in two shards (layer 0 in the second), the index edited or replaced by `raw`."""
    folder = _copy(tmp_path)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    second = {k: v for k, v in weights.items() if ".layers.0." in k}
    save_file({k: v for k, v in weights.items() if k not in second}, os.path.join(folder, "a.safetensors"))
    save_file(second, os.path.join(folder, "b.safetensors"))
    index = {"metadata": {}, "weight_map": {k: "b.safetensors" if k in second else "a.safetensors" for k in weights}}
    if index_edit:
        index_edit(index)
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path, "wb") as f:
        f.write(raw if raw is not None else json.dumps(index).encode())
    return folder, path


def test_a_sharded_copy_runs_as_the_single_file(tmp_path):
    assert _tokens(_shard(tmp_path)[0]) == _tokens(STORIES)


@pytest.mark.parametrize("edit, message", [
    (lambda i: i["weight_map"].update({Q: "b.safetensors"}),
     f"weight_map puts tensor {Q} in shard b.safetensors, which does not contain it"),
    (lambda i: i.update(weight_map=list(i["weight_map"])), "weight_map must be an object .*got list"),
    (lambda i: i["weight_map"].update({Q: 7}), f"weight_map entry '{Q}' names shard 7, not a file name"),
])
def test_a_broken_index_is_one_clear_error(tmp_path, edit, message):
    folder, index = _shard(tmp_path, edit)
    with pytest.raises(CheckpointError, match=f"{index}: {message}"):
        LLM(folder, dtype="float32", device="cpu")


def test_an_index_that_is_not_utf8_is_one_clear_error(tmp_path):
    folder, index = _shard(tmp_path, raw=b'{"weight_map": {"\xff\xfe": "a.safetensors"}}')
    with pytest.raises(CheckpointError, match=f"{index} is not a valid safetensors index"):
        LLM(folder, dtype="float32", device="cpu")

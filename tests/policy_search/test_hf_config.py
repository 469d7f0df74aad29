"""config.json values of the wrong type or out of range get one SpecError naming the file and the
field (not a traceback, not a silently different model); booleans are JSON true/false only."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from policy_search.errors import SpecError
from policy_search.hf_config import HFConfig, read_config_json
from tests.conftest import STORIES


def _write(tmp_path: Path, edit: dict | None = None, raw: bytes | None = None) -> Path:
    """stories260K's config.json copied into tmp_path, with `edit` applied (or replaced by `raw` bytes)."""
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"{STORIES} is absent")
    shutil.copy(STORIES / "config.json", tmp_path / "config.json")
    if raw is not None:
        (tmp_path / "config.json").write_bytes(raw)
    elif edit:
        cfg = json.loads((tmp_path / "config.json").read_text())
        cfg.update(edit)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _load(folder: Path) -> HFConfig:
    cfg, path = read_config_json(folder)
    return HFConfig.parse(cfg, path)


BAD = [
    ({"num_hidden_layers": 0}, r"num_hidden_layers must be an integer >= 1 and <= 10000, got 0"),
    ({"num_hidden_layers": -1}, r"num_hidden_layers must be an integer >= 1 and <= 10000, got -1"),
    ({"num_hidden_layers": 10 ** 9}, r"num_hidden_layers must be an integer >= 1 and <= 10000, got 1000000000"),
    ({"num_hidden_layers": float("inf")}, r"num_hidden_layers must be an integer, got inf"),
    ({"num_key_value_heads": "four"}, r"num_key_value_heads must be an integer, got 'four'"),
    ({"num_key_value_heads": 0}, r"num_key_value_heads must be an integer >= 1, got 0"),
    ({"num_attention_heads": 0}, r"num_attention_heads must be an integer >= 1, got 0"),
    ({"head_dim": "x"}, r"head_dim must be an integer, got 'x'"),
    ({"sliding_window": "abc"}, r"sliding_window must be an integer, got 'abc'"),
    ({"sliding_window": -1}, r"sliding_window must be an integer >= 1, got -1"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings must be an integer >= 1, got 0"),
    ({"max_position_embeddings": -5}, r"max_position_embeddings must be an integer >= 1, got -5"),
    ({"rms_norm_eps": "abc"}, r"rms_norm_eps must be a finite number, got 'abc'"),
    ({"rms_norm_eps": -1e-5}, r"rms_norm_eps must be a finite number > 0.0, got -1e-05"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps must be a finite number, got nan"),
    ({"rope_theta": 0}, r"rope_theta must be a finite number > 0.0, got 0.0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "two"}}, r"rope_scaling.factor must be a finite number, "
                                                                  r"got 'two'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2}}, r"rope_scaling.factor must be a finite number > 0.0"),
    ({"rope_scaling": "linear"}, r"rope_scaling must be an object or null, got 'linear'"),
    ({"rope_scaling": [2.0]}, r"rope_scaling must be an object or null, got \[2.0\]"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings must be true or false, got 'false'"),
    ({"attention_bias": 1}, r"attention_bias must be true or false, got 1"),
    ({"eos_token_id": ["2"]}, r"eos_token_id\[0\] must be an integer, got '2'"),
    ({"eos_token_id": "2"}, r"eos_token_id must be an integer, got '2'"),
    ({"bos_token_id": "1"}, r"bos_token_id must be an integer, got '1'"),
    ({"vocab_size": 512.5}, r"vocab_size must be an integer, got 512.5"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": "x"}},
     r"rope_scaling.beta_fast must be a finite number, got 'x'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}},
     r"rope_scaling.truncate must be true or false"),
    ({"partial_rotary_factor": 0.75}, r"partial_rotary_factor=0.75 \(RoPE over part of each head\) is not supported"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     r"partial_rotary_factor=0.5 \(RoPE over part of each head\)"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     r"rope type 'longrope' is not supported"),
]


@pytest.mark.parametrize("edit, message", BAD, ids=[str(e) for e, _ in BAD])
def test_a_bad_field_is_one_error_naming_the_file_and_field(tmp_path, edit, message):
    folder = _write(tmp_path, edit)
    with pytest.raises(SpecError, match=r"config\.json: " + message):
        _load(folder)


def test_non_utf8_config_json_is_named(tmp_path):
    folder = _write(tmp_path, raw=b'{"model_type": "llama", "name": "caf\xe9"}')
    with pytest.raises(SpecError, match=r"config\.json is not UTF-8 text \(byte 0xe9 at offset 36\)"):
        _load(folder)


def test_good_values_parse_as_transformers_reads_them(tmp_path):
    from transformers import AutoConfig

    folder = _write(tmp_path, {"tie_word_embeddings": False, "eos_token_id": [2, 383], "sliding_window": None,
                               "rope_scaling": {"rope_type": "linear", "factor": 2}})
    ours, ref = _load(folder), AutoConfig.from_pretrained(folder)
    assert ours.tie_word_embeddings is False is ref.tie_word_embeddings
    assert list(ours.eos_token_ids) == ref.eos_token_id == [2, 383]
    assert (ours.rope.kind, ours.rope.factor, ours.sliding_window) == ("linear", 2.0, None)
    assert (ours.num_layers, ours.num_kv_heads, ours.head_dim, ours.norm_eps) == (5, 4, 8, 1e-5)

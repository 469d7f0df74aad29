"""Hostile GGUF files: metadata of the wrong type or disagreeing with the tensors, data cut short.
Each is one CheckpointError naming the file and the GGUF key or tensor, never a traceback or a
model silently other than the one saved."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from flexsarathi.formats.gguf_checkpoint import GGUFCheckpoint  # noqa: E402
from tests.flexsarathi.formats.test_gguf_file import _one_line_error  # noqa: E402
from tests.gguf_files import build_model, write_gguf  # noqa: E402

T = gguf.GGUFValueType
_DROP = object()


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    write_gguf(build_model("llama"), path, weight_type="F32")
    return path


def _rewrite(src, dst, changes: dict) -> None:
    """`src` written again to `dst` with metadata `changes`: key -> (value, GGUFValueType), or _DROP."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changes:
            continue
        sub = field.types[-1] if field.types[0] == T.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, change in changes.items():
        if change is not _DROP:
            writer.add_key_value(key, change[0], change[1])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_unchanged_rewrite_opens(good_file, tmp_path):
    _rewrite(good_file, tmp_path / "same.gguf", {})
    GGUFCheckpoint(str(tmp_path / "same.gguf"))


def test_block_count_below_the_files_blocks_is_refused(good_file, tmp_path):
    layers = build_model("llama").config.num_hidden_layers
    bad = tmp_path / "fewer.gguf"
    _rewrite(good_file, bad, {"llama.block_count": (layers - 1, T.UINT32)})
    message = _one_line_error(bad)
    assert f"blk.{layers - 1}.attn_k.weight" in message
    assert f"llama.block_count is {layers - 1}, but the file holds block {layers - 1}" in message


def test_a_tensor_nothing_reads_is_refused(good_file, tmp_path):
    reader = gguf.GGUFReader(str(good_file))
    bad = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(str(bad), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            writer.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.add_tensor("blk.0.mystery.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "blk.0.mystery.weight" in _one_line_error(bad)


@pytest.mark.parametrize("key, change, words", [
    ("llama.block_count", (0, T.UINT32), "llama.block_count is 0"),
    ("llama.block_count", ("five", T.STRING), "llama.block_count is 'five'"),
    ("llama.attention.head_count", ("8", T.STRING), "llama.attention.head_count is '8'"),
    ("llama.attention.layer_norm_rms_epsilon", ("x", T.STRING), "llama.attention.layer_norm_rms_epsilon is 'x'"),
    ("llama.rope.freq_base", ("big", T.STRING), "llama.rope.freq_base is 'big'"),
    ("llama.rope.scaling.type", ("linear", T.STRING), "llama.rope.scaling.factor is missing"),
    ("tokenizer.ggml.eot_token_id", ("2", T.STRING), "tokenizer.ggml.eot_token_id is '2'"),
    ("tokenizer.ggml.bos_token_id", (1.5, T.FLOAT32), "tokenizer.ggml.bos_token_id is 1.5"),
    ("llama.context_length", (True, T.BOOL), "llama.context_length is True"),
])
def test_metadata_of_the_wrong_type_names_the_key(good_file, tmp_path, key, change, words):
    bad = tmp_path / "bad.gguf"
    _rewrite(good_file, bad, {key: change})
    assert words in _one_line_error(bad)


@pytest.mark.parametrize("cut", [4, 1000])
def test_data_cut_short_names_the_first_tensor_past_the_end(good_file, tmp_path, cut):
    data = good_file.read_bytes()
    bad = tmp_path / "short.gguf"
    bad.write_bytes(data[:-cut])
    last = gguf.GGUFReader(str(good_file)).tensors[-1].name
    message = _one_line_error(bad)
    assert "truncated" in message and f"tensor {last} ends at byte" in message


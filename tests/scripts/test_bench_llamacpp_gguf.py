"""scripts/bench_llamacpp.py's GGUF: the llama tensors of a registry shape, Q4_0 codes drawn directly,
read back by the gguf package's own reader and dequantizer (the reference for what llama.cpp loads)."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_llamacpp.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gguf_of_a_tiny_llama_reads_back(tmp_path):
    bench = _bench()
    cfg = {**bench.known_config("llama-2-7b"), **bench.TINY}  # --quick's shape (registry left as it is)
    path = str(tmp_path / "tiny.gguf")
    bench.write_gguf(path, cfg, seed=3)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors) == [n for n, _ in bench.gguf_tensors(cfg)]
    assert reader.fields["llama.block_count"].parts[-1][0] == cfg["num_hidden_layers"]
    assert bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode() == "none"
    up = tensors["blk.0.ffn_up.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.Q4_0
    values = quants.dequantize(up.data, up.tensor_type)
    assert values.shape == (cfg["intermediate_size"], cfg["hidden_size"])
    # every value is (nibble - 8) * step with the one step of every block: 16 levels, std ~0.02
    step = float(np.float16(0.02 / math.sqrt(255 / 12)))
    levels = np.round(values / step).astype(np.int64)
    assert np.array_equal(levels * np.float32(step), values)
    assert levels.min() == -8 and levels.max() == 7
    assert abs(values.std() - 0.02) < 0.001
    norm = tensors["blk.1.ffn_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32 and np.all(norm.data == 1.0)

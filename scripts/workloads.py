"""Workloads more than one benchmark runs: a GGUF file of llama-2-7b's layer shapes with random
codes of a llama.cpp quantization type (bench_gguf loads it; bench_load_quantized loads it as a
user's Q4_0 file). numpy only at import time: bench_gguf's parent process stays small.
"""
from __future__ import annotations

import numpy as np

HIDDEN, FFN, HEADS, VOCAB = 4096, 11008, 32, 32000  # llama-2-7b
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def write_model(path: str, type_name: str, layers: int) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", layers), ("context_length", 4096), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", HEADS)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)

    def blocks(rows: int, cols: int) -> np.ndarray:
        raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
        for offset in FP16_FIELDS[type_name]:
            raw[:, offset:offset + 2] = np.full(raw.shape[0], 1e-4, dtype=np.float16).view(np.uint8).reshape(-1, 2)
        return raw.reshape(rows, cols // block * size)

    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), dtype=np.float16))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor("output.weight", np.zeros((VOCAB, HIDDEN), dtype=np.float16))
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN, HIDDEN), "attn_v": (HIDDEN, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    for i in range(layers):
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(HIDDEN, dtype=np.float32))
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks(*shape), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

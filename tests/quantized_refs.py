"""Reference writers of pre-quantized HF checkpoints for the loader tests, written from the layouts
as the formats' authors' code packs them, independently of flexsarathi/formats/quantized_formats.py:

- GPTQ: AutoGPTQ `auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py` (AutoGPTQ/AutoGPTQ), `pack`:
  `qweight[row] |= intweight[j] << (bits * (j - i))` over runs of 32 / bits input rows; `zeros -= 1`
  before packing `qzeros` the same way along the output columns; `forward` reads
  `(qzeros >> shift) & mask` then `zeros + 1` and `scales * (weight - zeros)`, column j in group
  `g_idx[j]` in the act-order kernels. GPTQModel's "gptq_v2" format stores the zero point itself
  (ModelCloud/GPTQModel `gptqmodel/utils/model.py`, `convert_gptq_v1_to_v2_format_module`: "v1
  checkpoint format used to do `qzeros = qzeros -= 1` before serialization").
- AWQ GEMM: AutoAWQ `awq/modules/linear/gemm.py` (casper-hansen/AutoAWQ), `WQLinear_GEMM.from_linear`:
  `qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)` with order_map
  [0, 2, 4, 6, 1, 3, 5, 7], qzeros likewise; `awq/utils/packing_utils.py` `dequantize_gemm`:
  `(iweight - izeros) * scales`.
- compressed-tensors: the package itself compresses (tests/flexsarathi/formats/test_quantized_checkpoint.py).
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def draw(out_features: int, in_features: int, bits: int, group: int, symmetric: bool, gen: torch.Generator,
         zero_low: int = 0):
    """Random codes [out, in], fp16 scales and integer zeros [out, groups]."""
    groups = in_features // group
    codes = torch.randint(0, 2**bits, (out_features, in_features), generator=gen)
    scale = (0.002 + 0.02 * torch.rand(out_features, groups, generator=gen) / bits).half()
    if symmetric:
        zero = torch.full((out_features, groups), 2 ** (bits - 1))
    else:
        zero = torch.randint(zero_low, 2**bits, (out_features, groups), generator=gen)
    return codes, scale, zero


def dequantize_ref(codes, scale, zero, g_idx=None) -> torch.Tensor:
    """fp32 scale * (code - zero), column j in group g_idx[j]."""
    if g_idx is None:
        g_idx = torch.arange(codes.shape[1]) // (codes.shape[1] // scale.shape[1])
    g_idx = g_idx.long()
    return scale.float()[:, g_idx] * (codes - zero[:, g_idx]).float()


def pack_along_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """[n, cols] ints -> uint32 [n * bits / 32, cols]: AutoGPTQ's qweight loop."""
    per = 32 // bits
    out = np.zeros((values.shape[0] // per, values.shape[1]), dtype=np.uint32)
    for row in range(out.shape[0]):
        for j in range(per):
            out[row] |= (values[row * per + j].astype(np.uint32) & (2**bits - 1)) << (bits * j)
    return out


def pack_along_cols(values: np.ndarray, bits: int, order=None) -> np.ndarray:
    """[rows, n] ints -> uint32 [rows, n * bits / 32]: AutoGPTQ's qzeros loop, or AutoAWQ's with its order map."""
    per = 32 // bits
    order = order or list(range(per))
    out = np.zeros((values.shape[0], values.shape[1] // per), dtype=np.uint32)
    for col in range(out.shape[1]):
        for i in range(per):
            out[:, col] |= (values[:, col * per + order[i]].astype(np.uint32) & (2**bits - 1)) << (bits * i)
    return out


def _int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.view(np.int32).copy())


def gptq_tensors(codes, scale, zero, bits, g_idx, v1: bool) -> dict[str, torch.Tensor]:
    stored_zero = (zero - 1) if v1 else zero
    return {"qweight": _int32(pack_along_rows(codes.t().numpy(), bits)),
            "qzeros": _int32(pack_along_cols(stored_zero.t().numpy(), bits)),
            "scales": scale.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def awq_tensors(codes, scale, zero) -> dict[str, torch.Tensor]:
    return {"qweight": _int32(pack_along_cols(codes.t().numpy(), 4, AWQ_ORDER_MAP)),
            "qzeros": _int32(pack_along_cols(zero.t().numpy(), 4, AWQ_ORDER_MAP)),
            "scales": scale.t().contiguous()}


def act_order_g_idx(in_features: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """GPTQ desc_act: columns visited in a permuted order, each run of `group` of them one group."""
    perm = torch.randperm(in_features, generator=gen)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_features) // group).to(torch.int32)
    return g_idx


def write_folder(folder: str, model, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> None:
    """config.json (+ quantization_config) and one model.safetensors of `tensors`."""
    os.makedirs(folder, exist_ok=True)
    config = model.config.to_dict()
    config["torch_dtype"] = "float16"
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))

"""Pure tensor functions shared by the model families. Norms accumulate in fp32."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flexsarathi.models.model_config import RopeConfig
from offload.weights import LoraLinear, RowSplit


# fp32 on the CPU, a large weight and few rows of x: `weight @ xᵀ`, transposed back, takes another
# of MKL's packings than F.linear and ran 1.2-2.6x faster on a 2-core AVX2 EPYC for 2-128 rows of
# llama-2-7b's weights (its fp32 LM head at 32 rows: 296 -> 171 ms); from 256 rows on the two are
# even, and for small weights F.linear is faster (docs/BENCHMARKS.md, "Smaller measurements").
# A fixed rule, not a per-call timing: the orientation changes the last bits of some outputs, and a
# run's tokens must not depend on how busy the machine was.
TRANSPOSED_ROWS = range(2, 129)
TRANSPOSED_MIN_WEIGHT = 1 << 22  # elements


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias; `weight` may be a compressed QTensor (dequantized right before use), a
    RowSplit (one matmul per part of its rows, outputs side by side) or a LoraLinear (its base, then
    each adapter's update added to its rows, as PEFT adds lora_B(lora_A(x)) * scaling)."""
    if isinstance(weight, torch.Tensor):
        if (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and weight.dim() == 2
                and weight.numel() >= TRANSPOSED_MIN_WEIGHT and x.numel() // max(1, x.shape[-1]) in TRANSPOSED_ROWS):
            out = torch.mm(weight, x.reshape(-1, x.shape[-1]).t()).t().contiguous()  # [rows, out]
            if bias is not None:
                out += bias
            return out.view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)
    if isinstance(weight, LoraLinear):
        out = linear(x, weight.base, bias)
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for rows, a, b in weight.updates:  # the adapter's rows: x_rows @ A.T @ B.T added to theirs
            if rows is None:
                flat_out += F.linear(F.linear(flat_x, a), b)
            else:
                flat_out.index_add_(0, rows, F.linear(F.linear(flat_x.index_select(0, rows), a), b))
        return out
    if isinstance(weight, RowSplit):
        outs, start = [], 0
        for part in weight.parts:
            stop = start + part.shape[0]
            outs.append(linear(x, part, None if bias is None else bias[start:stop]))
            start = stop
        return torch.cat(outs, dim=-1)
    from quant import quantized_linear  # a compressed QTensor

    return quantized_linear(x, weight, bias)


def embedding(token_ids: torch.Tensor, weight) -> torch.Tensor:
    """The rows of `weight` [vocab, hidden] at `token_ids` [T] -> [T, hidden]; `weight` may be a
    QTensor (a GGUF's quantized token embedding kept in its format): only the looked-up rows are
    dequantized, to its dtype."""
    if isinstance(weight, torch.Tensor):
        return F.embedding(token_ids, weight)
    from quant import dequantize  # noqa: PLC0415 - a compressed QTensor

    return dequantize(weight.take_rows(token_ids)).view(*token_ids.shape, weight.shape[1])


def swiglu(x: torch.Tensor, gate_up, down, gate_up_bias=None, down_bias=None) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)), gate and up fused in one weight [2 * ffn, hidden]."""
    gate, up = linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)
    return linear(F.silu(gate).mul_(up), down, down_bias)  # in place: one [T, ffn] buffer fewer


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF LlamaRMSNorm: normalise in fp32, cast back, then scale. F.rms_norm without a weight does
    # the first two itself (half-precision input upcast inside, the result rounded to x's dtype: HF's
    # bits, tests/flexsarathi/models/test_layers.py), two launches where x.float() and .to() add two
    # more; with the weight inside it would scale before rounding (other bits).
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rms_norm_scaled_in_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm that scales by the weight in fp32, then casts back (OLMo's, gpt-oss's; LLaMA's casts
    first, then scales)."""
    return (weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps)).to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, as HF's Gemma3RMSNorm: normalise and scale by (1 + weight) in fp32, then cast
    back (LLaMA's casts before it scales)."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)


def gelu_glu(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    """down(gelu_tanh(gate(x)) * up(x)) (Gemma's MLP), gate and up fused in one weight [2 * ffn, hidden]."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.gelu(gate, approximate="tanh").mul_(up), down)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    # In the compute dtype, as HF's OPT runs its LayerNorm modules: the kernel accumulates in fp32
    # for half-precision inputs, and no fp32 copies of x, weight and bias are launched.
    if weight.dtype != x.dtype:
        weight, bias = weight.to(x.dtype), bias.to(x.dtype)
    # torch.layer_norm is F.layer_norm's own call, without its wrapper's checks (a decode layer on a
    # GPU is host-bound: docs/DESIGN.md, "Decode passes on a GPU")
    return torch.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32), with linear, llama3-style or yarn scaling."""
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """YaRN's frequencies (transformers' _compute_yarn_parameters, in fp32 as it computes them): the
    interpolated ones (divided by factor) below the ramp's dimensions, the original ones above."""
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # no singular ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 for the other kinds)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, head_dim] in `dtype` for positions [T] (inv_freq on positions' device), times
    `scale` in fp32 before the cast (rope_attention_factor)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, d]
    if scale != 1.0:
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in HF's rotate-half layout: x * cos + rotate_half(x) * sin, without
    building rotate_half(x) (the same products and sums, so the same bits). x: [T, heads, head_dim];
    cos, sin: rope_tables'."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].sub_(x[..., half:] * sin[..., :half])
    out[..., half:].add_(x[..., :half] * sin[..., half:])
    return out


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope in place (the same products and sums in the same order, so the same bits): x's
    memory keeps its layout, so a fused qkv output's roped K stays beside its V (one KV write), and
    q and k of one call rotate together (six launches for both, where apply_rope takes five each)."""
    first, second = x.chunk(2, -1)  # views; chunk is one call where indexing takes one per half
    (sin_first, sin_second), (cos_first, cos_second) = sin.chunk(2, -1), cos.chunk(2, -1)
    first_term, second_term = second * sin_first, first * sin_second  # before x changes
    first.mul_(cos_first).sub_(first_term)
    second.mul_(cos_second).add_(second_term)
    return x

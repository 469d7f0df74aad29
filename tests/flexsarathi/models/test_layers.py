"""flexsarathi/models/layers.py: RMSNorm and rotary embedding (in place) give transformers' bits; the
rotation in place keeps a fused qkv output's layout (K beside V)."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from flexsarathi.models.layers import apply_rope, apply_rope_, rms_norm, rope_tables
from offload.kv_cache import kv_pair

HEADS, KV_HEADS, DIM = 4, 2, 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_in_place_on_fused_q_and_k_gives_transformers_bits(dtype):
    gen = torch.Generator().manual_seed(0)
    tokens = 7
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)  # a fused projection's output
    positions = torch.tensor([0, 1, 2, 5, 9, 130, 4000])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)).float()
    cos, sin = rope_tables(positions, inv_freq, dtype)  # [T, 1, d]
    heads = qkv.view(tokens, HEADS + 2 * KV_HEADS, DIM)
    q, k, v = (t.clone() for t in heads.split_with_sizes((HEADS, KV_HEADS, KV_HEADS), 1))
    # transformers: [B, heads, T, d] with cos/sin [B, T, d]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos.transpose(0, 1),
                                        sin.transpose(0, 1))
    apply_rope_(heads.narrow(1, 0, HEADS + KV_HEADS), cos, sin)
    got_q, got_k, got_v = heads.split_with_sizes((HEADS, KV_HEADS, KV_HEADS), 1)
    assert torch.equal(got_q, ref_q[0].transpose(0, 1)) and torch.equal(got_k, ref_k[0].transpose(0, 1))
    assert torch.equal(got_q, apply_rope(q, cos, sin)) and torch.equal(got_k, apply_rope(k, cos, sin))
    assert torch.equal(got_v, v)  # V untouched, and still right after K: one pair for the pool
    assert kv_pair(got_k, got_v) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 64), (33, 4096), (3, 5, 128)])
def test_rms_norm_gives_transformers_bits(dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    hf = LlamaRMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(shape[-1], generator=gen))
    hf = hf.to(dtype)
    with torch.inference_mode():
        assert torch.equal(rms_norm(x, hf.weight, 1e-6), hf(x))

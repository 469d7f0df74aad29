"""flexsarathi/models/layers.py: RMSNorm gives transformers' bits in every compute dtype."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from flexsarathi.models.layers import rms_norm


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

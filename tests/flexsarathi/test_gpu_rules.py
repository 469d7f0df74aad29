"""The CUDA rules that are pure functions, checked on the CPU with given capabilities (issue 28):
the auto dtype (no bf16 below sm_80), the quantized-linear dispatch (the Triton kernel only at
decode-sized row counts on sm_80+), the dequantize scratch a CUDA engine reserves, and RoPE's
inv_freq made once per device."""
from __future__ import annotations

import pytest
import torch

from flexsarathi.engine.llm_engine import gpu_auto_dtype, resolve_dtype
from flexsarathi.models.model_config import ModelConfig
from flexsarathi.models import build_model_math
from offload.memory import dequant_scratch_bytes
from policy_search.model_registry import known_config
from policy_search.model_spec import ModelSpec
from quant.fused import TRITON_MAX_ROWS, use_triton

T4, A100, H100 = (7, 5), (8, 0), (9, 0)


@pytest.mark.parametrize("checkpoint, capability, expected", [
    (torch.bfloat16, T4, torch.float16),  # sm_75: no bf16 tensor cores, Triton's bf16 tl.dot fails
    (torch.bfloat16, A100, torch.bfloat16),
    (torch.bfloat16, H100, torch.bfloat16),
    (torch.bfloat16, None, torch.bfloat16),  # unknown (a Ray driver without the actors' GPU)
    (torch.float16, T4, torch.float16),
    (torch.float32, A100, torch.float16),
    (torch.float32, T4, torch.float16),
])
def test_auto_dtype_on_a_gpu_follows_its_capability(checkpoint, capability, expected):
    assert gpu_auto_dtype(checkpoint, capability) == expected


def test_an_explicit_dtype_wins_on_any_gpu():
    assert resolve_dtype("bfloat16", torch.float32, torch.device("cuda")) == torch.bfloat16


def test_the_triton_kernel_runs_only_at_few_rows_on_sm80_and_newer():
    assert [use_triton(rows, A100) for rows in (0, 1, 16, TRITON_MAX_ROWS, TRITON_MAX_ROWS + 1, 4096)] == \
        [False, True, True, True, False, False]
    assert use_triton(1, H100) and not use_triton(1, T4) and not use_triton(1, None)


def _math(name: str):
    config = ModelConfig.from_hf(known_config(name))
    return config, build_model_math(config)


def test_the_dequantize_scratch_is_the_largest_weight_as_the_engine_fuses_it():
    config, math = _math("opt-30b")
    shapes = math.layer_shapes()
    assert dequant_scratch_bytes(shapes, 2) == 28672 * 7168 * 2  # fc1 [ffn, hidden]
    # the planner prices the same matrix
    assert dequant_scratch_bytes(shapes, 2) == ModelSpec.from_hf(config, "opt-30b", 2).largest_matrix_params * 2
    config, math = _math("llama-2-70b")
    # LLaMA's gate and up are one fused [2 * ffn, hidden] weight, and the planner prices that one.
    assert dequant_scratch_bytes(math.layer_shapes(), 2) == 2 * 28672 * 8192 * 2
    assert ModelSpec.from_hf(config, "llama-2-70b", 2).largest_matrix_params == 2 * 28672 * 8192
    # Experts are dequantized one expert's rows at a time: the scratch holds one expert's gate and up
    # ([2 * 14336, 4096] for Mixtral-8x7B), not the layer's stack of 8, and the planner prices that.
    config, math = _math("mixtral-8x7b")
    scratch = dequant_scratch_bytes(math.weight_kinds(), 2, math.expert_stacks())
    assert scratch == 2 * 14336 * 4096 * 2 == ModelSpec.from_hf(config, "mixtral-8x7b", 2).largest_matrix_params * 2

def test_rope_inv_freq_is_made_once_per_device():
    _, math = _math("llama-2-7b")
    assert math.inv_freq_on(torch.device("cpu")) is math.inv_freq  # no copy where it lives
    meta = torch.device("meta")
    first = math.inv_freq_on(meta)
    assert first.device == meta and math.inv_freq_on(meta) is first

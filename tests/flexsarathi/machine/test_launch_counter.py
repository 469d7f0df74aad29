"""flexsarathi/machine/launch_counter.py: what counts as a launch. Under inference mode (every pass
runs in it) a cast reaches the dispatch mode as `aten::to`, which may alias: it is a launch exactly
where it made new memory; views and bare allocations are none."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexsarathi.machine.launch_counter import LaunchCounter


def _launched(fn) -> list[str]:
    with torch.inference_mode(), LaunchCounter() as counter:
        fn()
    return [op[0] for op in counter.ops]


def test_a_cast_is_a_launch_and_a_no_op_cast_or_a_view_is_none():
    x, w = torch.randn(2, 64, dtype=torch.float16), torch.randn(64, dtype=torch.float16)
    # HF's RMSNorm in half precision: up to fp32, normalise, back down, scale: four kernels on a GPU
    assert _launched(lambda: w * F.rms_norm(x.float(), (64,), eps=1e-5).to(x.dtype)) == ["to", "rms_norm", "to", "mul"]
    assert _launched(lambda: (x.to(torch.float16), x.view(2, 2, 32), x.t(), x.reshape(128), torch.empty(3))) == []
    assert _launched(lambda: x.t().contiguous()) == ["contiguous"]  # a copy; of a contiguous x: none
    assert _launched(lambda: x.contiguous()) == []

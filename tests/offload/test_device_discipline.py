"""What the CUDA paths rely on, checked where it runs on the CPU (issue 28): pool indices stay on the
host when a micro-batch moves to the compute device, empty tensors quantize, the finite check still
raises at once on the CPU, a DiskStore pins only when told, the stream helpers are inert on the CPU,
and the dequantize scratch the engine reserves is what quant/fused.py holds (and what the planner
prices). The GPU side of each is in tests/offload/test_cuda.py (docs/GPU.md)."""
from __future__ import annotations

import pytest
import torch

from offload.micro_batch import POOL_INDEX_FIELDS, AttentionGroup, KVPart, KVWrite, MicroBatch, host_of
from offload.disk_store import DiskStore
from offload.memory import MemoryTracker
from offload.streams import IOStream, indexed, record_event, to_host, used_on
from quant import QuantConfig, dequantize, quantize

META = torch.device("meta")  # a device that is not the CPU, with no data: where tensors went shows


def _micro_batch() -> MicroBatch:
    long = lambda *values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    part = KVPart(tier="cpu", kv_slots=long(0, 1, 2, 3).view(1, 4), kv_start=long(0), kv_len=long(4),
                  patch_src=long(0), patch_seq=long(0), patch_pos=long(3), residual_ids=long(0),
                  complete_len=long(0))
    group = AttentionGroup(token_rows=long(0), num_queries=1, q_pos=long(3).view(1, 1), parts=[part], row_start=0)
    write = KVWrite(tier="cpu", rows=long(0), slots=long(3), residual_ids=long(0))
    return MicroBatch(token_ids=long(5), positions=long(3), groups=[group], kv_writes=[write], logit_rows=long(0))


def test_moving_a_micro_batch_leaves_pool_indices_on_the_host_and_keeps_the_host_originals():
    built = _micro_batch()
    moved = built.to(META)
    group, part, write = moved.groups[0], moved.groups[0].parts[0], moved.kv_writes[0]
    assert moved.token_ids.device == META and group.q_pos.device == META and write.rows.device == META
    assert part.kv_len.device == META and part.patch_pos.device == META
    for obj in (part, write):  # what indexes a pool stays the batch builder's tensor
        for name in POOL_INDEX_FIELDS & set(vars(obj)):
            assert getattr(obj, name).device.type == "cpu"
    assert host_of(group) is built.groups[0] and host_of(part) is built.groups[0].parts[0]
    assert host_of(write) is built.kv_writes[0] and host_of(built.groups[0]) is built.groups[0]
    assert host_of(part).kv_len.device.type == "cpu" and host_of(group).q_pos.device.type == "cpu"


@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (0,)])
def test_an_empty_tensor_quantizes_and_reads_back_empty(shape):
    config = QuantConfig(bits=4, group_size=64 if shape[-1] else 2)
    q = quantize(torch.empty(shape), config)
    assert dequantize(q).shape == shape


def test_the_finite_check_is_immediate_on_the_cpu_even_with_a_flag():
    flag = torch.zeros((), dtype=torch.bool)
    bad = torch.tensor([[1.0, float("nan")] * 32])
    with pytest.raises(ValueError, match="finite"):
        quantize(bad, QuantConfig(), nonfinite=flag)
    assert not bool(flag)  # the flag is only for CUDA, where the immediate check would be a sync


def test_a_disk_store_pins_only_when_told(tmp_path):
    # A CPU engine on a GPU machine must not pin (nor start a CUDA context): the default follows
    # the caller, not torch.cuda.is_available().
    assert DiskStore(tmp_path, "k").pin_memory is False
    assert DiskStore(tmp_path, "k", pin_memory=True).pin_memory is True


def test_stream_helpers_are_inert_on_the_cpu():
    t = torch.arange(4)
    assert to_host(t) is t
    assert record_event(torch.device("cpu")) is None and indexed(torch.device("cpu")) == torch.device("cpu")
    used_on([t, None], None)
    assert IOStream(torch.device("cpu")).run(None, lambda a, b: a + b, 2, 3) == (5, None)


def test_a_cpu_tracker_reports_no_cuda_peak():
    assert "torch_peak" not in MemoryTracker(None, torch.device("cpu")).report()["gpu"]


"""What the CUDA paths rely on, checked where it runs on the CPU (issue 28): pool indices stay on the
host when a micro-batch moves to the compute device, empty tensors quantize, the finite check still
raises at once on the CPU, a DiskStore pins only when told, the stream helpers are inert on the CPU,
and the dequantize scratch the engine reserves is what quant/fused.py holds (and what the planner
prices). The GPU side of each is in tests/offload/test_cuda.py (docs/GPU.md)."""
from __future__ import annotations

import pytest
import torch

import offload.micro_batch
from offload.micro_batch import POOL_INDEX_FIELDS, AttentionGroup, KVPart, KVWrite, MicroBatch, host_of, view_in
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


def _packed_micro_batch() -> MicroBatch:
    """_micro_batch's fields as views of one int64 tensor (as the batch builder makes them), itself a
    view at an offset into a larger one."""
    built = _micro_batch()
    tensors = _index_fields(built)
    backing = torch.full((3 + sum(t.numel() for _, t in tensors),), -1, dtype=torch.long)
    packed, start = backing[3:], 0
    views = {}
    for key, t in tensors:
        views[key] = packed[start:start + t.numel()].view(t.shape).copy_(t)
        start += t.numel()
    group, part, write = built.groups[0], built.groups[0].parts[0], built.kv_writes[0]
    part = KVPart(**{f: views.get(("part", f), getattr(part, f)) for f in vars(part) if f != "host"})
    group = AttentionGroup(token_rows=views["group", "token_rows"], num_queries=1, q_pos=views["group", "q_pos"],
                           parts=[part], row_start=0)
    write = KVWrite(**{f: views.get(("write", f), getattr(write, f)) for f in vars(write) if f != "host"})
    return MicroBatch(views["mb", "token_ids"], views["mb", "positions"], [group], [write], views["mb", "logit_rows"],
                      packed=packed)


def _index_fields(mb: MicroBatch) -> list[tuple[tuple[str, str], torch.Tensor]]:
    """((which object, field), tensor) of every int64 tensor of a one-group, one-part, one-write batch."""
    objects = {"mb": mb, "group": mb.groups[0], "part": mb.groups[0].parts[0], "write": mb.kv_writes[0]}
    return [((name, f), t) for name, obj in objects.items() for f, t in vars(obj).items()
            if isinstance(t, torch.Tensor)]


def test_a_packed_micro_batch_goes_up_in_one_copy_and_its_views_map_onto_it(monkeypatch):
    """A micro-batch whose index fields are views of `packed` moves it in one copy (a pinning and a
    copy per field on a GPU otherwise) and its fields are the same views of the copy; on the CPU it
    is itself."""
    mb = _packed_micro_batch()
    assert mb.to(torch.device("cpu")) is mb
    copies = []
    real = offload.micro_batch.to_device
    monkeypatch.setattr(offload.micro_batch, "to_device", lambda t, device: copies.append(t) or real(t, device))
    moved = mb.to(META)
    assert len(copies) == 1 and copies[0] is mb.packed
    for (name, f), t in _index_fields(moved):
        assert t.device == (torch.device("cpu") if f in POOL_INDEX_FIELDS else META), (name, f)
    # the views' values, where a copy has data: every field of the copy equals the original
    copy = mb.packed.clone()
    for key, t in _index_fields(mb):
        view = view_in(copy, mb.packed, t)
        assert view.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr(), key
        assert view.shape == t.shape and torch.equal(view, t), key
    assert view_in(copy, mb.packed, torch.zeros(2, dtype=torch.long)) is None  # not of the pack: moved alone


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


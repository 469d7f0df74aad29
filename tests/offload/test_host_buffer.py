"""offload/host_buffer.py's RecycledBuffers: a buffer is handed out again only once no tensor
(view, slice, transpose) shares it, best fit first, and their number stays the most ever alive."""
from __future__ import annotations

import pytest
import torch

from offload import host_buffer
from offload.host_buffer import RecycledBuffers

needs_use_count = pytest.mark.skipif(host_buffer._STORAGE_USE_COUNT is None,
                                     reason="this torch build does not report storage use counts")


@needs_use_count
def test_a_buffer_in_use_through_any_view_is_never_handed_out_again():
    buffers = RecycledBuffers()
    first = buffers.take((4, 6), torch.float32).fill_(1.0)
    first_ptr = first.data_ptr()
    view = first.transpose(0, 1)[1:]  # the only holder left after `first` goes
    del first
    second = buffers.take((4, 6), torch.float32).fill_(2.0)
    assert second.data_ptr() != first_ptr  # a new buffer: the first is still held by the view
    assert bool((view == 1.0).all())
    del view
    third = buffers.take((2, 3), torch.bfloat16)  # the first buffer is free again, and fits
    assert third.data_ptr() == first_ptr and third.is_contiguous() and third.shape == (2, 3)
    assert buffers.nbytes == 2 * 4 * 6 * 4


@needs_use_count
def test_best_fit_and_a_too_small_free_buffer_is_replaced():
    buffers = RecycledBuffers()
    small, large = buffers.take((10,), torch.uint8), buffers.take((1000,), torch.uint8)
    small_ptr, large_ptr = small.data_ptr(), large.data_ptr()
    del small, large
    assert buffers.take((8,), torch.uint8).data_ptr() == small_ptr  # the smallest that fits
    assert buffers.take((500,), torch.uint8).data_ptr() == large_ptr
    # Both free again; a request larger than both replaces the larger free one: still two buffers.
    big = buffers.take((4000,), torch.uint8)
    assert big.numel() == 4000 and sorted(s.nbytes() for s in buffers._storages) == [10, 4000]


def test_without_use_counts_every_take_is_a_fresh_tensor(monkeypatch):
    monkeypatch.setattr(host_buffer, "_STORAGE_USE_COUNT", None)
    buffers = RecycledBuffers()
    a = buffers.take((3,), torch.float32)
    del a
    assert buffers.take((3,), torch.float32).shape == (3,) and buffers.nbytes == 0

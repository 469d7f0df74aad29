"""ActivationStore on its own: hidden states parked over the tiers come back bitwise equal to what
was parked (the reference: the tensor itself, as if it had never left the device), disk rows live
in unlinked files mapped from the offload folder, and close() lets go of them."""
from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from offload.activations import ActivationStore

CPU = torch.device("cpu")
FRACTIONS = {"gpu": (1.0, 0.0, 0.0), "cpu": (0.0, 1.0, 0.0), "disk": (0.0, 0.0, 1.0),
             "split": (0.3, 0.3, 0.4), "gpu+disk": (0.5, 0.0, 0.5)}


def _hidden(rows: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, 24, generator=g) * 100).to(dtype)
    if rows > 2:  # values whose bits a conversion would change or lose
        hidden[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=dtype)
    return hidden


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _mappings_of(folder) -> list[str]:
    """Lines of /proc/self/maps for files in `folder` (unlinked ones read '... (deleted)')."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if str(folder) in line]


needs_proc_maps = pytest.mark.skipif(not os.path.exists("/proc/self/maps"),
                                     reason="needs /proc/self/maps (Linux) to see file mappings")


@pytest.mark.parametrize("placement", list(FRACTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_parked_hidden_states_come_back_bitwise(tmp_path, placement, dtype, rows):
    store = ActivationStore(FRACTIONS[placement], CPU, folder=str(tmp_path))
    hidden = _hidden(rows, dtype)
    store.put(0, hidden)
    back = store.take(0)
    assert _same_bits(back, hidden)
    store.close()


@pytest.mark.parametrize("placement", ["cpu", "disk", "split"])
def test_parked_copies_do_not_follow_later_writes_to_the_source(tmp_path, placement):
    """Rows parked off the compute device are copies: the executor reuses the source tensor."""
    store = ActivationStore(FRACTIONS[placement], CPU, folder=str(tmp_path))
    hidden = _hidden(10, torch.float32)
    expected = hidden.clone()
    store.put(0, hidden)
    first_off_device = round(FRACTIONS[placement][0] * 10)
    hidden[first_off_device:] = 0.0
    back = store.take(0)
    assert _same_bits(back[first_off_device:], expected[first_off_device:])
    store.close()


@pytest.mark.parametrize("placement", ["split", "gpu+disk"])
def test_rows_kept_on_the_device_do_not_keep_the_whole_micro_batch_alive(tmp_path, placement):
    """With 0 < act_gpu < 1 the kept rows are their own tensor: a view of the input would keep all
    its rows (the off-device ones too) in device memory until the next layer takes them."""
    store = ActivationStore(FRACTIONS[placement], CPU, folder=str(tmp_path))
    hidden = _hidden(64, torch.bfloat16)
    expected = hidden.clone()
    input_alive = weakref.ref(hidden)
    storage = hidden.untyped_storage().data_ptr()
    store.put(0, hidden)
    kept = [t for tier, t, _ in store._parked[0] if tier == "gpu"]
    assert kept and all(t.untyped_storage().data_ptr() != storage for t in kept)
    del hidden
    gc.collect()
    assert input_alive() is None
    assert _same_bits(store.take(0), expected)
    store.close()


def test_micro_batches_parked_at_once_keep_their_own_rows(tmp_path):
    """The executor parks micro-batch k+1 while k is parked: each key has its own spill buffer, and
    re-parking a key (the next layer) with fewer rows reuses it without touching another key's."""
    store = ActivationStore(FRACTIONS["split"], CPU, folder=str(tmp_path))
    a, b = _hidden(40, torch.bfloat16, seed=1), _hidden(33, torch.bfloat16, seed=2)
    store.put(0, a)
    store.put(1, b)
    assert _same_bits(store.take(0), a)
    smaller = _hidden(20, torch.bfloat16, seed=3)
    store.put(0, smaller)
    assert _same_bits(store.take(1), b)
    assert _same_bits(store.take(0), smaller)
    store.close()


def test_a_key_is_taken_once(tmp_path):
    store = ActivationStore(FRACTIONS["split"], CPU, folder=str(tmp_path))
    store.put(3, _hidden(8, torch.float32))
    store.take(3)
    with pytest.raises(KeyError):
        store.take(3)
    store.close()


@needs_proc_maps
def test_disk_rows_live_in_unlinked_files_mapped_from_the_offload_folder(tmp_path):
    store = ActivationStore(FRACTIONS["disk"], CPU, folder=str(tmp_path))
    store.put(0, _hidden(64, torch.float32))
    store.put(1, _hidden(64, torch.float32, seed=1))
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing outlives the process
    mapped = _mappings_of(tmp_path)
    assert len(mapped) == 2 and all(line.rstrip().endswith("(deleted)") for line in mapped)
    store.take(0)
    store.put(0, _hidden(32, torch.float32, seed=2))  # fits the buffer it had: no new file
    assert len(_mappings_of(tmp_path)) == 2
    store.take(0), store.take(1)
    store.close()


@needs_proc_maps
def test_close_unmaps_the_spill_files(tmp_path):
    store = ActivationStore(FRACTIONS["split"], CPU, folder=str(tmp_path))
    store.put(0, _hidden(50, torch.float32))
    assert _mappings_of(tmp_path)
    store.close()
    gc.collect()
    assert _mappings_of(tmp_path) == []
    with pytest.raises(KeyError):
        store.take(0)  # parked states are dropped too


def test_without_a_folder_disk_rows_stay_in_host_memory():
    store = ActivationStore(FRACTIONS["disk"], CPU, folder=None)
    hidden = _hidden(16, torch.float16)
    store.put(0, hidden)
    assert _same_bits(store.take(0), hidden)
    store.close()

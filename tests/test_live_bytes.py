"""tests/live_bytes.py, the measuring tool of the working-set tests: a storage that was alive when the
measurement began stays allocated through it, so no new allocation can take its address and pass
for an existing storage, uncounted (the peak of a LLaMA decode pass varied 95-128 KB run to run that
way, with the allocator's choices)."""
from __future__ import annotations

import torch

from tests.live_bytes import LiveBytes, storages_alive


def test_an_existing_storage_stays_allocated_through_a_measurement():
    before = torch.ones(4096)  # existing: not counted
    address = before.data_ptr()
    existing = storages_alive()
    live = LiveBytes(existing)
    with live:
        del before  # its last tensor gone: it would be freed, its address free for the next allocation
        assert existing[address].data_ptr() == address and existing[address].nbytes() == 4096 * 4
        after = torch.ones(4096)
    assert after.data_ptr() != address and live.peak >= after.nbytes

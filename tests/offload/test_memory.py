import random
import threading

import pytest

from offload.memory import MemoryBudgetError, MemoryTracker, TierBudget, human_bytes

MiB = 1 << 20
GiB = 1 << 30


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1024) == "1.00 KiB"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(3 * MiB) == "3.00 MiB"
    assert human_bytes(int(4.5 * GiB)) == "4.50 GiB"
    assert human_bytes(2 << 40) == "2.00 TiB"
    assert human_bytes(-512 * MiB) == "-512.00 MiB"


def test_reserve_release_arithmetic_and_peak():
    tracker = MemoryTracker(TierBudget(gpu=1 * GiB, cpu=None, disk=10 * GiB))
    tracker.reserve("gpu", 300 * MiB, "weights")
    tracker.reserve("gpu", 200 * MiB, "kv cache")
    tracker.reserve("gpu", 100 * MiB, "weights")
    assert tracker.in_use("gpu") == 600 * MiB
    assert tracker.in_use_by_what("gpu") == {"weights": 400 * MiB, "kv cache": 200 * MiB}
    assert tracker.available("gpu") == 1 * GiB - 600 * MiB

    tracker.release("gpu", 400 * MiB, "weights")
    assert tracker.in_use("gpu") == 200 * MiB
    assert tracker.in_use_by_what("gpu") == {"kv cache": 200 * MiB}  # emptied entries disappear
    assert tracker.peak("gpu") == 600 * MiB

    tracker.reserve("gpu", 824 * MiB, "activations")  # exactly up to capacity is allowed
    assert tracker.in_use("gpu") == 1 * GiB
    assert tracker.peak("gpu") == 1 * GiB

    tracker.reserve("cpu", 100 * GiB, "weights")  # unlimited tier
    assert tracker.available("cpu") is None
    assert tracker.in_use("disk") == 0 and tracker.peak("disk") == 0

    # each purpose's own peak, kept after it is released (the load's memory: offload/tiered_weights.py)
    assert tracker.peak_by_what("gpu") == {"weights": 400 * MiB, "kv cache": 200 * MiB, "activations": 824 * MiB}

    tracker.release("gpu", 824 * MiB, "activations")
    assert "activations: none now, peak 824.00 MiB" in tracker.format_report()
    tracker.reset_peak()
    assert tracker.peak("gpu") == 200 * MiB
    assert tracker.peak_by_what("gpu") == {"kv cache": 200 * MiB}


def test_budget_error_carries_the_arithmetic_and_changes_nothing():
    tracker = MemoryTracker({"cpu": 4 * GiB})
    tracker.reserve("cpu", 3 * GiB, "weights")
    tracker.reserve("cpu", 512 * MiB, "activations")
    with pytest.raises(MemoryBudgetError) as info:
        tracker.reserve("cpu", 1 * GiB, "kv cache layer 3")
    message = str(info.value)
    for text in ("cpu", "'kv cache layer 3'",
                 "asked 1.00 GiB (1073741824 bytes)",
                 "in use 3.50 GiB (3758096384 bytes)",
                 "weights 3.00 GiB (3221225472 bytes)",
                 "activations 512.00 MiB (536870912 bytes)",
                 "= 4.50 GiB (4831838208 bytes)",
                 "capacity 4.00 GiB (4294967296 bytes)",
                 "short by 512.00 MiB (536870912 bytes)"):
        assert text in message, (text, message)
    error = info.value
    assert (error.tier, error.what, error.requested, error.in_use, error.capacity) == (
        "cpu", "kv cache layer 3", 1 * GiB, int(3.5 * GiB), 4 * GiB)
    assert tracker.in_use("cpu") == int(3.5 * GiB)
    assert "kv cache layer 3" not in tracker.in_use_by_what("cpu")


def test_invalid_uses_are_refused():
    tracker = MemoryTracker(TierBudget(gpu=100))
    with pytest.raises(ValueError, match="unknown tier"):
        tracker.reserve("tpu", 1, "x")
    with pytest.raises(ValueError, match="unknown tiers"):
        MemoryTracker({"hbm": 1})
    with pytest.raises(ValueError, match="non-negative"):
        tracker.reserve("gpu", -1, "x")
    with pytest.raises(ValueError, match="non-negative"):
        tracker.reserve("gpu", 1.5, "x")
    with pytest.raises(ValueError):
        TierBudget(cpu=-1)
    tracker.reserve("gpu", 10, "weights")
    with pytest.raises(ValueError, match="only 10 B is reserved"):
        tracker.release("gpu", 11, "weights")
    with pytest.raises(ValueError, match="only 0 B"):
        tracker.release("gpu", 1, "kv cache")


def test_reservation_context_releases_on_error():
    tracker = MemoryTracker(TierBudget(disk=1000))
    with pytest.raises(KeyError):
        with tracker.reservation("disk", 600, "spill"):
            assert tracker.in_use("disk") == 600
            raise KeyError("boom")
    assert tracker.in_use("disk") == 0
    assert tracker.peak("disk") == 600


def test_report_and_pretty_string():
    tracker = MemoryTracker(TierBudget(gpu=2 * GiB))
    tracker.reserve("gpu", 1 * GiB, "weights")
    tracker.reserve("disk", 5 * MiB, "kv cache")
    report = tracker.report()
    assert set(report) == {"gpu", "cpu", "disk"}
    assert report["gpu"]["capacity"] == 2 * GiB
    assert report["gpu"]["in_use"] == 1 * GiB
    assert report["gpu"]["peak"] == 1 * GiB
    assert report["gpu"]["by_what"] == {"weights": 1 * GiB}
    assert report["cpu"]["capacity"] is None
    text = tracker.format_report()
    assert "gpu: in use 1.00 GiB, peak 1.00 GiB, capacity 2.00 GiB" in text
    assert "capacity unlimited" in text
    assert "kv cache: 5.00 MiB" in text
    assert str(tracker) == text


def test_threads_reserving_and_releasing_end_at_zero():
    capacity = 64 * MiB
    tracker = MemoryTracker(TierBudget(cpu=capacity))
    refused = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(2000):
            nbytes = rng.randrange(1, 4 * MiB)
            what = f"buffer {rng.randrange(3)}"
            try:
                tracker.reserve("cpu", nbytes, what)
            except MemoryBudgetError:
                refused.append(nbytes)
                continue
            tracker.release("cpu", nbytes, what)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert tracker.in_use("cpu") == 0
    assert tracker.in_use_by_what("cpu") == {}
    assert 0 < tracker.peak("cpu") <= capacity
    assert refused == []  # 8 threads x < 4 MiB each never reach 64 MiB


def test_a_host_budget_caps_the_gpu_and_cpu_tiers_together():
    """TierBudget.host (a CPU-only machine: both tiers are its RAM): each tier within its own
    capacity and the two together within host; the disk tier is apart."""
    t = MemoryTracker(TierBudget(gpu=8000, cpu=8000, disk=100, host=10000))
    t.reserve("gpu", 6000, "weights")
    t.reserve("cpu", 3000, "kv")
    t.reserve("disk", 100, "weights")  # not host memory
    assert t.available("gpu") == 10000 - 9000 and t.available("cpu") == 1000 and t.available("disk") == 0
    with pytest.raises(MemoryBudgetError, match=r"host memory budget exceeded reserving 'more' on the cpu tier .* "
                       r"gpu 5\.86 KiB \(6000 bytes\) \+ cpu 2\.93 KiB \(3000 bytes\) \+ 1001 B = .*short by 1 B"):
        t.reserve("cpu", 1001, "more")
    assert (t.in_use("gpu"), t.in_use("cpu")) == (6000, 3000)  # nothing changed
    t.reserve("gpu", 1000, "more")  # exactly the host budget
    t.release("cpu", 3000, "kv")
    t.reserve("gpu", 1000, "again")  # its own capacity binds now: 8000
    with pytest.raises(MemoryBudgetError, match="gpu memory budget exceeded"):
        t.reserve("gpu", 1, "over")
    assert t.available("gpu") == 0 and t.available("cpu") == 2000
    assert MemoryTracker(TierBudget(gpu=5)).available("cpu") is None
    assert "host: gpu + cpu tiers within 9.77 KiB" in t.format_report()

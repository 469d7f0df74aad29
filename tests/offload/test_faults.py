"""Fault injection: damaged, truncated and half-written disk stores, a full disk, an unwritable
offload folder, and interrupts inside `generate`. Each case compares with the undisturbed run:
the source's own weights, or the tokens of an engine that never met the fault."""
from __future__ import annotations

import _thread
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from flexsarathi.errors import FlexSarathiError
from offload.disk_store import DiskStore, OffloadError, StoreCorruptError
from offload.memory import MemoryTracker
from offload.tiered_weights import TieredWeights
from offload.weights import RowSplit
from policy_search.policy import Policy
from tests.conftest import REPO, mounted_tmpfs, on_call, raise_keyboard_interrupt

SHAPES = {"qkv": (96, 32), "o": (32, 32), "up": (80, 32), "down": (32, 80), "norm": (32,)}
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
ON_DISK = Policy(w_gpu=0.0, w_cpu=0.0, w_disk=1.0, overlap=True)


def _layer(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _weights(folder, fractions, read_layer=_layer, overlap=True) -> TieredWeights:
    return TieredWeights(
        num_layers=3, layer_shapes=SHAPES, read_globals=lambda: {"embed": torch.ones(4, 32)},
        read_layer=read_layer, fractions=fractions, device=torch.device("cpu"), dtype=torch.float32,
        quant=None, tracker=MemoryTracker(), overlap=overlap,
        disk_store=lambda: DiskStore(folder, "faults", direct_io=True))


def _store_dir(folder) -> Path:
    (path,) = [p for p in Path(folder).iterdir() if p.is_dir()]
    return path


def _smash(folder, offset: int = 0) -> Path:
    """4 KiB of 0xff written over the first data shard at `offset`, as a torn write would."""
    shard = _store_dir(folder) / "data-00000.bin"
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 4096)
    return shard


def _all_layers(weights: TieredWeights) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(weights.num_layers):
        out.append({k: v.whole() if isinstance(v, RowSplit) else v.clone() for k, v in weights.get(i).items()})
        weights.release(i)
    return out


def _assert_source_weights(weights: TieredWeights) -> None:
    for i, layer in enumerate(_all_layers(weights)):
        for name, value in _layer(i).items():
            assert torch.equal(layer[name], value), (i, name)


# ---- damaged and truncated stores ---------------------------------------------------------------

def test_a_damaged_tensor_is_refused_by_reads_naming_the_file(tmp_path):
    with DiskStore(tmp_path, "k") as store, store.begin_write() as writer:
        writer.add("a", torch.arange(4096, dtype=torch.float32))
        writer.add("b", torch.ones(1024))
        writer.commit()
    shard = _smash(tmp_path, offset=4096)  # inside "a", whose 16 KiB start at offset 0
    with DiskStore(tmp_path, "k") as store:
        assert store.is_complete()  # sizes check out: only the bytes are wrong
        with pytest.raises(StoreCorruptError, match=str(shard)):
            store.read_tensor("a")
        with pytest.raises(StoreCorruptError, match="'a'"):  # a row range checks the whole tensor
            store.read_range_async("a", 8192, torch.empty(16)).result()
        assert torch.equal(store.read_tensor("b"), torch.ones(1024))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("fractions", [(0.0, 0.0, 1.0), (0.3, 0.3, 0.4)], ids=["all-disk", "split"])
def test_a_damaged_store_is_rebuilt_from_the_source(tmp_path, fractions, overlap):
    """all-disk: the damage is found by the first pass's read (rebuilt while running); split: by
    reading the resident pieces when the store is reused (rebuilt before any pass)."""
    _weights(tmp_path, fractions).close()
    _smash(tmp_path)
    with pytest.warns(RuntimeWarning, match="rebuilding the store"):
        weights = _weights(tmp_path, fractions, overlap=overlap)
        weights.prefetch(0)
        _assert_source_weights(weights)
    weights.close()
    with DiskStore(tmp_path, "faults") as store:
        assert store.verify()


def test_a_damaged_store_whose_source_is_gone_is_a_clear_error(tmp_path):
    _weights(tmp_path, (0.3, 0.3, 0.4)).close()
    shard = _smash(tmp_path)

    def source_gone(layer):
        raise FileNotFoundError(f"checkpoint shard of layer {layer} was removed")

    with pytest.warns(RuntimeWarning), pytest.raises(OffloadError, match=f"{shard}.*cannot be rebuilt"):
        _weights(tmp_path, (0.3, 0.3, 0.4), read_layer=source_gone)


def test_a_truncated_store_is_rewritten(tmp_path):
    _weights(tmp_path, (0.0, 0.5, 0.5)).close()
    shard = _store_dir(tmp_path) / "data-00000.bin"
    os.truncate(shard, shard.stat().st_size - 4096)
    calls = []
    weights = _weights(tmp_path, (0.0, 0.5, 0.5), read_layer=lambda i: calls.append(i) or _layer(i))
    assert calls == [0, 1, 2]  # not trusted: written again from the source
    _assert_source_weights(weights)
    weights.close()


@pytest.fixture(scope="module")
def tiny_opt(tiny_checkpoint):
    folder, _ = tiny_checkpoint("opt_deep")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    with LLM(folder) as llm:  # everything on the compute device: no store at all
        reference = [out.token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return folder, prompts, reference


@pytest.mark.parametrize("policy", [ON_DISK, Policy(w_gpu=0.5, w_cpu=0.0, w_disk=0.5, overlap=False)],
                         ids=["all-disk-overlap", "split-serial"])
def test_an_engine_on_a_damaged_store_gives_the_undamaged_tokens(tmp_path, tiny_opt, policy):
    """The issue's reproduction: 4 KiB of 0xff in data-00000.bin of a reused store."""
    folder, prompts, reference = tiny_opt
    with LLM(folder, policy=policy, offload_dir=str(tmp_path)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference
    _smash(tmp_path)
    with pytest.warns(RuntimeWarning, match="rebuilding"), \
            LLM(folder, policy=policy, offload_dir=str(tmp_path)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference


# ---- kill -9, a full disk, an unwritable folder --------------------------------------------------

# Places every weight of 4 of opt-125m's layers on disk (48 tensors) and SIGKILLs itself right
# after the writer's argv[2]-th tensor: kill -9 at a named point of the store's writing, never on
# a timer.
PLACE = """
import os, signal, sys
from flexsarathi import LLM
from offload import store_writer
from policy_search.policy import Policy
add, added = store_writer.DiskStoreWriter.add, []

def add_then_die(self, name, tensor):
    add(self, name, tensor)
    added.append(name)
    if len(added) == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)

store_writer.DiskStoreWriter.add = add_then_die
LLM('dummy:opt-125m-4l', policy=Policy(w_gpu=0.0, w_cpu=0.0, w_disk=1.0), offload_dir=sys.argv[1])
"""


@pytest.mark.slow
def test_kill_during_placement_leaves_nothing_trusted(tmp_path):
    """A subprocess is killed with SIGKILL while it writes the store (4 of opt-125m's layers: 48
    tensors, 55 MB in bf16); no file under a name a reader trusts may remain, and the next run gives
    an uninterrupted run's tokens."""
    child = subprocess.run([sys.executable, "-c", PLACE, str(tmp_path), "40"], cwd=REPO, timeout=300)
    assert child.returncode == -signal.SIGKILL, "the writer finished before its 40th tensor"
    store = _store_dir(tmp_path)
    assert list(store.glob(".data-*")), "no shard was being written: the kill was not mid-store"
    assert not (store / "manifest.json").exists()
    assert not list(store.glob("data-*.bin")), "a half-written shard sits under its final name"
    prompts = [[5, 6, 7, 8] * 3]
    with LLM("dummy:opt-125m-4l") as llm:  # uninterrupted, no disk at all
        reference = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM("dummy:opt-125m-4l", policy=ON_DISK, offload_dir=str(tmp_path)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference
    assert not list(store.glob(".data-*")), "the killed writer's temporary shard was not removed"
    shutil.rmtree(store)  # the rest of the suite needs the disk space


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (needs root; CI runs as root). Yields (mount point, remount(options))."""
    with mounted_tmpfs(tmp_path / "small", "size=256k",
                       "the disk-full and read-only cases need one") as mount:

        def remount(options: str) -> None:
            subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)

        yield mount, remount


def test_disk_full_while_writing_is_a_clear_error_and_nothing_is_trusted(small_tmpfs):
    mount, _ = small_tmpfs
    with DiskStore(mount, "full") as store:
        writer = store.begin_write()  # size unknown: the real ENOSPC comes from the writes
        with pytest.raises(OffloadError, match="not enough disk space"):
            for i in range(20):
                writer.add(f"t{i}", torch.ones(8192))  # 32 KiB each, 640 KiB in all
        assert not store.is_complete()
    assert [p.name for p in _store_dir(mount).iterdir()] == []  # no half-written shard is left


def test_an_engine_on_a_full_disk_says_so_then_runs_once_there_is_room(small_tmpfs, tiny_opt):
    mount, remount = small_tmpfs
    folder, prompts, reference = tiny_opt
    with pytest.raises(OffloadError, match="not enough disk space"):
        LLM(folder, policy=ON_DISK, offload_dir=str(mount))
    remount("size=16m")
    with LLM(folder, policy=ON_DISK, offload_dir=str(mount)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference


def test_an_unwritable_offload_folder_is_a_clear_error(small_tmpfs, tiny_opt, tmp_path):
    mount, remount = small_tmpfs
    folder, _, _ = tiny_opt
    remount("ro")
    with pytest.raises((OffloadError, FlexSarathiError), match=str(mount)):
        LLM(folder, policy=ON_DISK, offload_dir=str(mount))
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises((OffloadError, FlexSarathiError), match=str(not_a_folder)):
        LLM(folder, policy=ON_DISK, offload_dir=str(not_a_folder / "offload"))


# ---- interrupts inside generate ------------------------------------------------------------------

@pytest.fixture(scope="module")
def disk_engine(tmp_path_factory):
    """dummy:opt-125m (12 layers: the interrupts' loads below fall inside a pass, not at its end)
    with every weight streamed from disk and overlap on, and a fresh engine's tokens for the same
    prompts (the reference every interrupted engine must give next)."""
    folder = str(tmp_path_factory.mktemp("offload"))
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 3]
    with LLM("dummy:opt-125m", dtype="float32", policy=ON_DISK, offload_dir=folder) as fresh:
        reference = [o.token_ids for o in fresh.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM("dummy:opt-125m", dtype="float32", policy=ON_DISK, offload_dir=folder)
    yield llm, prompts, reference
    llm.close()
    shutil.rmtree(folder)  # 324 MiB; a module's folder outlives each test's: free its space now


def _tokens(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]



@pytest.mark.parametrize("at_load", [1, 3, 8, 17])
def test_interrupts_from_another_thread_leave_fresh_engine_results(disk_engine, at_load, python_sigint):
    """SIGINT sent to the main thread from another thread (as Ctrl-C in Jupyter), while the main
    thread computes: the weight-prefetch thread sends it on its at_load-th layer load (a named point,
    never a timer) and finishes that load. The engine takes it between layers (not at whatever
    bytecode the main thread ran, where it could leave a thread pool's lock held), and the next
    generate on the same LLM gives the fresh engine's tokens."""
    llm, prompts, reference = disk_engine
    with on_call(llm.engine.weights, "_load", at_load, _thread.interrupt_main) as loads, \
            pytest.raises(KeyboardInterrupt) as raised:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert raised.traceback[-1].name == "raise_if_interrupted", f"raised in {raised.traceback[-1].name}"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the deferral is over
    assert len(loads) >= at_load
    assert _tokens(llm, prompts) == reference, f"after an interrupt at load {at_load}"


def test_an_interrupt_while_a_batch_is_added_leaves_nothing_queued(disk_engine, python_sigint):
    """SIGINT as the engine lays out the KV pools for a new batch: taken once the batch is added,
    which generate then drops, so the next generate runs (not "one batch at a time")."""
    llm, prompts, reference = disk_engine
    with on_call(llm.engine, "_ensure_pools", 1, lambda: signal.raise_signal(signal.SIGINT)), \
            pytest.raises(KeyboardInterrupt) as raised:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert raised.traceback[-1].name == "__exit__"
    assert not llm.engine.has_unfinished()
    assert _tokens(llm, prompts) == reference


def test_a_second_interrupt_inside_a_pass_closes_the_engine_and_says_why(python_sigint):
    """Two SIGINTs before the engine reaches a layer's end: the second is raised where it lands (a
    user whose pass hangs must be able to stop it), and the engine, which cannot vouch for the state
    it left, refuses the next call with the reason."""
    llm = LLM("dummy:opt-125m", dtype="float32")

    def ctrl_c_twice():
        signal.raise_signal(signal.SIGINT)  # noted
        signal.raise_signal(signal.SIGINT)  # raised here, inside the model's math

    with on_call(llm.engine.executor.model, "post_attention", 3, ctrl_c_twice), pytest.raises(KeyboardInterrupt) as raised:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert raised.traceback[-1].name == "_note"
    with pytest.raises(FlexSarathiError, match="a second Ctrl-C stopped a pass"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("at_call", [5, 14, 40])
def test_an_exception_inside_a_pass_leaves_fresh_engine_results(disk_engine, at_call):
    """The same at exact points: KeyboardInterrupt raised by the model's `post_attention` on its n-th call
    (layer n-1 of the first pass, ...), while the next layers' weights are being prefetched."""
    llm, prompts, reference = disk_engine
    with on_call(llm.engine.executor.model, "post_attention", at_call, raise_keyboard_interrupt), \
            pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(llm, prompts) == reference


def test_ctrl_c_at_random_lines_never_hangs_or_changes_the_next_results(tmp_path):
    """SIGINT at lines drawn at random over a whole generate (weights streamed from disk, prefetch
    and I/O threads running): lines of any file, then of the threading module (the locks the thread
    pools take). Before Ctrl-C was deferred to layer boundaries, one landing as a pool's submit had
    just taken a lock left it held and the next generate hung; one just after a deferral ended
    switched deferral off for good. Each is followed by a generate that must give the fresh engine's
    tokens; in a child (tests/offload/ctrl_c_at_lines.py), whose watchdog dumps every thread's stack
    if one hangs."""
    child = subprocess.run([sys.executable, str(Path(__file__).with_name("ctrl_c_at_lines.py")), str(tmp_path),
                            "8", "0"], cwd=REPO, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.returncode == 0, child.stdout + child.stderr[-6000:]
    assert child.stdout.count("ok: SIGINT at line") == 16, child.stdout
    shutil.rmtree(tmp_path)  # ~500 MB; pytest keeps the temporary folders of recent sessions

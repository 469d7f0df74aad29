import errno
import fcntl
import json
import os
import shutil
import subprocess
from collections import namedtuple

import pytest
import torch

import offload.disk_store as disk_store
from offload.disk_store import ALIGNMENT, DiskStore, OffloadError, drop_page_cache, store_dir_name
from offload.host_buffer import aligned_empty
from tests.conftest import mounted_tmpfs

KEY = "stories260K|float16|no-compression"
SMALL_CHUNK = 64 << 10  # small chunks so a few hundred KiB already exercise the parallel chunked path


def make_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "layers.0.fp32": torch.randn(3, 7, generator=generator),
        "layers.0.fp16": torch.randn(1001, generator=generator).half(),
        "layers.0.bf16": torch.randn(17, 33, generator=generator).bfloat16(),
        "layers.1.int8": torch.randint(-128, 128, (4097,), dtype=torch.int8, generator=generator),
        "layers.1.uint8": torch.randint(0, 256, (1,), dtype=torch.uint8, generator=generator),
        "layers.1.big_fp32": torch.randn(50_003, generator=generator),  # 4 chunks + ragged tail
        "layers.1.transposed": torch.randn(5, 9, generator=generator).t(),  # not contiguous
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 5, dtype=torch.float16),
        "flags": torch.tensor([True, False, True]),
        "nan_and_inf": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Compare bytes, not values: NaN != NaN and -0.0 == 0.0 would hide or invent differences.
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                        b.contiguous().reshape(-1).view(torch.uint8)))


def write_store(folder, tensors, key=KEY, **store_kwargs) -> None:
    with DiskStore(folder, key, chunk_bytes=SMALL_CHUNK, **store_kwargs) as store:
        with store.begin_write(total_bytes=sum(t.nbytes for t in tensors.values()),
                               shard_bytes=128 << 10) as writer:
            for name, tensor in tensors.items():
                writer.add(name, tensor)
            writer.commit()


def unaligned_empty(shape, dtype) -> torch.Tensor:
    # Starts one element past an allocation, so the address is never 4096-aligned.
    numel = 1
    for size in shape:
        numel *= size
    return torch.empty(numel + 1, dtype=dtype)[1:].reshape(shape)


@pytest.mark.parametrize("direct_io", [False, True])
def test_write_then_new_store_object_reads_back_exact_bytes(tmp_path, direct_io):
    tensors = make_tensors()
    write_store(tmp_path, tensors, direct_io=direct_io)

    with DiskStore(tmp_path, KEY, direct_io=direct_io, chunk_bytes=SMALL_CHUNK) as store:
        assert store.is_complete()
        assert sorted(store.names()) == sorted(tensors)
        assert len(store.data_files()) > 1  # the 128 KiB shard limit split the data
        for name, tensor in tensors.items():
            out = store.read_into(name, torch.empty(tensor.shape, dtype=tensor.dtype))
            assert same_bytes(out, tensor), name
            assert same_bytes(store.read_into(name, unaligned_empty(tensor.shape, tensor.dtype)),
                              tensor), name
            assert same_bytes(store.read_tensor(name), tensor), name

        outs = {name: aligned_empty(t.shape, t.dtype) for name, t in tensors.items()}
        futures = {name: store.read_async(name, out) for name, out in outs.items()}
        for name, future in futures.items():
            assert future.result(timeout=30) is outs[name]
            assert same_bytes(outs[name], tensors[name]), name
        assert store.verify()


def test_manifest_records_every_tensor(tmp_path):
    tensors = make_tensors()
    write_store(tmp_path, tensors)
    store_path = tmp_path / store_dir_name(KEY)
    manifest = json.loads((store_path / "manifest.json").read_text())
    assert manifest["key"] == KEY
    for name, tensor in tensors.items():
        entry = manifest["tensors"][name]
        assert entry["offset"] % ALIGNMENT == 0
        assert entry["nbytes"] == tensor.nbytes
        assert entry["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert entry["shape"] == list(tensor.shape)
        assert isinstance(entry["crc32"], int)
        assert (store_path / entry["file"]).stat().st_size == manifest["files"][entry["file"]]
    for size in manifest["files"].values():
        assert size % ALIGNMENT == 0  # padded, so a rounded-up O_DIRECT read of a tail fits


def test_store_dir_name_is_readable_and_collision_free():
    assert store_dir_name("a|b") != store_dir_name("a/b")
    assert store_dir_name(KEY).startswith("stories260K_float16_no-compression-")
    assert len(store_dir_name("x" * 1000)) < 80


def test_different_key_is_not_complete(tmp_path):
    write_store(tmp_path, make_tensors())
    with DiskStore(tmp_path, "other-checkpoint|float16") as other:
        assert not other.is_complete()
        with pytest.raises(OffloadError, match="must be .*written"):
            other.read_tensor("scalar")
    # A manifest copied under another key's folder is refused too: the key inside is checked.
    wrong_dir = tmp_path / store_dir_name("other-checkpoint|float16")
    shutil.copytree(tmp_path / store_dir_name(KEY), wrong_dir, dirs_exist_ok=True)
    with DiskStore(tmp_path, "other-checkpoint|float16") as other:
        assert not other.is_complete()


def test_truncated_data_file_is_detected(tmp_path):
    tensors = make_tensors()
    write_store(tmp_path, tensors)
    with DiskStore(tmp_path, KEY) as store:
        assert store.is_complete()
        victim = store.data_files()[0]
        os.truncate(victim, victim.stat().st_size - ALIGNMENT)
        assert not store.is_complete()
        assert not store.verify()
        with pytest.raises(OffloadError):
            store.read_tensor("layers.0.fp32")


def test_flipped_byte_fails_verify_only(tmp_path):
    tensors = make_tensors()
    write_store(tmp_path, tensors)
    with DiskStore(tmp_path, KEY) as store:
        assert store.verify()
        entry = store.entry("layers.1.big_fp32")
        with open(store.path / entry.file, "r+b") as data:
            data.seek(entry.offset + 12345)
            byte = data.read(1)
            data.seek(entry.offset + 12345)
            data.write(bytes([byte[0] ^ 0x01]))
        assert store.is_complete()  # sizes are right: the cheap check cannot see it
        assert not store.verify()


def test_interrupted_write_leaves_nothing_trusted_and_next_write_succeeds(tmp_path):
    tensors = make_tensors()
    with DiskStore(tmp_path, KEY) as store:
        with pytest.raises(KeyboardInterrupt):
            with store.begin_write() as writer:
                writer.add("layers.0.fp32", tensors["layers.0.fp32"])
                raise KeyboardInterrupt
        assert not store.manifest_path.exists()
        assert store.data_files() == []  # partial data removed
        assert not store.is_complete()

        writer = store.begin_write()
        writer.add("layers.0.fp32", tensors["layers.0.fp32"])
        # process "dies" here: no commit

    with DiskStore(tmp_path, KEY) as store:
        assert not store.manifest_path.exists()
        assert not store.is_complete()
    write_store(tmp_path, tensors)
    with DiskStore(tmp_path, KEY) as store:
        assert store.is_complete()
        assert same_bytes(store.read_tensor("flags"), tensors["flags"])


def test_rewrite_removes_old_manifest_before_touching_data(tmp_path):
    tensors = make_tensors()
    write_store(tmp_path, tensors)
    with DiskStore(tmp_path, KEY) as store:
        assert store.is_complete()
        writer = store.begin_write()
        assert not store.manifest_path.exists()
        assert not store.is_complete()
        writer.add("only", torch.arange(10))
        writer.commit()
        assert store.names() == ["only"]
        assert same_bytes(store.read_tensor("only"), torch.arange(10))


FakeUsage = namedtuple("FakeUsage", "total used free")


def test_too_little_free_space_up_front(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: FakeUsage(total=10**9, used=10**9 - 1000, free=1000))
    with DiskStore(tmp_path, KEY) as store:
        with pytest.raises(OffloadError) as info:
            store.begin_write(total_bytes=5_000_000)
        message = str(info.value)
        assert str(store.path) in message
        assert "needs 4.77 MiB (5000000 bytes)" in message
        assert "free 1000 B (1000 bytes)" in message
        assert not store.manifest_path.exists()
    monkeypatch.undo()
    write_store(tmp_path, make_tensors())
    with DiskStore(tmp_path, KEY) as store:
        assert store.is_complete()


def test_enospc_mid_write(tmp_path, monkeypatch):
    tensors = make_tensors()
    real_pwrite = os.pwrite
    calls = []

    def pwrite_until_disk_full(fd, data, offset):
        calls.append(len(data))
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(disk_store.os, "pwrite", pwrite_until_disk_full)
    with DiskStore(tmp_path, KEY) as store:
        writer = store.begin_write()
        with pytest.raises(OffloadError) as info:
            for name, tensor in tensors.items():
                writer.add(name, tensor)
        message = str(info.value)
        assert str(store.path) in message
        assert "needs at least" in message and "free" in message
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert not store.manifest_path.exists()
        assert store.data_files() == []
        with pytest.raises(RuntimeError, match="already committed or aborted"):
            writer.commit()
    monkeypatch.undo()
    write_store(tmp_path, tensors)
    with DiskStore(tmp_path, KEY) as store:
        assert store.is_complete() and store.verify()


def test_enospc_at_fsync_with_known_total(tmp_path, monkeypatch):
    # Filesystems with delayed allocation (ext4, xfs) may report a full disk only when flushing.
    def fsync_disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    tensors = make_tensors()
    total = sum(t.nbytes for t in tensors.values())
    with DiskStore(tmp_path, KEY) as store:
        writer = store.begin_write(total_bytes=total)
        for name, tensor in tensors.items():
            writer.add(name, tensor)
        monkeypatch.setattr(disk_store.os, "fsync", fsync_disk_full)
        with pytest.raises(OffloadError, match=f"needs .*\\({total} bytes\\)"):
            writer.commit()
        monkeypatch.undo()
        assert not store.manifest_path.exists()
        assert not store.is_complete()


def test_folder_that_cannot_be_created(tmp_path):
    regular_file = tmp_path / "not-a-folder"
    regular_file.write_text("x")
    with DiskStore(regular_file / "offload", KEY) as store:
        assert not store.is_complete()
        with pytest.raises(OffloadError, match="not usable"):
            store.begin_write()


def test_read_only_folder(tmp_path):
    """Root ignores permission bits, a read-only mount it cannot (how the suite runs as root in CI):
    writing there is one clear error naming the folder, and a store written before the folder
    became read-only is still read back whole, while rewriting it is refused the same way."""
    tensors = make_tensors()
    with mounted_tmpfs(tmp_path / "ro", "size=1m,ro", "the read-only case needs one") as mount:
        with DiskStore(mount, KEY) as store:
            assert not store.is_complete()
            with pytest.raises(OffloadError, match=f"offload folder {mount} is not usable.*Read-only file system"):
                store.begin_write()
        assert list(mount.iterdir()) == []
        subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True)
        write_store(mount, tensors)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        with DiskStore(mount, KEY) as store:
            assert store.is_complete()
            for name, tensor in tensors.items():
                assert same_bytes(store.read_tensor(name), tensor), name
            with pytest.raises(OffloadError, match=f"{mount}.*Read-only file system"):
                store.begin_write()
            assert store.is_complete()  # the refused rewrite discarded nothing


def _fail_o_direct_open(monkeypatch):
    real_open = os.open

    def open_refusing_o_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(disk_store.os, "open", open_refusing_o_direct)


def _fail_o_direct_reads(monkeypatch):
    real_preadv = os.preadv

    def preadv_refusing_o_direct(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(disk_store.os, "preadv", preadv_refusing_o_direct)


@pytest.mark.parametrize("refuse", [_fail_o_direct_open, _fail_o_direct_reads])
def test_o_direct_refused_falls_back_to_exact_buffered_reads(tmp_path, monkeypatch, refuse):
    tensors = make_tensors()
    write_store(tmp_path, tensors)
    refuse(monkeypatch)
    with DiskStore(tmp_path, KEY, direct_io=True, chunk_bytes=SMALL_CHUNK) as store:
        with pytest.warns(RuntimeWarning, match="direct I/O refused"):
            first = store.read_tensor("layers.1.big_fp32")
        assert not store.direct_io_active
        assert same_bytes(first, tensors["layers.1.big_fp32"])
        for name, tensor in tensors.items():
            assert same_bytes(store.read_tensor(name), tensor), name


def test_wrong_destination_is_refused_clearly(tmp_path):
    write_store(tmp_path, make_tensors())
    with DiskStore(tmp_path, KEY) as store:
        with pytest.raises(ValueError, match=r"dtype torch.float16 and shape \(3, 7\).*"
                                             r"dtype torch.float32 and shape \(3, 7\)"):
            store.read_into("layers.0.fp32", torch.empty(3, 7, dtype=torch.float16))
        with pytest.raises(ValueError, match=r"shape \(7, 3\)"):
            store.read_into("layers.0.fp32", torch.empty(7, 3))
        with pytest.raises(ValueError, match="not contiguous"):
            store.read_into("layers.0.fp32", torch.empty(7, 3).t())
        with pytest.raises(KeyError, match="no tensor 'missing'"):
            store.read_tensor("missing")


def test_page_cache_drop_and_close(tmp_path):
    write_store(tmp_path, make_tensors())
    store = DiskStore(tmp_path, KEY)
    store.drop_page_cache()
    drop_page_cache(store.manifest_path)
    assert same_bytes(store.read_tensor("scalar"), torch.tensor(3.5))
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.read_tensor("scalar")


@pytest.mark.parametrize("direct_io", [False, True])
def test_read_range_returns_the_exact_bytes_of_any_row_range(tmp_path, direct_io):
    weight = torch.randn(257, 129)  # rows of 516 bytes: ranges start at unaligned offsets
    with DiskStore(tmp_path, KEY, direct_io=direct_io, chunk_bytes=SMALL_CHUNK) as store:
        writer = store.begin_write()
        writer.add("w", weight)
        writer.commit()
        row_bytes = weight[0].numel() * weight.element_size()
        for start, stop in [(0, 257), (1, 2), (3, 200), (100, 257), (256, 257)]:
            out = torch.empty(stop - start, 129)
            store.read_range_async("w", start * row_bytes, out).result()
            assert torch.equal(out, weight[start:stop])
            # the engine's case: a row range of an aligned working buffer (middle chunks go direct)
            buffer = aligned_empty((257, 129), torch.float32)
            store.read_range_async("w", start * row_bytes, buffer[start:stop]).result()
            assert torch.equal(buffer[start:stop], weight[start:stop])
        with pytest.raises(ValueError, match="outside the stored"):
            store.read_range_async("w", row_bytes, torch.empty(257, 129)).result()


# ---- linked tensors: bytes that a file outside the store already holds -------------------------
def _outside_file(tmp_path, nbytes: int, seed: int = 1):
    """A file of random bytes outside the store folder (a checkpoint's), and its bytes."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    path = tmp_path / "checkpoint" / f"model-{seed}.bin"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data.numpy().tobytes())
    return str(path), data


def _linked_store(tmp_path, direct_io: bool):
    """A store with one tensor written and one linked to three unaligned ranges of two outside
    files (the middle one spans several chunks); -> (store folder, {name: tensor}, the files)."""
    (a, a_bytes), (b, b_bytes) = _outside_file(tmp_path, 300_001, 1), _outside_file(tmp_path, 200_003, 2)
    extents = [(a, 13, 1_000), (b, 4_097, 150_000), (a, 250_001, 50_000)]
    linked = torch.cat([a_bytes[13:1_013], b_bytes[4_097:154_097], a_bytes[250_001:300_001]]).view(torch.float16)
    tensors = {"written": torch.randn(33, 17), "linked": linked.view(1_000 + 150_000 + 50_000 >> 1)}
    with DiskStore(tmp_path / "store", KEY, direct_io=direct_io, chunk_bytes=SMALL_CHUNK) as store:
        writer = store.begin_write()
        writer.add("written", tensors["written"])
        writer.link("linked", tensors["linked"], extents)
        writer.commit()
    return tmp_path / "store", tensors, (a, b)


@pytest.mark.parametrize("direct_io", [False, True])
def test_a_linked_tensor_reads_back_its_ranges_whole_and_by_any_range(tmp_path, direct_io):
    folder, tensors, files = _linked_store(tmp_path, direct_io)
    assert sum(p.stat().st_size for p in (folder / store_dir_name(KEY)).glob("data-*.bin")) < 8192  # not copied
    with DiskStore(folder, KEY, direct_io=direct_io, chunk_bytes=SMALL_CHUNK) as store:
        assert store.is_complete() and store.entry("linked").linked and not store.entry("written").linked
        store.drop_page_cache()  # its shards and the linked files
        for name, tensor in tensors.items():
            assert same_bytes(store.read_tensor(name), tensor)
        linked = tensors["linked"]
        for start, stop in [(0, linked.numel()), (1, 7), (499, 501), (400, 80_000), (75_499, 100_000)]:
            buffer = aligned_empty((linked.numel(),), torch.float16)  # the engine's case, and an unaligned one
            for out in (buffer[start:stop], unaligned_empty((stop - start,), torch.float16)):
                store.read_range_async("linked", start * 2, out).result()
                assert same_bytes(out, linked[start:stop]), (start, stop)
        assert store.verify()
    for path in files:  # the outside files stay as they were
        assert os.path.getsize(path) in (300_001, 200_003)


def test_a_changed_linked_file_fails_the_check_and_a_resized_one_makes_the_store_incomplete(tmp_path):
    folder, tensors, (a, b) = _linked_store(tmp_path, direct_io=False)
    with open(b, "r+b") as f:  # same size, one byte of the linked range changed
        f.seek(4_097 + 70_000)
        byte = f.read(1)
        f.seek(4_097 + 70_000)
        f.write(bytes([byte[0] ^ 0x20]))
    with DiskStore(folder, KEY, chunk_bytes=SMALL_CHUNK) as store:
        assert store.is_complete()  # the sizes still match: the bytes are checked when read
        with pytest.raises(disk_store.StoreCorruptError, match="linked file changed"):
            store.read_tensor("linked")
        with pytest.raises(disk_store.StoreCorruptError, match=os.path.basename(b)):
            store.read_range_async("linked", 2, torch.empty(3, dtype=torch.float16)).result()
        assert same_bytes(store.read_tensor("written"), tensors["written"])
        assert not store.verify()
    with open(a, "ab") as f:
        f.write(b"\0")
    with DiskStore(folder, KEY) as store:
        assert not store.is_complete()
    os.remove(a)
    with DiskStore(folder, KEY) as store:
        assert not store.is_complete()


def test_an_aborted_or_rewritten_store_never_touches_linked_files(tmp_path):
    path, data = _outside_file(tmp_path, 10_000)
    with DiskStore(tmp_path / "store", KEY) as store:
        with store.begin_write() as writer:
            writer.link("x", data[100:4_196].clone(), [(path, 100, 4_096)])
            writer.add("y", torch.ones(3))
            # no commit: the block's exit aborts
        assert not store.is_complete()
        with store.begin_write() as writer:
            writer.link("x", data[100:4_196].clone(), [(path, 100, 4_096)])
            writer.commit()
        with store.begin_write() as writer:  # a rewrite discards the committed store first
            writer.add("y", torch.ones(3))
            writer.commit()
    assert open(path, "rb").read() == data.numpy().tobytes()


def test_a_link_to_ranges_that_do_not_hold_the_tensor_is_refused(tmp_path):
    path, data = _outside_file(tmp_path, 1_000)
    with DiskStore(tmp_path / "store", KEY) as store, store.begin_write() as writer:
        for extents in ([(path, 0, 99)], [(path, 950, 100)], [(path, -1, 100)], [], [(str(tmp_path / "no"), 0, 100)]):
            with pytest.raises(ValueError, match="cannot link 'x'"):
                writer.link("x", data[:100], extents)

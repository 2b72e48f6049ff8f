"""Swap space: extent allocation, striping over several paths, swap file lifetime and bad paths."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import textwrap
import warnings

import numpy as np
import pytest
from helpers import run_code
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.buffers import BufferPool, HostBuffer
from offload.config import AioConfig
from offload.errors import ConfigError
from offload.space import Extent, ExtentAllocator, SwapSpace

KiB = 1 << 10
MiB = 1 << 20
UNIT = 64 * KiB  # small stripes so a few MiB cross many stripe boundaries
AIO = AioConfig(block_size=UNIT, queue_depth=8)


# A script of allocator operations: ("alloc", nbytes) or ("free", index into the live extents).
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 300_000)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    max_size=60,
)


def _check_extents(live: list[Extent], alignment: int, capacity: int) -> None:
    spans = sorted((e.offset, e.end) for e in live if e.nbytes)
    for start, end in spans:
        assert start % alignment == 0 and end % alignment == 0
        assert 0 <= start < end <= capacity
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "live extents overlap"


def _run_ops(ops, alloc, free) -> list[Extent]:
    live: list[tuple[Extent, int]] = []
    for kind, arg in ops:
        if kind == "alloc":
            ext = alloc(arg)
            assert ext.nbytes >= arg
            live.append((ext, arg))
        elif live:
            ext, _ = live.pop(arg % len(live))
            free(ext)
    return [e for e, _ in live]


@given(_ops)
def test_allocator_keeps_extents_aligned_disjoint_and_coalesces_after_free(ops):
    """Any alloc/free sequence keeps live extents aligned, inside capacity and disjoint, and freeing
    everything leaves one free range the size of the whole space (no fragmentation leak)."""
    a = ExtentAllocator(256 * KiB, alignment=4096, owner=7)

    def alloc(n):
        ext = a.alloc(n)
        if ext is None:  # what SwapSpace does: grow the end of the space
            a.grow(a.capacity_for(n))
            ext = a.alloc(n)
        _check_extents(a.live_extents(), 4096, a.capacity)
        return ext

    live = _run_ops(ops, alloc, a.free)
    _check_extents(live, 4096, a.capacity)
    assert a.used == sum(e.nbytes for e in live)
    for e in live:
        a.free(e)
    assert a.used == 0
    assert a.free_ranges() == ([(0, a.capacity)] if a.capacity else [])
    whole = a.alloc(a.capacity)
    assert whole is not None and whole.offset == 0


@settings(max_examples=20, deadline=None)
@given(_ops)
def test_swap_space_allocations_stay_valid_and_whole_capacity_is_reusable(ops):
    """The same properties hold through SwapSpace over two paths, growth included, and after freeing
    everything one extent of the whole capacity fits without growing the files."""
    with tempfile.TemporaryDirectory() as d:
        with SwapSpace([os.path.join(d, "a"), os.path.join(d, "b")], 128 * KiB, aio=AIO) as space:
            live = _run_ops(ops, space.alloc, space.free)
            _check_extents(live, space.alignment, space.capacity)
            for e in live:
                space.free(e)
            capacity = space.capacity
            whole = space.alloc(capacity)
            assert (whole.offset, whole.nbytes, space.capacity) == (0, capacity, capacity)


def test_freed_extent_is_reused():
    """A freed extent's range is handed out again to a request that fits it."""
    a = ExtentAllocator(64 * KiB)
    x = a.alloc(8 * KiB)
    a.alloc(8 * KiB)
    a.free(x)
    assert a.alloc(5000).offset == x.offset


def test_zero_length_alloc_is_a_valid_empty_extent(tmp_path):
    """alloc(0) returns Extent(0, 0), holds no space, and can be written, read and freed as a no-op."""
    with SwapSpace(tmp_path, 0, aio=AIO) as space:
        ext = space.alloc(0)
        assert (ext.offset, ext.nbytes, space.used) == (0, 0, 0)
        buf = HostBuffer(4096)
        assert space.write(ext, buf).wait() == 0
        assert space.read(ext, buf).wait() == 0
        space.free(ext)


def test_double_free_and_foreign_extent_are_errors(tmp_path):
    """Freeing an extent twice, one never allocated, or another space's extent raises ValueError."""
    with SwapSpace(tmp_path / "a", MiB, aio=AIO) as s1, SwapSpace(tmp_path / "b", MiB, aio=AIO) as s2:
        e1 = s1.alloc(4096)
        s2.alloc(4096)
        with pytest.raises(ValueError, match="another swap space"):
            s2.free(e1)
        s1.free(e1)
        with pytest.raises(ValueError, match="double free"):
            s1.free(e1)
        s1.alloc(8192)
        with pytest.raises(ValueError, match="not allocated"):
            s1.free(Extent(4096, 4096))


def test_alloc_beyond_capacity_grows_the_files(tmp_path):
    """An allocation larger than the free space grows every swap file instead of failing."""
    with SwapSpace([tmp_path / "a", tmp_path / "b"], 256 * KiB, aio=AIO) as space:
        space.alloc(200 * KiB)
        ext = space.alloc(MiB)
        assert ext.end <= space.capacity
        sizes = {os.path.getsize(f) for f in space.files}
        assert sizes == {space.capacity // 2}


def _raw_logical_bytes(files: list[str], unit: int, offset: int, nbytes: int) -> bytes:
    """Reassemble logical bytes from the raw swap files with the RAID0 mapping, independently of SwapSpace."""
    out = bytearray()
    raw = [open(f, "rb").read() for f in files]  # noqa: SIM115 - small files, read once
    n = len(files)
    pos = offset
    while pos < offset + nbytes:
        stripe, within = divmod(pos, unit)
        take = min(unit - within, offset + nbytes - pos)
        foff = (stripe // n) * unit + within
        out += raw[stripe % n][foff:foff + take]
        pos += take
    return bytes(out)


@pytest.mark.parametrize("npaths", [1, 2, 3])
def test_striped_round_trip_returns_the_bytes_written(tmp_path, backend, npaths):
    """Random data of odd lengths written through 1-3 striped paths reads back unchanged, and the raw
    files hold it at the offsets the RAID0 mapping gives."""
    rng = np.random.default_rng(npaths)
    paths = [tmp_path / f"d{i}" for i in range(npaths)]
    lengths = [1, 4095, 4097, UNIT * 3 + 123, UNIT * 7 + 5]
    with SwapSpace(paths, 2 * MiB, aio=AIO.replace(backend=backend)) as space:
        assert space.backend == backend
        space.alloc(4097)  # so later extents start off a stripe boundary
        src, dst = HostBuffer(UNIT * 8), HostBuffer(UNIT * 8)
        for n in lengths:
            ext = space.alloc(n)
            data = rng.integers(0, 256, n, dtype=np.uint8)
            src.numpy()[:n] = data
            assert space.write(ext, src, nbytes=n).wait() == ext.nbytes
            dst.numpy()[:] = 0
            assert space.read(ext, dst, nbytes=n).wait() == ext.nbytes
            assert np.array_equal(dst.numpy()[:n], data)
            raw = _raw_logical_bytes(space.files, space.stripe_unit if npaths > 1 else 1 << 62, ext.offset, n)
            assert raw == data.tobytes()


def test_two_paths_each_get_their_share(tmp_path):
    """With two paths, an extent of 4 stripes puts 2 stripes in each file, in alternation."""
    with SwapSpace([tmp_path / "a", tmp_path / "b"], 4 * UNIT, aio=AIO) as space:
        assert [os.path.getsize(f) for f in space.files] == [2 * UNIT, 2 * UNIT]
        ext = space.alloc(4 * UNIT)
        buf = HostBuffer(4 * UNIT)
        for s in range(4):
            buf.numpy()[s * UNIT:(s + 1) * UNIT] = s + 1
        space.write(ext, buf).wait()
        a, b = (open(f, "rb").read() for f in space.files)  # noqa: SIM115
        assert a[:UNIT] == bytes([1]) * UNIT and a[UNIT:] == bytes([3]) * UNIT
        assert b[:UNIT] == bytes([2]) * UNIT and b[UNIT:] == bytes([4]) * UNIT
        assert space.stats()["requests"] == 2  # one vectored request per path


def test_registered_pool_buffers_round_trip(tmp_path):
    """A BufferPool handed to the space is registered with each engine (when the kernel allows) and
    I/O through its buffers works either way."""
    with BufferPool(2, UNIT * 2) as pool, SwapSpace([tmp_path / "a", tmp_path / "b"], MiB, aio=AIO,
                                                    buffers=pool) as space:
        ext = space.alloc(UNIT * 2)
        pool[0].numpy()[:] = 42
        space.write(ext, pool[0]).wait()
        space.read(ext, pool[1]).wait()
        assert (pool[1].numpy() == 42).all()


def test_buffer_too_small_is_an_error(tmp_path):
    """A buffer that cannot hold nbytes rounded up to the alignment is refused before any I/O."""
    with SwapSpace(tmp_path, MiB, aio=AIO) as space:
        ext = space.alloc(8192)
        with pytest.raises(ValueError, match="do not fit"):
            space.write(ext, HostBuffer(4096), nbytes=4097)


def test_bad_stripe_unit_is_a_config_error(tmp_path):
    """A stripe unit that is not a multiple of block_size is refused with both numbers named."""
    with pytest.raises(ConfigError, match="stripe_unit"):
        SwapSpace([tmp_path / "a", tmp_path / "b"], aio=AIO, stripe_unit=UNIT + 4096)
    assert os.listdir(tmp_path / "a") == []  # the failed construction left no file behind


def _mount_tmpfs(where, *options) -> None:
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)],
                        capture_output=True)
    if rc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {rc.stderr.decode().strip()}")


def _umount(where) -> None:
    subprocess.run(["umount", str(where)], check=True)


def test_full_disk_is_reported_at_construction_with_bytes_needed_and_free(tmp_path):
    """Asking for 64 MiB on a 4 MiB file system fails at once with ENOSPC naming bytes needed and free,
    and leaves no swap file behind."""
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=4m")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # tmpfs may refuse O_DIRECT
            with pytest.raises(OSError) as info:
                SwapSpace(mnt, 64 * MiB, aio=AIO, o_direct="auto")
        assert info.value.errno == errno.ENOSPC
        message = str(info.value)
        assert str(64 * MiB) in message
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        assert f"has {free} bytes" in message
        assert os.listdir(mnt) == []
    finally:
        _umount(mnt)


def test_missing_directory_is_created_when_its_parent_exists(tmp_path):
    """A missing swap directory under an existing parent is created."""
    with SwapSpace(tmp_path / "new", MiB, aio=AIO) as space:
        assert os.path.isdir(tmp_path / "new") and len(space.files) == 1


def test_missing_parent_is_a_clear_error(tmp_path):
    """A swap directory whose parent does not exist raises FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match="parent") as info:
        SwapSpace(tmp_path / "no" / "such", aio=AIO)
    assert info.value.filename == str(tmp_path / "no" / "such")


def test_path_that_is_a_file_is_a_clear_error(tmp_path):
    """A path naming a regular file raises NotADirectoryError."""
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        SwapSpace(tmp_path / "f", aio=AIO)


def test_read_only_directory_is_a_clear_error(tmp_path):
    """A directory on a read-only file system (or not writable by this user) raises PermissionError."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        try:
            with pytest.raises(PermissionError, match="not writable"):
                SwapSpace(ro, aio=AIO)
        finally:
            ro.chmod(0o700)
        return
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "size=1m", "ro")
    try:
        with pytest.raises(PermissionError, match="read-only"):
            SwapSpace(ro, aio=AIO)
    finally:
        _umount(ro)


def test_duplicate_paths_are_an_error(tmp_path):
    """The same directory twice, by name or through a symlink, is refused."""
    with pytest.raises(ValueError, match="twice"):
        SwapSpace([tmp_path, tmp_path], aio=AIO)
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="twice"):
        SwapSpace([tmp_path, tmp_path / "link"], aio=AIO)


def test_two_spaces_in_one_directory_use_different_files_removed_on_close(tmp_path):
    """Two spaces sharing a directory get distinct files; close deletes them, twice is harmless, and a
    closed space refuses use."""
    s1, s2 = SwapSpace(tmp_path, MiB, aio=AIO), SwapSpace(tmp_path, MiB, aio=AIO)
    assert s1.files != s2.files and len(os.listdir(tmp_path)) == 2
    assert SwapSpace.find_stale(tmp_path) == []  # live files are locked, never stale
    s1.close()
    s1.close()
    assert os.listdir(tmp_path) == [os.path.basename(s2.files[0])]
    with pytest.raises(ValueError, match="closed"):
        s1.alloc(1)
    s2.close()
    assert os.listdir(tmp_path) == []


def test_engine_fault_surfaces_as_oserror_naming_the_swap_file(tmp_path, backend):
    """An injected write failure comes back from wait() as OSError with errno and the swap file path."""
    with SwapSpace([tmp_path / "a", tmp_path / "b"], MiB, aio=AIO.replace(backend=backend)) as space:
        ext = space.alloc(2 * UNIT)
        space.inject_fault("error", op="write", errno=errno.EIO)
        with pytest.raises(OSError) as info:
            space.write(ext, HostBuffer(2 * UNIT)).wait()
        assert info.value.errno == errno.EIO
        assert info.value.filename in space.files


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_file_is_found_warned_about_and_removable(tmp_path):
    """A swap-named file nobody holds (its process is gone) is reported as stale, warned about with
    the space it holds, never reused, and removed by remove_stale."""
    import socket

    stale = tmp_path / f"nvme-offload-swap-{socket.gethostname()}-{_dead_pid()}-0123abcd.swap"
    stale.write_bytes(b"\0" * 8192)
    (tmp_path / "unrelated.swap").write_bytes(b"x")
    assert SwapSpace.find_stale(tmp_path) == [str(stale)]
    with pytest.warns(RuntimeWarning, match=r"stale swap files.*remove_stale") as record:
        with SwapSpace(tmp_path, MiB, aio=AIO) as space:
            assert str(stale) not in space.files
    assert "8.00 KiB" in str(record[0].message)
    assert SwapSpace.remove_stale(tmp_path) == [str(stale)]
    assert sorted(os.listdir(tmp_path)) == ["unrelated.swap"]


def test_files_are_removed_at_exit_and_a_crash_leaves_a_stale_file(tmp_path):
    """A space never closed is cleaned up at normal interpreter exit; after a crash (os._exit) its
    file remains and is recognised as stale."""
    script = textwrap.dedent(f"""
        import os, sys
        from offload.config import AioConfig
        from offload.space import SwapSpace
        space = SwapSpace({str(tmp_path)!r}, 1 << 20, aio=AioConfig(block_size=65536))
        if sys.argv[1] == "crash":
            os._exit(0)
    """)
    for how in ("exit", "crash"):
        done = run_code(script, how)
        assert done.returncode == 0, done.stderr
        if how == "exit":
            assert os.listdir(tmp_path) == []
    left = [str(tmp_path / f) for f in os.listdir(tmp_path)]
    assert len(left) == 1 and SwapSpace.find_stale(tmp_path) == left
    SwapSpace.remove_stale(tmp_path)


def test_sub_extent_addresses_the_bytes_of_its_part_and_refuses_to_leave_it(tmp_path):
    """space.sub(extent, start, n) reads and writes exactly bytes [start, start + n) of the extent
    (its length rounded to the alignment), and a misaligned or overflowing part is refused."""
    with SwapSpace(str(tmp_path), 1 << 20) as space, HostBuffer(64 * 1024) as buf:
        a = space.alignment
        ext = space.alloc(4 * a)
        rng = np.random.default_rng(0)
        whole = rng.integers(0, 256, 4 * a, dtype=np.uint8)
        buf.numpy()[:4 * a] = whole
        space.write(ext, buf).wait()
        part = space.sub(ext, a, a + 100)
        assert (part.offset, part.nbytes) == (ext.offset + a, 2 * a)
        buf.numpy()[:] = 0
        space.read(part, buf, nbytes=a + 100).wait()
        assert np.array_equal(buf.numpy()[:a + 100], whole[a:2 * a + 100])
        for start, n in ((a // 2, 10), (3 * a, a + 1), (-a, 10)):
            with pytest.raises(ValueError, match="aligned part"):
                space.sub(ext, start, n)

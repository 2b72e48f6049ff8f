"""Swap space: extent allocation, striping over several paths, swap file lifetime and bad paths."""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings

import numpy as np
import pytest
from helpers import run_code
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.aio import files as aio_files
from offload.buffers import BufferPool, HostBuffer
from offload.config import AioConfig
from offload.errors import ConfigError
from offload.sizes import KIB, MIB, round_up
from offload.space import Extent, ExtentAllocator, SwapSpace

UNIT = 64 * KIB  # small stripes so a few MiB cross many stripe boundaries
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
    a = ExtentAllocator(256 * KIB, alignment=4096, owner=7)

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
        with SwapSpace([os.path.join(d, "a"), os.path.join(d, "b")], 128 * KIB, aio=AIO) as space:
            live = _run_ops(ops, space.alloc, space.free)
            _check_extents(live, space.alignment, space.capacity)
            for e in live:
                space.free(e)
            capacity = space.capacity
            whole = space.alloc(capacity)
            assert (whole.offset, whole.nbytes, space.capacity) == (0, capacity, capacity)


def test_freed_extent_is_reused():
    """A freed extent's range is handed out again to a request that fits it."""
    a = ExtentAllocator(64 * KIB)
    x = a.alloc(8 * KIB)
    a.alloc(8 * KIB)
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
    with SwapSpace(tmp_path / "a", MIB, aio=AIO) as s1, SwapSpace(tmp_path / "b", MIB, aio=AIO) as s2:
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
    with SwapSpace([tmp_path / "a", tmp_path / "b"], 256 * KIB, aio=AIO) as space:
        space.alloc(200 * KIB)
        ext = space.alloc(MIB)
        assert ext.end <= space.capacity
        sizes = {os.path.getsize(f) for f in space.files}
        assert sizes == {space.capacity // 2 + space.alignment}  # and the guard block


def _raw_logical_bytes(files: list[str], unit: int, offset: int, nbytes: int) -> bytes:
    """Reassemble logical bytes from the raw swap files with the RAID0 mapping, independently of SwapSpace."""
    out = bytearray()
    raw = [open(f, "rb").read() for f in files]  # small files, read once
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
    with SwapSpace(paths, 2 * MIB, aio=AIO.replace(backend=backend)) as space:
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
        assert [os.path.getsize(f) for f in space.files] == [2 * UNIT + space.alignment] * 2  # and the guard
        ext = space.alloc(4 * UNIT)
        buf = HostBuffer(4 * UNIT)
        for s in range(4):
            buf.numpy()[s * UNIT:(s + 1) * UNIT] = s + 1
        space.write(ext, buf).wait()
        a, b = (open(f, "rb").read() for f in space.files)
        assert a[:UNIT] == bytes([1]) * UNIT and a[UNIT:2 * UNIT] == bytes([3]) * UNIT
        assert b[:UNIT] == bytes([2]) * UNIT and b[UNIT:2 * UNIT] == bytes([4]) * UNIT
        assert space.stats()["requests"] == 2  # one vectored request per path


def test_registered_pool_buffers_round_trip(tmp_path):
    """A BufferPool handed to the space is registered with each engine (when the kernel allows) and
    I/O through its buffers works either way."""
    with BufferPool(2, UNIT * 2) as pool, SwapSpace([tmp_path / "a", tmp_path / "b"], MIB, aio=AIO,
                                                    buffers=pool) as space:
        ext = space.alloc(UNIT * 2)
        pool[0].numpy()[:] = 42
        space.write(ext, pool[0]).wait()
        space.read(ext, pool[1]).wait()
        assert (pool[1].numpy() == 42).all()


def test_buffer_too_small_is_an_error(tmp_path):
    """A buffer that cannot hold nbytes rounded up to the alignment is refused before any I/O."""
    with SwapSpace(tmp_path, MIB, aio=AIO) as space:
        ext = space.alloc(8192)
        with pytest.raises(ValueError, match="do not fit"):
            space.write(ext, HostBuffer(4096), nbytes=4097)


def test_bad_stripe_unit_is_a_config_error(tmp_path):
    """A stripe unit that is not a multiple of block_size is refused with both numbers named."""
    with pytest.raises(ConfigError, match="stripe_unit"):
        SwapSpace([tmp_path / "a", tmp_path / "b"], aio=AIO, stripe_unit=UNIT + 4096)
    assert os.listdir(tmp_path / "a") == []  # the failed construction left no file behind


def test_full_disk_is_reported_at_construction_with_bytes_needed_and_free(tmpfs):
    """Asking for 64 MiB on a 4 MiB file system fails at once with ENOSPC naming bytes needed and free,
    and leaves no swap file behind."""
    mnt = tmpfs("4m")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # tmpfs may refuse O_DIRECT
        with pytest.raises(OSError) as info:
            SwapSpace(mnt, 64 * MIB, aio=AIO, o_direct="auto")
    assert info.value.errno == errno.ENOSPC
    message = str(info.value)
    assert str(64 * MIB) in message
    free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
    assert f"has {free - 4096} bytes" in message  # while the new file held its 4 KiB guard block
    assert os.listdir(mnt) == []


def test_a_file_system_that_cannot_preallocate_is_refused_saying_what_to_do(tmp_path, monkeypatch):
    """Where fallocate(2) is unsupported (NFSv3, ext4 without extents), a swap space is refused at construction
    with EOPNOTSUPP naming the file and the file systems to use, not glibc's EINVAL of writing a byte per block
    on an O_DIRECT file, and leaves no swap file behind."""
    monkeypatch.setattr(aio_files, "_fallocate", (lambda fd, mode, offset, length: -1, lambda: errno.EOPNOTSUPP))
    with pytest.raises(OSError) as info:
        SwapSpace(tmp_path / "swap", 4 * MIB, aio=AIO, o_direct=True)
    assert info.value.errno == errno.EOPNOTSUPP and info.value.filename.startswith(str(tmp_path / "swap"))
    assert "no fallocate" in str(info.value) and "ext4, XFS or btrfs" in str(info.value)
    assert os.listdir(tmp_path / "swap") == []
    with SwapSpace(tmp_path / "buffered", 4 * MIB, aio=AIO, o_direct=False) as space:  # glibc's fallback writes
        assert os.path.getsize(space.files[0]) >= 4 * MIB


def test_missing_directory_is_created_when_its_parent_exists(tmp_path):
    """A missing swap directory under an existing parent is created."""
    with SwapSpace(tmp_path / "new", MIB, aio=AIO) as space:
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


def test_read_only_directory_is_a_clear_error(tmp_path, tmpfs):
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
    ro = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
    with pytest.raises(PermissionError, match="read-only"):
        SwapSpace(ro, aio=AIO)


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
    s1, s2 = SwapSpace(tmp_path, MIB, aio=AIO), SwapSpace(tmp_path, MIB, aio=AIO)
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
    with SwapSpace([tmp_path / "a", tmp_path / "b"], MIB, aio=AIO.replace(backend=backend)) as space:
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


def _crashed_run(directory) -> str:
    """The swap file of a run that died without cleaning up (1 MiB of space, unlocked, its pid gone)."""
    done = run_code(f"""
        import os
        from offload.space import SwapSpace
        space = SwapSpace({str(directory)!r}, 1 << 20)
        print(space.files[0], flush=True)
        os._exit(0)
    """, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_stale_file_is_found_warned_about_and_removable(tmp_path):
    """A crashed run's swap file (nobody holds it, its process is gone) is reported as stale, warned about
    with the space it holds, never reused, and removed by remove_stale; files merely named like one are not."""
    stale = _crashed_run(tmp_path)
    user = tmp_path / _swap_name(_dead_pid())
    user.write_bytes(b"\0" * 8192)
    (tmp_path / "unrelated.swap").write_bytes(b"x")
    assert SwapSpace.find_stale(tmp_path) == [stale]
    with pytest.warns(RuntimeWarning, match=r"stale swap files.*remove_stale") as record:
        with SwapSpace(tmp_path, MIB, aio=AIO) as space:
            assert stale not in space.files
    assert "1.00 MiB" in str(record[0].message)
    assert SwapSpace.remove_stale(tmp_path) == [stale]
    assert sorted(os.listdir(tmp_path)) == sorted([user.name, "unrelated.swap"])


def test_only_files_provably_ours_are_stale(tmp_path):
    """A stale swap file must be this user's, end in the seal we wrote with its name's random part, and be as
    long as the seal says. A user's file named like one (whatever its pid), a crashed run's file that was cut
    short or grown, one renamed to another swap name, and one of another user are never reported or removed."""
    real = _crashed_run(tmp_path / "a")
    names = {}
    for tag in ("user", "cut", "grown", "renamed", "other_uid"):
        names[tag] = tmp_path / tag / os.path.basename(real)
        names[tag].parent.mkdir()
        shutil.copyfile(real, names[tag])
    names["user"].write_bytes(b"my notes\n" * 1000)
    os.truncate(names["cut"], os.path.getsize(real) - 4096)
    with open(names["grown"], "ab") as f:
        f.write(b"\0" * 4096)
    renamed = names["renamed"].parent / _swap_name(_dead_pid(), rand="89abcdef")
    os.rename(names["renamed"], renamed)
    names["renamed"] = renamed
    if os.geteuid() == 0:
        os.chown(names["other_uid"], 65534, 65534)
    else:
        names.pop("other_uid")
    for tag, path in names.items():
        before = path.read_bytes()
        assert SwapSpace.find_stale(path.parent) == [], tag
        assert SwapSpace.remove_stale(path.parent) == [], tag
        assert path.read_bytes() == before, tag
    assert SwapSpace.remove_stale(tmp_path / "a") == [real]


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


# -- reservations: all or nothing ------------------------------------------------------------------

def _state(space: SwapSpace):
    """Everything a failed reservation must leave unchanged."""
    return (space.capacity, space.used, space._alloc.free_ranges(), space._alloc.live_extents(),
            [os.path.getsize(f) for f in space.files], [os.stat(f).st_blocks for f in space.files])


def test_alloc_many_reserves_once_and_returns_extents_in_order(tmp_path):
    """alloc_many reuses free space, then grows every file once by whole stripes for the rest, and
    hands back disjoint aligned extents in the order of the sizes asked."""
    with SwapSpace([tmp_path / "a", tmp_path / "b"], aio=AIO) as space:
        hole = space.alloc(8 * KIB)
        space.alloc(4 * KIB)
        space.free(hole)
        sizes = [5000, 0, 3 * UNIT + 1, 8 * KIB, 1]
        extents = space.alloc_many(sizes)
        assert [e.nbytes for e in extents] == [round_up(n, space.alignment) for n in sizes]
        assert extents[0].offset == hole.offset  # the freed range came first
        _check_extents(extents, space.alignment, space.capacity)
        assert space.capacity % (2 * space.stripe_unit) == 0
        assert {os.path.getsize(f) for f in space.files} == {space.capacity // 2 + space.alignment}
        assert space.alloc_many([]) == []


def test_full_disk_alloc_many_changes_nothing_and_names_the_whole_request(tmpfs):
    """On a 1 MiB file system, alloc_many of more than fits raises ENOSPC naming the bytes the whole
    request needs and the bytes free, even when its first sizes would fit; the space is exactly as
    before and its existing extent still reads back, and a request that fits then succeeds."""
    mnt = tmpfs("1m")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # tmpfs before Linux 6.6 refuses O_DIRECT
        space = SwapSpace(mnt, aio=AIO, o_direct="auto")
    with space, HostBuffer(UNIT) as buf:
        (kept,) = space.alloc_many([UNIT])
        buf.numpy()[:] = 7
        space.write(kept, buf).wait()
        before = _state(space)
        sizes = [100_000, 300_000, 900_000]
        need = round_up(kept.nbytes + sum(round_up(n, space.alignment) for n in sizes), UNIT) - kept.nbytes
        with pytest.raises(OSError) as info:
            space.alloc_many(sizes)
        assert info.value.errno in (errno.ENOSPC, errno.EDQUOT)
        assert info.value.filename == space.files[0]
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        assert f"{mnt}: needs {need} bytes" in str(info.value)
        assert f"has {free} bytes" in str(info.value)
        assert _state(space) == before
        with pytest.raises(OSError):
            space.alloc(2 * MIB)
        assert _state(space) == before
        buf.numpy()[:] = 0
        assert space.read(kept, buf).wait() == UNIT and (buf.numpy() == 7).all()
        more = space.alloc_many([100_000, 100_000])
        _check_extents([kept, *more], space.alignment, space.capacity)


def test_alloc_many_refuses_bad_sizes_before_reserving(tmp_path):
    """A negative or non-integer size is a ValueError, and nothing is reserved."""
    with SwapSpace(tmp_path, aio=AIO) as space:
        for bad in ([4096, -1], [4096, 1.5], [True]):
            with pytest.raises(ValueError, match="non-negative"):
                space.alloc_many(bad)
        assert (space.capacity, space.used) == (0, 0)


# -- short reads -----------------------------------------------------------------------------------

@pytest.mark.parametrize("npaths", [1, 2])
def test_read_of_a_truncated_swap_file_is_an_error_naming_file_and_offset(tmp_path, backend, npaths):
    """After a swap file is truncated, reading an extent across the cut or wholly past it raises
    OSError(ENODATA) naming the file, the file offset and the bytes expected and got, instead of
    returning stale buffer bytes; an extent before the cut still reads."""
    paths = [tmp_path / f"d{i}" for i in range(npaths)]
    with SwapSpace(paths, aio=AIO.replace(backend=backend)) as space, HostBuffer(4 * UNIT) as buf:
        early, late = space.alloc_many([2 * UNIT * npaths, 2 * UNIT * npaths])
        victim = space.files[-1]
        assert os.path.getsize(victim) == 4 * UNIT + space.alignment  # `late` is the second half of every file
        cut = 3 * UNIT + 8 * KIB
        os.truncate(victim, cut)
        assert space.read(early, buf).wait() == early.nbytes
        with pytest.raises(OSError) as info:
            space.read(late, buf).wait()
        assert info.value.errno == errno.ENODATA and info.value.filename == victim
        m = re.search(r"file offset (\d+): expected (\d+) bytes, got (\d+)", str(info.value))
        offset, expected, got = (int(x) for x in m.groups())
        assert offset + got == cut and got < expected
        os.truncate(victim, 2 * UNIT)
        with pytest.raises(OSError, match=rf"file offset {2 * UNIT}: expected \d+ bytes, got 0") as info:
            space.read(late, buf).wait()
        assert info.value.errno == errno.ENODATA and info.value.filename == victim


def test_read_across_the_cut_reports_the_bytes_that_were_there(tmp_path, backend):
    """A read whose extent spans the new end of the file reports how many bytes it got before it."""
    with SwapSpace(tmp_path, aio=AIO.replace(backend=backend)) as space, HostBuffer(UNIT) as buf:
        ext = space.alloc(UNIT)
        os.truncate(space.files[0], ext.offset + 3 * 4096)
        with pytest.raises(OSError, match=rf"file offset {ext.offset}: expected {UNIT} bytes, got {3 * 4096}"):
            space.read(ext, buf).wait()


# -- O_DIRECT refused: ramfs -----------------------------------------------------------------------

@pytest.fixture
def ramfs(tmpfs):
    """A ramfs mount (a file system without O_DIRECT), or skip saying why."""
    return tmpfs(kind="ramfs")


def test_o_direct_auto_on_a_file_system_without_it_warns_once_and_leaves_one_file(ramfs, monkeypatch):
    """o_direct="auto" on ramfs builds a working buffered swap space with one warning, and the
    directory holds its one swap file (no orphan from a refused O_DIRECT open), removed on close."""
    monkeypatch.setattr(aio_files, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        space = SwapSpace(ramfs, MIB, aio=AIO, o_direct="auto")
    assert [str(w.message) for w in caught if "O_DIRECT" in str(w.message)] == [
        str(caught[0].message)]
    assert "refuses O_DIRECT" in str(caught[0].message)
    assert caught[0].filename == __file__  # the warning names the caller's line, not the library's
    with space, HostBuffer(UNIT) as a, HostBuffer(UNIT) as b:
        assert not space.o_direct
        assert os.listdir(ramfs) == [os.path.basename(space.files[0])]
        ext = space.alloc(UNIT)
        a.numpy()[:] = np.arange(UNIT) % 251
        space.write(ext, a).wait()
        assert space.read(ext, b).wait() == UNIT and np.array_equal(a.numpy(), b.numpy())
    assert os.listdir(ramfs) == []


def test_o_direct_required_on_a_file_system_without_it_refuses_and_leaves_nothing(ramfs):
    """o_direct=True on ramfs raises EINVAL saying what to set, and leaves no file behind."""
    with pytest.raises(OSError, match="refuses O_DIRECT") as info:
        SwapSpace(ramfs, MIB, aio=AIO, o_direct=True)
    assert info.value.errno == errno.EINVAL
    assert os.listdir(ramfs) == []


# -- special files named like swap files -----------------------------------------------------------

def _swap_name(pid: int, rand: str = "0123abcd") -> str:
    return f"nvme-offload-swap-{socket.gethostname()}-{pid}-{rand}.swap"


def test_fifo_named_like_a_swap_file_neither_blocks_nor_is_touched(tmp_path):
    """A FIFO named like a stale swap file does not block the stale scan or the constructor (run in a
    subprocess with a deadline), is not reported, and is left in place."""
    fifo = tmp_path / _swap_name(_dead_pid())
    os.mkfifo(fifo)
    done = run_code(f"""
        from offload.config import AioConfig
        from offload.space import SwapSpace
        print(SwapSpace.find_stale({str(tmp_path)!r}), SwapSpace.remove_stale({str(tmp_path)!r}))
        with SwapSpace({str(tmp_path)!r}, 1 << 20, aio=AioConfig(block_size=65536)) as space:
            print(len(space.files))
    """, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "[]", "1"]
    assert os.listdir(tmp_path) == [fifo.name]


def test_symlinks_named_like_swap_files_are_never_followed_or_deleted(tmp_path):
    """Symlinks named like stale swap files, to a regular file or to a FIFO, are not reported, not
    removed, and their targets are untouched."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    d = tmp_path / "nvme"
    d.mkdir()
    dead = _dead_pid()
    (d / _swap_name(dead, "0000aaaa")).symlink_to(victim)
    (d / _swap_name(dead, "0000bbbb")).symlink_to(fifo)
    (d / _swap_name(dead, "0000cccc")).symlink_to(tmp_path / "missing")
    links = sorted(os.listdir(d))
    done = run_code(f"""
        from offload.config import AioConfig
        from offload.space import SwapSpace
        print(SwapSpace.find_stale({str(d)!r}), SwapSpace.remove_stale({str(d)!r}))
        with SwapSpace({str(d)!r}, 1 << 20, aio=AioConfig(block_size=65536)):
            pass
    """, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "[]"]
    assert sorted(os.listdir(d)) == links
    assert victim.read_bytes() == b"precious" and fifo.exists()


def test_half_created_file_of_a_dead_process_is_stale_and_one_of_a_live_process_is_not(tmp_path):
    """A hidden file a crashed run left while creating a swap file (sealed, not yet renamed) is stale and
    removable; one whose creator is alive (this process) is never reported, even unlocked."""
    from types import SimpleNamespace

    from offload.space import files as swap_files

    found = []
    for pid in (_dead_pid(), os.getpid()):
        final = tmp_path / _swap_name(pid)
        hidden = tmp_path / ("." + final.name + ".new")
        fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            swap_files.seal(SimpleNamespace(fd=fd, path=str(final)), 0, 4096)
        finally:
            os.close(fd)
        found.append(hidden)
    dead, live = found
    assert SwapSpace.find_stale(tmp_path) == [str(dead)]
    assert SwapSpace.remove_stale(tmp_path) == [str(dead)]
    assert os.listdir(tmp_path) == [live.name]


# -- stale scans racing with live spaces -----------------------------------------------------------

def test_stale_scans_never_remove_a_live_swap_file(tmp_path):
    """Two processes create, use and close swap spaces in a loop while this one scans for stale files
    and removes them as fast as it can: nothing is ever reported or removed, and every space in the
    other processes keeps its own file to the end (its data reads back, its file is still there)."""
    rounds = 150
    script = textwrap.dedent(f"""
        import os, sys
        from offload.buffers import HostBuffer
        from offload.config import AioConfig
        from offload.space import SwapSpace
        bad = 0
        with HostBuffer(65536) as a, HostBuffer(65536) as b:
            for i in range({rounds}):
                space = SwapSpace({str(tmp_path)!r}, 65536, aio=AioConfig(block_size=65536, queue_depth=1))
                ext = space.alloc(65536)
                a.numpy()[:] = i % 256
                space.write(ext, a).wait()
                fd = space._res.files[0].fd
                try:
                    space.read(ext, b).wait()
                    same = os.fstat(fd).st_ino == os.stat(space.files[0]).st_ino
                    ok = same and (b.numpy() == i % 256).all()
                except OSError:
                    ok = False
                bad += not ok
                space.close()
        print("bad", bad)
    """)
    from helpers import python_env
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=python_env()) for _ in range(2)]
    reported, removed, scans = [], [], 0
    stop = threading.Event()

    def scan() -> None:
        nonlocal scans
        while not stop.is_set():
            reported.extend(SwapSpace.find_stale(tmp_path))
            removed.extend(SwapSpace.remove_stale(tmp_path))
            scans += 1

    scanner = threading.Thread(target=scan)
    scanner.start()
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        stop.set()
        scanner.join()
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split() == ["bad", "0"], out + err
    assert scans > 0
    assert reported == [] and removed == []
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("npaths", [1, 2])
def test_check_intact_names_a_truncated_file_even_after_our_writes_past_the_cut(tmp_path, npaths):
    """A swap file cut short is named by check_intact (ENODATA, the file, its size and the size it should
    have), also once a write past the cut has made the file long again: the guard block after the address
    space is never written, so no write of ours gives the file its size back."""
    paths = [tmp_path / f"d{i}" for i in range(npaths)]
    with SwapSpace(paths, aio=AIO) as space, HostBuffer(2 * UNIT * npaths) as buf:
        early, late = space.alloc_many([2 * UNIT * npaths, 2 * UNIT * npaths])
        space.write(early, buf).wait()
        space.write(late, buf).wait()
        space.check_intact()
        victim = space.files[-1]
        os.truncate(victim, UNIT)
        space.write(late, buf).wait()  # past the cut: the file is long again, with a hole in `early`
        with pytest.raises(OSError) as info:
            space.check_intact()
        assert info.value.errno == errno.ENODATA and info.value.filename == victim
        assert f"{os.path.getsize(victim)} bytes, shorter than the {4 * UNIT + space.alignment}" in str(info.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root could create a directory at /")
def test_a_missing_swap_directory_is_never_created_at_the_file_system_root(tmp_path, monkeypatch):
    """A missing nvme_path is made when its parent exists, but never at "/": a placeholder such as "/local_nvme"
    of an example config, or a relative path met with the current directory "/", is an error naming the path, why
    and what to give, and nothing appears at the root."""
    from offload.space.paths import check_paths

    name = f"offload-test-{os.getpid()}"
    for path, said in ((f"/{name}", "placeholder"), (name, "is relative: it was met with the current directory /")):
        monkeypatch.chdir("/")
        with pytest.raises(FileNotFoundError, match=said) as info:
            check_paths(path)
        assert info.value.filename == f"/{name}" and "NVMe drive" in str(info.value)
        assert not os.path.exists(f"/{name}")
    monkeypatch.chdir(tmp_path)
    assert check_paths("made") == [str(tmp_path / "made")] and (tmp_path / "made").is_dir()  # below the root: made

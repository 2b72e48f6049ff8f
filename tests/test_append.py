"""AppendFile: a new file written front to back through aligned buffers with the engine."""

import errno
import os
import stat

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.aio import AppendFile, Engine, reserve


@pytest.fixture(scope="module")
def engine():
    with Engine() as e:
        yield e


# The scratch directory is shared by the examples: each writes its own name and removes it.
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 40_000), max_size=12), buffer_pages=st.integers(1, 3),
       count=st.integers(2, 4), o_direct=st.booleans(), seed=st.integers(0, 2**31),
       reserve=st.sampled_from([None, 0, -5000, 1, 70_000]))
def test_pieces_of_any_length_round_trip_exactly(scratch, sizes, buffer_pages, count, o_direct, seed, reserve):
    """Pieces of random lengths (empty ones, ones longer than a buffer, ones ending mid-page) appended as bytes,
    memoryviews and arrays of other dtypes read back byte for byte, and the file is exactly their length, with
    direct I/O (the last write padded, the file cut) and without; with the length reserved up front exactly,
    or too little or too much (the file is cut to what was written)."""
    rng = np.random.default_rng(seed)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    path = os.path.join(scratch, f"f-{seed}-{o_direct}.bin")
    size = 0 if reserve is None else max(0, sum(sizes) + reserve)
    with Engine({"o_direct": o_direct}) as engine:
        with AppendFile(path, engine, buffer_size=buffer_pages * 4096, count=count, size=size) as f:
            assert f._file.o_direct == o_direct
            for k, piece in enumerate(pieces):
                kind = k % 3
                data = piece.tobytes() if kind == 0 else memoryview(piece) if kind == 1 else piece
                if kind == 2 and piece.size % 4 == 0:
                    data = piece.view(np.float32)  # a tensor's bytes, as a NumPy array of another dtype
                assert f.write(data) == piece.size
                assert f.tell() == sum(sizes[:k + 1])
    with open(path, "rb") as back:
        assert back.read() == b"".join(p.tobytes() for p in pieces)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.unlink(path)


def test_an_existing_name_or_a_planted_link_is_refused_and_left_alone(tmp_path, engine):
    theirs = tmp_path / "theirs"
    theirs.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(theirs)
    for name in (theirs, link):
        with pytest.raises(FileExistsError):
            AppendFile(name, engine)
    assert theirs.read_bytes() == b"keep" and os.path.islink(link)


def test_a_reservation_the_disk_cannot_hold_fails_before_any_write_and_leaves_no_file(tmpfs, engine):
    """``size`` past the free space: ENOSPC at construction, naming the file, the bytes asked and free; no file."""
    small = tmpfs("1m")
    path = small / "f.bin"
    with pytest.raises(OSError) as caught:
        AppendFile(path, engine, buffer_size=4096, count=2, size=8 << 20)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    assert "cannot reserve 8388608 bytes" in str(caught.value) and "bytes free" in str(caught.value)
    assert os.listdir(small) == []


def test_the_size_given_is_reserved_when_the_file_is_made(tmp_path, engine):
    """``size`` allocates the file's blocks at construction, before any write (not in the round-trip test,
    which passes whether or not anything is reserved); the file is then cut to what was written."""
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        if not reserve(fd, 0, 4096, str(probe)):
            pytest.skip("this file system cannot reserve space (no fallocate)")
    finally:
        os.close(fd)
    path = tmp_path / "f.bin"
    with AppendFile(path, engine, buffer_size=4096, count=2, size=300_000) as f:
        st = os.stat(path)
        assert st.st_size >= 300_000 and st.st_blocks * 512 >= 300_000
        f.write(b"x" * 5000)
    assert os.path.getsize(path) == 5000


@pytest.mark.parametrize("errors, expected", [
    ([errno.EOPNOTSUPP], False), ([errno.EINTR, errno.EINTR], True), ([errno.ENOSPC], errno.ENOSPC),
    ([errno.EINTR, errno.EDQUOT], errno.EDQUOT)])
def test_reserve_tells_a_file_system_without_fallocate_from_a_full_one(tmp_path, monkeypatch, errors, expected):
    """fallocate(2) unsupported: nothing reserved (False), nothing raised; interrupted: tried again; no space or
    quota: an OSError naming the file, the bytes asked and the bytes free."""
    from offload.aio import files

    left = list(errors)
    last = []

    def fallocate(fd, mode, offset, length):
        if left:
            last[:] = [left.pop(0)]
            return -1
        return 0

    monkeypatch.setattr(files, "_fallocate", (fallocate, lambda: last[0]))
    if isinstance(expected, bool):
        assert reserve(3, 0, 8192, str(tmp_path / "f")) is expected
    else:
        with pytest.raises(OSError) as caught:
            reserve(3, 0, 8192, str(tmp_path / "f"))
        assert caught.value.errno == expected and caught.value.filename == str(tmp_path / "f")
        assert "cannot reserve 8192 bytes" in str(caught.value) and "bytes free" in str(caught.value)
    assert not left


def test_a_failed_write_raises_and_leaves_no_file(tmp_path, engine):
    """A write error (injected in the engine) is an OSError from write() or close(), and the file is gone."""
    path = tmp_path / "f.bin"
    engine.inject_fault("error", op="write", skip=1, count=1)
    try:
        with pytest.raises(OSError):
            with AppendFile(path, engine, buffer_size=4096, count=2) as f:
                for _ in range(8):
                    f.write(b"x" * 4096)
    finally:
        engine.inject_fault("none")
    assert not path.exists()


def test_after_a_failed_write_nothing_more_is_written_and_close_does_not_pretend(tmp_path, engine):
    """A caller that catches the write error and goes on writing gets ValueError, and close() too: the file
    was removed at the error, so no file with a hole where the failed block was is ever left as complete."""
    path = tmp_path / "f.bin"
    engine.inject_fault("error", op="write", skip=0, count=1)
    f = AppendFile(path, engine, buffer_size=4096, count=2)
    try:
        with pytest.raises(OSError):
            for _ in range(4):
                f.write(b"a" * 4096)
    finally:
        engine.inject_fault("none")
    assert not path.exists()
    with pytest.raises(ValueError, match="earlier error"):
        f.write(b"b" * 4096)
    with pytest.raises(ValueError, match="earlier error"):
        f.close()
    assert not path.exists()


def test_an_exception_in_the_block_removes_the_file_and_a_closed_file_refuses_writes(tmp_path, engine):
    path = tmp_path / "f.bin"
    with pytest.raises(KeyError):
        with AppendFile(path, engine, buffer_size=4096) as f:
            f.write(b"y" * 10_000)
            raise KeyError("the caller failed")
    assert not path.exists()
    with AppendFile(path, engine) as f:
        f.write(b"z")
    with pytest.raises(ValueError, match="closed"):
        f.write(b"more")
    assert path.read_bytes() == b"z"
    with pytest.raises(ValueError, match="at least 2"):
        AppendFile(tmp_path / "g", engine, count=1)


def test_files_in_turn_through_one_callers_pool_leave_it_open(tmp_path, engine):
    """Several files written in turn through the caller's pool each read back whole; the pool stays the
    caller's (open, reusable), also after a file that failed."""
    from offload.buffers import BufferPool

    with BufferPool(2, 4096) as pool:
        for k in range(3):
            with AppendFile(tmp_path / f"f{k}", engine, buffers=pool) as f:
                f.write(bytes([k]) * (10_000 + k))
            assert (tmp_path / f"f{k}").read_bytes() == bytes([k]) * (10_000 + k)
        with pytest.raises(KeyError):
            with AppendFile(tmp_path / "bad", engine, buffers=pool) as f:
                f.write(b"x" * 9000)
                raise KeyError("the caller failed")
        assert not pool[0].closed and not (tmp_path / "bad").exists()
        with AppendFile(tmp_path / "again", engine, buffers=pool) as f:
            f.write(b"y" * 5000)
        assert (tmp_path / "again").read_bytes() == b"y" * 5000

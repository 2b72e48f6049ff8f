"""The native engine, through offload.aio: data arrives intact, and every failure is surfaced.

Each test is run for every backend that works here (see conftest.py). The file contents are
checked with plain ``os.pread`` as well, so a bug shared by the engine's read and write paths
cannot hide itself.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
from helpers import REPO, run_code

from offload import aio
from offload._native import HAVE_IO_URING, ffi, lib
from offload.aio import READ, WRITE, Engine, FutureGroup, Segment
from offload.aio import files as aio_files
from offload.buffers import BufferPool, HostBuffer
from offload.sizes import KIB, MIB


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8)


def fill(buf: HostBuffer, data: np.ndarray, offset: int = 0) -> None:
    buf.numpy()[offset:offset + len(data)] = data


def file_bytes(path: str, offset: int, n: int) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY)
    try:
        return np.frombuffer(os.pread(fd, n, offset), dtype=np.uint8)
    finally:
        os.close(fd)


# -- round trips ------------------------------------------------------------------------------

SHAPES = {
    # name: (block_size, queue_depth, thread_count, nbytes, file_offset, buffer_offset)
    "one_block": (64 * KIB, 4, 1, 64 * KIB, 0, 0),
    "many_blocks": (64 * KIB, 8, 1, 1 * MIB, 128 * KIB, 4 * KIB),
    "short_tail": (64 * KIB, 4, 1, 3 * 64 * KIB + 12 * KIB, 4 * KIB, 8 * KIB),
    "more_pieces_than_queue_depth": (64 * KIB, 2, 1, 5 * MIB, 0, 0),
    "three_workers": (64 * KIB, 4, 3, 3 * MIB + 4 * KIB, 8 * KIB, 0),
}


@pytest.mark.parametrize("overlap_events", [True, False], ids=["overlap", "batch"])
@pytest.mark.parametrize("single_submit", [False, True], ids=["batched", "single"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_round_trip_is_identical(scratch, backend, shape, single_submit, overlap_events):
    """Random bytes written at an aligned offset read back identical, whatever the request shape."""
    block_size, qd, threads, nbytes, file_offset, buffer_offset = SHAPES[shape]
    data = random_bytes(nbytes, seed=nbytes)
    path = os.path.join(scratch, "f")
    with Engine(backend=backend, block_size=block_size, queue_depth=qd, thread_count=threads,
                single_submit=single_submit, overlap_events=overlap_events) as e, \
            BufferPool(2, nbytes + buffer_offset) as pool, e.open(path, "w+") as f:
        assert f.o_direct
        fill(pool[0], data, buffer_offset)
        assert e.write(f, pool[0], file_offset, nbytes, buffer_offset=buffer_offset) == nbytes
        assert np.array_equal(file_bytes(path, file_offset, nbytes), data)
        assert e.read(f, pool[1], file_offset, nbytes, buffer_offset=buffer_offset) == nbytes
        assert np.array_equal(pool[1].numpy()[buffer_offset:buffer_offset + nbytes], data)
        assert e.stats()["resubmits"] == 0


def test_vectored_request_moves_every_segment(scratch, backend):
    """One request of several segments, each at its own file and buffer offset, moves them all."""
    path = os.path.join(scratch, "f")
    layout = [(0, 8 * KIB, 68 * KIB), (1 * MIB, 0, 4 * KIB), (256 * KIB, 200 * KIB, 128 * KIB)]
    data = random_bytes(512 * KIB, seed=1)
    with Engine(backend=backend, block_size=16 * KIB, queue_depth=4) as e, \
            BufferPool(2, 512 * KIB) as pool, e.open(path, "w+") as f:
        fill(pool[0], data)
        segs = [Segment(f, fo, pool[0], bo, n) for fo, bo, n in layout]
        assert e.submit(WRITE, segs).wait() == sum(n for *_, n in layout)
        for fo, bo, n in layout:
            assert np.array_equal(file_bytes(path, fo, n), data[bo:bo + n])
        segs = [Segment(f, fo, pool[1], bo, n) for fo, bo, n in layout]
        assert e.submit(READ, segs).wait() == sum(n for *_, n in layout)
        for _, bo, n in layout:
            assert np.array_equal(pool[1].numpy()[bo:bo + n], data[bo:bo + n])


@pytest.mark.parametrize("threads", [1, 3])
def test_digests_of_a_write_and_a_read_of_the_same_bytes_agree_and_catch_a_flipped_bit(scratch, backend, threads):
    """digest=True: the digest a write computes (on the engine's threads) equals the one a read of the same
    bytes computes, and the one computed in Python from the buffers (where the engine is built without
    libxxhash); one flipped bit in the file makes the read's differ."""
    from offload.aio.futures import segments_digest

    path = os.path.join(scratch, "f")
    layout = [(0, 8 * KIB, 68 * KIB), (1 * MIB, 0, 4 * KIB), (256 * KIB, 200 * KIB, 128 * KIB)]
    data = random_bytes(512 * KIB, seed=3)
    with Engine(backend=backend, block_size=16 * KIB, queue_depth=4, thread_count=threads) as e, \
            BufferPool(2, 512 * KIB) as pool, e.open(path, "w+") as f:
        fill(pool[0], data)
        segs = [Segment(f, fo, pool[0], bo, n) for fo, bo, n in layout]
        wrote = e.submit(WRITE, segs, digest=True)
        assert wrote.wait() == sum(n for *_, n in layout)
        back = [Segment(f, fo, pool[1], bo, n) for fo, bo, n in layout]
        read = e.submit(READ, back, digest=True)
        read.wait()
        assert wrote.digest() == read.digest() == segments_digest(segs, 16 * KIB)
        assert segments_digest(segs, 32 * KIB) != wrote.digest()  # pieces are part of what is hashed
        with open(path, "r+b") as raw:
            raw.seek(1 * MIB + 100)
            b = raw.read(1)
            raw.seek(1 * MIB + 100)
            raw.write(bytes([b[0] ^ 0x04]))
        again = e.submit(READ, back, digest=True)
        again.wait()
        assert again.digest() != wrote.digest()
        with pytest.raises(ValueError, match="digest=True"):
            e.submit(READ, back).digest()


@pytest.fixture(params=["hasher", "no-hasher"])
def hasher(request):
    """Engines made in the test hash on their hasher thread, or (``no-hasher``) without one, on the threads
    that complete and submit requests, as when the thread cannot be created."""
    previous = lib.ofl_test_no_hasher(request.param == "no-hasher")
    yield request.param
    lib.ofl_test_no_hasher(previous)


@pytest.mark.parametrize("short", [False, True])
def test_digests_of_many_requests_in_flight_are_those_of_their_bytes(scratch, backend, short, hasher):
    """Pieces are hashed as they land, in whatever order: with many requests of many pieces in flight, writes
    and reads at once (and, with ``short``, every piece coming back half done and resubmitted), each request's
    digest is the one of its own bytes, computed in Python; with or without a hasher thread."""
    from offload.aio.futures import segments_digest

    path = os.path.join(scratch, "f")
    n, parts = 1 * MIB, 6
    hashers_before = set(_threads_named("offload-hash"))
    with Engine(backend=backend, block_size=32 * KIB, queue_depth=8, thread_count=3) as e, \
            BufferPool(3 * parts, n) as pool, e.open(path, "w+") as f:
        for i in range(2 * parts):
            fill(pool[i], random_bytes(n, seed=40 + i))
        if short:
            e.inject_fault("short", count=-1)
        first = [[Segment(f, i * n, pool[i], 0, n)] for i in range(parts)]
        want = [segments_digest(s, 32 * KIB) for s in first]
        assert [w.digest() for w in [e.submit(WRITE, s, digest=True) for s in first]] == want
        # The mode the fixture asked for is the one running: a hasher thread of this engine, or none.
        hashers = set(_threads_named("offload-hash")) - hashers_before
        assert len(hashers) == (1 if hasher == "hasher" and lib.ofl_have_xxhash() else 0)
        # Reads of the first half beside writes of the second: the hasher takes both kinds at once.
        second = [[Segment(f, (parts + i) * n, pool[parts + i], 0, n)] for i in range(parts)]
        back = [[Segment(f, i * n, pool[2 * parts + i], 0, n)] for i in range(parts)]
        futures = [e.submit(op, s, digest=True) for pair in zip(second, back) for op, s in zip((WRITE, READ), pair)]
        assert [fut.digest() for fut in futures] == [d for i in range(parts) for d in
                                                      (segments_digest(second[i], 32 * KIB), want[i])]
        assert all(np.array_equal(pool[2 * parts + i].numpy(), pool[i].numpy()) for i in range(parts))


def test_a_read_that_meets_end_of_file_or_fails_has_no_digest(scratch, backend, hasher):
    """A read (not exact) that meets end of file returns the bytes that exist, and no digest: there is none
    of bytes that did not come; a read of the whole file has the write's; a read that fails raises when its
    digest is asked for."""
    path = os.path.join(scratch, "f")
    with Engine(backend=backend, block_size=32 * KIB) as e, BufferPool(2, 256 * KIB) as pool, \
            e.open(path, "w+") as f:
        fill(pool[0], random_bytes(256 * KIB, seed=9))
        wrote = e.submit(WRITE, [Segment(f, 0, pool[0], 0, 128 * KIB)], digest=True)
        wrote.wait()
        read = e.submit(READ, [Segment(f, 0, pool[1], 0, 256 * KIB)], digest=True)
        assert read.wait() == 128 * KIB
        assert read.digest() is None
        whole = e.submit(READ, [Segment(f, 0, pool[1], 0, 128 * KIB)], digest=True)
        assert whole.digest() == wrote.digest()
        e.inject_fault("error", op="read", skip=1)
        failed = e.submit(READ, [Segment(f, 0, pool[1], 0, 128 * KIB)], digest=True)
        with pytest.raises(OSError):
            failed.digest()


def _threads_named(name: str) -> list[int]:
    """This process's threads called ``name``, by thread id."""
    tids = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as fh:
            if fh.read().strip() == name:
                tids.append(int(tid))
    return tids


def test_the_engines_threads_are_named(scratch, backend):
    """The engine's threads are named (offload-io, and offload-hash once a digest is asked for): what
    ``top -H``, a profiler or a stack dump shows of them."""
    if not lib.ofl_have_xxhash():
        pytest.skip("built without libxxhash: no hasher thread")
    before = {name: set(_threads_named(name)) for name in ("offload-io", "offload-hash")}
    with Engine(backend=backend, block_size=64 * KIB) as e, HostBuffer(256 * KIB) as buf, \
            e.open(os.path.join(scratch, "f"), "w+") as f:
        e.submit(WRITE, [Segment(f, 0, buf, 0, 256 * KIB)], digest=True).wait()
        assert [t for t in _threads_named("offload-io") if t not in before["offload-io"]]
        assert len([t for t in _threads_named("offload-hash") if t not in before["offload-hash"]]) == 1


@pytest.mark.slow
def test_256_mib_of_random_bytes_survive_o_direct(scratch, backend):
    """256 MiB of random bytes written with O_DIRECT at 1 MiB blocks, queue depth 32, read back identical."""
    n = 256 * MIB
    path = os.path.join(scratch, "big")
    with Engine(backend=backend, block_size=1 * MIB, queue_depth=32) as e, BufferPool(2, n) as pool, \
            e.open(path, "w+", o_direct=True) as f:
        e.register_buffers(pool)
        fill(pool[0], random_bytes(n, seed=256))
        assert e.write(f, pool[0], 0) == n
        assert e.read(f, pool[1], 0) == n
        assert np.array_equal(pool[0].numpy(), pool[1].numpy())
        assert e.stats()["failures"] == 0


def test_concurrent_submissions_from_python_threads(scratch, backend):
    """Eight Python threads writing and reading their own regions at once all get their own data back."""
    path = os.path.join(scratch, "f")
    region, rounds, nthreads = 256 * KIB, 4, 8
    errors: list[BaseException] = []
    with Engine(backend=backend, block_size=64 * KIB, queue_depth=4, thread_count=2) as e, \
            e.open(path, "w+") as f:

        def worker(t: int) -> None:
            try:
                with BufferPool(2, region) as pool:
                    for r in range(rounds):
                        data = random_bytes(region, seed=t * 100 + r)
                        fill(pool[0], data)
                        e.write(f, pool[0], t * region)
                        e.read(f, pool[1], t * region)
                        assert np.array_equal(pool[1].numpy(), data), f"thread {t} round {r}"
            except BaseException as err:  # collected, raised in the main thread
                errors.append(err)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]


def test_read_past_end_of_file_returns_the_prefix(scratch, backend):
    """A read crossing end of file returns the bytes that exist; one entirely past it returns 0."""
    path = os.path.join(scratch, "f")
    data = random_bytes(12 * KIB + 1808, seed=2)  # not a multiple of 4096: the tail is short
    with open(path, "wb") as fh:
        fh.write(data.tobytes())
    with Engine(backend=backend, block_size=8 * KIB) as e, BufferPool(1, 64 * KIB) as pool, \
            e.open(path, "r") as f:
        assert f.o_direct
        assert e.read(f, pool[0], 0) == len(data)
        assert np.array_equal(pool[0].numpy()[:len(data)], data)
        assert e.read(f, pool[0], 8 * KIB, 16 * KIB) == len(data) - 8 * KIB
        assert e.read(f, pool[0], 1 * MIB, 16 * KIB) == 0


def test_exact_read_past_end_of_file_is_enodata_naming_file_offset_and_bytes(scratch, backend):
    """A request submitted exact that meets end of file raises ENODATA naming the file, the segment's
    file offset and the bytes expected and got; a full exact read returns every byte."""
    path = os.path.join(scratch, "f")
    with open(path, "wb") as fh:
        fh.write(random_bytes(40 * KIB, seed=8).tobytes())
    with Engine(backend=backend, block_size=8 * KIB) as e, HostBuffer(64 * KIB) as buf, \
            e.open(path, "r") as f:
        whole = [Segment(f, 0, buf, 0, 16 * KIB), Segment(f, 24 * KIB, buf, 16 * KIB, 16 * KIB)]
        assert e.submit(READ, whole, exact=True).wait() == 32 * KIB
        cut = [Segment(f, 0, buf, 0, 16 * KIB), Segment(f, 32 * KIB, buf, 16 * KIB, 16 * KIB)]
        assert e.submit(READ, cut).wait() == 16 * KIB + 8 * KIB  # not exact: the prefix, as before
        with pytest.raises(OSError) as info:
            e.submit(READ, cut, exact=True).wait()
        assert info.value.errno == errno.ENODATA and info.value.filename == path
        assert f"file offset {32 * KIB}: expected {16 * KIB} bytes, got {8 * KIB}" in str(info.value)
        with pytest.raises(OSError, match=f"file offset {1 * MIB}: expected 4096 bytes, got 0"):
            e.submit(READ, [Segment(f, 1 * MIB, buf, 0, 4096)], exact=True).wait()


# -- errors -----------------------------------------------------------------------------------

def test_missing_file_is_file_not_found(scratch, backend):
    """Opening a missing file read-only raises FileNotFoundError naming the path."""
    path = os.path.join(scratch, "missing")
    with Engine(backend=backend) as e, pytest.raises(FileNotFoundError) as info:
        e.open(path, "r")
    assert info.value.filename == path


def test_file_without_permission_is_permission_error(scratch):
    """A 0600 file of root opened by another user raises PermissionError naming the path."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a file another user may not read")
    d = os.path.join(scratch, "d")
    os.mkdir(d, 0o711)  # others may enter, but not read the file
    path = os.path.join(d, "secret")
    with open(path, "wb") as fh:
        fh.write(b"\0" * 4096)
    os.chmod(path, 0o600)
    done = run_code(f"""
        import os
        from offload.aio import open_file
        os.chdir({d!r})
        os.setgid(65534)
        os.setuid(65534)
        try:
            open_file("secret", "r")
        except PermissionError as err:
            print("PermissionError", err.filename)
    """)
    assert done.stdout.strip() == "PermissionError secret", done.stderr


def test_write_to_read_only_file_is_ebadf_naming_the_path(scratch, backend):
    """Writing through a file opened read-only fails with EBADF and the path, not silently."""
    path = os.path.join(scratch, "f")
    with open(path, "wb") as fh:
        fh.write(b"\0" * 8192)
    with Engine(backend=backend) as e, HostBuffer(8192) as buf, e.open(path, "r") as f:
        with pytest.raises(OSError) as info:
            e.write(f, buf, 0)
    assert info.value.errno == errno.EBADF
    assert info.value.filename == path


def test_closed_engine_refuses_work_and_futures_keep_results(scratch, backend):
    """After close, calls raise ValueError, while futures submitted before still return their result."""
    path = os.path.join(scratch, "f")
    e = Engine(backend=backend, block_size=64 * KIB)
    with HostBuffer(1 * MIB) as buf, e.open(path, "w+") as f:
        futures = [e.write_async(f, buf, i * MIB) for i in range(4)]
        e.close()
        assert [fu.wait() for fu in futures] == [1 * MIB] * 4
        assert all(fu.done() for fu in futures)
        for call in (lambda: e.write(f, buf, 0), lambda: e.read_async(f, buf, 0), e.stats,
                     lambda: e.inject_fault("none"), lambda: e.register_buffers([])):
            with pytest.raises(ValueError, match="closed engine"):
                call()
        e.close()  # twice is fine


# -- faults -----------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["write", "read"])
def test_short_transfer_is_resubmitted(scratch, backend, op):
    """Every piece coming back half done is resubmitted for its remainder: the bytes are right."""
    path = os.path.join(scratch, "f")
    n = 2 * MIB
    data = random_bytes(n, seed=3)
    with Engine(backend=backend, block_size=256 * KIB, queue_depth=4) as e, BufferPool(2, n) as pool, \
            e.open(path, "w+") as f:
        fill(pool[0], data)
        e.inject_fault("short", op=op, count=-1)
        assert e.write(f, pool[0], 0) == n
        assert np.array_equal(file_bytes(path, 0, n), data)
        assert e.read(f, pool[1], 0) == n
        assert np.array_equal(pool[1].numpy(), data)
        assert e.stats()["resubmits"] >= n // (256 * KIB)


@pytest.mark.parametrize("op", ["write", "read"])
def test_failed_request_is_eio_with_path_and_offset(scratch, backend, op):
    """An injected failure surfaces as OSError EIO naming the file and offset; the engine goes on working."""
    path = os.path.join(scratch, "f")
    offset = 3 * MIB
    with Engine(backend=backend, block_size=64 * KIB) as e, HostBuffer(64 * KIB) as buf, \
            e.open(path, "w+") as f:
        e.write(f, buf, offset)
        e.inject_fault("error", op=op)
        call = e.write if op == "write" else e.read
        with pytest.raises(OSError) as info:
            call(f, buf, offset)
        assert info.value.errno == errno.EIO
        assert info.value.filename == path
        assert f"{op} at offset {offset}" in str(info.value)
        assert e.stats()["failures"] == 1
        fill(buf, random_bytes(64 * KIB, seed=4))
        assert e.write(f, buf, offset) == 64 * KIB
        assert e.read(f, buf, offset) == 64 * KIB


def test_failure_of_one_segment_fails_the_whole_request(scratch, backend):
    """A request whose second segment fails raises, naming that segment's file, though the others succeed."""
    a, b = os.path.join(scratch, "a"), os.path.join(scratch, "b")
    with Engine(backend=backend, block_size=64 * KIB, thread_count=1) as e, HostBuffer(192 * KIB) as buf, \
            e.open(a, "w+") as fa, e.open(b, "w+") as fb:
        segs = [Segment(fa, 0, buf, 0, 64 * KIB), Segment(fb, 0, buf, 64 * KIB, 64 * KIB),
                Segment(fa, 64 * KIB, buf, 128 * KIB, 64 * KIB)]
        e.inject_fault("error", op="write", errno=errno.ENOSPC)
        fut = e.submit(WRITE, segs[1:2])
        # Let the armed fault land on b's piece, the only one queued: with several workers, a piece
        # submitted next could otherwise reach the fault first.
        while not fut.done():
            time.sleep(0.001)
        others = [e.submit(WRITE, segs[:1]), e.submit(WRITE, segs[2:])]
        with pytest.raises(OSError) as info:
            FutureGroup([others[0], fut, others[1]]).wait()
        assert info.value.errno == errno.ENOSPC and info.value.filename == b
        assert [o.wait() for o in others] == [64 * KIB, 64 * KIB]
        e.inject_fault("error", op="write", skip=1, errno=errno.ENOSPC)
        with pytest.raises(OSError) as info:
            e.submit(WRITE, segs).wait()
        assert info.value.errno == errno.ENOSPC
        assert e.submit(WRITE, segs).wait() == 192 * KIB


def test_unwaited_failure_is_not_swallowed(scratch, backend):
    """A failed future dropped without wait() still reports its error, as a warning."""
    path = os.path.join(scratch, "f")
    with Engine(backend=backend) as e, HostBuffer(4096) as buf, e.open(path, "w+") as f:
        e.inject_fault("error", op="write")
        fut = e.write_async(f, buf, 0)
        with pytest.warns(RuntimeWarning, match="nobody waited"):
            del fut


# -- the GIL ----------------------------------------------------------------------------------

def test_waiting_releases_the_gil(scratch, backend):
    """A Python thread keeps counting while the main thread waits on 128 MiB of I/O."""
    n = 128 * MIB
    path = os.path.join(scratch, "f")
    count = 0
    stop = threading.Event()

    def counter() -> None:
        nonlocal count
        while not stop.is_set():
            count += 1

    with Engine(backend=backend, block_size=1 * MIB, queue_depth=8) as e, HostBuffer(n) as buf, \
            e.open(path, "w+") as f:
        t = threading.Thread(target=counter)
        t.start()
        try:
            advanced = []
            for call in (e.write_async, e.read_async):
                fut = call(f, buf, 0)
                before = count
                fut.wait()  # with the GIL held here, `count` could not move at all
                advanced.append(count - before)
        finally:
            stop.set()
            t.join()
    assert min(advanced) > 1000, advanced


# -- argument checks --------------------------------------------------------------------------

def test_misaligned_o_direct_request_names_value_and_alignment(scratch, backend):
    """Misaligned offsets, lengths and buffer addresses under O_DIRECT are ValueErrors naming the need."""
    path = os.path.join(scratch, "f")
    with Engine(backend=backend) as e, HostBuffer(64 * KIB) as buf, e.open(path, "w+") as f:
        with pytest.raises(ValueError, match="file offset 100 is not a multiple of 4096"):
            e.write(f, buf, 100, 4096)
        with pytest.raises(ValueError, match="length 1000 is not a multiple of 4096"):
            e.write(f, buf, 0, 1000)
        with pytest.raises(ValueError, match=f"buffer address {buf.address + 512} is not a multiple of 4096"):
            e.write(f, buf, 0, 4096, buffer_offset=512)
        with pytest.raises(ValueError, match="do not fit in a buffer of 65536 bytes"):
            e.read(f, buf, 0, 128 * KIB)
        with pytest.raises(ValueError, match="do not fit"):
            e.read(f, buf, 0, 4096, buffer_offset=64 * KIB)
        with pytest.raises(ValueError, match="must not be negative"):
            e.read(f, buf, -4096, 4096)
        assert e.stats()["requests"] == 0


@pytest.mark.parametrize("setting, value", [
    ("block_size", 1000), ("block_size", 0), ("queue_depth", 0), ("queue_depth", 5000),
    ("thread_count", 0), ("backend", "spdk"), ("o_direct", "yes"), ("use_gds", "yes"),
])
def test_bad_config_is_value_error_naming_it(setting, value):
    """Each bad aio setting is refused with a ValueError naming the setting and the value."""
    with pytest.raises(ValueError, match=setting) as info:
        Engine(**{setting: value})
    if not isinstance(value, bool):
        assert str(value) in str(info.value)


def test_io_uring_not_available_is_enosys_or_runs():
    """Asking for io_uring either gets it, or an OSError saying why (never a silent fallback)."""
    try:
        e = Engine(backend="io_uring")
    except OSError as err:
        assert err.errno in (errno.ENOSYS, errno.EPERM, errno.EACCES)
    else:
        with e:
            assert e.backend == "io_uring" and e.fallback_reason is None


@pytest.mark.parametrize("err, meaning", [
    (errno.EPERM, "io_uring_disabled"), (errno.ENOSYS, "seccomp"), (errno.ENOMEM, "ulimit -l"),
])
def test_fallback_to_threads_warns_once_per_process_with_the_reason(monkeypatch, err, meaning):
    """When io_uring is refused, backend "auto" runs on threads and warns once per process (not per
    engine) with the errno and what it means; backend "io_uring" raises that errno instead."""
    monkeypatch.setattr(aio_files, "_warned", set())  # as if no warning had been given yet
    previous = aio._test_refuse_io_uring(err)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Engine(backend="auto") as a, Engine(backend="auto") as b:
                assert a.backend == b.backend == "threads"
        if HAVE_IO_URING:
            assert a.fallback_reason.errno == err
            with pytest.raises(OSError) as info:
                Engine(backend="io_uring")
            assert info.value.errno == err
            meaning = re.escape(f"{errno.errorcode[err]}: {os.strerror(err)}): ") + f".*{meaning}"
        else:
            meaning = "ENOSYS.*liburing"
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1, messages
        assert caught[0].filename == __file__  # the warning names the caller's line
        assert re.search(meaning, messages[0]) and "thread-pool backend" in messages[0]
    finally:
        aio._test_refuse_io_uring(previous)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(backend="auto").close()  # io_uring again (or the process's one warning already given)


# -- O_DIRECT refused -------------------------------------------------------------------------

@pytest.fixture
def no_o_direct_dir(tmpfs):
    """A ramfs mount (it refuses O_DIRECT), or skip where mounting is not possible."""
    mnt = tmpfs(kind="ramfs")
    probe = mnt / "probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pass
    else:
        pytest.skip("ramfs accepts O_DIRECT on this kernel")
    finally:
        probe.unlink(missing_ok=True)  # a refused O_DIRECT open still creates the file
    return str(mnt)


def test_o_direct_required_on_refusing_fs_is_clear_error(no_o_direct_dir, backend):
    """o_direct=True where the file system refuses it raises EINVAL saying what to set."""
    with Engine(backend=backend, o_direct=True) as e, \
            pytest.raises(OSError, match="refuses O_DIRECT") as info:
        e.open(os.path.join(no_o_direct_dir, "f"), "w+")
    assert info.value.errno == errno.EINVAL


def test_o_direct_auto_falls_back_to_buffered_with_one_warning(no_o_direct_dir, backend, monkeypatch):
    """o_direct="auto" on a refusing file system warns once, then buffered I/O (any alignment) works."""
    monkeypatch.setattr(aio_files, "_warned", set())
    data = random_bytes(10_000, seed=5)
    with Engine(backend=backend, block_size=4096) as e, BufferPool(2, 16 * KIB) as pool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f = e.open(os.path.join(no_o_direct_dir, "f"), "w+")
            g = e.open(os.path.join(no_o_direct_dir, "g"), "w+")
        assert [w.category for w in caught] == [RuntimeWarning]
        assert "refuses O_DIRECT" in str(caught[0].message)
        with f, g:
            assert not f.o_direct and f.alignment == 1
            fill(pool[0], data)
            assert e.write(f, pool[0], 3, len(data), buffer_offset=1) == len(data)
            assert e.read(f, pool[1], 3, len(data) + 100) == len(data)
            assert np.array_equal(pool[1].numpy()[:len(data)], pool[0].numpy()[1:1 + len(data)])


def test_o_direct_auto_creates_exclusively_on_refusing_fs_without_orphans(no_o_direct_dir, monkeypatch):
    """o_direct="auto" with mode "x+" (how swap and checkpoint files are made) creates the file once,
    buffered, with no FileExistsError and no second file; "w+" opens an existing file the same way."""
    monkeypatch.setattr(aio_files, "_warned", set())
    path = os.path.join(no_o_direct_dir, "new")
    with warnings.catch_warnings(record=True) as caught, Engine() as e:
        warnings.simplefilter("always")
        with e.open(path, "x+", o_direct="auto") as f, HostBuffer(4096) as buf:
            assert not f.o_direct
            e.write(f, buf, 0)
        with e.open(path, "w+", o_direct="auto") as f:
            assert not f.o_direct
    assert len([w for w in caught if "refuses O_DIRECT" in str(w.message)]) == 1
    assert os.listdir(no_o_direct_dir) == ["new"] and os.path.getsize(path) == 4096


@pytest.mark.parametrize("mode", ["x+", "w+"])
def test_o_direct_required_leaves_no_file_it_created_and_keeps_one_it_did_not(no_o_direct_dir, mode):
    """o_direct=True on a refusing file system removes the file the refused open created, and never
    removes a file that existed before."""
    path = os.path.join(no_o_direct_dir, "f")
    with Engine() as e:
        with pytest.raises(OSError, match="refuses O_DIRECT"):
            e.open(path, mode, o_direct=True)
        assert os.listdir(no_o_direct_dir) == []
        if mode == "w+":
            with open(path, "wb") as fh:
                fh.write(b"kept")
            with pytest.raises(OSError, match="refuses O_DIRECT"):
                e.open(path, mode, o_direct=True)
            assert open(path, "rb").read() == b"kept"


# -- fixed buffers ----------------------------------------------------------------------------

def test_registered_pool_is_used_as_fixed_buffers(scratch, backend):
    """A registered pool is reported as fixed buffers on io_uring, and data still round trips through it."""
    path = os.path.join(scratch, "f")
    with Engine(backend=backend, block_size=64 * KIB, thread_count=2) as e, \
            BufferPool(3, 256 * KIB) as pool, e.open(path, "w+") as f:
        assert e.register_buffers(pool)
        assert e.stats()["fixed_buffers"] == (len(pool) if backend == "io_uring" else 0)
        data = random_bytes(256 * KIB, seed=6)
        fill(pool[0], data)
        e.write(f, pool[0], 0)
        e.read(f, pool[2], 0, 192 * KIB, buffer_offset=64 * KIB)
        assert np.array_equal(pool[2].numpy()[64 * KIB:], data[:192 * KIB])
        assert e.register_buffers([])
        assert e.stats()["fixed_buffers"] == 0
        e.read(f, pool[1], 0)
        assert np.array_equal(pool[1].numpy(), data)


def test_segment_outside_its_registered_buffer_is_rejected(scratch, backend):
    """The native engine refuses a fixed-buffer segment that is not inside the buffer it names."""
    path = os.path.join(scratch, "f")
    with Engine(backend=backend) as e, BufferPool(2, 64 * KIB) as pool, e.open(path, "w+") as f:
        assert e.register_buffers(pool)
        segs = ffi.new("ofl_segment[]", 1)
        out = ffi.new("ofl_request **")
        for address, nbytes in ((pool[1].address, 4096), (pool[0].address + 60 * KIB, 8192)):
            segs[0].fd, segs[0].buf_index, segs[0].offset = f.fd, 0, 0
            segs[0].buf, segs[0].len = ffi.cast("void *", address), nbytes
            assert lib.ofl_engine_submit(e._handle, lib.OFL_OP_WRITE, segs, 1, out) == -errno.EINVAL
        assert e.write(f, pool[0], 0) == 64 * KIB


def test_registering_is_refused_while_requests_are_live(scratch, backend):
    """Registering buffers while a request is in flight is a clear error, not a race with the kernel."""
    path = os.path.join(scratch, "f")
    with Engine(backend=backend, block_size=64 * KIB, queue_depth=1) as e, BufferPool(1, 64 * MIB) as pool, \
            e.open(path, "w+") as f:
        # 1024 pieces written one at a time take ~100 ms even on fast disks: still in flight below.
        fut = e.write_async(f, pool[0], 0)
        try:
            with pytest.raises(RuntimeError, match="in flight"):
                e.register_buffers(pool)
        finally:
            fut.wait()
        assert e.register_buffers(pool)


# -- the build --------------------------------------------------------------------------------

def test_stale_build_is_refused():
    """An extension built for another package version refuses to import, saying it is stale."""
    done = run_code("""
        import importlib, sys
        import offload._version
        offload._version.__version__ = "0.0.0+other"
        sys.modules.pop("offload._native", None)  # the package's __init__ may have loaded it already
        try:
            importlib.import_module("offload._native")
        except ImportError as err:
            print("ImportError:", err)
    """)
    assert "ImportError:" in done.stdout and "stale" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
def test_build_without_liburing_runs_on_threads(tmp_path):
    """Built without liburing, the engine runs on threads, refuses io_uring with ENOSYS, and moves data."""
    shutil.copytree(os.path.join(REPO, "native"), tmp_path / "native",
                    ignore=shutil.ignore_patterns("*.o"))
    shutil.copytree(os.path.join(REPO, "offload"), tmp_path / "offload",
                    ignore=shutil.ignore_patterns("*.so", "*.o", "_engine.c", "_kernels.c", "__pycache__"))
    # The build gets this process's import path (cffi may come from PYTHONPATH), the copy first.
    env = dict(os.environ, OFFLOAD_NO_URING="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), *(p for p in sys.path if p)]))
    built = subprocess.run([sys.executable, "offload/_build.py"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    done = run_code("""
        import errno, os
        import offload.aio as aio
        from offload.aio import Engine
        from offload.buffers import HostBuffer
        assert aio.__file__.startswith(os.path.join(os.getcwd(), "offload", "")), aio.__file__
        try:
            Engine(backend="io_uring")
        except OSError as err:
            assert err.errno == errno.ENOSYS, err
        else:
            raise AssertionError("io_uring started in a build without it")
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            e = Engine()
        with e, HostBuffer(1 << 20) as a, HostBuffer(1 << 20) as b, e.open("f", "w+") as f:
            a.numpy()[:] = 7
            e.write(f, a, 0)
            e.read(f, b, 0)
            assert (b.numpy() == 7).all()
            print(e.backend, e.fallback_reason.errno == errno.ENOSYS,
                  ["liburing" in str(w.message) for w in caught])
    """, cwd=tmp_path, pythonpath=env["PYTHONPATH"])
    assert done.stdout.strip() == "threads True [True]", done.stdout + done.stderr


def test_closing_a_file_waits_for_its_requests(scratch, backend):
    """A file closed while its writes are in flight keeps its descriptor until they finish: no other
    file opened meanwhile can receive their bytes."""
    path, other = os.path.join(scratch, "f"), os.path.join(scratch, "other")
    n = 32 * MIB
    with Engine(backend=backend, block_size=1 * MIB, queue_depth=2) as e, HostBuffer(n) as buf:
        fill(buf, random_bytes(n, seed=7))
        f = e.open(path, "w+")
        fut = e.write_async(f, buf, 0)
        f.close()
        assert f.closed
        with pytest.raises(ValueError, match="closed file"):
            e.write(f, buf, 0)
        assert f.fd >= 0  # held open for the request, whose future has not been waited on
        with e.open(other, "w+"):
            assert fut.wait() == n
        assert f.fd < 0
        assert os.path.getsize(other) == 0
        assert np.array_equal(file_bytes(path, 0, n), buf.numpy())


def test_no_links_opens_only_a_regular_file_and_never_waits_on_a_fifo(tmp_path):
    """open_file(..., no_links=True), as checkpoints open their data files: a regular file opens; a symbolic
    link (to a file, or to /dev/zero) and a FIFO are refused at once with an OSError naming the path."""
    from offload.aio import open_file

    real = tmp_path / "data.bin"
    real.write_bytes(bytes(4096))
    with open_file(real, "r", no_links=True) as f:
        assert f.path == str(real)
    os.symlink(real, tmp_path / "link")
    os.symlink("/dev/zero", tmp_path / "zero")
    os.mkfifo(tmp_path / "fifo")
    for name in ("link", "zero", "fifo"):
        with pytest.raises(OSError) as err:
            open_file(tmp_path / name, "r", no_links=True)
        assert err.value.filename == str(tmp_path / name), name
    with open_file(tmp_path / "link", "r") as f:  # without it, a link is followed as before
        assert f.path == str(tmp_path / "link")

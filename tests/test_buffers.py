"""Host buffers: page-aligned, exactly sized, shared with torch and numpy, safe to close; pools that fit."""

from __future__ import annotations

import errno
import mmap
import os
import types

import numpy as np
import psutil
import pytest
import torch

from offload.buffers import PAGE_SIZE, BufferPool, HostBuffer
from offload.errors import ConfigError, PoolTooSmallError


@pytest.mark.parametrize("nbytes, expected", [(1, PAGE_SIZE), (PAGE_SIZE, PAGE_SIZE),
                                              (PAGE_SIZE + 1, 2 * PAGE_SIZE), (5 << 20, 5 << 20)])
def test_buffer_is_page_aligned_and_rounded_to_pages(nbytes, expected):
    """Every buffer starts on a 4096-byte boundary and holds its size rounded up to whole pages."""
    with HostBuffer(nbytes) as b:
        assert b.address % 4096 == 0
        assert b.nbytes == expected
        assert b.tensor.dtype == torch.uint8 and b.tensor.numel() == expected
        assert b.tensor.data_ptr() == b.address
        assert not b.tensor.any()


@pytest.mark.parametrize("nbytes", [0, -4096, 4096.0, "4096"])
def test_bad_buffer_size_is_value_error(nbytes):
    """A size that is not a positive int is a ValueError naming it."""
    with pytest.raises(ValueError, match="positive number of bytes"):
        HostBuffer(nbytes)


def test_typed_views_share_memory_within_bounds():
    """Views by dtype and offset alias the buffer; views past its end or misaligned are ValueErrors."""
    with HostBuffer(8192) as b:
        v = b.view(torch.float32, 4096, 16)
        v.fill_(1.5)
        assert b.view(torch.float32, 4096, 16).tolist() == [1.5] * 16
        assert b.tensor[4096:4096 + 64].view(torch.float32).eq(1.5).all()
        assert b.view(torch.float16).numel() == 4096
        assert b.view(torch.bfloat16, 8190).numel() == 1
        with pytest.raises(ValueError, match=r"view \[4096, 8196\) is outside the buffer of 8192 bytes"):
            b.view(torch.float32, 4096, 1025)
        with pytest.raises(ValueError, match="outside"):
            b.view(torch.float32, -4, 1)
        with pytest.raises(ValueError, match="outside"):
            b.view(torch.float32, 0, -1)
        with pytest.raises(ValueError, match="not a multiple of"):
            b.view(torch.float64, 4)


def test_numpy_shares_memory_with_the_tensor():
    """Writing through numpy() is seen by the tensor and the other way round."""
    with HostBuffer(4096) as b:
        a = b.numpy()
        assert a.dtype == np.uint8 and a.shape == (4096,)
        a[10] = 42
        assert int(b.tensor[10]) == 42
        b.tensor[11] = 43
        assert a[11] == 43


def test_close_is_idempotent_and_views_stay_valid():
    """Closing twice is fine, the closed buffer refuses new views, and views taken before stay readable."""
    b = HostBuffer(4096)
    v = b.tensor
    v[0] = 9
    b.close()
    b.close()
    assert b.closed
    assert int(v[0]) == 9  # still mapped: it was unmapped under live views once
    with pytest.raises(ValueError, match="closed"):
        _ = b.tensor


def test_pool_holds_count_buffers_of_rounded_size():
    """A pool has count distinct, indexed, page-aligned buffers of the rounded size."""
    with BufferPool(3, 10_000) as pool:
        assert len(pool) == 3 and pool.buffer_size == 3 * PAGE_SIZE
        assert pool.nbytes == 3 * 3 * PAGE_SIZE
        assert [b.index for b in pool] == [0, 1, 2]
        assert pool[2] is list(pool)[2]
        assert len({b.address for b in pool}) == 3
        assert all(b.address % 4096 == 0 for b in pool)
    assert all(b.closed for b in pool)


@pytest.mark.parametrize("count", [0, -1, 1.5])
def test_empty_pool_is_refused(count):
    """A pool of fewer than one buffer is a PoolTooSmallError (a ValueError) naming the count."""
    with pytest.raises(PoolTooSmallError, match="buffer_count must be at least 1"):
        BufferPool(count, 4096)
    assert issubclass(PoolTooSmallError, ValueError)


def test_pin_memory_without_cuda_warns_and_still_works():
    """Asking to pin without CUDA warns once per buffer and gives a usable, unpinned buffer."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning really happens (see the gpu test)")
    with pytest.warns(UserWarning, match="CUDA is not available"), HostBuffer(4096, pin_memory=True) as b:
        assert not b.pinned
        b.numpy()[:] = 1


@pytest.mark.gpu
def test_pinned_buffer_copies_to_the_gpu():
    """With CUDA, a pinned buffer is registered and copies to and from the GPU asynchronously."""
    with HostBuffer(1 << 20, pin_memory=True) as b:
        assert b.pinned and b.tensor.is_pinned()
        b.numpy()[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
        g = b.tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(g.cpu(), b.tensor)


# --- the pool's bounds: checked against the machine before anything is allocated --------------------

GiB = 1 << 30


@pytest.fixture
def machine(monkeypatch):
    """Pretend the machine has 8 GiB of memory, 6 GiB of it available; mmap calls are counted, and maps of
    more than 64 MiB in all fail the test instead of taking the memory."""
    figures = types.SimpleNamespace(total=8 * GiB, available=6 * GiB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: figures)
    calls = []
    real_mmap = mmap.mmap

    def counting_mmap(fileno, length, *args, **kwargs):
        calls.append(length)
        if sum(calls) > 64 << 20:
            pytest.fail(f"the pool mapped {sum(calls)} bytes")
        return real_mmap(fileno, length, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", counting_mmap)
    figures.mmap_calls = calls
    return figures


@pytest.mark.parametrize(("count", "size"), [(4, 16 * GiB), (10**6, 64 << 20), (5, 2 * 10**12), (2, 10**400)])
def test_a_pool_larger_than_available_memory_is_refused_before_allocating(machine, count, size):
    """16 GiB x 4, 10**6 buffers or 2e12-byte buffers are a ConfigError (a ValueError) naming the settings,
    the total and the machine's memory, and not one buffer is mapped."""
    with pytest.raises(ConfigError, match=r"does not fit in memory: buffer_count x buffer_size = .*of host "
                                          r"memory, but this machine has 6\.00 GiB available \(8\.00 GiB in all\)"
                                          r"\. Set buffer_count or buffer_size lower"):
        BufferPool(count, size)
    assert machine.mmap_calls == []
    assert issubclass(ConfigError, ValueError)


def test_the_refusal_names_the_given_keys_and_what_fits(machine):
    """With keys, the message names those settings and how many buffers of that size would fit."""
    keys = ("offload_optimizer.buffer_count", "offload_optimizer.buffer_size")
    with pytest.raises(ConfigError) as info:
        BufferPool(4, 4 * GiB, keys=keys)
    message = str(info.value)
    assert "offload_optimizer.buffer_count x offload_optimizer.buffer_size = 4 x 4.00 GiB = 16.00 GiB" in message
    assert "Set offload_optimizer.buffer_count or offload_optimizer.buffer_size lower" in message
    assert message.endswith("at this buffer size at most 1 fit.")
    with pytest.raises(ConfigError, match=r"one buffer of 7\.00 GiB alone does not fit; lower p\.size"):
        BufferPool(2, 7 * GiB, keys=("p.count", "p.size"))


def test_a_pool_that_just_fits_is_allocated(machine):
    """A pool of exactly the available memory is allowed: the bound is the machine's, not a guess."""
    machine.available = 3 * PAGE_SIZE
    with BufferPool(3, PAGE_SIZE) as pool:
        assert len(pool) == 3 and len(machine.mmap_calls) == 3
    with pytest.raises(ConfigError, match="at most 3 fit"):
        BufferPool(4, PAGE_SIZE)


def _closes(monkeypatch) -> list:
    closed = []
    real_close = HostBuffer.close

    def recording_close(self):
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(HostBuffer, "close", recording_close)
    return closed


def _mmap_failing_at(monkeypatch, call: int, error: BaseException) -> None:
    real_mmap = mmap.mmap
    calls = []

    def mmap_that_fails(*args, **kwargs):
        calls.append(args)
        if len(calls) == call:
            raise error
        return real_mmap(*args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", mmap_that_fails)


def test_enomem_half_way_is_a_config_error_and_releases_what_was_made(machine, monkeypatch):
    """mmap failing with ENOMEM on the third buffer gives a ConfigError naming the sizes and the settings
    (chained to the OSError), and the two buffers already made are closed."""
    closed = _closes(monkeypatch)
    _mmap_failing_at(monkeypatch, 3, OSError(errno.ENOMEM, os.strerror(errno.ENOMEM)))
    with pytest.raises(ConfigError) as info:
        BufferPool(4, 1 << 20, keys=("offload_param.buffer_count", "offload_param.buffer_size"))
    message = str(info.value)
    assert message.startswith("could not allocate host buffer 3 of 4: offload_param.buffer_count x "
                              "offload_param.buffer_size = 4 x 1.00 MiB = 4.00 MiB of host memory")
    assert "Cannot allocate memory: cannot map a host buffer of 1.00 MiB" in message
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOMEM
    assert len(closed) == 2 and all(b.closed for b in closed)


def test_other_failures_half_way_propagate_and_release_what_was_made(machine, monkeypatch):
    """An error that is not a lack of memory (here EPERM, then Ctrl-C) is raised as is, after the buffers
    made so far are closed."""
    closed = _closes(monkeypatch)
    _mmap_failing_at(monkeypatch, 2, OSError(errno.EPERM, os.strerror(errno.EPERM)))
    with pytest.raises(PermissionError, match="cannot map a host buffer of 4.00 KiB"):
        BufferPool(3, PAGE_SIZE)
    assert len(closed) == 1 and closed[0].closed
    _mmap_failing_at(monkeypatch, 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        BufferPool(3, PAGE_SIZE)
    assert len(closed) == 3 and all(b.closed for b in closed)


@pytest.mark.parametrize("size", [0, -1, 4096.0, "4096"])
def test_a_pool_of_bad_size_is_refused(size):
    """A buffer size that is not a positive int is a ValueError naming it, before any check or allocation."""
    with pytest.raises(ValueError, match="positive number of bytes"):
        BufferPool(2, size)


def _mapping_flags(address: int) -> str | None:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps), or None if unmapped."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line
    return None


def test_a_pinned_buffer_is_registered_portable_and_not_copied_into_a_forked_child(monkeypatch):
    """With CUDA (faked here: cudaHostRegister recorded), a pinned buffer is registered portable (for every
    context) and marked MADV_DONTFORK: a forked child (a DataLoader worker) gets no mapping of it, so the
    page-locked pages are neither copied at the fork nor reachable from the child; the parent's bytes are
    intact. An unpinned buffer is left to fork as usual."""
    calls = []
    fake = types.SimpleNamespace(cudaHostRegister=lambda a, n, flags: calls.append(("register", flags)) or 0,
                                 cudaHostUnregister=lambda a: calls.append(("unregister",)) or 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    pinned, plain = HostBuffer(1 << 20, pin_memory=True), HostBuffer(1 << 20)
    try:
        assert pinned.pinned and calls == [("register", 1)]
        assert " dc" in _mapping_flags(pinned.address) and " dc" not in _mapping_flags(plain.address)
        pinned.tensor.fill_(7)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if _mapping_flags(pinned.address) is None and _mapping_flags(plain.address) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert bool((pinned.tensor == 7).all())
    finally:
        pinned.close()
        plain.close()
    assert calls[-1] == ("unregister",)

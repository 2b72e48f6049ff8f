"""Host buffers: page-aligned, exactly sized, shared with torch and numpy, safe to close."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offload.buffers import PAGE_SIZE, BufferPool, HostBuffer
from offload.errors import PoolTooSmallError


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

"""Workloads shared by the benchmarks: a model-sized set of parameters with grads, a stack of blocks, and
the time a swap space takes to move a given number of bytes."""

from __future__ import annotations

import threading
import time
from typing import Callable

import psutil
import torch
from torch import nn

from ..buffers import BufferPool
from ..pipeline import Pipeline
from ..sizes import format_size, round_up
from ..space import SwapSpace
from .cli import BenchError

IO_PIECE = 8 << 20  # request size of io_only

# Split the model into 4M-element tensors, like a stack of layers.
TENSOR_ELEMENTS = 4 << 20


def synthetic_params(n: int, dtype: torch.dtype = torch.float32, *, tensor_elements: int = TENSOR_ELEMENTS,
                     device: torch.device | str = "cpu") -> list[torch.nn.Parameter]:
    """``n`` parameters in tensors of ``tensor_elements`` on ``device``, each with a random grad (seeded).

    Raises:
        BenchError: they (and their grads) would not fit in the host memory available now.
    """
    need = 2 * n * torch.empty(0, dtype=dtype).element_size()
    available = psutil.virtual_memory().available
    if torch.device(device).type == "cpu" and need > available:
        raise BenchError(f"{n:,} parameters and their grads need {format_size(need)} of host memory, "
                         f"{format_size(available)} is available; give a smaller --params")
    g = torch.Generator().manual_seed(0)
    sizes = [tensor_elements] * (n // tensor_elements) + ([n % tensor_elements] if n % tensor_elements else [])
    params = []
    for s in sizes:
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype))
        p.grad = torch.randn(s, generator=g).to(device, dtype)
        params.append(p)
    return params


class _Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.up = nn.Linear(h, 4 * h)
        self.down = nn.Linear(4 * h, h)
        self.norm = nn.LayerNorm(h)

    def forward(self, x):
        return self.norm(x + self.down(nn.functional.gelu(self.up(x))))


def block_model(layers: int, h: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
    """``layers`` transformer-like blocks (Linear h->4h, GELU, Linear 4h->h, LayerNorm), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(*(_Block(h) for _ in range(layers))).to(device, dtype)


def io_only(paths, aio, read_bytes: int, write_bytes: int, buffers: int = 4, *, piece: int = IO_PIECE) -> float:
    """Seconds to read ``read_bytes`` and write ``write_bytes`` on a fresh swap space, overlapped, in requests of
    at most ``piece`` bytes (a multiple of the alignment). Any byte counts work: each region starts aligned."""
    with BufferPool(buffers, piece) as pool, \
            SwapSpace(paths, max(read_bytes + write_bytes, piece), aio=aio, buffers=pool, name="iobench") as sp:
        # Reads and writes go to different blocks, as a step's do (it writes a unit while reading the next).
        write_at = round_up(read_bytes, sp.alignment)
        size = max(write_at + round_up(write_bytes, sp.alignment), piece)
        extent = sp.alloc(size)
        # Lay the bytes down first, so the reads read real blocks (not holes of the preallocation).
        _run_ops(sp, pool, extent, _pieces("w", 0, size, piece))
        reads = _pieces("r", 0, read_bytes, piece)
        writes = _pieces("w", write_at, write_bytes, piece)
        mixed = [op for pair in zip(reads, writes) for op in pair]
        n = min(len(reads), len(writes))
        mixed += reads[n:] + writes[n:]
        t = time.perf_counter()
        _run_ops(sp, pool, extent, mixed)
        return time.perf_counter() - t


def _pieces(op: str, start: int, nbytes: int, piece: int) -> list[tuple[str, int, int]]:
    """``(op, offset, length)`` requests covering ``nbytes`` from ``start``, ``piece`` bytes each but the last."""
    return [(op, start + off, min(piece, nbytes - off)) for off in range(0, nbytes, piece)]


def compute_beside_io(paths, aio, work: Callable[[], float], *, buffers: int = 4, piece: int = IO_PIECE) -> float:
    """What ``work()`` returns (its seconds) while reads and writes of ``piece`` bytes, ``buffers`` of them in
    flight, run beside it on another thread without pause: how much compute slows down when it shares the
    machine with I/O (on a VM, the disk's emulation shares the cores and the memory bandwidth). It makes a
    pool and a swap file of its own (2 x ``buffers`` x ``piece`` bytes) for the time it runs."""
    size = 2 * buffers * piece
    with BufferPool(buffers, piece) as pool, SwapSpace(paths, size, aio=aio, buffers=pool, name="iobench") as sp:
        extent = sp.alloc(size)
        half = size // 2
        _run_ops(sp, pool, extent, [("w", off, piece) for off in range(0, size, piece)])
        # Reads from the first half, writes to the second, a round at a time until work() is done.
        mixed = [op for off in range(0, half, piece) for op in (("r", off, piece), ("w", half + off, piece))]
        done, failed = threading.Event(), []

        def move() -> None:
            try:
                while not done.is_set():
                    _run_ops(sp, pool, extent, mixed)
            except BaseException as err:  # raised on the caller's thread below
                failed.append(err)

        mover = threading.Thread(target=move, name="offload-bench-io")
        mover.start()
        try:
            seconds = work()
        finally:
            done.set()
            mover.join()
        if failed:
            raise failed[0]
        return seconds


def _run_ops(sp, pool, extent, ops) -> None:
    """Reads and writes of ``extent``'s parts, as many in flight as the pool has buffers."""
    def part(op):
        _, off, n = op
        return sp.sub(extent, off, n), n

    Pipeline(list(pool)).run(
        ops, read=lambda op, buf: sp.read(part(op)[0], buf, nbytes=op[2]) if op[0] == "r" else None,
        process=lambda op, buf: op[0] == "w", write=lambda op, buf: sp.write(part(op)[0], buf, nbytes=op[2]))

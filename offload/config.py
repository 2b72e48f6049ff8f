"""Configuration: DeepSpeed's ``aio``, ``offload_optimizer`` and ``offload_param`` blocks.

(Provisional: only the ``aio`` block so far; the full loader comes next.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class AioConfig:
    """Settings of the native I/O engine (DeepSpeed's ``aio`` block, same key names).

    Attributes:
        block_size: bytes per request piece; a multiple of 4096.
        queue_depth: pieces in flight per worker.
        thread_count: worker threads, each with its own io_uring ring. DeepSpeed's newer name
            ``intra_op_parallelism`` means the same.
        single_submit: one submit system call per piece instead of one per batch.
        overlap_events: refill the queue as completions arrive instead of submit-all-then-wait.
        use_gds: GPUDirect Storage (not supported; must stay false).
        backend: ``"auto"`` (io_uring, else threads), ``"io_uring"`` or ``"threads"``.
        o_direct: ``"auto"`` (O_DIRECT, else buffered with one warning), ``True`` or ``False``.
    """

    block_size: int = 1 << 20
    queue_depth: int = 32
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False
    backend: str = "auto"
    o_direct: object = "auto"

    def replace(self, **changes) -> AioConfig:
        return dataclasses.replace(self, **changes)

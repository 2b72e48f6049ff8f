"""The one owner of offloaded bytes: extents on a swap space, their checksums, their writes, their failures."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..aio import CheckedRead, hex_digest, wait_quietly
from ..errors import StateError
from ..sizes import round_up
from ..space import Extent, SwapSpace

__all__ = ["ByteStore", "Stored"]


@dataclass(eq=False)
class Stored:
    """Something whose bytes live in one extent: a unit of optimizer state, a parameter's weights, a gradient.

    Its bytes move in blocks of the owner's ``block_bytes`` (one pool buffer); block ``k`` holds bytes
    ``[k * block_bytes, ...)``. ``writes`` are the writes of the extent that may still be landing, in the
    order issued; ``digests[k]`` the checksum of block ``k``'s last write (its future until it landed),
    ``None`` where unknown. ``digests=None`` keeps no checksums (what is read is then not checked).
    """

    extent: Optional[Extent] = None
    nbytes: int = 0
    writes: list = field(default_factory=list)
    digests: Optional[list] = field(default_factory=list)


# NOTE: every owner of offloaded state (the optimizer's units, the offloaded weights, their grads) moves
# its bytes through one ByteStore, so that these rules hold in one place:
# * a write of an extent lands before the extent is read or written again (requests complete in any
#   order: an old write must not land after a newer one, nor a read see the bytes before a write);
# * with checksums, each block written has the engine's xxh3_64 of it recorded, and each read of it is
#   checked against that as it lands: bytes changed on disk behind our back are named, never used;
# * a failure part-way through a change of state makes the store unusable (``mark_failed``) until the
#   state is restored (``mark_restored``): it never silently goes on from half-written state;
# * a swap file cut behind our back is named before any write that was not preceded by a read;
# * ``freeze`` lets a consistent copy be taken while the state keeps changing (asynchronous checkpoints).
class ByteStore:
    """Offloaded bytes on a swap space, moved block by block with checked reads and tracked writes.

    Args:
        space: the swap space (``None``: state lives in host memory only; then nothing here does I/O).
        block_bytes: bytes per block (the pool's buffer size, a multiple of the space's alignment).
        checksum: record and check the blocks' checksums.
        remedy: the sentence telling a user how to restore damaged state (ends a mismatch's message).
        mismatch_fails: a read whose bytes differ from the last write makes the store unusable (the
            optimizer's state: a step found it part-way); else only that read raises (weights, fetched
            one at a time, each naming itself).
    """

    def __init__(self, space: Optional[SwapSpace], block_bytes: int, *, checksum: bool, remedy: str,
                 mismatch_fails: bool):
        self.space = space
        self.block_bytes = block_bytes
        self.checksum = checksum
        self.remedy = remedy
        self.mismatch_fails = mismatch_fails
        self.error: Optional[BaseException] = None
        self.bytes_read = self.bytes_written = 0
        self.on_failure: list[Callable[[], None]] = []  # what an owner forgets when the store fails
        self._tail: list = []  # writes a caller left landing (futures), until they are seen to have landed
        self._freezers: list[Callable[[Any, Any], None]] = []  # see freeze

    # -- failed, usable, restored ------------------------------------------------------------------

    def mark_failed(self, err: BaseException) -> None:
        """Record that state may be half written: :attr:`usable` is False until :meth:`mark_restored`."""
        self.error = err
        for forget in self.on_failure:
            forget()

    def mark_restored(self) -> None:
        """State is whole again (a load succeeded)."""
        self.error = None

    @property
    def usable(self) -> bool:
        """Whether the store is not failed: no error marked since the last restore."""
        return self.error is None

    @contextlib.contextmanager
    def failing_on(self, *errors: type[BaseException]):
        """Mark the store failed when the block raises one of ``errors``, then re-raise it."""
        try:
            yield
        except errors as err:
            self.mark_failed(err)
            raise

    @property
    def _swap(self) -> SwapSpace:
        """The swap space, which every move of bytes needs (a store without one keeps them in host memory)."""
        assert self.space is not None, "bytes moved by a store without a swap space"
        return self.space

    # -- blocks ------------------------------------------------------------------------------------

    def block_count(self, nbytes: int) -> int:
        """Blocks of something of ``nbytes`` bytes."""
        return -(-nbytes // self.block_bytes)

    def block(self, stored: Stored, k: int) -> tuple[Extent, int]:
        """Block ``k`` of ``stored``: its part of the extent (rounded up to the alignment) and its bytes."""
        start = k * self.block_bytes
        n = min(self.block_bytes, stored.nbytes - start)
        assert stored.extent is not None, "a block of something kept in host memory"
        if k == 0 and n == stored.nbytes:
            return stored.extent, n
        return self._swap.sub(stored.extent, start, n), n

    # -- moving blocks -----------------------------------------------------------------------------

    def read(self, stored: Stored, buffer, k: int = 0, *, what: Callable[[], str] = lambda: "offloaded bytes"):
        """Start reading block ``k`` of ``stored`` into ``buffer``; returns the future. Waiting for it checks
        the bytes against the block's last write (``StateError``). Call :meth:`land` first when the extent
        may have writes in flight (a read must see them)."""
        ext, n = self.block(stored, k)
        # The write this read must see, taken now: a later write of the block (after this read landed and
        # was waited for once) must not become what a second wait compares with.
        source = stored.digests[k] if self.checksum and stored.digests is not None \
            and k < len(stored.digests) else None
        fut = self._swap.read(ext, buffer, nbytes=n, digest=source is not None)
        self.bytes_read += ext.nbytes
        if source is None:
            return fut
        return CheckedRead(fut, lambda: self._digest_of(stored, k, source),
                           lambda found, want: self._mismatch(stored, k, found, want, what))

    def read_range(self, stored: Stored, start: int, nbytes: int, buffer, *, buffer_offset: int = 0):
        """Start reading bytes ``[start, start + nbytes)`` (aligned) of ``stored`` into ``buffer`` at
        ``buffer_offset``. Not checked: a checksum covers whole blocks. Call :meth:`land` first."""
        assert stored.extent is not None, "a range of something kept in host memory"
        fut = self._swap.read(self._swap.sub(stored.extent, start, nbytes), buffer, buffer_offset=buffer_offset,
                              nbytes=nbytes)
        self.bytes_read += nbytes
        return fut

    def write(self, stored: Stored, buffer, k: int = 0, *, landing: bool = False):
        """Start writing block ``k`` of ``stored`` from ``buffer``, recording the checksum of what it puts
        on disk (the block's bytes, then zeros to the alignment: ``buffer``'s padding is zeroed first);
        returns the future. Call :meth:`land` first when the extent may have writes in flight.
        ``landing``: the caller returns before it lands (see :meth:`collect_landed` and :meth:`drain`)."""
        ext, n = self.block(stored, k)
        keep = self.checksum and stored.digests is not None
        _zero(buffer, n, round_up(n, self._swap.alignment))
        fut = self._swap.write(ext, buffer, nbytes=n, digest=keep)
        self.bytes_written += ext.nbytes
        stored.writes.append(fut)
        if stored.digests is not None:
            if len(stored.digests) <= k:
                stored.digests.extend([None] * (k + 1 - len(stored.digests)))
            stored.digests[k] = fut if keep else None  # the engine computes it as the write lands
        if landing:
            self._tail.append(fut)
        return fut

    def landed_digest(self, stored: Stored, k: int = 0) -> Optional[tuple]:
        """The checksum of block ``k``'s last write, if it is known and that write has landed: a tuple of
        xxh3_64, one per swap file the block is striped over, each the engine's
        (:class:`offload.aio.PieceDigest`) of the block's bytes on that file, padding to the alignment
        included (:meth:`write` zeroes it). None without checksums, before a write, after
        :meth:`forget_digests`, while the write is still landing, or if it failed."""
        if not self.checksum or stored.digests is None or k >= len(stored.digests):
            return None
        source = stored.digests[k]
        if source is None or isinstance(source, tuple):
            return source
        if not source.done():
            return None
        try:
            return self._digest_of(stored, k, source)
        except OSError:
            return None  # the write failed: nothing is known of what is there

    def forget_digests(self, stored: Stored) -> None:
        """What is on disk is no longer known (it is about to be replaced): reads of it go unchecked."""
        if stored.digests is not None:
            stored.digests = []

    def land(self, stored: Stored, *, fails: bool = True) -> None:
        """Wait for every write of ``stored``'s extent. If one failed the bytes it carried are lost: the
        error is raised here, and with ``fails`` the store is failed first."""
        futures, stored.writes = stored.writes, []
        first = _first_error(futures)
        if first is not None:
            if fails:
                self.mark_failed(first)
            raise first

    def collect_landed(self) -> None:
        """Forget left-landing writes that landed; the first that failed fails the store and is raised."""
        landed = [fut for fut in self._tail if fut.done()]
        gone = {id(fut) for fut in landed}
        self._tail = [fut for fut in self._tail if id(fut) not in gone]
        first = _first_error(landed)
        if first is not None:
            self.mark_failed(first)
            raise first

    def drain(self, *, quiet: bool = False) -> None:
        """Wait for every write left landing.

        Args:
            quiet: ignore their errors (state is about to be overwritten: a load).

        Raises:
            OSError: one of them failed (file and offset named); the store is then failed.
        """
        tail, self._tail = self._tail, []
        if quiet:
            wait_quietly(tail)
            return
        first = _first_error(tail)
        if first is not None:
            self.mark_failed(first)
            raise first

    def close(self) -> None:
        """Let the writes left landing land (their errors no longer matter)."""
        wait_quietly(self._tail)
        self._tail = []

    # -- the swap files ----------------------------------------------------------------------------

    def check_intact(self, *, fails: bool = True) -> None:
        """Raise if a swap file was truncated behind our back (failing the store with ``fails``): a write
        of bytes not read first would fill the cut with a hole that reads back as zeros."""
        if self.space is None:
            return
        if fails:
            with self.failing_on(OSError):
                self.space.check_intact()
        else:
            self.space.check_intact()

    def regrow(self) -> None:
        """Every byte the space holds is about to be rewritten (a whole load): a swap file cut behind our
        back gets its size back, since nothing will be read from the cut."""
        if self.space is not None:
            self.space.regrow()

    # -- consistent copies -------------------------------------------------------------------------

    def freeze(self, guard: Callable[[Any, Any], None]) -> Callable[[], None]:
        """Call ``guard(item, buffer)`` before an owner changes an item's bytes, with ``buffer`` holding them
        as they are then. For a consistent copy taken while training goes on (an asynchronous checkpoint):
        the guard captures the item first if it has not yet. Returns the function that removes the guard."""
        self._freezers.append(guard)
        return lambda: self._freezers.remove(guard) if guard in self._freezers else None

    def changing(self, item: Any, buffer) -> None:
        """``item``'s bytes in ``buffer`` are about to change: let every :meth:`freeze` guard see them first."""
        for guard in list(self._freezers):
            guard(item, buffer)

    # -- checksums ---------------------------------------------------------------------------------

    @staticmethod
    def _digest_of(stored: Stored, k: int, source):
        """The checksum of the write ``source`` of block ``k`` (its future, or the checksum it had)."""
        if isinstance(source, tuple):
            return source
        digest = source.digest()  # the write landed before the read was issued
        if stored.digests is not None and k < len(stored.digests) and stored.digests[k] is source:
            stored.digests[k] = digest  # keep the checksum, not the future
        return digest

    def _mismatch(self, stored: Stored, k: int, found, want, what: Callable[[], str]) -> StateError:
        ext, n = self.block(stored, k)
        path, offset = self._swap.locate(ext.offset)
        err = StateError(
            f"{what()}: {n} bytes at byte {k * self.block_bytes} of it (offset {offset} of {path}) have xxh3_64 "
            f"{hex_digest(found)} on disk, its last write had {hex_digest(want)}; the swap file was changed behind "
            f"our back. {self.remedy}")
        if self.mismatch_fails:
            self.mark_failed(err)
        return err


def _zero(buffer, start: int, end: int) -> None:
    """Zero ``buffer``'s bytes ``[start, end)``: the padding a write sends after a block's bytes, so that
    what lands on disk (and its checksum) depends on the block alone, never on stale bytes of the buffer."""
    if end <= start:
        return
    if hasattr(buffer, "tensor"):  # a HostBuffer
        buffer.tensor[start:end].zero_()
    else:
        memoryview(buffer).cast("B")[start:end] = bytes(end - start)


def _first_error(futures) -> Optional[OSError]:
    """Wait for every one of ``futures`` (each lands before any error is reported); the first OSError, or None."""
    first = None
    for fut in futures:
        try:
            fut.wait()
        except OSError as err:
            first = first or err
    return first

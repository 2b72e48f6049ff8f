"""Moving a checkpoint's data files through host buffers: the writer of state.bin and params.bin, and the
checked reader of their ranges."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import xxhash
from tqdm import tqdm

from ..aio import CompletedFuture, Engine, PieceDigest, reserve
from ..buffers import BufferPool
from ..config import AioConfig, load_config
from ..errors import CheckpointError, ChecksumError
from ..pipeline import Pipeline
from ..progress import progress
from ..regular import CHUNK
from ..sizes import ALIGNMENT, round_up


# NOTE: save, load, verify, export and import all move state.bin (and params.bin) with the native engine
# through a few page-aligned buffers (the optimizer's pool, or a small one of the tools' own), never
# holding more than those buffers in host memory. ``stream`` overlaps the reads ahead, the processing of
# one buffer and the writes behind; ``write_data`` lays units out in a data file and hashes them as they
# pass; ``read_verified`` reads ranges of one back, checking each range's checksum and the file's.
# Every engine that touches a data file comes from the save's or load's ``Storage``.
def tool_pool(lengths, cap: Optional[int] = CHUNK) -> BufferPool:
    """Three buffers for a tool's read of ranges of ``lengths`` bytes: as long as the longest (at most
    ``cap``, where not None: longer ranges are read in parts)."""
    longest = round_up(max([ALIGNMENT, *lengths]), ALIGNMENT)
    return BufferPool(3, longest if cap is None else min(longest, cap))


def aio_of(manifest) -> AioConfig:
    """The engine settings a checkpoint was saved with (the defaults where this version cannot read them)."""
    try:
        return load_config({"aio": manifest.config["aio"]}).aio
    except Exception:  # a config this version cannot read: the defaults do
        return AioConfig()


DONE = CompletedFuture()


def progress_bar(total: int, what: str, enabled: Optional[bool] = None, *, delay: float = 1.0) -> tqdm:
    """A progress bar of ``total`` bytes on stderr, shown once the work has lasted ``delay`` seconds;
    ``enabled`` None: as :func:`offload.progress.shown` decides (a terminal, or ``OFFLOAD_PROGRESS``)."""
    return progress(total, what, nbytes=True, enabled=enabled, delay=delay)


def stream(items: Sequence, buffers: Sequence, *, read: Optional[Callable] = None,
            process: Callable[[Any, Any], bool], write: Optional[Callable] = None) -> None:
    """:meth:`offload.pipeline.Pipeline.run` over ``buffers``, reads as far ahead as buffers allow."""
    if len(items):
        Pipeline(list(buffers)).run(items, read=read, process=process, write=write)


# -- writing a data file (state.bin, params.bin) -------------------------------------------


def packed(sizes: Sequence[int]) -> tuple[list[int], list[int], int]:
    """Offsets and lengths of ranges of ``sizes`` bytes laid back to back, each padded to ALIGNMENT; and
    the total."""
    lengths = [round_up(n, ALIGNMENT) for n in sizes]
    offsets, pos = [], 0
    for n in lengths:
        offsets.append(pos)
        pos += n
    return offsets, lengths, pos


class DataFile:
    """A new data file ``name`` of the checkpoint being written into ``staged``, open for the engine of
    ``staged``'s storage (O_DIRECT where the file system allows), to hold items of ``sizes`` bytes (each at
    ``offsets[i]``, ``lengths[i]`` long: padded to ALIGNMENT), ``total`` bytes in all."""

    def __init__(self, staged, aio: AioConfig, name: str, sizes: Sequence[int]):
        self.offsets, self.lengths, self.total = packed(sizes)
        self.path = staged.path(name)
        self.storage = staged.storage
        self.engine = staged.storage.engine(aio)
        self.file = None
        try:
            self.file = self.engine.open(self.path, "x+")
            if self.file.alignment > ALIGNMENT:
                raise CheckpointError(f"{self.path}: the file system wants {self.file.alignment}-byte direct I/O; "
                                      f"checkpoints use {ALIGNMENT}. Set aio.o_direct to false for this path")
        except BaseException:
            self.close()
            raise

    def register(self, buffers: Sequence) -> None:
        """Register a pool's ``buffers`` with the engine, where they are a whole pool in order."""
        if buffers and all(b.index == k for k, b in enumerate(buffers)):
            try:
                self.engine.register_buffers(list(buffers))
            except (ValueError, RuntimeError, OSError):
                pass  # fixed buffers only save a little CPU

    def reserve(self, runs: Sequence[tuple[int, int]]) -> None:
        """Allocate the file's ranges ``[a, b)`` (in order) now, so that a full disk is reported before data
        moves: ranges that touch are reserved in one call (a save's units lie back to back), so an error names
        the bytes of the whole stretch."""
        merged: list[list[int]] = []
        for a, b in runs:
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        for a, b in merged:
            reserve(self.file.fd, a, b - a, self.path)  # where the file system can

    def write(self, i: int, buf):
        """Start writing item ``i`` (its padded length) from ``buf``."""
        return self.engine.write_async(self.file, buf, self.offsets[i], self.lengths[i])

    def sync(self) -> None:
        """fsync the file (with ``staged``'s storage)."""
        self.storage.fsync(self.file.fd, self.path)

    def close(self) -> None:
        """Close the file, then the engine."""
        if self.file is not None:
            self.file.close()
            self.file = None
        self.engine.close()


def write_data(staged, aio: AioConfig, buffers: Sequence, sizes: Sequence[int], *, read: Optional[Callable],
               fill: Optional[Callable], name: str) -> tuple[dict, list]:
    """Write items of ``sizes`` bytes to the data file ``name`` in order through ``buffers``, each at a
    4096-aligned offset (``read(i, buffer)`` and ``fill(i, buffer)`` put item ``i``'s bytes there); returns the
    file entry (size, xxh3_64) and the items' offsets."""
    data = DataFile(staged, aio, name, sizes)
    whole = xxhash.xxh3_64()
    try:
        data.register(buffers)
        if data.total:
            data.reserve([(0, data.total)])

        def process(i: int, buf) -> bool:
            if fill is not None:
                fill(i, buf)
            buf.tensor[sizes[i]: data.lengths[i]].zero_()  # padding: same state, same bytes
            whole.update(buf.tensor[: data.lengths[i]].numpy())
            return True

        stream(list(range(len(sizes))), list(buffers), read=read, process=process, write=data.write)
        data.sync()
    finally:
        data.close()
    return {"bytes": data.total, "xxh3_64": whole.hexdigest()}, data.offsets


# -- reading a data file back, checked --------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``offset`` of a data file whose first ``nbytes`` have xxh3_64 ``xxh3_64``
    (None: unchecked), or with ``pieces`` the engine's checksum of them in pieces of that size
    (:class:`offload.aio.PieceDigest`); ``what`` names them in an error (``"bytes [a, b) (unit 3, ...) have"``)."""

    offset: int
    length: int
    nbytes: int
    xxh3_64: Optional[str]
    what: str
    key: Any = None
    pieces: Optional[int] = None

    def hasher(self):
        """A fresh hasher of this span's form (``update``, ``hexdigest``)."""
        return xxhash.xxh3_64() if self.pieces is None else PieceDigest(self.pieces)


def read_verified(engine: Engine, path: str, spans: Sequence[Span], buffers: Sequence, whole: Optional[str], *,
                  sink: Optional[Callable[[Span, int, Any], None]] = None,
                  write: Optional[Callable[[Span, int, Any], Any]] = None, label: Optional[str] = None,
                  part_bytes: Optional[int] = None) -> None:
    """Read ``spans`` of the data file ``path`` through ``buffers`` (in parts of ``part_bytes`` bytes, a multiple of
    ALIGNMENT, where a span is longer; None: as long as a buffer), check each span's checksum and then
    ``whole``, the file's (its spans must cover it; None: the file has none of its own, and the spans'
    checksums, which the manifest's checks make cover the file, are all there is). ``sink(span, start,
    bytes)`` gets a span's bytes (its first ``nbytes``) as they pass, checked only once its last part is in;
    ``write(span, start, buffer)`` writes each part on as it passes (a span of one part: once checked).
    ``label``: a progress bar of the bytes read, so labelled (where :mod:`offload.progress` shows bars), for a
    read that is the whole of what a caller does.

    Raises:
        ChecksumError: a span's checksum, or the file's, differs (the first named).
    """
    size = part_bytes or min(b.nbytes for b in buffers) // ALIGNMENT * ALIGNMENT
    parts = [(s, off, min(size, s.length - off)) for s in spans for off in range(0, s.length, size)]
    hashes = {id(s): s.hasher() for s in spans}
    file_hash = xxhash.xxh3_64() if whole is not None else None
    with engine.open(path, "r", no_links=True) as f, \
            progress(sum(n for _, _, n in parts), label or "", nbytes=True, enabled=None if label else False) as bar:
        def read(part, buf):
            s, off, n = part
            return engine.read_async(f, buf, s.offset + off, n)

        def process(part, buf) -> bool:
            s, off, n = part
            if file_hash is not None:
                file_hash.update(buf.tensor[:n].numpy())
            real = buf.tensor[:max(0, min(n, s.nbytes - off))]
            hashes[id(s)].update(real.numpy())
            if off + n == s.length and s.xxh3_64 is not None and hashes[id(s)].hexdigest() != s.xxh3_64:
                kind = "xxh3_64" if s.pieces is None else f"xxh3_64 (in {s.pieces}-byte pieces)"
                raise ChecksumError(f"{path}: {s.what} {kind} {hashes[id(s)].hexdigest()}, the manifest says "
                                    f"{s.xxh3_64}; the checkpoint is corrupt, load an older one")
            if sink is not None:
                sink(s, off, real)
            bar.update(n)
            return write is not None

        stream(parts, list(buffers), read=read, process=process,
               write=None if write is None else lambda part, buf: write(part[0], part[1], buf))
    if file_hash is not None and file_hash.hexdigest() != whole:
        raise ChecksumError(f"{path}: xxh3_64 is {file_hash.hexdigest()}, the manifest says {whole}")


def unit_spans(manifest) -> list[Span]:
    """A :class:`Span` per unit of ``manifest``'s state.bin, in order (``key``: the unit's index)."""
    return [Span(u.offset, u.length, u.length, u.xxh3_64,
                 f"bytes [{u.offset}, {u.offset + u.length}) (unit {i}, state of parameter(s) "
                 f"{', '.join(str(p) for p in manifest.holders(i)) or 'none'}) have", i, u.pieces)
            for i, u in enumerate(manifest.units)]


def tensor_spans(manifest) -> list[Span]:
    """A :class:`Span` per tensor in ``manifest``'s params.bin, by offset (``key``: its entry)."""
    return [Span(t.offset, round_up(t.length, ALIGNMENT), t.length, t.xxh3_64,
                 f"parameter {t.name!r} (bytes [{t.offset}, {t.offset + t.length})) has", t)
            for t in manifest.model.on_disk()]

"""The open files of a mount: what each kind of handle does with reads, writes and flushes.

- ``FileHandle``: a cluster file (live or in a snapshot): writes go through its write-behind,
  reads through its read-ahead; a flush lands the writes, grows the file and records whether
  it now holds a tensor;
- ``BytesHandle``: content made whole at open (status files, a pull through ``.workers``);
- ``PushHandle``: ``.workers/<rank>/.../t.npy`` written: one gradient, pushed at flush;
- ``BatchSizeHandle``: ``.irdma/workers/<r>/batch_size`` written: the rank's batch size.

The safetensors view's handles are in views.py, the step streams' in streams.py. A handle's
requests come one at a time per handle (see vfs.py, Concurrency); its flush may run again at
release, so it is a no-op once clean.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

import numpy as np
import trio

from .. import formats
from ..names import LAYOUT_CHANGED, ROOT
from ..packing import in_force
from ..errors import FsError, RemoteError
from . import models
from .openfiles import OpenFile
from .readahead import ReadAhead
from .writeback import WriteBehind

if TYPE_CHECKING:
    from ..client.client import Client

log = logging.getLogger(__name__)

BATCH_XATTR = "user.irdma.batch."  # + rank, on the root: the batch size each rank reported


@dataclass(eq=False)
class Handle:
    ino: int

    async def read(self, off: int, size: int) -> memoryview:
        raise FsError(errno.EBADF)

    async def write(self, off: int, data: bytes) -> int:
        raise FsError(errno.EBADF)

    async def flush(self) -> None:
        pass

    async def fsync(self) -> None:
        await self.flush()


@dataclass
class BytesHandle(Handle):
    """A file whose whole content is made at open: status files, and pulls (the parameters as
    the model's policy lets the rank see them)."""

    content: bytes = b""
    # status files: read past the size the kernel was told (they change size); pulls: read
    # once, so the page cache would only cost a copy
    direct: bool = False

    async def read(self, off: int, size: int) -> memoryview:
        return memoryview(self.content)[off : off + size]


@dataclass(eq=False)
class FileHandle(Handle):
    """A cluster file (live or in a snapshot), through the ``OpenFile`` it refers to (what the
    mount knows of the file: openfiles.py). What a file holds once written (a tensor, a model)
    is decided by ``on_flushed``; a model file's conversions are reported by ``on_changed``."""

    file: OpenFile = None  # type: ignore[assignment]
    client: "Client" = None  # type: ignore[assignment]
    models: models.ModelFiles = None  # type: ignore[assignment]
    slots: trio.Semaphore = None  # type: ignore[assignment]  # stripes on their way, mount-wide
    on_flushed: Callable[["FileHandle"], Awaitable[None]] | None = None
    on_changed: Callable[[int, dict], None] | None = None
    snap: int = 0
    size: int = 0  # what this handle knows the size to be, its own unflushed writes included
    dirty: bool = False
    writes: int = 0  # writes through this handle so far: a flush leaves it dirty if one came meanwhile
    name: str = ""
    behind: WriteBehind | None = None  # its writes on their way (see writeback.py)
    reader: ReadAhead | None = None  # what it has read and reads ahead (see readahead.py)
    model: models.ModelReader | None = None  # a model file's reads (see models.py)
    pages_current: bool = False  # a live file unchanged since its last open (pagecache.py)
    # Opened for writing only: its writes go around the page cache (``direct``). Nothing can
    # read or map such an open, so cached pages would serve nobody, and filling them cost the
    # writer a page allocation and a copy per byte (its kernel time was 10x that of writing
    # to the pyfuse3 ceiling). Other opens' pages of the file are dropped at their next open,
    # as after any write (pagecache.py). Not for a set-user-ID file (inodes.write_only), nor
    # when the file is open here already: kernels before 6.6 leave other opens' cached (or
    # mapped, dirty) pages of the range as they were after a write that goes around them.
    write_only: bool = False
    writable: bool = False  # opened for writing (or created): a size set meanwhile is a writer's (live.py, W1)
    _read_attr: dict = field(default_factory=dict)
    _model_lock: trio.Lock = field(default_factory=trio.Lock)

    @property
    def direct(self) -> bool:
        """Should the kernel send this open's reads and writes straight here (fs/ops.py asks)?"""
        return self.write_only

    @property
    def keep_cache(self) -> bool:
        """May the kernel keep this file's pages across opens (fs/ops.py asks; a handle without
        the attribute keeps none)? A snapshot's file never changes and a snapshot id is never
        reused, so its pages stay; a live file's stay if it has not changed since its last open
        (``pages_current``: pagecache.py), else they are dropped (close-to-open)."""
        return self.snap != 0 or self.pages_current

    @property
    def attr(self) -> dict:
        return self.file.attr

    @attr.setter
    def attr(self, value: dict) -> None:
        self.file.attr = value

    async def read(self, off: int, size: int) -> memoryview:
        if not self.snap:
            await self.models.settled(self.ino)  # a conversion under way here ends first
        if models.model_of(self.attr) is not None:
            async with self._model_lock:  # reads come concurrently: one layout
                if self.model is None:
                    self.model = models.ModelReader(self.client, await models.layout(self.client, self.attr, self.snap))
            return memoryview(await self.model.read(off, size))
        # This mount's writes in flight first. A write that comes in while this waits (its
        # data still in the write-behind) would be missing from what the read-ahead fetches
        # next and keeps, after that write dropped the read-ahead: so wait until none came.
        f = self.file
        while True:
            seen = f.writes_seen
            await f.drain()
            if off >= max(self.attr["size"], f.pending) and not self.dirty:
                # a read from the end (O_DIRECT: the kernel does not stop it at the size it
                # knows): another mount may have grown the file since we opened it. A read
                # that merely runs past the end, as the last of every file's does, ends there.
                self.file.update(await self.client.getattr(self.ino, self.snap))
            if f.writes_seen == seen:
                break  # and no await from here until the read-ahead has started its fetches
        # what this mount's other handles wrote and have not flushed counts too (drained above):
        # a read cut at the flushed size is a short read, and the kernel then takes the file for
        # that short, under an O_APPEND writer of it (whose next write would land there)
        attr = dict(self.attr, size=max(self.attr["size"], self.size, f.pending))
        if self.reader is None:
            self.reader = ReadAhead(self._fetch)
        self._read_attr = attr
        return await self.reader.read(off, size, attr["size"], attr["unit"])

    async def _fetch(self, off: int, into: memoryview) -> int:
        return await self.client.read_into(self.ino, off, into, self._read_attr, self.snap)

    async def write(self, off: int, data: bytes) -> int:
        await self.models.settled(self.ino)  # a conversion under way here ends first
        if models.model_of(self.attr) is not None:  # a model file written in place
            async with self.models.locked(self.ino):
                attr = await self.models.materialize(await self.client.getattr(self.ino))
                self.on_changed(self.ino, attr)
        # dirty before anything awaits: a conversion starting now sees this handle writing
        self.dirty = True
        self.writes += 1
        f = self.file
        f.writes_seen += 1
        if self.behind is None:
            self.behind = WriteBehind(self.client, self.ino, self.attr, self.slots)
            f.writers.add(self.behind)
        if not f.marked and not self.snap:
            await self._mark()
        await self.behind.write(off, data)
        f.wrote = max(f.wrote, off + len(data))
        f.forget_fetched()
        self.size = max(self.size, off + len(data))
        self.dirty = True
        f.pending = max(f.pending, self.size)
        return len(data)

    async def flush(self) -> None:
        """Send this handle's writes and grow the file to their end. A write that comes while
        this waits (another close of the file: a forked child's exec closes its copy of the fd
        mid-write, as every ``subprocess`` call in a writing process does) leaves the handle
        dirty for the next flush. Marked clean regardless, the writer's own close then flushed
        nothing: the file kept the size of that early flush, the later bytes never extended it,
        and ``np.save`` returned with a file cut short (chaos soak: a tensor "not in this model").
        Likewise a flush whose decision of what the file holds failed (``on_flushed``: the
        metadata primary stalled) leaves it dirty: that flush may be a child's, whose error
        nobody reads, and the writer's own close must decide again (1 GiB chaos soak: the file
        was whole, but no tensor, so not in its model's layout)."""
        if not self.dirty:
            return
        seen = self.writes
        try:
            await self.behind.drain()
        except Exception:
            # A write failed (ENOSPC, a node lost): what the others committed past the file's
            # end would hold memory for ever (a 0-byte file holding 450 MB after dd met ENOSPC),
            # so it is freed, unless another handle here wrote and has not flushed (its writes
            # past the end are this client's too: FileData.free_past_end would take them).
            f = self.file
            if not any(h is not self and h.dirty for h in f.handles) and not any(w is not self.behind and (w.run or w.inflight) for w in f.writers):
                attr = await self.client.data.free_past_end(self.ino)
                if attr is not None:  # the size a stat shows here is the cluster's again
                    f.update(attr)
                    self.size = min(self.size, attr["size"])
                    f.pending = 0
            raise
        self.file.update(await self.client.data.extend(self.ino, self.size))
        if self.writes != seen:
            return  # more came meanwhile: the next flush sends them, and decides what the file holds
        self.dirty = False
        if self.file.pending <= self.attr["size"]:
            self.file.pending = 0
        try:
            await self.on_flushed(self)
        except BaseException:
            self.dirty = True
            raise

    async def _mark(self) -> None:
        """The first change of a file this mount neither created nor truncated for writing: one
        of its writers in the namespace before any byte of the change lands (W1). One op at a
        time (``mark_lock``): a ``written`` on its way is answered first."""
        f = self.file
        async with f.mark_lock:
            if not f.marked:
                f.update(await self.client.data.writing(self.ino))
                f.marked = True

    async def finish(self, final: bool) -> None:
        """After a close's flush (``final`` False: FLUSH, before close() returns) or at the
        handle's release (``final``): if no other handle here may write the file and nothing of
        it is unflushed or on its way, this mount is done writing it (W2: ``written``), so a file
        closed is never left marked (a mount killed right after a close would leave a complete
        file that opens as EIO). At a FLUSH only if its writes reach the size a writer here set
        it to: a forked child's exec or a dup'd descriptor flushes too while the writer goes on,
        and safetensors sizes its file (ftruncate) before it writes it. A failure leaves the
        mark: the file opens as EIO if this mount dies, never as finished when it is not."""
        f = self.file
        if not self.writable:
            return
        if final:
            self.writable = False  # (before any await: of two released at once, the second finishes)
        if self.snap or not f.marked or self.dirty or (not final and f.wrote < f.sized):
            return
        if any(h.writable or h.dirty for h in f.handles if h is not self) or any(w.run or w.inflight for w in f.writers):
            return
        async with f.mark_lock:
            if not f.marked or any(h.writable for h in f.handles if h is not self):
                return  # another handle opened for writing meanwhile: it finishes the file
            try:
                f.update(await self.client.data.written(self.ino))
                f.marked, f.sized, f.wrote = False, 0, 0
            except RemoteError as exc:
                log.warning("file %d: not recorded as finished (%s): it opens as EIO elsewhere if this mount dies first", self.ino, exc)


@dataclass
class BufferedHandle(Handle):
    """Written bytes gathered in memory and used as a whole at flush (a push, a model stream)."""

    buf: bytearray = field(default_factory=bytearray)
    dirty: bool = False

    async def write(self, off: int, data: bytes) -> int:
        end = off + len(data)
        if end > len(self.buf):
            self.buf.extend(bytes(end - len(self.buf)))
        memoryview(self.buf)[off:end] = data  # (a bytearray slice assigned bytes copies them twice)
        self.dirty = True
        return len(data)


@dataclass
class PushHandle(BufferedHandle):
    """``.workers/<rank>/.../t.npy`` opened for writing: the bytes written are one gradient
    (an .npy, or the raw data bytes), pushed at flush."""

    client: "Client" = None  # type: ignore[assignment]
    rank: int = 0
    direct: bool = True  # written once and pushed: no page cache

    async def flush(self) -> None:
        # Clean only once pushed: a failed flush (say, from the close of a dup'd fd, which
        # numpy's tofile ignores) must fail again at the final close.
        if not self.dirty:
            return
        client = self.client
        t = (await client.training.train_info(self.ino, self.rank))["tensor"]
        dtype, shape = np.dtype(t["dtype"]), tuple(t["shape"])
        data = bytes(self.buf)
        try:
            if data.startswith(formats.MAGIC):
                h = formats.parse_header(data[: formats.header_length(data[:12])])
                if (h.dtype, h.shape) != (dtype, shape) or len(data) != h.data_offset + h.nbytes:
                    raise formats.NpyError(f"pushed {h.dtype}{list(h.shape)}, tensor is {dtype}{list(shape)}")
                grad = np.frombuffer(data, dtype, offset=h.data_offset).reshape(shape, order="F" if h.fortran else "C")
            elif len(data) == int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                grad = np.frombuffer(data, dtype).reshape(shape)
            else:
                raise formats.NpyError(f"{len(data)} raw bytes do not hold {dtype}{list(shape)}")
        except formats.NpyError as exc:
            log.warning("push by rank %d to inode %d refused: %s", self.rank, self.ino, exc)
            raise FsError(errno.EINVAL, str(exc)) from None
        # ``data`` is immutable and never reused: a push kept while its round is open stays a
        # view of it (PushPull.push ``owner``), no copy
        for last in (False, True):
            try:
                await client.training.push(self.ino, self.rank, np.ascontiguousarray(grad), owner=data)
                break
            except RemoteError as exc:  # packed into a bucket (docs/buckets.md): this rank trains it alone
                if exc.code != LAYOUT_CHANGED or last:
                    raise
                await self._alone()
        self.dirty = False

    async def _alone(self) -> None:
        """The tensor's bucket unpacked: a push of one tensor of a bucket is not the bucket's
        (B3); from now on its directory's tensors train alone."""
        client = self.client
        client.training.forget_training(self.ino)
        ptr = in_force(await client.getattr(self.ino))
        if ptr is not None:
            await client.buckets.unpack(ptr["fid"])

    async def fsync(self) -> None:
        await self.flush()
        await self.client.training.wait_applied(self.ino, self.rank)


@dataclass
class BatchSizeHandle(BufferedHandle):
    """``.irdma/workers/<r>/batch_size`` opened for writing: the rank reports its batch size."""

    client: "Client" = None  # type: ignore[assignment]
    rank: int = 0

    async def flush(self) -> None:
        if not self.dirty:
            return
        text = self.buf.decode(errors="replace").strip()
        if not text.isdigit() or int(text) < 1:
            raise FsError(errno.EINVAL, f"a batch size is a positive integer, not {text!r}")
        await self.client.setxattr(ROOT, f"{BATCH_XATTR}{self.rank}", text)
        self.dirty = False

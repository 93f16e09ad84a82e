"""The safetensors view of a model directory: ``<model>.safetensors`` beside ``<model>/``.

Reading it streams a header and then each tensor's data straight from its ``.npy`` file
(``layout`` says where each lies; ``ViewReadHandle`` reads it ahead in chunks). Writing it is
buffered (``ViewWriteHandle``) and applied at flush by ``apply``: the whole stream is validated
first, so a malformed one gets EINVAL and leaves every tensor as it was; then every tensor is
created or assigned, ``__metadata__`` kept in the directory's xattr ``META_XATTR``. Tensor
``enc/l0.w`` is ``<model>/enc/l0.w.npy``: a ``/`` in a name is a subdirectory.
"""

from __future__ import annotations

import errno
import json
import logging
import stat as S
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .. import formats
from ..util import single_exception
from ..errors import FsError
from .handles import BufferedHandle, Handle
from .inodes import FILE_ATTR_SECONDS, SUFFIX, VIEW, Family, file_stat, writes
from .lookups import Lookups
from .readahead import ReadAhead

if TYPE_CHECKING:
    from ..client.client import Client

log = logging.getLogger(__name__)

VIEW_CHUNK = 4 << 20  # a safetensors view is read ahead in chunks of this many bytes
META_XATTR = "user.irdma.safetensors_metadata"


@dataclass
class ViewReadHandle(Handle):
    """The safetensors stream of a directory, laid out at open."""

    client: "Client" = None  # type: ignore[assignment]
    header: bytes = b""
    parts: list = field(default_factory=list)  # (entry, file attr) in data order
    stat: dict = field(default_factory=dict)  # its attributes as of the open

    reader: ReadAhead | None = None

    @property
    def size(self) -> int:
        return len(self.header) + (self.parts[-1][0].end if self.parts else 0)

    async def read(self, off: int, size: int) -> memoryview | bytes:
        if self.reader is None:
            self.reader = ReadAhead(self._fill)
        return await self.reader.read(off, size, self.size, VIEW_CHUNK)

    async def _fill(self, off: int, view: memoryview) -> int:
        """Bytes ``off``.. of the stream into ``view``: the header, then every tensor's data
        bytes that fall in the range, read at once (the small ones in a burst per node)."""
        size = max(0, min(len(view), self.size - off))
        if off < len(self.header):
            n = min(size, len(self.header) - off)
            view[:n] = self.header[off : off + n]
        base = len(self.header)
        lo, hi = off - base, off - base + size
        reads = []
        for entry, attr in self.parts:
            a, b = max(lo, entry.begin), min(hi, entry.end)
            if a < b:
                reads.append((attr["ino"], attr["tensor"]["offset"] + a - entry.begin, view[a - lo : b - lo], attr))
        with single_exception():
            await self.client.data.read_many(reads)
        return size


@dataclass
class ViewWriteHandle(BufferedHandle):
    """A safetensors stream being written; applied as a whole at flush."""

    client: "Client" = None  # type: ignore[assignment]
    model: int = 0  # the model directory's inode

    async def read(self, off: int, size: int) -> memoryview:
        return memoryview(self.buf)[off : off + size]

    async def flush(self) -> None:
        if not self.dirty:
            return
        await apply(self.client, self.model, bytes(self.buf))
        self.dirty = False  # only once applied: a failed flush fails again at close


async def layout(client: Client, model: int) -> tuple[bytes, list]:
    """Header and (entry, file attr) parts of the safetensors view of directory ``model``."""
    tensors: list[tuple[str, dict]] = []

    async def walk(ino: int, prefix: str) -> None:
        for name, attr in await client.readdir(ino):
            if S.S_ISDIR(attr["mode"]):
                await walk(attr["ino"], f"{prefix}{name}/")
            elif name.endswith(".npy") and attr.get("tensor") and not attr["tensor"]["fortran"] and formats.st_dtype(attr["tensor"]["dtype"]):
                tensors.append((prefix + name[:-4], attr))

    await walk(model, "")
    d = await client.getattr(model)
    metadata = None
    if META_XATTR in d["xattrs"]:
        try:
            metadata = json.loads(d["xattrs"][META_XATTR])
        except ValueError:
            metadata = None
    header, entries = formats.st_layout([(n, a["tensor"]["dtype"], tuple(a["tensor"]["shape"])) for n, a in tensors], metadata)
    return header, [(e, a) for e, (_, a) in zip(entries, tensors)]


async def apply(client: Client, model: int, data: bytes) -> None:
    """Create or assign every tensor of a safetensors stream under directory ``model``;
    validates everything before changing anything."""
    try:
        start, entries, metadata = formats.st_parse(data, len(data))
        problem = next(filter(None, (formats.st_path_problem(e.name) for e in entries)), None)
        if problem:
            raise formats.SafetensorsError(problem)
    except formats.SafetensorsError as exc:
        log.warning("safetensors write to directory %d refused: %s", model, exc)
        raise FsError(errno.EINVAL, str(exc)) from None
    for e in entries:
        *dirs, leaf = e.name.split("/")
        parent = model
        for d in dirs:
            parent = (await client.paths.makedirs_under(parent, d))["ino"]
        arr = np.frombuffer(data, dtype=e.dtype, count=(e.end - e.begin) // np.dtype(e.dtype).itemsize, offset=start + e.begin).reshape(e.shape)
        await client.paths.save_under(parent, leaf + ".npy", arr)
    if metadata:
        await client.setxattr(model, META_XATTR, json.dumps(metadata))
    elif META_XATTR in (await client.getattr(model))["xattrs"]:
        await client.setxattr(model, META_XATTR, None)  # the new stream has none
    log.info("safetensors stream applied to directory %d: %d tensors", model, len(entries))


class Views(Family):
    """``VIEW | d``: ``<name>.safetensors`` beside a directory ``d`` of at least one tensor
    (when no real entry has that name): read, the model as one stream; written, applied whole."""

    def __init__(self, client: "Client", opened, lookups: Lookups) -> None:
        self.client = client
        self.opened = opened  # open handles of an inode, by kind
        # the layout a lookup of X.safetensors made, for the open that follows (lookups.py):
        # made twice, it was a quarter of a view read's time for a 161-tensor model
        self.lookups = lookups

    def owns(self, ino: int) -> bool:
        return bool(ino & VIEW)

    async def stat(self, ino: int, header: bytes, parts: list) -> dict:
        d = await self.client.getattr(ino & ~VIEW)
        size = len(header) + (parts[-1][0].end if parts else 0)
        st = file_stat(ino, size, d["mode"] & 0o666, d["mtime_ns"], d["uid"], d["gid"])
        return st | {"attr_timeout": FILE_ATTR_SECONDS}  # as a file's (inodes.py)

    async def getattr(self, ino: int) -> dict:
        # open for reading here: the layout made at open answers (the kernel asks per read)
        opened = self.opened(ino, ViewReadHandle)
        if opened:
            return opened[0].stat
        return await self.stat(ino, *await layout(self.client, ino & ~VIEW))

    async def beside(self, parent: int, name: str) -> dict:
        """``name`` (``X.safetensors``, missing in ``parent``) as the view of directory ``X``."""
        begun = self.lookups.begin()
        model = await self.client.lookup(parent, name[: -len(SUFFIX)])
        if not S.S_ISDIR(model["mode"]):
            raise FsError(errno.ENOENT)
        header, parts = await layout(self.client, model["ino"])
        if not parts:  # a directory of no tensors has no model view
            raise FsError(errno.ENOENT)
        self.lookups.note(("view", model["ino"]), (header, parts), begun)
        return await self.stat(VIEW | model["ino"], header, parts)

    async def open(self, ino: int, flags: int, uid: int):
        model = ino & ~VIEW
        if writes(flags):
            return ViewWriteHandle(ino, client=self.client, model=model)
        header, parts = self.lookups.take(("view", model)) or await layout(self.client, model)
        return ViewReadHandle(ino, self.client, header, parts, await self.stat(ino, header, parts))

    async def setattr(self, ino: int, changes: dict) -> dict:
        if set(changes) - {"size", "atime_ns", "mtime_ns"} or changes.get("size", 0) != 0:
            raise FsError(errno.EPERM, "a model view can only be replaced as a whole")
        return await self.getattr(ino)  # O_TRUNC before a rewrite: the write replaces it

"""Safetensors files as models: ``X.safetensors`` trained where it is, read back byte for byte.

A file named ``*.safetensors`` is plain bytes when its writer closes it: saving a checkpoint
copies nothing (most are never trained in place; shared/DESIGN.md: a tensor is a reading of a
file, never a conversion). It becomes a *model file* where it is first wanted as one, in the
mount that wants it: a lookup of its tensor directory ``X`` (``ModelFiles.entry``: the
namespace answers a missing ``X`` beside a plain ``X.safetensors`` with that file's attributes
marked ``unconverted``) or of its step stream ``.workers/<rank>/X.safetensors``
(``ModelFiles.first_use``), if it holds a safetensors stream whose tensors map onto tensor
files: dtypes numpy has, names that are paths, data sections back to back from the end of the
header to the end of the file (what the safetensors library writes). One that does not map
stays plain bytes, ``X`` is ENOENT, and the mount does not look again until the file changes
(its version). Then:

- each tensor's bytes move into the tensor file ``<name>.npy`` of a hidden directory beside the
  file, ``.irdmafs-model-<ino>`` (its *tensor directory*; a ``/`` in a name is a subdirectory),
  where the nodes store and train it as any other tensor;
- the file keeps its header (its first ``start`` bytes, verbatim), its size and times; one
  namespace op (``setmodel``) both records ``irdmafs.model`` = ``{"dir": <ino>, "start": <n>}``
  (never listed, never settable by a user) and drops its stripes past the header on every node,
  so no reader sees the one without the other;
- reading the file gives the header, then each tensor's current data in the file's order. Each
  tensor is read whole, all of one version (``StripeIO.read_settled``: the seqlock rule of a
  stripe, applied to the stripes of a tensor), and served from memory (``ModelReader``);
- ``X/`` (when no real ``X`` exists) is the tensor directory: ``X/<t>.npy`` as any tensor, and
  the step streams and door of model ``X`` under ``.workers/<rank>/``. It holds the tensors of
  the file's header and nothing else: making, removing or renaming anything in it gets EPERM;
  a tensor's data may be rewritten in place (np.save of the same dtype and shape);
- its user.irdma.* attributes (policy, optimizer, workers, ...) are mirrored on the tensor
  directory, which sits in the file's directory: a model's policy is set on the file, or on any
  directory above it, as for a directory of tensors; chmod and chown are mirrored too;
- opened for writing with O_TRUNC it drops its tensor directory and is plain bytes again; its
  first write without O_TRUNC, or a truncate to another size, brings its bytes back into it
  first (``materialize``); it stays plain bytes until it is wanted as a model again;
- removing its last name removes the tensor directory; a rename moves the directory along.

A snapshot's plain ``X.safetensors`` is not converted (snapshots are read only): its ``X`` is
ENOENT; a model file's snapshot has its tensor directory as it was.

Invariants: a model file reads back the bytes that were written, except the data of tensors
that training (or a write through ``X/<t>.npy``) changed since; its tensor directory is complete
before the file says ``irdmafs.model``, and the file's own copy of the tensor bytes goes in the
same op, on condition that the file's version and size are still those its bytes were copied
at; a conversion, the bytes coming back and this mount's writes to the file never overlap
(``ModelFiles.locked``: a write waits for a conversion, a conversion skips a file a handle of
this mount is writing, ``writing``); a file that does not map, or whose conversion fails
(ENOSPC, a node lost), stays plain bytes, byte for byte, with a log line saying why. A tensor
rewritten through ``X/<t>.npy`` with another dtype or shape makes the file's header untrue:
reading the file then answers EIO naming the tensor (nothing is lost: the tensor file holds the
data). Across mounts it is close-to-open: a file is wanted as a model after its writer closed
it. A mount cannot see another mount's writers: a conversion there while a writer elsewhere
still writes the file in place (no O_TRUNC, which moves the version; safetensors' own writer
renames its file to its final name before it closes it) copies the bytes as they are, and the
writer's later bytes past the header are dropped with the file's stripes (a known window:
``docs/filesystem.md``).

"""

from __future__ import annotations

import errno
import json
import logging
import stat as S
from bisect import bisect_right
from collections import Counter, OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import numpy as np
import trio

from .. import formats
from ..client.client import Client
from ..client.buckets import data_of
from ..errors import FsError, NodeDown, RemoteError, Unavailable
from ..names import MODEL_XATTR
from .inodes import RESERVED, SUFFIX, TENSOR_DIR

log = logging.getLogger(__name__)

PROBE = 4096  # first bytes looked at to tell whether a file may be a safetensors stream
CACHE_BYTES = 64 << 20  # whole tensors a reader keeps once it has served all of their bytes
CACHE_LIMIT = 512 << 20  # ... and, past this, even those it has not (a random reader of a big model)
COPY_CHUNK = 16 << 20  # bytes per read and write when tensor bytes are copied
FAILED = (RemoteError, NodeDown, Unavailable, trio.TooSlowError)  # what a conversion may meet
PLAIN_REMEMBERED = 4096  # files found not to map, by (inode, version), that are not looked at again


def model_of(attr: dict) -> dict | None:
    """``{"dir": ino, "start": n}`` if ``attr`` is a model file's, else None."""
    raw = attr.get("xattrs", {}).get(MODEL_XATTR)
    try:
        m = json.loads(raw) if raw else None
    except ValueError:
        return None
    return m if isinstance(m, dict) and isinstance(m.get("dir"), int) and isinstance(m.get("start"), int) else None


def tensor_dir_name(ino: int) -> str:
    return f"{TENSOR_DIR}{ino}"


def dir_mode(mode: int) -> int:
    """The tensor directory's mode for a file of ``mode``: searchable where readable."""
    m = S.S_IMODE(mode)
    return m | ((m & 0o444) >> 2)


def plan(head: bytes, size: int) -> tuple[int, list[formats.StEntry]]:
    """(data start, entries in file order) if a file of ``size`` bytes starting with ``head``
    maps onto tensor files; SafetensorsError saying why not."""
    start, entries, _ = formats.st_parse(head, size)
    files: set[str] = set()
    dirs: set[str] = set()
    for e in entries:
        problem = formats.st_path_problem(e.name)
        if problem:
            raise formats.SafetensorsError(problem)
        parts = e.name.split("/")
        files.add(e.name + ".npy")
        dirs.update("/".join(parts[:k]) for k in range(1, len(parts)))
    if files & dirs:
        raise formats.SafetensorsError(f"{sorted(files & dirs)[0]!r} would be both a tensor and a directory")
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise formats.SafetensorsError(f"tensor {e.name!r} starts at {e.begin}, not {pos}: data sections overlap or leave a gap")
        pos = e.end
    if start + pos != size:
        raise formats.SafetensorsError(f"{size - start - pos} bytes after the last tensor")
    return start, entries


def may_be_safetensors(prefix: bytes, size: int) -> bool:
    """A cheap first look: a header length that fits (and is one safetensors allows) and a JSON
    object after it."""
    n = int.from_bytes(prefix[:8], "little") if len(prefix) >= 9 else -1
    return 0 < n <= formats.MAX_ST_HEADER and 8 + n <= size and prefix[8:9] == b"{"


class ModelFiles:
    """The mount's side of model files: one lock per file that a conversion, the bytes coming
    back and this mount's writes take turns under, the tensor directories this mount has seen
    (the file system refuses changes in them, vfs.py), and the files it found do not map.
    ``writing(ino)``: whether a handle of this mount writes ``ino`` now; ``changed(ino, attr)``
    is told of a conversion (this mount's open files and step layouts follow it)."""

    def __init__(
        self, client: Client, writing: Callable[[int], bool] = lambda ino: False, changed: Callable[[int, dict], None] = lambda ino, attr: None
    ) -> None:
        self.client = client
        self.writing, self.changed = writing, changed
        self._locks: dict[int, trio.Lock] = {}
        self.tensor_dirs: set[int] = set()
        self._plain: OrderedDict[int, int] = OrderedDict()  # inode -> the version found not to map

    @asynccontextmanager
    async def locked(self, ino: int) -> AsyncIterator[None]:
        lock = self._locks.setdefault(ino, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting and self._locks.get(ino) is lock:
                del self._locks[ino]

    async def entry(self, parent: int, name: str, snap: int = 0) -> dict:
        """The namespace entry ``name`` of ``parent``: a real one, or else, for ``X``, the tensor
        directory of a model file ``X.safetensors`` (one call either way), made one first if it
        is a plain file that maps (ENOENT if it does not)."""
        attr = await self.client.lookup(parent, name, snap, alias=True)
        if attr.get("unconverted"):
            gone = RemoteError("ENOENT", f"{name!r} not in directory {parent}")
            if snap or await self.first_use(attr, name + SUFFIX) is None:
                raise gone
            attr = await self.client.lookup(parent, name, snap, alias=True)
            if attr.get("unconverted"):  # plain again already (another mount's O_TRUNC)
                raise gone
        # a tensor directory (by X, by its own name, or a subdirectory of one: a "/" in a
        # tensor name) holds the file's tensors only (vfs refuses changes in it)
        if "alias_of" in attr or S.S_ISDIR(attr["mode"]) and (parent in self.tensor_dirs or name.startswith(TENSOR_DIR)):
            self.tensor_dirs.add(attr["ino"])
        return attr

    async def listed(self, ino: int, snap: int = 0) -> list[tuple[str, dict]]:
        """A directory's entries but the mount's own (tensor directories, unlinked open files)."""
        return [(n, a) for n, a in await self.client.readdir(ino, snap) if not RESERVED.fullmatch(n)]

    async def settled(self, ino: int) -> None:
        """Until no conversion of ``ino`` is under way here."""
        if ino in self._locks:
            async with self.locked(ino):
                pass

    async def first_use(self, attr: dict, name: str) -> dict | None:
        """File ``attr``, named ``name`` in its directory, is wanted as a model (its tensor
        directory or its step stream was looked up): its attributes if it is a model file (made
        one now if it maps), else None. Not while a handle of this mount writes it, nor while any
        writer's mark says it is unfinished: its writer's close comes first."""
        ino = attr["ino"]
        if self._plain.get(ino) == attr["version"] or not S.S_ISREG(attr["mode"]) or self.writing(ino):
            return None
        async with self.locked(ino):
            attr = await self.client.getattr(ino)
            if model_of(attr) is not None:
                return attr
            if self.writing(ino) or attr.get("writers"):  # a writer has not finished it (docs/design.md W1): its bytes are not all there
                return None
            new = await self.convert(attr, name)
            if new is not None:
                self.changed(ino, new)
            return new

    def _does_not_map(self, attr: dict) -> None:
        """File ``attr`` is not a model at its version: not looked at again until it changes."""
        self._plain[attr["ino"]] = attr["version"]
        self._plain.move_to_end(attr["ino"])
        while len(self._plain) > PLAIN_REMEMBERED:
            self._plain.popitem(last=False)

    async def convert(self, attr: dict, name: str) -> dict | None:
        """Make file ``attr`` (named ``name``) a model file if it is a ``*.safetensors`` that
        maps; its new attributes if it became one. Called with the file's lock held."""
        ino, size = attr["ino"], attr["size"]
        if not S.S_ISREG(attr["mode"]) or model_of(attr) or not name.endswith(SUFFIX):
            return None
        prefix = await self.client.read(ino, 0, min(size, PROBE), attr) if size >= 10 else b""
        if not may_be_safetensors(prefix, size):
            self._does_not_map(attr)
            return None
        need = 8 + int.from_bytes(prefix[:8], "little")
        head = prefix if need <= len(prefix) else await self.client.read(ino, 0, need, attr)
        try:
            start, entries = plan(head, size)
        except formats.SafetensorsError as exc:
            log.warning("%s (inode %d): kept as plain bytes, not a model: %s", name, ino, exc)
            self._does_not_map(attr)
            return None
        try:
            d = await self._tensor_dir(attr, start, entries)
            # only if the file is still what was copied (no write, truncate or other conversion since)
            new = await self.client.set_model(ino, {"dir": d, "start": start}, version=attr["version"], size=size)
        except FAILED as exc:  # not remembered: the next use tries again
            log.warning("%s (inode %d): kept as plain bytes, its conversion to a model failed: %s", name, ino, exc)
            await self._remove_quietly(attr["parent"], ino)
            return None
        self.tensor_dirs.add(d)
        log.info("%s (inode %d): a model of %d tensors (tensor directory %d)", name, ino, len(entries), d)
        return new

    async def _tensor_dir(self, attr: dict, start: int, entries: list[formats.StEntry]) -> int:
        """Make the file's tensor directory and copy each tensor's bytes into its tensor file."""
        client, ino = self.client, attr["ino"]
        await self._remove_quietly(attr["parent"], ino, strict=True)  # left by a conversion cut short
        d = (await client.mkdir(attr["parent"], tensor_dir_name(ino), dir_mode(attr["mode"]), attr["uid"], attr["gid"]))["ino"]
        limit = trio.CapacityLimiter(4)

        async def move(e: formats.StEntry) -> None:
            async with limit:
                where = d
                *dirs, leaf = e.name.split("/")
                for sub in dirs:
                    where = (await client.paths.makedirs_under(where, sub))["ino"]
                header = formats.npy_header(np.dtype(e.dtype), e.shape)
                t = await client.create(where, leaf + ".npy", S.S_IMODE(attr["mode"]), attr["uid"], attr["gid"])
                await client.io.write(t["ino"], t["unit"], 0, memoryview(header))
                for off in range(0, e.end - e.begin, COPY_CHUNK):
                    data = await client.read(ino, start + e.begin + off, min(COPY_CHUNK, e.end - e.begin - off), attr)
                    await client.io.write(t["ino"], t["unit"], len(header) + off, memoryview(data))
                await client.data.extend(t["ino"], len(header) + e.end - e.begin)
                await client.set_tensor(t["ino"], {"dtype": np.dtype(e.dtype).str, "shape": list(e.shape), "offset": len(header), "fortran": False})

        async with trio.open_nursery() as n:
            for e in entries:
                n.start_soon(move, e)
        for k, v in attr["xattrs"].items():
            if k.startswith("user.irdma."):
                await client.setxattr(d, k, v)
        return d

    async def _remove_quietly(self, parent: int, ino: int, strict: bool = False) -> None:
        """Remove ``ino``'s tensor directory in ``parent`` if one is there and the file's model
        record does not name it (a conversion that failed, or whose answer was lost after it was
        applied, or another mount's: never the tensors of a model); ``strict``: errors raise,
        else they are logged."""
        try:
            d = await self.client.lookup(parent, tensor_dir_name(ino))
            m = model_of(await self.client.getattr(ino))
            if m is not None and m["dir"] == d["ino"]:
                return
            await self.remove_dir(d["ino"], ino)
        except FAILED as exc:
            if strict and not (isinstance(exc, RemoteError) and exc.code == "ENOENT"):
                raise
            if not (isinstance(exc, RemoteError) and exc.code == "ENOENT"):
                log.warning("tensor directory of inode %d not removed: %s", ino, exc)

    async def remove_dir(self, dir_ino: int, file_ino: int) -> None:
        """Remove a model file's tensor directory (wherever it is) and everything in it."""
        client = self.client
        try:
            d = await client.getattr(dir_ino)
        except RemoteError as exc:
            if exc.code == "ENOENT":
                return
            raise

        async def empty(ino: int) -> None:
            for name, a in await client.readdir(ino):
                if S.S_ISDIR(a["mode"]):
                    await empty(a["ino"])
                    await client.rmdir(ino, name)
                else:
                    await client.unlink(ino, name)

        await empty(dir_ino)
        await client.rmdir(d["parent"], tensor_dir_name(file_ino))
        self.tensor_dirs.discard(dir_ino)

    async def forget(self, dir_ino: int | None, file_ino: int | None) -> None:
        """Model file ``file_ino`` is gone (its last name): so is its tensor directory. An
        unlink's or rename's answer names both only when it freed a model file (else None)."""
        if dir_ino is None or file_ino is None:
            return
        try:
            await self.remove_dir(dir_ino, file_ino)
        except FAILED as exc:
            log.warning("tensor directory %d of removed model file %d not removed: %s", dir_ino, file_ino, exc)

    async def unmodel(self, attr: dict) -> dict:
        """The file is plain bytes from now on; its tensor data is not wanted (O_TRUNC). Returns
        its attributes. Called with the file's lock held."""
        m = model_of(attr)
        if m is None:
            return attr
        new = await self.client.set_model(attr["ino"], None)
        await self.forget(m["dir"], attr["ino"])
        return new

    async def materialize(self, attr: dict) -> dict:
        """The model file's bytes back into its own stripes, then plain bytes from now on (it is
        about to be changed in place). Returns its attributes. Called with the file's lock held."""
        m = model_of(attr)
        if m is None:
            return attr
        reader = ModelReader(self.client, await layout(self.client, attr))
        for off in range(m["start"], attr["size"], COPY_CHUNK):
            data = await reader.read(off, COPY_CHUNK)
            await self.client.io.write(attr["ino"], attr["unit"], off, memoryview(data))
        log.info("model file %d written in place: its bytes are back in it, a plain file until its writer closes it", attr["ino"])
        return await self.unmodel(attr)

    async def after_rename(self, ino: int, new_parent: int, new_name: str) -> None:
        """``ino`` now has the name ``new_name`` in ``new_parent``: a model file's tensor
        directory moves along (a file newly named ``*.safetensors`` stays plain bytes until it
        is wanted as a model). Failures are logged: the rename itself happened."""
        try:
            async with self.locked(ino):
                m = model_of(await self.client.getattr(ino))
                if m is not None:
                    d = await self.client.getattr(m["dir"])
                    if d["parent"] != new_parent:
                        await self.client.rename(d["parent"], tensor_dir_name(ino), new_parent, tensor_dir_name(ino))
        except FAILED as exc:
            log.warning("inode %d renamed to %s: its model bookkeeping failed: %s", ino, new_name, exc)


# -- reading ---------------------------------------------------------------------------------------
@dataclass
class Part:
    begin: int  # offsets in the file
    end: int
    ino: int  # the tensor file
    attr: dict


@dataclass
class Layout:
    header: bytes
    size: int
    parts: list[Part]
    snap: int = 0


async def _tensors(client: Client, ino: int, snap: int, prefix: str = "") -> dict[str, dict]:
    """Tensor name -> tensor file attributes under directory ``ino``."""
    out: dict[str, dict] = {}
    for name, a in await client.readdir(ino, snap):
        if S.S_ISDIR(a["mode"]):
            out |= await _tensors(client, a["ino"], snap, f"{prefix}{name}/")
        elif name.endswith(".npy"):
            out[prefix + name[:-4]] = a
    return out


async def layout(client: Client, attr: dict, snap: int = 0) -> Layout:
    """Where each byte of model file ``attr`` lies: its header, then its tensors' files. EIO if
    a tensor no longer fits what the header says."""
    m = model_of(attr)
    head = await client.read(attr["ino"], 0, m["start"], attr, snap)
    try:
        start, entries = plan(head, attr["size"])
        files = await _tensors(client, m["dir"], snap)
    except (formats.SafetensorsError, RemoteError) as exc:  # it mapped when converted: not this mount's doing
        log.error("model file %d: its header or tensor directory is gone bad: %s", attr["ino"], exc)
        raise FsError(errno.EIO, f"model file {attr['ino']}: {exc}") from None
    parts = []
    for e in entries:
        a = files.get(e.name)
        t = a and a.get("tensor")
        if not t or np.dtype(t["dtype"]) != np.dtype(e.dtype) or tuple(t["shape"]) != e.shape or t["fortran"]:
            now = f"{t['dtype']}{t['shape']}" if t else "missing or not a tensor"
            said = f"{e.dtype}{list(e.shape)}"
            log.error("model file %d: tensor %r is %s, the file says %s; rewrite the file or restore the tensor", attr["ino"], e.name, now, said)
            raise FsError(errno.EIO, f"tensor {e.name!r} no longer fits the file's header")
        parts.append(Part(start + e.begin, start + e.end, a["ino"], a))
    return Layout(head, attr["size"], parts, snap)


@dataclass
class ModelReader:
    """Reads of a model file: header bytes, and whole tensors read settled and kept. Reads that
    arrive together (the kernel's read-ahead) share one read of a tensor, and a tensor is kept
    while any read is serving it and until all of its bytes have been served (up to
    CACHE_LIMIT), so every byte a reader gets of a tensor is of one version; a tensor read again
    after it left the cache may be a newer version, whole."""

    client: Client
    layout: Layout
    timeout: float = 30.0
    cache: OrderedDict = field(default_factory=OrderedDict)  # part index -> its bytes
    reading: dict = field(default_factory=dict)  # part index -> Event set when its read ended
    serving: Counter = field(default_factory=Counter)  # part index -> reads using it now
    served: Counter = field(default_factory=Counter)  # part index -> its bytes served so far

    async def read(self, off: int, size: int) -> bytes:
        lay = self.layout
        end = max(off, min(off + size, lay.size))
        out = bytearray(end - off)
        if off < len(lay.header):
            n = min(end, len(lay.header)) - off
            out[:n] = lay.header[off : off + n]
        first = max(0, bisect_right([p.begin for p in lay.parts], off) - 1)
        wanted = [i for i in range(first, len(lay.parts)) if lay.parts[i].begin < end and lay.parts[i].end > off]
        self.serving.update(wanted)
        try:
            for i in wanted:
                p = lay.parts[i]
                a, b = max(off, p.begin), min(end, p.end)
                data = await self._tensor(i)
                memoryview(out)[a - off : b - off] = memoryview(data)[a - p.begin : b - p.begin]
                self.served[i] += b - a
        finally:
            self.serving.subtract(wanted)
        return bytes(out)

    async def _tensor(self, i: int) -> bytearray:
        while i not in self.cache:
            busy = self.reading.get(i)
            if busy is None:
                await self._fetch(i)
            else:
                await busy.wait()
        self.cache.move_to_end(i)
        return self.cache[i]

    async def _fetch(self, i: int) -> None:
        done = self.reading[i] = trio.Event()
        try:
            p = self.layout.parts[i]
            buf = bytearray(p.end - p.begin)
            where = data_of(dict(p.attr, ino=p.ino), self.layout.snap)  # its own stripes or its bucket's
            await self.client.io.read_settled(where.extent, where.start, memoryview(buf), self.timeout)
            self.cache[i] = buf
            self._evict(keep=i)
        finally:
            del self.reading[i]
            done.set()

    def _evict(self, keep: int) -> None:
        """Least recently used first: tensors served whole past CACHE_BYTES, then any not being
        served past CACHE_LIMIT."""
        for limit, whole in ((CACHE_BYTES, True), (CACHE_LIMIT, False)):
            for k in list(self.cache):
                if sum(map(len, self.cache.values())) <= limit:
                    break
                if k != keep and self.serving[k] <= 0 and (not whole or self.served[k] >= len(self.cache[k])):
                    del self.cache[k]
                    self.served[k] = 0

"""Safetensors files as models: ``X.safetensors`` trained where it is, read back byte for byte.

A file becomes a *model file* when the flush of its only writer in this mount (or a rename, as
rsync makes files) leaves it named ``*.safetensors`` and holding a safetensors stream whose
tensors map onto tensor files: dtypes numpy has, names that are paths, data sections back to
back from the end of the header to the end of the file (what the safetensors library writes).
Then:

- each tensor's bytes move into the tensor file ``<name>.npy`` of a hidden directory beside the
  file, ``.irdmafs-model-<ino>`` (its *tensor directory*; a ``/`` in a name is a subdirectory),
  where the nodes store and train it as any other tensor;
- the file keeps its header (its first ``start`` bytes, verbatim) and its size, and drops its
  other stripes; its internal attribute ``irdmafs.model`` = ``{"dir": <ino>, "start": <n>}``
  (never listed, never settable by a user) says so;
- reading the file gives the header, then each tensor's current data in the file's order. Each
  tensor is read whole, all of one version (``StripeIO.read_settled``: the seqlock rule of a
  stripe, applied to the stripes of a tensor), and served from memory (``ModelReader``);
- ``X/`` (when no real ``X`` exists) is the tensor directory: ``X/<t>.npy`` as any tensor, and
  the step streams and door of model ``X`` under ``.workers/<rank>/``;
- its user.irdma.* attributes (policy, optimizer, workers, ...) are mirrored on the tensor
  directory, which sits in the file's directory: a model's policy is set on the file, or on any
  directory above it, as for a directory of tensors; chmod and chown are mirrored too;
- opened for writing with O_TRUNC it drops its tensor directory and is plain bytes again;
  opened for writing without, or truncated, its bytes come back into it first
  (``materialize``); the next flush makes it a model again;
- removing its last name removes the tensor directory; a rename moves the directory along.

Invariants: a model file reads back the bytes that were written, except the data of tensors
that training (or a write through ``X/<t>.npy``) changed since; its tensor directory is complete
before the file says ``irdmafs.model``, and the file's own copy of the tensor bytes is dropped
only after; a file that does not map stays plain bytes, byte for byte, with a log line saying
why. A tensor rewritten through ``X/<t>.npy`` with another dtype or shape makes the file's
header untrue: reading the file then answers EIO naming the tensor (nothing is lost: the tensor
file holds the data).
"""

from __future__ import annotations

import errno
import json
import logging
import stat as S
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import trio

from .. import formats
from ..client.client import Client
from ..transport.base import RemoteError
from .errors import FsError

log = logging.getLogger(__name__)

MODEL_XATTR = "irdmafs.model"  # internal: on a model file, where its tensors are
HIDDEN_PREFIX = ".irdmafs-"  # names the mount keeps for itself: never listed
TENSOR_DIR = HIDDEN_PREFIX + "model-"  # + the file's inode: its tensor directory
SUFFIX = ".safetensors"
PROBE = 4096  # first bytes read to tell whether a file may be a safetensors stream
CACHE_BYTES = 64 << 20  # whole tensors a reader keeps (at least the last two)
COPY_CHUNK = 16 << 20  # bytes per read and write when a model file's bytes come back


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
    """A cheap first look: a header length that fits and a JSON object after it."""
    return len(prefix) >= 9 and 8 + int.from_bytes(prefix[:8], "little") <= size and prefix[8:9] == b"{"


async def name_of(client: Client, attr: dict) -> str | None:
    """A name of file ``attr`` in its directory (the namespace records the parent only)."""
    try:
        return next((n for n, a in await client.readdir(attr["parent"]) if a["ino"] == attr["ino"]), None)
    except (RemoteError, KeyError):
        return None


async def convert(client: Client, attr: dict, name: str | None = None) -> bool:
    """Make file ``attr`` a model file if it is a ``*.safetensors`` that maps (see the module
    docstring); True if it became one."""
    ino, size = attr["ino"], attr["size"]
    if not S.S_ISREG(attr["mode"]) or model_of(attr) or size < 10:
        return False
    prefix = await client.read(ino, 0, min(size, PROBE), attr)
    if not may_be_safetensors(prefix, size):
        return False
    name = name or await name_of(client, attr)
    if not name or not name.endswith(SUFFIX):
        return False
    need = 8 + int.from_bytes(prefix[:8], "little")
    head = prefix if need <= len(prefix) else await client.read(ino, 0, need, attr)
    try:
        start, entries = plan(head, size)
    except formats.SafetensorsError as exc:
        log.warning("%s (inode %d): kept as plain bytes, not a model: %s", name, ino, exc)
        return False
    parent = attr["parent"]
    try:  # a directory left by a conversion cut short (the file never said model): anew
        await remove_tensor_dir(client, ino, (await client.lookup(parent, tensor_dir_name(ino)))["ino"])
    except RemoteError as exc:
        if exc.code != "ENOENT":
            raise
    d = await client.mkdir(parent, tensor_dir_name(ino), dir_mode(attr["mode"]), attr["uid"], attr["gid"])
    limit = trio.CapacityLimiter(4)

    async def move(e: formats.StEntry) -> None:
        async with limit:
            where = d["ino"]
            *dirs, leaf = e.name.split("/")
            for sub in dirs:
                where = (await client.makedirs_under(where, sub))["ino"]
            header = formats.npy_header(np.dtype(e.dtype), e.shape)
            t = await client.create(where, leaf + ".npy", S.S_IMODE(attr["mode"]), attr["uid"], attr["gid"])
            data = await client.read(ino, start + e.begin, e.end - e.begin, attr) if e.end > e.begin else b""
            await client.io.write(t["ino"], t["unit"], 0, memoryview(header + data))
            await client.extend(t["ino"], len(header) + len(data))
            await client.set_tensor(t["ino"], {"dtype": np.dtype(e.dtype).str, "shape": list(e.shape), "offset": len(header), "fortran": False})

    async with trio.open_nursery() as n:
        for e in entries:
            n.start_soon(move, e)
    for k, v in attr["xattrs"].items():
        if k.startswith("user.irdma."):
            await client.setxattr(d["ino"], k, v)
    await client.setxattr(ino, MODEL_XATTR, json.dumps({"dir": d["ino"], "start": start}))
    # the tensors' bytes now live in their files: the file keeps its header only
    await client.truncate(ino, start)
    await client.setattr(ino, size=size, atime_ns=attr["atime_ns"], mtime_ns=attr["mtime_ns"])
    log.info("%s (inode %d): a model of %d tensors (tensor directory %d)", name, ino, len(entries), d["ino"])
    return True


async def remove_tensor_dir(client: Client, file_ino: int, dir_ino: int) -> None:
    """Remove a model file's tensor directory and everything in it."""
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


async def forget_file(client: Client, parent: int, ino: int) -> None:
    """File ``ino`` of directory ``parent`` is gone: so is its tensor directory, if it had one."""
    try:
        d = await client.lookup(parent, tensor_dir_name(ino))
    except RemoteError as exc:
        if exc.code == "ENOENT":
            return
        raise
    await remove_tensor_dir(client, ino, d["ino"])


async def unmodel(client: Client, attr: dict) -> dict:
    """The file is plain bytes from now on (its tensor data is not wanted: O_TRUNC). Returns
    its attributes."""
    m = model_of(attr)
    if m is None:
        return attr
    await client.setxattr(attr["ino"], MODEL_XATTR, None)
    await remove_tensor_dir(client, attr["ino"], m["dir"])
    return await client.getattr(attr["ino"])


async def materialize(client: Client, attr: dict) -> dict:
    """The model file's bytes back into its own stripes, then plain bytes from now on (it is
    about to be changed in place). Returns its attributes."""
    if model_of(attr) is None:
        return attr
    reader = ModelReader(client, await layout(client, attr))
    for off in range(0, attr["size"], COPY_CHUNK):
        data = await reader.read(off, COPY_CHUNK)
        await client.io.write(attr["ino"], attr["unit"], off, memoryview(data))
    log.info("model file %d written in place: its bytes are back in it, no longer a model", attr["ino"])
    return await unmodel(client, attr)


async def after_rename(client: Client, ino: int, parent: int, new_parent: int, new_name: str, *, may_convert: bool = True) -> None:
    """``ino`` now has the name ``new_name`` in ``new_parent``: a model file's tensor directory
    moves along; a file newly named ``*.safetensors`` may become a model (if ``may_convert``:
    not while a writer of this mount has it open)."""
    attr = await client.getattr(ino)
    m = model_of(attr)
    if m is not None:
        if new_parent != parent:
            try:
                await client.rename(parent, tensor_dir_name(ino), new_parent, tensor_dir_name(ino))
            except RemoteError as exc:
                log.warning("tensor directory of model file %d not moved along: %s", ino, exc)
        return
    if may_convert and new_name.endswith(SUFFIX) and S.S_ISREG(attr["mode"]):
        await convert(client, attr, new_name)


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
    except formats.SafetensorsError as exc:  # it mapped when converted: not this mount's doing
        raise FsError(errno.EIO, f"model file {attr['ino']}: header no longer valid: {exc}") from None
    files = await _tensors(client, m["dir"], snap)
    parts = []
    for e in entries:
        a = files.get(e.name)
        t = a and a.get("tensor")
        if not t or np.dtype(t["dtype"]) != np.dtype(e.dtype) or tuple(t["shape"]) != e.shape or t["fortran"]:
            now = f"{t['dtype']}{t['shape']}" if t else "missing or not a tensor"
            log.error("model file %d: tensor %r is %s, the file says %s%s; rewrite the file or restore the tensor", attr["ino"], e.name, now, e.dtype, list(e.shape))
            raise FsError(errno.EIO, f"tensor {e.name!r} no longer fits the file's header")
        parts.append(Part(start + e.begin, start + e.end, a["ino"], a))
    return Layout(head, attr["size"], parts, snap)


@dataclass
class ModelReader:
    """Reads of a model file: header bytes, and whole tensors read settled and kept (LRU)."""

    client: Client
    layout: Layout
    timeout: float = 30.0
    cache: OrderedDict = field(default_factory=OrderedDict)  # part index -> its bytes

    async def read(self, off: int, size: int) -> bytes:
        lay = self.layout
        end = max(off, min(off + size, lay.size))
        out = bytearray(end - off)
        if off < len(lay.header):
            n = min(end, len(lay.header)) - off
            out[:n] = lay.header[off : off + n]
        i = max(0, bisect_right([p.begin for p in lay.parts], off) - 1)
        while i < len(lay.parts) and lay.parts[i].begin < end:
            p = lay.parts[i]
            a, b = max(off, p.begin), min(end, p.end)
            if a < b:
                data = await self._tensor(i)
                memoryview(out)[a - off : b - off] = memoryview(data)[a - p.begin : b - p.begin]
            i += 1
        return bytes(out)

    async def _tensor(self, i: int) -> bytes:
        if i in self.cache:
            self.cache.move_to_end(i)
            return self.cache[i]
        p = self.layout.parts[i]
        buf = bytearray(p.end - p.begin)
        t = p.attr["tensor"]
        await self.client.io.read_settled(p.ino, t["offset"] + len(buf), p.attr["unit"], t["offset"], memoryview(buf), self.layout.snap, self.timeout)
        self.cache[i] = buf
        while len(self.cache) > 2 and sum(map(len, self.cache.values())) > CACHE_BYTES:
            self.cache.popitem(last=False)
        return buf

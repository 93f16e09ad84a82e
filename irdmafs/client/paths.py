"""Paths for Python users: a client's inode-level calls (client.py) reached by path.

``client.paths.write_file("/m/notes.txt", b"...")``, ``save("/m/w.npy", arr)``, ``load``,
``listdir``, ``makedirs``, ``move``... Paths are resolved from the namespace's root, following
symbolic links on the way as the kernel does. ``SyncClient`` offers every one of them, blocking.
"""

from __future__ import annotations

import stat as S
from typing import Any

import numpy as np
import trio

from .. import formats
from ..packing import in_force
from ..names import ROOT
from ..errors import RemoteError

MAX_SYMLINKS = 40  # links followed in one path, as Linux allows


class Paths:
    def __init__(self, client) -> None:
        self.client = client  # the Client (client.py) whose inode-level calls these make
    async def resolve(self, path: str, *, follow: bool = True) -> dict:
        """The attributes of ``path`` (from the namespace's root), following symbolic links on
        the way as the kernel does (and the last one too, unless ``follow`` is False): a
        relative target from the link's directory, ELOOP after MAX_SYMLINKS. An absolute
        target names a path on the mounting machine, not in the namespace: ENOENT."""
        parts = [p for p in path.split("/") if p]
        trail = [await self.client.getattr(ROOT)]  # the directories walked, for ".."
        links = 0
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            if part == "..":
                if len(trail) > 1:
                    trail.pop()
                continue
            attr = await self.client.lookup(trail[-1]["ino"], part)
            if S.S_ISLNK(attr["mode"]) and (parts or follow):
                links += 1
                if links > MAX_SYMLINKS:
                    raise RemoteError("ELOOP", f"more than {MAX_SYMLINKS} symbolic links in {path!r}")
                if attr["target"].startswith("/"):
                    raise RemoteError("ENOENT", f"{part!r} links to {attr['target']!r}, outside the namespace")
                parts = [p for p in attr["target"].split("/") if p] + parts
                continue
            if parts and not S.S_ISDIR(attr["mode"]):
                raise RemoteError("ENOTDIR", f"{part!r} is not a directory")
            trail.append(attr)
        return trail[-1]

    async def _parent(self, path: str) -> tuple[dict, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        return await self.resolve(head), name

    async def makedirs_under(self, parent: int, name: str) -> dict:
        """The directory ``name`` in ``parent``, made if missing (races with other makers are
        fine)."""
        try:
            return await self.client.lookup(parent, name)
        except RemoteError as exc:
            if exc.code != "ENOENT":
                raise
        try:
            return await self.client.mkdir(parent, name)
        except RemoteError as exc:
            if exc.code != "EEXIST":
                raise
            return await self.client.lookup(parent, name)

    async def makedirs(self, path: str) -> dict:
        attr = await self.client.getattr(ROOT)
        for part in [p for p in path.split("/") if p]:
            attr = await self.makedirs_under(attr["ino"], part)
        return attr

    async def open_file(self, path: str, *, create: bool = True, truncate: bool = False) -> dict:
        parent, name = await self._parent(path)
        return await self.open_under(parent["ino"], name, create=create, truncate=truncate)

    async def open_under(self, parent: int, name: str, *, create: bool = True, truncate: bool = False) -> dict:
        try:
            attr = await self.client.lookup(parent, name)
        except RemoteError as exc:
            if exc.code != "ENOENT" or not create:
                raise
            try:
                return await self.client.create(parent, name)
            except RemoteError as exc2:
                if exc2.code != "EEXIST":
                    raise
                attr = await self.client.lookup(parent, name)
        if truncate and attr["size"]:
            attr = await self.client.truncate(attr["ino"], 0)
        return attr

    async def write_file(self, path: str, data: Any) -> dict:
        attr = await self.open_file(path, truncate=True)
        return await self.client.write(attr["ino"], 0, data, attr)

    async def read_file(self, path: str) -> bytes:
        attr = await self.resolve(path)
        return await self.client.read(attr["ino"], 0, attr["size"], attr)

    async def stat(self, path: str) -> dict:
        return await self.resolve(path)

    async def listdir(self, path: str = "/") -> list[str]:
        return [name for name, _ in await self.client.readdir((await self.resolve(path))["ino"])]

    async def remove(self, path: str) -> None:
        parent, name = await self._parent(path)
        await self.client.unlink(parent["ino"], name)

    async def rmdir_path(self, path: str) -> None:
        parent, name = await self._parent(path)
        await self.client.rmdir(parent["ino"], name)

    async def move(self, src: str, dst: str) -> None:
        sp, sn = await self._parent(src)
        dp, dn = await self._parent(dst)
        await self.client.rename(sp["ino"], sn, dp["ino"], dn)

    # -- arrays ----------------------------------------------------------------------------------
    async def save(self, path: str, array: np.ndarray) -> dict:
        """Store ``array`` as a .npy file (header, then the array's own buffer: no copy of the
        data unless it is not C-contiguous)."""
        parent, name = await self._parent(path)
        return await self.save_under(parent["ino"], name, array)

    async def save_under(self, parent: int, name: str, array: np.ndarray) -> dict:
        array = np.require(array, requirements="C")  # (ascontiguousarray would make 0-d into 1-d)
        header = formats.encode_header(array)
        attr = await self.open_under(parent, name)
        if in_force(attr):  # packed into a bucket: written whole, its data is its own again (docs/buckets.md)
            attr = await self.client.truncate(attr["ino"], 0)
        elif attr["size"] > len(header) + array.nbytes:
            attr = await self.client.truncate(attr["ino"], len(header) + array.nbytes)
        body = memoryview(array.reshape(-1)).cast("B") if array.size else memoryview(b"")
        async with trio.open_nursery() as n:
            n.start_soon(self.client.io.write, attr["ino"], attr["unit"], 0, memoryview(header))
            if len(body):
                n.start_soon(self.client.io.write, attr["ino"], attr["unit"], len(header), body)
        await self.client.data.extend(attr["ino"], len(header) + len(body))
        return await self.client.set_tensor(attr["ino"], formats.tensor_info(formats.parse_header(header)))

    async def load(self, path: str, out: np.ndarray | None = None) -> np.ndarray:
        """Read a .npy file straight into a new array (or ``out``): one copy, from the wire."""
        attr = await self.resolve(path)
        prefix = bytearray(min(attr["size"], formats.PREFIX))
        await self.client.read_into(attr["ino"], 0, memoryview(prefix), attr)
        try:
            need = formats.header_length(bytes(prefix[:12]))
            if need > len(prefix):
                prefix = bytearray(need)
                await self.client.read_into(attr["ino"], 0, memoryview(prefix), attr)
            h = formats.parse_header(bytes(prefix))
        except formats.NpyError as exc:
            raise RemoteError("EINVAL", f"{path}: {exc}") from None
        if h.data_offset + h.nbytes > attr["size"]:
            raise RemoteError("EINVAL", f"{path}: file is shorter than its .npy header says")
        if out is None:
            out = np.empty(h.shape, h.dtype, order="F" if h.fortran else "C")
        elif out.shape != h.shape or out.dtype != h.dtype:
            raise RemoteError("EINVAL", f"{path}: holds {h.dtype}{list(h.shape)}, not {out.dtype}{list(out.shape)}")
        if h.nbytes:
            await self.client.read_into(attr["ino"], h.data_offset, memoryview(out.reshape(-1, order="A")).cast("B"), attr)
        return out

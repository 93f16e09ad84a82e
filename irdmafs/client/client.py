"""The API the file system and Python users call: files, directories, byte ranges, arrays.

Inode level (``lookup``, ``getattr``, ``create``, ``read_into``, ``write``...): what the FUSE layer
uses. The same by path (``client.paths``: ``write_file``, ``read_file``, ``save``, ``load``,
``listdir``...) for Python users: paths.py. Pushes and pulls: ``client.training`` (training.py).
``SyncClient`` wraps all of it for code without trio.

Client is the whole: it owns the connection (``connect``: the cluster, the staging regions) and
holds the parts, each with its own state:

- the namespace calls at inode level are Client's own methods here (lookup, getattr, create,
  mkdir, rename, links, xattrs, snapshots...); they go through ``client.meta`` (meta.py): the
  calls to the metadata primary, following it (when it is lost the next ready node takes over
  and the call is retried), the namespace ops' request ids, ``on_change``, ``op`` and
  ``cache_wait``;
- byte ranges: ``client.data`` (data.py: ``read_into``, ``read_many``, ``write``, ``extend``,
  ``free_past_end``, ``truncate``), through ``StripeIO`` (``client.io``, stripe.py); Client
  forwards ``read``, ``read_into``, ``write`` and ``truncate``;
- pushes and pulls: ``client.training`` (training.py); by path: ``client.paths`` (paths.py);
  packing small tensors: ``client.buckets`` (buckets.py). What the client knows of the nodes
  (status tables, statfs, its counters) is in nodes.py.

Errors: namespace errors are ``RemoteError`` with an errno name (ENOENT, EEXIST, ...); a stripe
with no live replica is ``Unavailable``. The mount's one errno table
(fs/errnos.py) maps any of them to an errno number.

Resource handling: ``Client.connect(cfg)`` is an async context manager owning a nursery (heartbeat
task, connection receivers) and a staging region on each node it wrote to; leaving it releases
both.
"""

from __future__ import annotations

import contextlib
import os
import stat as S
import threading
import uuid
from functools import partial
from typing import Any, AsyncIterator

import trio

from ..runtime.cluster import Cluster
from ..config import ClusterConfig
from ..runtime.slots import StagingPool
from ..transport.base import Transport
from ..errors import RemoteError, TransportError
from ..util import single_exception
from .buckets import Packer
from .data import FileData
from .meta import MetaCalls
from .paths import Paths
from .stripe import StripeIO
from .training import LOCAL_BATCH, PUSH_BATCH, PushPull


class Client:
    def __init__(self, cfg: ClusterConfig, transport: Transport, nursery: trio.Nursery):
        self.cfg = cfg
        self.owner = f"client:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.cluster = Cluster(cfg, transport, nursery)
        self.cluster.heartbeats.args["owner"] = self.owner  # keeps our staging leased on the nodes
        # a slot holds a stripe (commit), or fused pushes plus their descriptors
        self.staging = StagingPool(self.cluster, self.owner, max(cfg.stripe_unit, PUSH_BATCH, LOCAL_BATCH) + (64 << 10))
        self.io = StripeIO(self.cluster, self.staging)
        self.meta = MetaCalls(cfg, self.cluster, self.owner)  # calls to the metadata primary (meta.py)
        self.data = FileData(cfg, self.cluster, self.owner, self.io, self.getattr, self.meta.op)  # byte ranges (data.py)
        self.training = PushPull(cfg, self.cluster, self.staging, self.io, self.getattr, self.meta.follow)
        self.paths = Paths(self)  # the same calls by path, for Python users (paths.py)
        self.buckets = Packer(self)  # packing small tensors (buckets.py)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, cfg: ClusterConfig, transport: Transport | None = None) -> AsyncIterator["Client"]:
        if transport is None:
            from ..transport.select import choose

            transport = choose(cfg.transport, cfg.token, op_timeout=cfg.op_timeout)
        with single_exception():
            async with trio.open_nursery() as nursery:
                client = cls(cfg, transport, nursery)
                await client.cluster.heartbeats.refresh()
                nursery.start_soon(client.cluster.heartbeats.loop)
                try:
                    yield client
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(2):
                        # the staging regions this client leased on the nodes go back
                        for node in client.cluster.roles.ready():
                            with contextlib.suppress(TransportError, RemoteError):
                                await client.cluster.call(node, "release", {"owner": client.owner}, timeout=1)
                        await client.cluster.aclose()
                    nursery.cancel_scope.cancel()

    # -- namespace (inode level) --------------------------------------------------------------
    async def lookup(self, parent: int, name: str, snap: int = 0, *, alias: bool = False) -> dict:
        """The entry ``name`` of ``parent``; with ``alias``, where it is missing, the tensor
        directory of a model file ``name.safetensors`` (its attributes carry ``alias_of``)."""
        args = {"parent": parent, "name": name, "snap": snap} | ({"alias": True} if alias else {})
        return await self.meta.call("lookup", args)

    async def getattr(self, ino: int, snap: int = 0) -> dict:
        return await self.meta.call("getattr", {"ino": ino, "snap": snap})

    async def readdir(self, ino: int, snap: int = 0) -> list[tuple[str, dict]]:
        return [tuple(e) for e in (await self.meta.call("readdir", {"ino": ino, "snap": snap}))["entries"]]

    async def snapshots(self) -> dict[str, dict]:
        """name -> {"id", "time_ns"} of every snapshot."""
        return (await self.meta.call("snapshots", {}))["snapshots"]

    async def take_snapshot(self, name: str) -> dict:
        """A consistent, read-only, point-in-time copy of the whole namespace and its data."""
        return await self.meta.op(op="snapshot", name=name)

    async def drop_snapshot(self, name: str) -> dict:
        return await self.meta.op(op="unsnapshot", name=name)

    async def set_tensor(self, ino: int, tensor: dict | None) -> dict:
        return await self.meta.op(op="settensor", ino=ino, tensor=tensor)

    async def set_model(self, ino: int, model: dict | None, *, version: int | None = None, size: int | None = None) -> dict:
        """Make a file a model file (``{"dir", "start"}``: its stripes past ``start`` go), only
        if it still has ``version`` and ``size`` (EAGAIN if not), or, with None, plain bytes
        again (fs/models.py)."""
        return await self.meta.op(op="setmodel", ino=ino, model=model, version=version, size=size)

    async def mkdir(self, parent: int, name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> dict:
        return await self.meta.op(op="mkdir", parent=parent, name=name, mode=mode, uid=uid, gid=gid)

    async def create(self, parent: int, name: str, mode: int = 0o644, uid: int = 0, gid: int = 0, *, unit: int = 0, writing: bool = False) -> dict:
        """A regular file, striped in ``unit`` bytes (the cluster's stripe unit by default);
        ``writing``: created to be written by this client, unfinished until it is done (W1)."""
        mark = {"writer": self.owner} if writing else {}
        mode = S.S_IFREG | S.S_IMODE(mode)
        return await self.meta.op(op="create", parent=parent, name=name, mode=mode, uid=uid, gid=gid, unit=unit or self.cfg.stripe_unit, **mark)

    async def symlink(self, parent: int, name: str, target: str, uid: int = 0, gid: int = 0) -> dict:
        return await self.meta.op(op="create", parent=parent, name=name, mode=S.S_IFLNK | 0o777, target=target, uid=uid, gid=gid)

    async def mknod(self, parent: int, name: str, mode: int, rdev: int = 0, uid: int = 0, gid: int = 0) -> dict:
        """A FIFO, socket or device node (``mode`` names the kind); a regular file for S_IFREG."""
        if S.S_ISREG(mode):
            return await self.create(parent, name, mode, uid, gid)
        return await self.meta.op(op="create", parent=parent, name=name, mode=mode, rdev=rdev, uid=uid, gid=gid)

    async def link(self, ino: int, new_parent: int, new_name: str) -> dict:
        return await self.meta.op(op="link", ino=ino, new_parent=new_parent, new_name=new_name)

    async def readlink(self, ino: int, snap: int = 0) -> str:
        attr = await self.getattr(ino, snap)
        if not S.S_ISLNK(attr["mode"]):
            raise RemoteError("EINVAL", f"inode {ino} is not a symbolic link")
        return attr["target"]

    async def unlink(self, parent: int, name: str) -> dict:
        r = await self.meta.op(op="unlink", parent=parent, name=name)
        self.io.forget(r["ino"])
        return r

    async def rmdir(self, parent: int, name: str) -> dict:
        return await self.meta.op(op="rmdir", parent=parent, name=name)

    async def rename(self, parent: int, name: str, new_parent: int, new_name: str) -> dict:
        r = await self.meta.op(op="rename", parent=parent, name=name, new_parent=new_parent, new_name=new_name)
        if r.get("freed"):
            self.io.forget(r["freed"])
        return r

    async def setattr(self, ino: int, *, written: int = 0, writer: str | None = None, **attrs: Any) -> dict:
        """Change attributes; with ``size``, a truncate (``written``, ``writer``: see truncate)."""
        if "size" in attrs:
            return await self.data.truncate(ino, attrs.pop("size"), written=written, writer=writer, **attrs)
        return await self.meta.op(op="setattr", ino=ino, attrs=attrs)

    async def setxattr(self, ino: int, name: str, value: str | None) -> dict:
        return await self.meta.op(op="setxattr", ino=ino, name=name, value=value)

    # -- byte ranges: FileData's (data.py), the calls most callers use ----------------------------
    async def read_into(self, ino: int, offset: int, into: memoryview, attr: dict | None = None, snap: int = 0) -> int:
        """Read from ``offset`` into ``into``; returns the bytes read (short at end of file)."""
        return await self.data.read_into(ino, offset, into, attr, snap)

    async def read(self, ino: int, offset: int, length: int, attr: dict | None = None, snap: int = 0) -> bytes:
        return await self.data.read(ino, offset, length, attr, snap)

    async def write(self, ino: int, offset: int, data: Any, attr: dict | None = None, *, extend: bool = True) -> dict | None:
        """Write bytes at ``offset``; with ``extend`` (the default) the new size is visible to
        every client when it returns (FileData.write)."""
        return await self.data.write(ino, offset, data, attr, extend=extend)

    async def truncate(self, ino: int, size: int, *, written: int = 0, **attrs: Any) -> dict:
        """Set the size (FileData.truncate)."""
        return await self.data.truncate(ino, size, written=written, **attrs)


class SyncClient:
    """The Client for code without trio: a trio loop in a background thread runs every call.

    ``with SyncClient(cfg) as c: c.save("/m/w.npy", arr)`` -- every async method of Client, of
    its ``data`` and ``meta`` parts and of its ``paths`` is available under the same name,
    blocking (the first of them, in that order, that has it)."""

    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="irdmafs-client", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            async with Client.connect(self.cfg) as client:
                self.client = client
                self.token = trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()

        try:
            trio.run(main)
        except BaseException as exc:  # reported to the caller of __enter__
            self._error = exc
            self._ready.set()

    def __enter__(self) -> "SyncClient":
        self._thread.start()
        self._ready.wait()
        if self._error:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(10)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        for kind, part in ((Client, ""), (FileData, "data"), (MetaCalls, "meta"), (Paths, "paths")):
            if getattr(kind, name, None) is not None:
                owner = getattr(self.client, part) if part else self.client
                break
        else:
            raise AttributeError(name)
        return lambda *a, **kw: trio.from_thread.run(partial(getattr(owner, name), *a, **kw), trio_token=self.token)

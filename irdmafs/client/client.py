"""The API the file system and Python users call: files, directories, byte ranges, arrays.

Two levels. Inode level (``lookup``, ``getattr``, ``create``, ``read_into``, ``write``...) is what
the FUSE layer uses. Path level (``write_file``, ``read_file``, ``save``, ``load``, ``listdir``...)
resolves paths through it for Python users. ``SyncClient`` wraps it for code without trio.

Namespace operations go to the metadata primary (first ready node); when it is lost the next ready
node takes over and the call is retried. Data goes through ``StripeIO`` (stripe.py); pushes and
pulls through ``Training`` (training.py), which the training methods here hand on to.

Errors: namespace errors are ``RemoteError`` with an errno name (ENOENT, EEXIST, ...); a stripe
with no live replica is ``Unavailable``. The mount's one errno table
(fs/errors.py) maps any of them to an errno number.

Resource handling: ``Client.connect(cfg)`` is an async context manager owning a nursery (heartbeat
task, connection receivers) and a staging region on each node it wrote to; leaving it releases
both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat as S
import threading
import uuid
from functools import partial
from typing import Any, AsyncIterator

import numpy as np
import trio

from .. import formats
from ..cluster import Cluster, NodeDown, StagingPool
from ..config import ClusterConfig
from ..server.meta import ROOT
from ..transport.base import RemoteError, Transport, TransportError
from ..util import single_exception
from .stripe import StripeIO
from .training import PUSH_BATCH, Training

log = logging.getLogger(__name__)

# what a node's heartbeat reports that status tables show
NODE_FIGURES = ("pid", "stripes", "bytes", "capacity", "transport", "uptime", "calls", "served_bytes", "replicas_behind")

MAX_SYMLINKS = 40  # links followed in one path, as Linux allows


class Client:
    def __init__(self, cfg: ClusterConfig, transport: Transport, nursery: trio.Nursery):
        self.cfg = cfg
        self.owner = f"client:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.cluster = Cluster(cfg, transport, nursery)
        self.cluster.heartbeat_args["owner"] = self.owner  # keeps our staging leased on the nodes
        # a slot holds a stripe (commit), or fused pushes plus their descriptors
        self.staging = StagingPool(self.cluster, self.owner, max(cfg.stripe_unit, PUSH_BATCH) + (64 << 10))
        self.io = StripeIO(self.cluster, self.staging)
        self.meta_calls = 0
        self._rids = 0
        self.training = Training(cfg, self.cluster, self.staging, self.io, self.getattr, self._call_following)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, cfg: ClusterConfig, transport: Transport | None = None) -> AsyncIterator["Client"]:
        if transport is None:
            from ..transport.select import choose

            transport = choose(cfg.transport, cfg.token, op_timeout=cfg.op_timeout)
        with single_exception():
            async with trio.open_nursery() as nursery:
                client = cls(cfg, transport, nursery)
                await client.cluster.refresh()
                nursery.start_soon(client.cluster.heartbeat_loop)
                try:
                    yield client
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(2):
                        await client.release()
                    nursery.cancel_scope.cancel()

    async def release(self) -> None:
        for node in self.cluster.ready():
            with contextlib.suppress(TransportError, RemoteError):
                await self.cluster.call(node, "release", {"owner": self.owner}, timeout=1)
        await self.cluster.aclose()

    # -- namespace (inode level) --------------------------------------------------------------
    async def _primary_call(self, method: str, args: dict) -> dict:
        """A call to the metadata primary, following it when it moves."""
        self.meta_calls += 1
        return await self._call_following(self.cluster.meta_primary, method, args)

    async def _call_following(self, choose, method: str, args: dict, *, timeout: float | None = None) -> dict:
        """A control call to the node ``choose()`` names (the metadata primary, a stripe's
        primary), following it when it moves: a node lost or fenced mid-call is not an error
        the user should see while another can answer."""
        with trio.fail_after((timeout or self.cfg.op_timeout) + 2 * self.cfg.op_timeout):
            while True:
                target = choose()
                if target is None:
                    await self.cluster.wait_changed(0.5)
                    await self.cluster.refresh()
                    continue
                try:
                    return await self.cluster.call(target, method, args, timeout=timeout)
                except NodeDown:
                    continue
                except RemoteError as exc:
                    if exc.code not in ("ENOTPRIMARY", "EAGAIN"):
                        raise
                    await trio.sleep(0.1)
                    await self.cluster.refresh()

    async def _op(self, **op: Any) -> dict:
        # a request id, so a retry after a lost answer is not applied twice (server/meta.py)
        self._rids += 1
        return await self._primary_call("meta", {"op": dict(op, rid=f"{self.owner}:{self._rids}")})

    async def lookup(self, parent: int, name: str, snap: int = 0, *, alias: bool = False) -> dict:
        """The entry ``name`` of ``parent``; with ``alias``, where it is missing, the tensor
        directory of a model file ``name.safetensors`` (its attributes carry ``alias_of``)."""
        args = {"parent": parent, "name": name, "snap": snap} | ({"alias": True} if alias else {})
        return await self._primary_call("lookup", args)

    async def getattr(self, ino: int, snap: int = 0) -> dict:
        return await self._primary_call("getattr", {"ino": ino, "snap": snap})

    async def readdir(self, ino: int, snap: int = 0) -> list[tuple[str, dict]]:
        return [tuple(e) for e in (await self._primary_call("readdir", {"ino": ino, "snap": snap}))["entries"]]

    async def snapshots(self) -> dict[str, dict]:
        """name -> {"id", "time_ns"} of every snapshot."""
        return (await self._primary_call("snapshots", {}))["snapshots"]

    async def take_snapshot(self, name: str) -> dict:
        """A consistent, read-only, point-in-time copy of the whole namespace and its data."""
        return await self._op(op="snapshot", name=name)

    async def drop_snapshot(self, name: str) -> dict:
        return await self._op(op="unsnapshot", name=name)

    async def set_tensor(self, ino: int, tensor: dict | None) -> dict:
        return await self._op(op="settensor", ino=ino, tensor=tensor)

    async def set_model(self, ino: int, model: dict | None) -> dict:
        """Make a file a model file (``{"dir", "start"}``: its stripes past ``start`` go) or,
        with None, plain bytes again (fs/models.py)."""
        return await self._op(op="setmodel", ino=ino, model=model)

    async def extend(self, ino: int, size: int) -> dict:
        """Content changed up to ``size``: grow the file if needed, move mtime and version."""
        return await self._op(op="extend", ino=ino, size=size)

    async def statfs(self) -> dict:
        total = used = 0
        for node in self.cluster.ready():
            with contextlib.suppress(NodeDown, RemoteError):
                r = await self.cluster.call(node, "statfs")
                total += r["capacity"]
                used += r["used"]
        return {"capacity": total // self.cfg.replicas, "used": used // self.cfg.replicas}

    async def mkdir(self, parent: int, name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> dict:
        return await self._op(op="mkdir", parent=parent, name=name, mode=mode, uid=uid, gid=gid)

    async def create(self, parent: int, name: str, mode: int = 0o644, uid: int = 0, gid: int = 0) -> dict:
        return await self._op(op="create", parent=parent, name=name, mode=S.S_IFREG | S.S_IMODE(mode), uid=uid, gid=gid, unit=self.cfg.stripe_unit)

    async def symlink(self, parent: int, name: str, target: str, uid: int = 0, gid: int = 0) -> dict:
        return await self._op(op="create", parent=parent, name=name, mode=S.S_IFLNK | 0o777, target=target, uid=uid, gid=gid)

    async def mknod(self, parent: int, name: str, mode: int, rdev: int = 0, uid: int = 0, gid: int = 0) -> dict:
        """A FIFO, socket or device node (``mode`` names the kind); a regular file for S_IFREG."""
        if S.S_ISREG(mode):
            return await self.create(parent, name, mode, uid, gid)
        return await self._op(op="create", parent=parent, name=name, mode=mode, rdev=rdev, uid=uid, gid=gid)

    async def link(self, ino: int, new_parent: int, new_name: str) -> dict:
        return await self._op(op="link", ino=ino, new_parent=new_parent, new_name=new_name)

    async def readlink(self, ino: int, snap: int = 0) -> str:
        attr = await self.getattr(ino, snap)
        if not S.S_ISLNK(attr["mode"]):
            raise RemoteError("EINVAL", f"inode {ino} is not a symbolic link")
        return attr["target"]

    async def unlink(self, parent: int, name: str) -> dict:
        r = await self._op(op="unlink", parent=parent, name=name)
        self.io.forget(r["ino"])
        return r

    async def rmdir(self, parent: int, name: str) -> dict:
        return await self._op(op="rmdir", parent=parent, name=name)

    async def rename(self, parent: int, name: str, new_parent: int, new_name: str) -> dict:
        r = await self._op(op="rename", parent=parent, name=name, new_parent=new_parent, new_name=new_name)
        if r.get("freed"):
            self.io.forget(r["freed"])
        return r

    async def setattr(self, ino: int, *, written: int = 0, **attrs: Any) -> dict:
        """Change attributes; with ``size``, a truncate (``written``: see truncate)."""
        if "size" in attrs:
            return await self.truncate(ino, attrs.pop("size"), written=written, **attrs)
        return await self._op(op="setattr", ino=ino, attrs=attrs)

    async def setxattr(self, ino: int, name: str, value: str | None) -> dict:
        return await self._op(op="setxattr", ino=ino, name=name, value=value)

    # -- data (inode level) --------------------------------------------------------------------
    async def read_into(self, ino: int, offset: int, into: memoryview, attr: dict | None = None, snap: int = 0) -> int:
        """Read from ``offset`` into ``into``; returns the bytes read (short at end of file)."""
        attr = attr or await self.getattr(ino, snap)
        if S.S_ISDIR(attr["mode"]):
            raise RemoteError("EISDIR", "is a directory")
        return await self.io.read(ino, attr["size"], attr["unit"], offset, into, snap)

    async def read(self, ino: int, offset: int, length: int, attr: dict | None = None, snap: int = 0) -> bytes:
        buf = bytearray(length)
        n = await self.read_into(ino, offset, memoryview(buf), attr, snap)
        del buf[n:]
        return bytes(buf)

    async def write(self, ino: int, offset: int, data: Any, attr: dict | None = None, *, extend: bool = True) -> dict | None:
        """Write bytes at ``offset``. When it returns, the data is on every live replica; with
        ``extend`` (the default) the new size is visible to every client too and the new
        attributes are returned. The file system passes extend=False and calls ``extend`` once
        at flush, which is when POSIX close-to-open consistency needs it."""
        if offset < 0:
            raise RemoteError("EINVAL", f"negative offset {offset}")
        attr = attr or await self.getattr(ino)
        if S.S_ISDIR(attr["mode"]):
            raise RemoteError("EISDIR", "is a directory")
        view = memoryview(data).cast("B")
        await self.io.write(ino, attr["unit"], offset, view)
        return await self.extend(ino, offset + len(view)) if extend else None

    async def truncate(self, ino: int, size: int, *, written: int = 0, **attrs: Any) -> dict:
        """Set the size; ``written``: how far this client wrote data the file's size does not
        show yet (write-behind), which must be zeroed as well."""
        attr = await self.getattr(ino)
        old, unit = max(attr["size"], written), attr["unit"]
        result = await self._op(op="setattr", ino=ino, attrs=dict(attrs, size=size))
        # Whole stripes past the end were dropped by every node; the tail of the last one must
        # read as zeros if the file grows again, so it is zeroed through the normal write path.
        if unit and size < old and size % unit:
            end = min(old, (size // unit + 1) * unit)
            await self.io.write(ino, unit, size, memoryview(bytes(end - size)))
        self.io.forget(ino)
        return result

    # -- path level ----------------------------------------------------------------------------
    async def resolve(self, path: str, *, follow: bool = True) -> dict:
        """The attributes of ``path`` (from the namespace's root), following symbolic links on
        the way as the kernel does (and the last one too, unless ``follow`` is False): a
        relative target from the link's directory, ELOOP after MAX_SYMLINKS. An absolute
        target names a path on the mounting machine, not in the namespace: ENOENT."""
        parts = [p for p in path.split("/") if p]
        trail = [await self.getattr(ROOT)]  # the directories walked, for ".."
        links = 0
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            if part == "..":
                if len(trail) > 1:
                    trail.pop()
                continue
            attr = await self.lookup(trail[-1]["ino"], part)
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
            return await self.lookup(parent, name)
        except RemoteError as exc:
            if exc.code != "ENOENT":
                raise
        try:
            return await self.mkdir(parent, name)
        except RemoteError as exc:
            if exc.code != "EEXIST":
                raise
            return await self.lookup(parent, name)

    async def makedirs(self, path: str) -> dict:
        attr = await self.getattr(ROOT)
        for part in [p for p in path.split("/") if p]:
            attr = await self.makedirs_under(attr["ino"], part)
        return attr

    async def open_file(self, path: str, *, create: bool = True, truncate: bool = False) -> dict:
        parent, name = await self._parent(path)
        return await self.open_under(parent["ino"], name, create=create, truncate=truncate)

    async def open_under(self, parent: int, name: str, *, create: bool = True, truncate: bool = False) -> dict:
        try:
            attr = await self.lookup(parent, name)
        except RemoteError as exc:
            if exc.code != "ENOENT" or not create:
                raise
            try:
                return await self.create(parent, name)
            except RemoteError as exc2:
                if exc2.code != "EEXIST":
                    raise
                attr = await self.lookup(parent, name)
        if truncate and attr["size"]:
            attr = await self.truncate(attr["ino"], 0)
        return attr

    async def write_file(self, path: str, data: Any) -> dict:
        attr = await self.open_file(path, truncate=True)
        return await self.write(attr["ino"], 0, data, attr)

    async def read_file(self, path: str) -> bytes:
        attr = await self.resolve(path)
        return await self.read(attr["ino"], 0, attr["size"], attr)

    async def stat(self, path: str) -> dict:
        return await self.resolve(path)

    async def listdir(self, path: str = "/") -> list[str]:
        return [name for name, _ in await self.readdir((await self.resolve(path))["ino"])]

    async def remove(self, path: str) -> None:
        parent, name = await self._parent(path)
        await self.unlink(parent["ino"], name)

    async def rmdir_path(self, path: str) -> None:
        parent, name = await self._parent(path)
        await self.rmdir(parent["ino"], name)

    async def move(self, src: str, dst: str) -> None:
        sp, sn = await self._parent(src)
        dp, dn = await self._parent(dst)
        await self.rename(sp["ino"], sn, dp["ino"], dn)

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
        if attr["size"] > len(header) + array.nbytes:
            attr = await self.truncate(attr["ino"], len(header) + array.nbytes)
        body = memoryview(array.reshape(-1)).cast("B") if array.size else memoryview(b"")
        async with trio.open_nursery() as n:
            n.start_soon(self.io.write, attr["ino"], attr["unit"], 0, memoryview(header))
            if len(body):
                n.start_soon(self.io.write, attr["ino"], attr["unit"], len(header), body)
        await self.extend(attr["ino"], len(header) + len(body))
        return await self.set_tensor(attr["ino"], formats.tensor_info(formats.parse_header(header)))

    # -- training (training.py) ------------------------------------------------------------------
    async def train_info(self, ino: int, rank: int) -> dict:
        return await self.training.train_info(ino, rank)

    async def push(self, ino: int, rank: int, grad: np.ndarray, *, owner: object = None) -> int:
        return await self.training.push(ino, rank, grad, owner=owner)

    async def pull_into(self, ino: int, rank: int, out: np.ndarray) -> np.ndarray:
        return await self.training.pull_into(ino, rank, out)

    async def wait_applied(self, ino: int, rank: int) -> None:
        await self.training.wait_applied(ino, rank)

    def cached_train_info(self, ino: int, rank: int) -> dict | None:
        return self.training.cached_train_info(ino, rank)

    def pushed_tensors(self, rank: int) -> list[int]:
        return self.training.pushed_tensors(rank)

    def suggest_batch(self, rank: int, batches: dict[int, int]) -> int | None:
        return self.training.suggest_batch(rank, batches)

    def detach(self, owner: object) -> None:
        self.training.detach(owner)

    def forget_training(self, ino: int | None = None) -> None:
        self.training.forget_training(ino)

    @property
    def busy(self) -> dict[str, float]:
        return self.training.busy

    # -- status ----------------------------------------------------------------------------------
    def cluster_status(self) -> list[dict]:
        """Every node as this client sees it (state from its last heartbeat)."""
        out = []
        for spec in self.cfg.nodes:
            alive = self.cluster.node_state(spec.name) != "down"
            info = self.cluster.info.get(spec.name, {}) if alive else {}  # no stale figures
            out.append(
                {
                    "name": spec.name,
                    "address": f"{spec.host}:{spec.port}",
                    "state": self.cluster.node_state(spec.name),
                    "alive": alive,
                    **{k: info[k] for k in NODE_FIGURES if k in info},
                    # the process last heard from, even when down now: what 'irdmafs down' stops
                    # (a node restarted by hand or by the soak is not the one 'up' started)
                    "last_pid": self.cluster.info.get(spec.name, {}).get("pid"),
                }
            )
        return out

    def stats(self) -> dict:
        return {
            "bytes_read": self.io.bytes_read,
            "bytes_written": self.io.bytes_written,
            "bytes_pushed": self.io.bytes_pushed,
            "metadata_calls": self.meta_calls,
            "control_calls": self.cluster.calls,
            "control_calls_by_method": dict(self.cluster.calls_by_method),
            "replicas": self.cfg.replicas,
            "stripe_unit": self.cfg.stripe_unit,
            "transport": self.cluster.transport.name,
        }

    async def load(self, path: str, out: np.ndarray | None = None) -> np.ndarray:
        """Read a .npy file straight into a new array (or ``out``): one copy, from the wire."""
        attr = await self.resolve(path)
        prefix = bytearray(min(attr["size"], formats.PREFIX))
        await self.read_into(attr["ino"], 0, memoryview(prefix), attr)
        try:
            need = formats.header_length(bytes(prefix[:12]))
            if need > len(prefix):
                prefix = bytearray(need)
                await self.read_into(attr["ino"], 0, memoryview(prefix), attr)
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
            await self.read_into(attr["ino"], h.data_offset, memoryview(out.reshape(-1, order="A")).cast("B"), attr)
        return out


class SyncClient:
    """The Client for code without trio: a trio loop in a background thread runs every call.

    ``with SyncClient(cfg) as c: c.save("/m/w.npy", arr)`` -- every async method of Client is
    available under the same name, blocking."""

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
        fn = getattr(Client, name, None)
        if fn is None or name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **kw: trio.from_thread.run(partial(getattr(self.client, name), *a, **kw), trio_token=self.token)

"""The API the file system and Python users call: files, directories, byte ranges, arrays.

Inode level (``lookup``, ``getattr``, ``create``, ``read_into``, ``write``...): what the FUSE layer
uses. The same by path (``client.paths``: ``write_file``, ``read_file``, ``save``, ``load``,
``listdir``...) for Python users: paths.py. Pushes and pulls: ``client.training`` (training.py).
``SyncClient`` wraps all of it for code without trio.

Namespace operations go to the metadata primary (first ready node); when it is lost the next ready
node takes over and the call is retried. Data goes through ``StripeIO`` (stripe.py); pushes and
pulls through ``PushPull`` (training.py), reached as ``client.training``. What the client knows of
the nodes (status tables, statfs, its counters) is in nodes.py.

Errors: namespace errors are ``RemoteError`` with an errno name (ENOENT, EEXIST, ...); a stripe
with no live replica is ``Unavailable``. The mount's one errno table
(fs/errnos.py) maps any of them to an errno number.

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
from typing import Any, AsyncIterator, Callable

import trio

from ..runtime.cluster import Cluster
from ..errors import Unavailable
from ..errors import NodeDown
from ..config import ClusterConfig
from ..runtime.silence import Patience
from ..runtime.slots import StagingPool
from ..transport.base import Gather, Transport
from ..errors import RemoteError, TransportError
from ..util import single_exception
from .. import held
from ..packing import in_force
from .buckets import Packer, split_read
from .paths import Paths
from .stripe import Extent, StripeIO
from .training import LOCAL_BATCH, PUSH_BATCH, PushPull

log = logging.getLogger(__name__)

# calls that carry the client's view epoch (server/serving.py, check_epoch)
EPOCH_METHODS = frozenset({"meta", "train_info", "cache_wait"})



class Client:
    def __init__(self, cfg: ClusterConfig, transport: Transport, nursery: trio.Nursery):
        self.cfg = cfg
        self.owner = f"client:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.cluster = Cluster(cfg, transport, nursery)
        self.cluster.heartbeats.args["owner"] = self.owner  # keeps our staging leased on the nodes
        # a slot holds a stripe (commit), or fused pushes plus their descriptors
        self.staging = StagingPool(self.cluster, self.owner, max(cfg.stripe_unit, PUSH_BATCH, LOCAL_BATCH) + (64 << 10))
        self.io = StripeIO(self.cluster, self.staging)
        self.meta_calls = 0
        self._rids = 0
        # called after each namespace op this client sends, whatever its outcome: a mount drops
        # what it keeps of names then (the primary tells no mount of its own changes)
        self.on_change: list[Callable[[], None]] = []
        self.training = PushPull(cfg, self.cluster, self.staging, self.io, self.getattr, self._call_following)
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
    async def _meta_call(self, method: str, args: dict) -> dict:
        """A namespace call to the metadata primary (first ready node), following it."""
        self.meta_calls += 1
        return await self._call_following(self.cluster.roles.meta_primary, method, args)

    async def _call_following(self, choose, method: str, args: dict, *, timeout: float | None = None) -> dict:
        """A control call to the node ``choose()`` names (the metadata primary, a stripe's
        primary), following it when it moves: a node lost or fenced mid-call is not an error
        the user should see while another can answer. Its deadline bounds silence: a refusal
        (EAGAIN) is waited for while the long work of any member moves, the target's own (its
        catch-up) or another's it waits on (a snapshot is taken only once every node named has
        caught up: a ``mkdir`` in ``.snapshots`` got ETIMEDOUT while a restarted node took a GB
        back, 1 GiB chaos soak)."""
        patience = Patience(self.cluster.liveness.work, (timeout or self.cfg.op_timeout) + 2 * self.cfg.op_timeout)
        with patience.bound():
            while True:
                target = choose()
                if target is None:
                    await self.cluster.liveness.wait_changed(0.5)
                    await self.cluster.heartbeats.refresh()
                    continue
                if method in EPOCH_METHODS:
                    args = dict(args, epoch=self.cluster.roles.view_epoch)  # as it is now (runtime/roles.py)
                try:
                    return await self.cluster.call(target, method, args, timeout=timeout)
                except NodeDown:
                    await self.cluster.heartbeats.after_lost()
                    continue
                except RemoteError as exc:
                    if exc.code not in ("ENOTPRIMARY", "EAGAIN", "ESTALE"):
                        raise
                    await trio.sleep(0.1)
                    await self.cluster.heartbeats.refresh()
                    patience.heed(*self.cluster.roles.members.names)

    async def _op(self, **op: Any) -> dict:
        # a request id, so a retry after a lost answer is not applied twice (server/meta.py)
        self._rids += 1
        try:
            return await self._meta_call("meta", {"op": dict(op, rid=f"{self.owner}:{self._rids}")})
        finally:
            for changed in self.on_change:
                changed()

    async def op(self, **op: Any) -> dict:
        """A namespace op of a kind with no method of its own here (a bucket's ``pack`` and
        ``unpack``: buckets.py)."""
        return await self._op(**op)

    async def cache_wait(self, acked: int) -> dict:
        """This client's long-poll for a name cache lease at the metadata primary
        (server/namecache.py; the mount's side is fs/namelease.py)."""
        return await self._call_following(self.cluster.roles.meta_primary, "cache_wait", {"owner": self.owner, "acked": acked})

    async def lookup(self, parent: int, name: str, snap: int = 0, *, alias: bool = False) -> dict:
        """The entry ``name`` of ``parent``; with ``alias``, where it is missing, the tensor
        directory of a model file ``name.safetensors`` (its attributes carry ``alias_of``)."""
        args = {"parent": parent, "name": name, "snap": snap} | ({"alias": True} if alias else {})
        return await self._meta_call("lookup", args)

    async def getattr(self, ino: int, snap: int = 0) -> dict:
        return await self._meta_call("getattr", {"ino": ino, "snap": snap})

    async def readdir(self, ino: int, snap: int = 0) -> list[tuple[str, dict]]:
        return [tuple(e) for e in (await self._meta_call("readdir", {"ino": ino, "snap": snap}))["entries"]]

    async def snapshots(self) -> dict[str, dict]:
        """name -> {"id", "time_ns"} of every snapshot."""
        return (await self._meta_call("snapshots", {}))["snapshots"]

    async def take_snapshot(self, name: str) -> dict:
        """A consistent, read-only, point-in-time copy of the whole namespace and its data."""
        return await self._op(op="snapshot", name=name)

    async def drop_snapshot(self, name: str) -> dict:
        return await self._op(op="unsnapshot", name=name)

    async def set_tensor(self, ino: int, tensor: dict | None) -> dict:
        return await self._op(op="settensor", ino=ino, tensor=tensor)

    async def set_model(self, ino: int, model: dict | None, *, version: int | None = None, size: int | None = None) -> dict:
        """Make a file a model file (``{"dir", "start"}``: its stripes past ``start`` go), only
        if it still has ``version`` and ``size`` (EAGAIN if not), or, with None, plain bytes
        again (fs/models.py)."""
        return await self._op(op="setmodel", ino=ino, model=model, version=version, size=size)

    async def extend(self, ino: int, size: int) -> dict:
        """Content changed up to ``size``: grow the file if needed, move mtime and version,
        and record the stripes written since the last extend (``StripeIO.written``) as holding
        bytes: a stripe a node loses then reads as EIO, not zeros (held.py). A failed extend
        keeps them for the next one."""
        idxs = self.io.written.pop(ino, {})
        try:
            written = {"stripes": held.runs_of(idxs), "made": min(idxs.values())} if idxs else {}
            return await self._op(op="extend", ino=ino, size=size, **written)
        except BaseException:
            if idxs:
                mine = self.io.written.setdefault(ino, {})
                for i, v in idxs.items():
                    mine[i] = max(mine.get(i, 0), v)
            raise

    async def mkdir(self, parent: int, name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> dict:
        return await self._op(op="mkdir", parent=parent, name=name, mode=mode, uid=uid, gid=gid)

    async def create(self, parent: int, name: str, mode: int = 0o644, uid: int = 0, gid: int = 0, *, unit: int = 0) -> dict:
        """A regular file, striped in ``unit`` bytes (the cluster's stripe unit by default)."""
        return await self._op(op="create", parent=parent, name=name, mode=S.S_IFREG | S.S_IMODE(mode), uid=uid, gid=gid, unit=unit or self.cfg.stripe_unit)

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
        if not in_force(attr):
            return await self.io.read(Extent(ino, attr["size"], attr["unit"], snap), offset, into)
        # a packed tensor: its header from its own stripes, its data from its bucket's
        parts = split_read(attr, offset, len(into))
        async with trio.open_nursery() as n:
            for extent, off, pos, length in parts:
                n.start_soon(self.io.read, extent._replace(snap=snap), off, into[pos : pos + length])
        return sum(p[3] for p in parts)

    async def read_many(self, reads: list[tuple[int, int, memoryview, dict]]) -> None:
        """Fill each ``into`` of (ino, offset, into, attr) from its live file, all at once (many
        small files in a burst per node: StripeIO.read_small); each ``into`` lies within its
        file."""
        items = []
        for ino, offset, into, attr in reads:
            for extent, off, pos, length in split_read(dict(attr, ino=ino), offset, len(into)):
                items.append((extent.fid, extent.size, extent.unit, off, into[pos : pos + length]))
        await self.io.read_small(items)

    async def read(self, ino: int, offset: int, length: int, attr: dict | None = None, snap: int = 0) -> bytes:
        buf = bytearray(length)
        n = await self.read_into(ino, offset, memoryview(buf), attr, snap)
        del buf[n:]
        return bytes(buf)

    async def write(self, ino: int, offset: int, data: Any, attr: dict | None = None, *, extend: bool = True) -> dict | None:
        """Write bytes (a buffer, or a ``Gather`` of them) at ``offset``. When it returns, the
        data is on every live replica; with ``extend`` (the default) the new size is visible to
        every client too and the new attributes are returned. The file system passes
        extend=False and calls ``extend`` once at flush, which is when POSIX close-to-open
        consistency needs it."""
        if offset < 0:
            raise RemoteError("EINVAL", f"negative offset {offset}")
        attr = attr or await self.getattr(ino)
        if S.S_ISDIR(attr["mode"]):
            raise RemoteError("EISDIR", "is a directory")
        view = data if isinstance(data, Gather) else memoryview(data).cast("B")
        try:
            await self.io.write(ino, attr["unit"], offset, view)
        except Exception:
            if extend:  # (the file system frees at the flush that reports it: fs/handles.py)
                await self.free_past_end(ino)
            raise
        return await self.extend(ino, offset + len(view)) if extend else None

    async def free_past_end(self, ino: int) -> dict | None:
        """After a write that failed (ENOSPC, EIO, a node lost): the stripes this client
        committed and never extended the file over hold memory nobody can read. It gives them
        up at each one's primary (``release_tails``, server/tails.py), which trims those no
        other writer committed to since they went past the end (a namespace op in order with
        the extends, by stamp: another mount writing past the end meanwhile keeps what it
        wrote, and a stripe its extend grew the file over is not past the end). Not a truncate
        to the file's size, which would have taken such a writer's committed stripes before
        its extend came. (Bytes written past the end inside the file's last stripe stay, as
        any failed write's bytes inside a stripe do.) Best effort, shielded: the write's own
        error is what the caller reports; a failure here is logged and leaves the space to the
        primaries (once this client's staging lease ends) or the next truncate or unlink.
        Answers the file's attributes (None if it could not)."""
        with trio.CancelScope(shield=True), trio.move_on_after(self.cfg.op_timeout):
            try:
                mine = dict(self.io.written.get(ino, {}))  # (before any await: later writes are not this one's)
                attr = await self.getattr(ino)
                past = sorted(i for i in mine if attr["unit"] and i * attr["unit"] >= held.extent_end(attr))
                by_primary: dict[str, list[int]] = {}
                for i in past:
                    if (primary := self.cluster.roles.stripe_primary(ino, i)) is not None:
                        by_primary.setdefault(primary, []).append(i)
                released = 0
                for node, idxs in by_primary.items():
                    released += (await self.cluster.call(node, "release_tails", {"owner": self.owner, "fid": ino, "idxs": idxs}))["released"]
                for i in past:
                    if self.io.written.get(ino, {}).get(i) == mine[i]:
                        self.io.written[ino].pop(i, None)
                if past:
                    log.info("file %d: %d stripes a failed write left past its end given up", ino, released)
                return attr
            except (RemoteError, TransportError, Unavailable, NodeDown) as exc:
                log.warning("file %d: the stripes a failed write left past its end not freed: %s", ino, exc)
        return None

    async def truncate(self, ino: int, size: int, *, written: int = 0, **attrs: Any) -> dict:
        """Set the size; ``written``: how far this client wrote data the file's size does not
        show yet (write-behind), which must be zeroed as well."""
        attr = await self.getattr(ino)
        old, unit = max(attr["size"], written), attr["unit"]
        result = await self._op(op="setattr", ino=ino, attrs=dict(attrs, size=size))
        if unit and ino in self.io.written:  # what the truncate dropped holds nothing any more
            self.io.written[ino] = {i: v for i, v in self.io.written[ino].items() if i < -(-size // unit)}
        # Whole stripes past the end were dropped by every node; the tail of the last one must
        # read as zeros if the file grows again, so it is zeroed through the normal write path.
        if unit and size < old and size % unit:
            end = min(old, (size // unit + 1) * unit)
            await self.io.write(ino, unit, size, memoryview(bytes(end - size)))
        self.io.forget(ino)
        return result

    # -- path level ----------------------------------------------------------------------------


class SyncClient:
    """The Client for code without trio: a trio loop in a background thread runs every call.

    ``with SyncClient(cfg) as c: c.save("/m/w.npy", arr)`` -- every async method of Client and
    of its ``paths`` is available under the same name, blocking."""

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
        if getattr(Client, name, None) is not None:
            owner = self.client
        elif getattr(Paths, name, None) is not None:
            owner = self.client.paths
        else:
            raise AttributeError(name)
        return lambda *a, **kw: trio.from_thread.run(partial(getattr(owner, name), *a, **kw), trio_token=self.token)

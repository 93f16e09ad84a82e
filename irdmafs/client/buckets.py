"""Buckets from the client's side (docs/buckets.md): where a tensor's data lives, packing a
directory's small tensors into one bucket, and unpacking it again.

- ``data_of(attr)``: the extent and offset of a tensor's data bytes: its own file past its
  header, or its bucket's range (``tensor["bucket"]``, when in force: server/buckets.py).
- ``Packer.pack``: the two namespace ops of a pack around the copy. The first op holds the
  tensors' pushes on every node (their lease); then every live node is asked whether any rank
  has pushed to them (``train_busy``: a pack would lose an open round and the optimizer state);
  the data is copied into the bucket; the second op puts the pointers in force if no tensor
  changed meanwhile. Anything else (a change, a push, a node that cannot be asked) undoes the
  first op (``unpack``, which frees the bucket) and the directory stays as it was.
- ``Packer.unpack``: the bucket's data copied back into each member's own bytes (a settled
  read: every stripe at one step), then one ``unpack`` op on condition that no member changed
  meanwhile (EBUSY: read and copied again). For what needs a tensor alone: a write that is not
  a whole rewrite, a push of one tensor, a policy of its own.

Concurrency: one trio thread; a pack and an unpack of one directory by two mounts are ordered by
the namespace (the second one's op is refused and it gives up or reads again).
"""

from __future__ import annotations

import logging
import secrets
from typing import NamedTuple

import numpy as np
import trio

from ..names import BUCKET_MAX_BYTES, BUCKET_NAME, BUCKET_UNIT, PACK_LEASE_NS, PACK_MIN_TENSORS
from ..errors import NodeDown, RemoteError, TransportError
from ..packing import in_force, nbytes, packable, pointer
from .stripe import Extent

log = logging.getLogger(__name__)

UNPACK_TRIES = 5  # an unpack's copy taken again this often if a member keeps changing under it


class Where(NamedTuple):
    """Where a tensor's data bytes are: ``start`` in ``extent``."""

    extent: Extent
    start: int


def data_of(attr: dict, snap: int = 0) -> Where:
    """Where the data of tensor file ``attr`` lives (its own stripes past its header, or its
    bucket's range)."""
    t = attr["tensor"]
    ptr = in_force(attr)
    if ptr is not None:
        return Where(Extent(ptr["fid"], ptr["size"], ptr["unit"], snap), ptr["at"])
    return Where(Extent(attr["ino"], t["offset"] + nbytes(t), attr["unit"], snap), t["offset"])


def split_read(attr: dict, offset: int, length: int) -> list[tuple[Extent, int, int, int]]:
    """A read of ``length`` bytes at ``offset`` of file ``attr``, as (extent, offset in it,
    position in the caller's buffer, bytes): one piece, or two for a packed tensor whose read
    crosses from its header into its data."""
    ptr = in_force(attr)
    end = max(offset, min(offset + length, attr["size"]))
    if ptr is None:
        return [(Extent(attr["ino"], attr["size"], attr["unit"]), offset, 0, end - offset)]
    start = attr["tensor"]["offset"]
    out = []
    if offset < start:
        out.append((Extent(attr["ino"], attr["size"], attr["unit"]), offset, 0, min(end, start) - offset))
    if end > start:
        a = max(offset, start)
        out.append((Extent(ptr["fid"], ptr["size"], ptr["unit"]), ptr["at"] + a - start, a - offset, end - a))
    return out


def bucket_unit(size: int, nodes: int, stripe_unit: int) -> int:
    """A bucket's stripe unit: about two stripes per node, so its rounds spread over the nodes
    (ResNet-50's 0.8 MB of batch-norm vectors: 256 KiB); at least BUCKET_UNIT, a power of two,
    at most the cluster's stripe unit (a bucket of 8 MB in 4 stripes of 256 KiB each per node
    cost each node 32 rounds a step where 8 do)."""
    want = max(BUCKET_UNIT, -(-size // (2 * max(1, nodes))))
    return min(stripe_unit, 1 << (want - 1).bit_length())


def bucket_parts(group: list[dict], limit: int) -> list[list[dict]]:
    """``group`` (attributes of tensor files of one dtype, in the order their data is to lie)
    cut into runs of at most ``limit`` bytes of data each, one bucket each: a bucket is pushed,
    pulled, copied at a pack and an unpack, and unpacked by a partial step, whole, so its size
    bounds what each of those costs (a directory of gigabytes of small tensors got one bucket)."""
    parts: list[list[dict]] = []
    size = limit
    for a in group:
        n = nbytes(a["tensor"])
        if size + n > limit:
            parts.append([])
            size = 0
        parts[-1].append(a)
        size += n
    return parts


class Packer:
    """Packs and unpacks the buckets of directories through one client."""

    def __init__(self, client) -> None:
        self.client = client  # the Client it packs through (client.py, which makes it)
        self._refused: dict[int, tuple] = {}  # directory -> the tensors (ino, version) a pack gave up on
        self._unpacked: set[int] = set()  # directories this client unpacked: their tensors train alone

    async def pack(self, directory: int, tensors: list[dict]) -> bool:
        """Pack the packable ones of ``tensors`` (attributes of tensor files of ``directory``,
        in the order their data is to lie), per dtype into buckets of at most BUCKET_MAX_BYTES
        (``bucket_parts``), each of PACK_MIN_TENSORS or more;
        whether anything was packed. A directory whose pack gave up is not tried again until
        its tensors change."""
        seen = tuple(sorted((a["ino"], a["version"]) for a in tensors))
        if self._refused.get(directory) == seen or directory in self._unpacked:
            return False
        by_dtype: dict[str, list[dict]] = {}
        for a in tensors:
            if packable(a):
                by_dtype.setdefault(np.dtype(a["tensor"]["dtype"]).str, []).append(a)
        done = False
        for group in by_dtype.values():
            for part in bucket_parts(group, BUCKET_MAX_BYTES):
                if len(part) >= PACK_MIN_TENSORS:
                    done = await self._pack_one(directory, part) or done
        if not done:
            self._refused[directory] = seen
        return done

    async def _pack_one(self, directory: int, group: list[dict]) -> bool:
        client = self.client
        rows, at = [], 0
        for a in group:
            rows.append([a["ino"], at, a["version"]])
            at += nbytes(a["tensor"])
        itemsize = np.dtype(group[0]["tensor"]["dtype"]).itemsize
        unit = bucket_unit(at, len(client.cfg.names), client.cfg.stripe_unit)
        name = f"{BUCKET_NAME}{secrets.randbelow(10**12)}"
        bucket = (await client.create(directory, name, 0o600, unit=unit))["ino"]
        op = {"bucket": bucket, "tensors": rows, "count": at // itemsize}
        try:
            await client.meta.op(op="pack", final=False, **op)
        except RemoteError as exc:  # another mount packs them, or one changed: left as they are
            log.info("directory %d: not packed here (%s)", directory, exc)
            await self._drop_new(directory, name)
            return await self._other_pack(directory, {a["ino"] for a in group})
        except TransportError as exc:  # whether it landed is not known: undone if it did
            log.info("directory %d: pack of %d tensors given up (%s)", directory, len(rows), exc)
            await self._undo(directory, bucket, rows)
            await self._drop_new(directory, name)
            return False
        try:
            busy = await self._busy([r[0] for r in rows])
            if busy:
                raise RemoteError("EBUSY", f"ranks pushed to {len(busy)} of its tensors already")
            data = bytearray(at)
            view = memoryview(data)
            await client.data.read_many([(a["ino"], a["tensor"]["offset"], view[r[1] : r[1] + nbytes(a["tensor"])], a) for a, r in zip(group, rows)])
            await client.io.write(bucket, unit, 0, view)
            await client.data.extend(bucket, at)
            await client.meta.op(op="pack", final=True, **op)
        except (RemoteError, TransportError) as exc:
            log.info("directory %d: pack of %d tensors given up (%s)", directory, len(rows), exc)
            await self._undo(directory, bucket, rows)
            return False
        log.info("directory %d: %d tensors (%d bytes) packed into bucket %d", directory, len(rows), at, bucket)
        return True

    async def _other_pack(self, directory: int, group: set[int]) -> bool:
        """After a first step refused: until no tensor of ``group`` is being packed (another
        mount's pack under way ends or its lease runs out), so that every rank lays its steps
        out by the same packing; whether another mount packed any of them."""
        deadline = trio.current_time() + PACK_LEASE_NS / 1e9
        while True:
            now = [a for _, a in await self.client.readdir(directory) if a["ino"] in group]
            if not any(pointer(a) is not None and "until" in pointer(a) for a in now) or trio.current_time() > deadline:
                return any(in_force(a) for a in now)
            await trio.sleep(0.05)

    async def _undo(self, directory: int, bucket: int, rows: list[list[int]]) -> None:
        """A pack's first step undone (which frees the bucket); if it cannot be, its lease ends
        it anyway and the bucket goes at rmdir (server/buckets.py ``free_orphans``)."""
        try:
            await self.client.meta.op(op="unpack", bucket=bucket, tensors=[[r[0], -1] for r in rows])
        except (RemoteError, TransportError) as exc:
            log.warning("directory %d: pack not undone (%s)", directory, exc)

    async def _drop_new(self, directory: int, name: str) -> None:
        """The bucket file of a pack whose first step was refused removed; if it cannot be, it
        goes at rmdir (server/buckets.py ``free_orphans``)."""
        try:
            await self.client.unlink(directory, name)
        except (RemoteError, TransportError) as exc:
            log.warning("bucket %s of directory %d not removed: %s", name, directory, exc)

    async def _busy(self, fids: list[int]) -> list[int]:
        """The tensors of ``fids`` some rank has pushed to, as every live node says; EBUSY if a
        node cannot say."""
        busy: set[int] = set()
        for node in self.client.cluster.roles.live():
            try:
                busy |= set((await self.client.cluster.call(node, "train_busy", {"fids": fids}))["busy"])
            except (NodeDown, RemoteError) as exc:
                raise RemoteError("EBUSY", f"{node} cannot say whether its tensors were trained: {exc}") from None
        return sorted(busy)

    async def _bucket(self, bucket: int) -> dict | None:
        try:
            return await self.client.getattr(bucket)
        except RemoteError as exc:
            if exc.code == "ENOENT":
                return None
            raise

    async def unpack(self, bucket: int) -> None:
        """Every member of ``bucket`` back to its own bytes (see above); nothing if it is gone."""
        client = self.client
        for _ in range(UNPACK_TRIES):
            battr = await self._bucket(bucket)
            if battr is None:
                return
            # (its members share its directory: one call, not one per tensor)
            members = [a for _, a in await client.readdir(battr["parent"]) if (in_force(a) or {}).get("fid") == bucket]
            data = bytearray(battr["size"])
            await client.io.read_settled(Extent(bucket, battr["size"], battr["unit"]), 0, memoryview(data))
            # another mount's unpack may have ended meanwhile, and its members trained alone
            # since: not written over (the window left is this copy's own writes)
            again = await self._bucket(bucket)
            if again is None:
                return
            if again["version"] != battr["version"]:
                continue
            async with trio.open_nursery() as n:
                for a in members:
                    at, size = in_force(a)["at"], nbytes(a["tensor"])
                    n.start_soon(client.io.write, a["ino"], a["unit"], a["tensor"]["offset"], memoryview(data)[at : at + size])
            try:
                await client.meta.op(op="unpack", bucket=bucket, tensors=[[a["ino"], a["version"]] for a in members])
            except RemoteError as exc:
                if exc.code not in ("EBUSY", "EINVAL"):
                    raise
                continue  # a member changed under the copy, or another mount unpacked it: read again
            log.info("bucket %d: %d tensors unpacked", bucket, len(members))
            self._unpacked.add(battr["parent"])
            client.training.forget_training()
            return
        raise RemoteError("EBUSY", f"bucket {bucket}: its tensors kept changing under an unpack")

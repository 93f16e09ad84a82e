"""``/.irdma``: the mount's status files and the workers' ranks.

- ``.irdma/cluster``: the nodes as this mount sees them (JSON), and the mount itself (its
  config, transport, engine and kernels: runtime/dataplane.py); ``.irdma/stats``: its counters,
  the figures the Prometheus endpoint serves. Both are made whole at open.
- ``.irdma/workers/<r>``: ``rmdir`` says rank ``r`` left (``user.irdma.removed`` on the root),
  and every model stops waiting for it;
- ``.irdma/workers/<r>/batch_size``: a rank writes the batch it uses; reading it gives the batch
  suggested to it (r2sp with heterogeneous workers).

``statfs``: the cluster's capacity and use, as the mount answers the kernel's statfs (``df``).
``mount_samples``: the mount's figures as metric samples (metrics.py serves them; here so that
the node, which loads metrics.py, loads no client code).
"""

from __future__ import annotations

import errno
import json
import logging
from typing import TYPE_CHECKING, Callable

from ..client import nodes
from ..metrics import Sample, data_plane_sample, latency_samples
from ..names import ROOT
from ..runtime import dataplane
from .errnos import ANSWERED
from ..errors import FsError
from .handles import BATCH_XATTR, BatchSizeHandle, BytesHandle
from .inodes import (
    BATCH_FILE,
    CLUSTER_FILE,
    IRDMA_DIR,
    IRDMA_FILES,
    MAX_RANK,
    RANK_DIR,
    RANKS_DIR,
    REMOVED_XATTR,
    STATS_FILE,
    Family,
    dir_stat,
    file_stat,
    rank_of,
    writes,
)

if TYPE_CHECKING:
    from ..client.client import Client

log = logging.getLogger(__name__)


async def removed_ranks(client: "Client") -> set[int]:
    """The ranks that left (``rmdir .irdma/workers/<r>``)."""
    root = await client.getattr(ROOT)
    return {int(r) for r in root["xattrs"].get(REMOVED_XATTR, "").split(",") if r.strip()}


class StatusFiles(Family):
    def __init__(self, client: "Client", status: dict, figures: Callable[[], dict], opened: Callable[[int, type], list]) -> None:
        self.client = client
        self.status = status  # what the mount says of itself in .irdma/cluster
        self.figures = figures  # the mount's counters and metrics, for .irdma/stats
        self.opened = opened  # open handles of an inode, by kind

    async def statfs(self) -> dict:
        """The cluster's capacity and use, as the mount's statfs answers them (client/nodes.py)."""
        return await nodes.statfs(self.client)

    def owns(self, ino: int) -> bool:
        return ino in (IRDMA_DIR, RANKS_DIR, CLUSTER_FILE, STATS_FILE) or RANK_DIR <= ino < RANK_DIR + MAX_RANK or BATCH_FILE <= ino < BATCH_FILE + MAX_RANK

    async def getattr(self, ino: int) -> dict:
        if ino in (IRDMA_DIR, RANKS_DIR):
            return dir_stat(ino, 0o555 if ino == IRDMA_DIR else 0o755)
        if RANK_DIR <= ino < RANK_DIR + MAX_RANK:
            return dir_stat(ino, 0o755)
        if BATCH_FILE <= ino < BATCH_FILE + MAX_RANK:
            return file_stat(ino, len(await self.batch_content(ino - BATCH_FILE)), 0o644)
        # open: the content made at open (the figures change between calls, and the kernel
        # reads no further than the size it was told)
        opened = self.opened(ino, BytesHandle)
        return file_stat(ino, len(opened[0].content if opened else await self.content(ino)))

    async def lookup(self, parent: int, name: str) -> dict:
        if parent == IRDMA_DIR:
            if name == "workers":
                return await self.getattr(RANKS_DIR)
            if name not in IRDMA_FILES:
                raise FsError(errno.ENOENT)
            return await self.getattr(IRDMA_FILES[name])
        if parent == RANKS_DIR:
            rank = rank_of(name)
            if rank in await removed_ranks(self.client):
                raise FsError(errno.ENOENT)
            return await self.getattr(RANK_DIR + rank)
        if RANK_DIR <= parent < RANK_DIR + MAX_RANK and name == "batch_size":
            return await self.getattr(BATCH_FILE + parent - RANK_DIR)
        if RANK_DIR <= parent < RANK_DIR + MAX_RANK:
            raise FsError(errno.ENOENT)
        raise FsError(errno.ENOTDIR)

    async def readdir(self, ino: int) -> list[tuple[str, dict]]:
        if ino == IRDMA_DIR:
            return [(name, await self.getattr(i)) for name, i in IRDMA_FILES.items()]
        if RANK_DIR <= ino < RANK_DIR + MAX_RANK:
            return [("batch_size", await self.getattr(BATCH_FILE + ino - RANK_DIR))]
        if ino == RANKS_DIR:
            return []
        raise FsError(errno.ENOTDIR)

    async def open(self, ino: int, flags: int, uid: int):
        if ino in (CLUSTER_FILE, STATS_FILE):
            if writes(flags):
                raise FsError(errno.EACCES)
            return BytesHandle(ino, await self.content(ino), direct=True)
        if BATCH_FILE <= ino < BATCH_FILE + MAX_RANK:
            rank = ino - BATCH_FILE
            if writes(flags):
                return BatchSizeHandle(ino, client=self.client, rank=rank)
            return BytesHandle(ino, await self.batch_content(rank))
        raise FsError(errno.EISDIR)

    async def setattr(self, ino: int, changes: dict) -> dict:
        if BATCH_FILE <= ino < BATCH_FILE + MAX_RANK:
            return await self.getattr(ino)  # O_TRUNC before a new batch size is written
        raise FsError(errno.EPERM)

    async def remove_rank(self, name: str) -> None:
        """``rmdir .irdma/workers/<r>``: a worker left; every model stops waiting for it."""
        removed = await removed_ranks(self.client) | {rank_of(name)}
        await self.client.setxattr(ROOT, REMOVED_XATTR, ",".join(map(str, sorted(removed))))
        self.client.training.forget_training()
        log.info("worker rank %s removed; the others go on without it", name)

    async def batch_content(self, rank: int) -> bytes:
        """The batch size suggested to ``rank`` (r2sp, heterogeneous workers): proportional to
        its measured throughput; the batch it reported until every rank has been measured;
        empty before it reported one."""
        root = await self.client.getattr(ROOT)
        batches = {int(k[len(BATCH_XATTR) :]): int(v) for k, v in root["xattrs"].items() if k.startswith(BATCH_XATTR)}
        batches = {r: b for r, b in batches.items() if r not in await removed_ranks(self.client)}
        if rank not in batches:
            return b""
        suggestion = self.client.training.suggest_batch(rank, batches) or batches[rank]
        return f"{suggestion}\n".encode()

    async def content(self, ino: int) -> bytes:
        if ino == CLUSTER_FILE:
            doc = dict(self.status, nodes=nodes.table(self.client))
        else:
            doc = self.figures()  # the same figures the Prometheus endpoint serves (mount --metrics)
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def mount_samples(vfs) -> list[Sample]:
    """A mount's figures: bytes, FUSE operations and their latency, calls it made, nodes, the
    errors its users got by errno, and how whole the nodes say the cluster is (lost stripes)."""
    stats = nodes.figures(vfs.client)
    s: list[Sample] = [
        ("irdmafs_mount_bytes_total", "counter", "bytes moved by this mount", {"dir": "read"}, stats["bytes_read"]),
        ("irdmafs_mount_bytes_total", "counter", "bytes moved by this mount", {"dir": "written"}, stats["bytes_written"]),
        ("irdmafs_mount_bytes_total", "counter", "bytes moved by this mount", {"dir": "pushed"}, stats["bytes_pushed"]),
        ("irdmafs_mount_metadata_calls_total", "counter", "namespace operations sent to the metadata primary", {}, stats["metadata_calls"]),
    ]
    for method, n in stats["control_calls_by_method"].items():
        s.append(("irdmafs_mount_control_calls_total", "counter", "control calls made, by method", {"method": method}, n))
    for op, n in list(vfs.counters.items()):
        s.append(("irdmafs_mount_ops_total", "counter", "FUSE operations served, by operation", {"op": op}, n))
    table = nodes.table(vfs.client)
    states = [n["state"] for n in table]
    for st in ("ready", "syncing", "down"):
        s.append(("irdmafs_mount_nodes", "gauge", "nodes by state, as this mount sees them", {"state": st}, states.count(st)))
    for name, n in sorted(ANSWERED.items()):
        s.append(("irdmafs_mount_errors_total", "counter", "errors answered to the mount's users (FUSE, door), by errno", {"errno": name}, n))
    lost = [n.get("lost") or {} for n in table]  # a node's stripes it came back without (its heartbeats)
    s.append(("irdmafs_mount_lost_stripes", "gauge", "written stripes the nodes came back without", {}, sum(x.get("stripes", 0) for x in lost)))
    s.append(("irdmafs_mount_lost_bytes", "gauge", "bytes of the stripes the nodes came back without", {}, sum(x.get("bytes", 0) for x in lost)))
    whole = all(n["alive"] and n.get("caught_up") and not n.get("replicas_behind") for n in table) and not any(x.get("stripes") for x in lost)
    s.append(("irdmafs_mount_whole", "gauge", "1 while every node answers, has caught up, sees no peer behind and lost nothing", {}, int(whole)))
    s.append(data_plane_sample("mount", dataplane.facts(vfs.client.cluster.peers.transport)))
    s += latency_samples("irdmafs_mount_op_seconds", "FUSE operation latency", vfs.latency, "op")
    return s

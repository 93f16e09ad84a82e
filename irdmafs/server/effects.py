"""What the namespace means for this node's stripes: the local side effects of its ops and of a
namespace taken whole.

``Effects`` owns none of the namespace; it is handed the namespace (``meta.Meta``) each time and
changes this node's store and push bookkeeping (the training service's ``forget``; a change of
a model's workers rechecks its rounds: ``recheck``). Side effects on data are local and
deterministic, so every replica does the same: freed or truncated stripes are dropped with their
push bookkeeping, a trimmed stripe goes if its stamp is still the one named, a model file's
tensor bytes past its start go, a dropped snapshot's stripes go (``applied``); what a namespace
taken whole no longer has goes too (``prune``, ``drop_freed``).
"""

from __future__ import annotations

import logging
import math
from typing import Awaitable, Callable

from .datapath import VERSION_SHIFT
from .meta import Meta
from .store import Store

log = logging.getLogger("irdmafs.server.namespace")  # logged as the namespace service


class Effects:
    def __init__(self, store: Store, cluster, forget: Callable[..., None], recheck: Callable[[], Awaitable[None]]):
        self.store, self.cluster = store, cluster
        self.forget, self.recheck = forget, recheck  # the training service's (training.py)

    def applied(self, meta: Meta, op: dict, result: dict) -> None:
        """``op``, with ``result``, was just applied to ``meta``: its side effects here."""
        if result.get("freed"):
            self.store.drop(result["freed"])
            self.forget(result["freed"])
        for bucket in result.get("freed_buckets", ()):  # its last tensor gone (server/buckets.py)
            self.store.drop(bucket)
            self.forget(bucket)
        if op["op"] == "unsnapshot":
            self.store.drop_snapshot(result["id"])
        if op["op"] == "setxattr" and op["name"] in ("user.irdma.removed", "user.irdma.workers") and self.cluster.nursery:
            self.cluster.nursery.start_soon(self.recheck)
        if op["op"] == "setattr" and "size" in op["attrs"]:
            node = meta.inode(op["ino"])
            if node["unit"]:
                cut = math.ceil(op["attrs"]["size"] / node["unit"])
                if self.store.drop(op["ino"], cut):
                    log.debug("file %d truncated at op %d: its stripes from %d dropped", op["ino"], meta.seq, cut)
                self.forget(op["ino"], cut)  # a truncated tensor trains from its new start
        for idx, tag, version in result.get("trim", ()) if op["op"] == "trim" else ():  # past the end, its writers failed or gone
            stripe = self.store.get(op["ino"], idx)
            if stripe is not None and stripe.stamp <= (tag, version):
                self.store.drop_keys([(op["ino"], idx, s) for s in (0, -1, -2) if self.store.get(op["ino"], idx, s) is not None])
                self.forget(op["ino"], idx, idx + 1)
        if op["op"] == "setmodel" and op["model"]:  # the tensors' bytes live elsewhere now
            node = meta.inode(op["ino"])
            if node["unit"]:
                self.store.drop(op["ino"], math.ceil(op["model"]["start"] / node["unit"]))

    def prune(self, meta: Meta, held: dict | None = None) -> None:
        """Drop the stripes the namespace no longer has: of files it lacks, of snapshots it
        does not name (ids below 0 are optimizer state, never dropped here: every namespace
        taken once lost the training state of the node), and those its truncates freed
        (``drop_freed``; with ``held``, a node's cuts before it took this namespace, only the
        cuts it lacked). A node loaded from disk prunes too: a drop's file removals are written
        behind (persist.py), so a kill may leave them undone."""
        known = meta.files()
        for fid in {fid for fid, _, snap in self.store.stripes if snap == 0} - known:
            self.store.drop(fid)
        self.drop_freed(meta, held)
        snaps = set(meta.snapshot_ids().values())
        for snap in {snap for _, _, snap in self.store.stripes if snap > 0} - snaps:
            self.store.drop_snapshot(snap)

    def drop_freed(self, meta: Meta, held: dict | None = None) -> None:
        """Drop what the truncates in the namespace (those not in ``held``, if given: the cuts a
        node taking a namespace to catch up held before; by cut, not by sequence number, since
        a diverged history numbers other ops alike) freed and this node missed: a stripe at or
        past a cut with a version from before it (a stripe made since has a higher one: its
        version base is the namespace seq it was made at). Kept, a write that grew the file
        again landed on it, and the range before the written one read back the old bytes
        (chaos --views, seeds 2 and 7). A stripe past the size but made since (a write whose
        extend has not come yet) stays.

        A namespace op is acknowledged once every serving node holds it, so every stripe a
        node holds was made by a node that held every truncate acknowledged before, and its
        version base says so: a resync (whole) and a hand-over's catch-up (membership.py, after
        its fetches) drop by every cut; a node that takes a newer namespace to catch up (it
        answered an op stale) by the cuts of the ops it missed. A node a rebalance adds hears
        no namespace op until it is a member: it takes the namespace then, before it leads
        anything (membership.py ``_take_namespace``); a stripe it had made with an older base
        was an acknowledged write dropped (tests/mount/test_rebalance.py, 3 of 4 runs, before)."""
        for (fid, idx, snap), stripe in list(self.store.stripes.items()):
            cuts = [(seq, cut) for seq, cut in meta.cuts.table.get(fid, ()) if held is None or (seq, cut) not in held.get(fid, ())]
            if snap <= 0 and any(idx >= cut and stripe.version < seq << VERSION_SHIFT for seq, cut in cuts):
                log.info("stripe %d:%d (snapshot %d) was freed by a truncate this node missed: dropped", fid, idx, snap)
                self.store.drop_keys([(fid, idx, snap)])
                self.forget(fid, idx, idx + 1)

"""The namespace service of a PS node: namespace ops, their replication, and snapshots.

- ``meta`` (on the metadata primary, the first ready node): validate and apply a namespace op,
  then forward it with its stamp to every other live node (``meta_apply``, through the
  replicator); a node that missed ops gets the whole namespace (``meta_restore``). A retry of an
  op applied already (its request id) gets the first answer again, and only from the primary
  once every live node holds its namespace (``settled``): a node holds ops it did not settle
  itself (applied as a backup, taken with a peer's namespace, or answered EAGAIN), and answering
  one of those at once acknowledged it while a live node lacked it (fault simulator, mixed seed
  1560: an op refused by a replica in a newer view, its primary fenced, the op then taken from
  the third node's namespace and answered on the retry; a later failover would have lost it).
- An op's stamp is (epoch, seq): the view epoch it was applied in and its sequence number. A
  replica applies op ``seq`` only on top of the stamp the primary had before it (``prev``), and
  takes it as held only at that very stamp or below within the same epoch; anything else asks
  for the whole namespace, which replaces its own when its stamp is greater. So a replica that
  holds an op an old primary applied and never got acknowledged, numbered like one the next
  primary applied, is brought to the new one's namespace instead of answering "held" (fault
  simulator, mixed seed 13: the same seq with another mtime on two nodes after healing).
- Side effects on data are local and deterministic, so every replica does the same: freed or
  truncated stripes are dropped with their push bookkeeping (``forget``), a change of a model's
  workers rechecks its training rounds (``recheck``): ``effects`` (effects.py), as is what a
  namespace taken whole no longer has (``prune``, ``drop_freed``).
- A snapshot freezes commits on every live node (the commit barrier), records the namespace,
  freezes every live stripe under the snapshot id on every node (copy-on-write, store.py: no
  byte is copied), and thaws: ``freezer`` (freezer.py) does those steps.
- Reads of the namespace: ``lookup``, ``getattr``, ``readdir``, ``snapshots``.
- The mounts' name cache leases, as primary (``cache_wait``; namecache.py keeps them).

``Namespace`` owns the namespace this node holds (``meta``), its lock, the last op applied here
and the stamp it saw settled. The namespace itself is ``meta.Meta``, a deterministic state
machine; with ``--persist`` it is written through to disk after every op.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from ..errors import RemoteError
from ..runtime.cluster import now_ns
from .allocation import balanced_ino
from .core import NodeCore
from .effects import Effects
from .freezer import Freezer
from .leading import Leading
from .meta import Meta
from .namecache import NameLeases, changer_of, touched_by
from .persist import Persist

log = logging.getLogger(__name__)

# what meta_restore checks of a snapshot (``Meta.snapshot``'s form) before it reads one
SNAPSHOT_FIELDS = {"seq": int, "next_ino": int, "inodes": dict, "entries": dict}


class Namespace:
    def __init__(
        self,
        core: NodeCore,
        persist: Persist | None,
        leading: Leading,
        call_node: Callable[[str, str, dict], Awaitable[dict]],
        forget: Callable[..., None],
        recheck: Callable[[], Awaitable[None]],
        writer_heard: Callable[[str], bool],
    ):
        """``writer_heard(owner)``: whether a file's writer (a mount) is heard from still (W3)."""
        self.name, cfg, self.cluster, store, _, self.serving = core
        # ``leading``: a namespace op as a primary's change (leading.py): admitted like a commit,
        # under the namespace's lock, then replicated to every live node
        self.persist, self.leading, self.replicator = persist, leading, leading.replicator
        self.writer_heard = writer_heard
        self.meta = Meta()
        self.freezer = Freezer(self.name, self.cluster, self.serving, call_node, self._apply_and_forward)  # a snapshot's steps on every node
        self.effects = Effects(store, self.cluster, forget, recheck)  # what the ops mean for this node's stripes
        self.lock = trio.Lock()  # namespace ops, one at a time; a hand-over waits for it
        self.last: tuple[int, dict, tuple[int, int]] | None = None  # (seq, op, the stamp before it) of the last op applied here
        # the stamp up to which this node, as primary, saw every live node hold its namespace
        self.settled: tuple[int, int] | None = None
        self.names = NameLeases(cfg.name_lease)  # the mounts' cache leases, as primary
        self.cluster.roles.on_view.append(self._view)

    def current(self) -> Meta:
        """The namespace as it is now (a restore replaces it)."""
        return self.meta

    async def rpc_meta(self, op: dict, epoch: int = 0) -> dict:
        """Apply a namespace op as the metadata primary and replicate it to every live node."""
        Meta.check(op)  # EINVAL for an op no client sends (unknown kind, missing fields)
        return dict(await self._meta(op, epoch), acked_in=self.cluster.roles.view_epoch)  # runtime/heartbeats.py, follow_acked

    async def _meta(self, op: dict, epoch: int) -> dict:
        rid = op.get("rid")
        changer = changer_of(op)
        if rid in self.meta.done and self.settled == self.meta.stamp:
            # a retry of an op applied and acknowledged already (its answer was lost)
            await self._told(changer)
            return self.meta.done[rid]
        await self.leading.admit(epoch)
        async with self.lock:
            self._leads()  # under the lock: a hand-over waits for it
            if rid in self.meta.done:
                # applied meanwhile, by an earlier attempt of this very call still under way
                # when its client gave up on it and sent it again (a second mkdir answered
                # EEXIST, a second rename ENOENT: chaos --views, seed 2); or held here but not
                # known to be on every live node (see above): brought there first
                if self.settled != self.meta.stamp:
                    await self._settle()
                result = self.meta.done[rid]
            else:
                self._grace()
                for owner in self.names.stale(self.meta.cachers):
                    await self._apply_and_forward(self.meta.prepare({"op": "cacher", "owner": owner, "on": False}, now_ns()))
                op = self.meta.prepare(op, now_ns())
                if op["op"] == "create" and op.get("unit"):  # a regular file: its number places its first stripe
                    op["ino"] = balanced_ino(op["ino"], self.meta.tree.files_in(op["parent"]), self.cluster.roles.members.names)
                if op["op"] == "snapshot":
                    self.meta.frozen.check_name(op["name"])  # EEXIST before any node is frozen
                    result = await self.freezer.take(op)
                else:
                    result = await self._apply_and_forward(op)
        await self._told(changer)
        return result

    async def _told(self, changer: str | None) -> None:
        """Until every mount caching names, but the changer, dropped what the ops applied so
        far touched, or lost its lease (C1). Outside the lock: a mount's kernel drops a name
        only once its own pending change in that directory is answered, and that change may
        be waiting for this lock; nor does the changer wait for itself (C5)."""
        seq = self.meta.seq
        await self.names.settle([o for o in self.names.owing(seq) if o != changer], seq)

    async def _apply_and_forward(self, op: dict) -> dict:
        """Apply ``op`` here and answer once every other live node holds it (the replicator's
        acknowledgement rule: every node the view names active)."""
        result = self.apply(op, self.cluster.roles.view_epoch)
        seq, _, prev = self.last
        stamp = self.meta.stamp
        send = lambda peer: self.replicator.meta(peer, seq, op, self.meta.tag, prev)  # noqa: E731
        try:
            await self.replicator.to_every("metadata op", self.cluster.roles.live, send, self._leads)
            self.settled = stamp
        finally:
            # every mount caching names is told what the op made stale; its caller answers
            # once they dropped it (``_told``). Every node holds the op by now, so no lookup
            # answered after a mount is told can be older than the op; told even if the
            # forward failed, since a retry answers the op once ``_settle`` brought it
            # everywhere, and nothing would tell the mounts then.
            touch = touched_by(seq, op, result)
            if touch is not None and self.names.on:
                self.names.touched(changer_of(op), touch)
        return result

    def _grace(self) -> None:
        """EAGAIN while a new lead waits out the cache leases an earlier primary may have
        granted (C4): only if any mount caches names."""
        left = self.names.in_grace() if self.names.on else 0.0
        if left > 0:
            raise RemoteError("EAGAIN", f"a new metadata primary: changes wait {left:.1f} s more for the mounts' name caches to lapse")

    async def rpc_cache_wait(self, owner: str, acked: int = 0, epoch: int = 0) -> dict:
        """A mount's long-poll for its name cache lease (namecache.py): acknowledges the
        invalidations it applied up to ``acked``; answers with those queued for it and a
        lease. Only the metadata primary grants (ENOTPRIMARY elsewhere); ENOSYS with caching
        off (``name_lease`` 0)."""
        if not isinstance(owner, str) or not owner or type(acked) is not int:
            raise RemoteError("EINVAL", "cache_wait: an owner (a string) and acked (an integer)")
        if not self.names.on:
            raise RemoteError("ENOSYS", "name caching is off here (name_lease = 0)")
        await self.serving.check_epoch(epoch)
        await self._caught_up()
        self._leads()
        if owner not in self.meta.cachers:  # recorded on every node before its first lease (C4)
            async with self.lock:
                self._leads()
                if owner not in self.meta.cachers:
                    await self._apply_and_forward(self.meta.prepare({"op": "cacher", "owner": owner, "on": True}, now_ns()))
        try:
            answer = await self.names.wait(owner, acked, self.meta.seq)
        except LookupError:
            raise RemoteError("EAGAIN", "the lease was dropped meanwhile (a new lead); ask again") from None
        self._leads()  # still the primary as it answers: else this call grants nothing
        return answer

    async def _settle(self) -> None:
        """Under the lock, as primary: every live node brought up to this node's namespace (its
        last op again, a node further behind then asking for the whole namespace; the whole
        namespace if the last op here came from elsewhere) before a retry of an op it holds is
        answered. EAGAIN if that fails (the retry comes again)."""
        stamp = self.meta.stamp
        if self.last is not None and self.last[0] == self.meta.seq:
            seq, op, prev = self.last
            send = lambda peer: self.replicator.meta(peer, seq, op, self.meta.tag, prev)  # noqa: E731
        else:
            send = self.replicator.namespace
        await self.replicator.to_every("metadata op", self.cluster.roles.live, send, self._leads)
        self.settled = stamp

    def _leads(self) -> None:
        primary = self.cluster.roles.meta_primary()
        if primary != self.name:
            self.names.end(self.cluster.roles.view_epoch)
            raise RemoteError("ENOTPRIMARY", primary or "")
        self.names.leads(self.cluster.roles.view_epoch, self.meta.cachers, self.serving.gen)

    def _view(self, view) -> None:
        """Each view this node learns: whether its lead of the mounts' leases goes on."""
        self.names.view(view.epoch, self.cluster.roles.meta_primary() == self.name, self.meta.cachers, self.serving.gen)

    def _save(self) -> None:
        if self.persist is not None:
            self.persist.save_meta(self.meta.snapshot())

    def apply(self, op: dict, tag: int) -> dict:
        """Apply ``op`` here, stamped with epoch ``tag``, with its side effects on this node's
        stripes and training."""
        prev = self.meta.stamp
        result = self.meta.apply(op)
        self.meta.tag = tag
        self.last = (self.meta.seq, op, prev)
        self._save()
        if op["op"] == "cacher" and not op["on"]:
            self.names.leases.pop(op["owner"], None)  # gone (a clean unmount): no change waits for it
        self.effects.applied(self.meta, op, result)  # on this node's stripes and training (effects.py)
        return result

    async def rpc_meta_apply(self, seq: int, op: dict, sender: str = "", epoch: int = 0, tag: int = 0, prev: list | None = None) -> dict:
        """Op ``seq`` of the primary, stamped (``tag``, ``seq``), on top of stamp ``prev``:
        applied if this node is at ``prev``; {} if it holds it already; {"stale": True} (send
        the whole namespace) otherwise."""
        if not (prev is None or isinstance(prev, list) and len(prev) == 2 and all(type(x) is int for x in prev)) or type(tag) is not int:
            raise RemoteError("EINVAL", f"meta_apply: a stamp is two integers, not {prev!r} ({tag!r})")
        await self.serving.check_epoch(epoch)
        self.serving.check_sender(sender, self.cluster.roles.meta_primary)
        have = self.meta.stamp
        if (tag, seq) == have or seq < have[1] and tag == have[0]:
            return {}  # this op, or it and later ops of the same primary (one per epoch)
        if seq != have[1] + 1 or (prev is not None and tuple(prev) != have):
            return {"stale": True}
        try:
            self.apply(op, tag)
        except RemoteError as exc:  # diverged somehow: ask for the whole namespace
            log.warning("metadata op %d failed here (%s); asking for a snapshot", seq, exc)
            return {"stale": True}
        return {}

    async def rpc_meta_restore(self, snapshot: dict) -> dict:
        self.restore(snapshot)
        return {}

    def restore(self, snapshot: dict, *, whole: bool = False) -> None:
        """Take a peer's whole namespace if it is newer, or with ``whole`` whatever its sequence
        number, dropping the stripes and snapshots it no longer has; EINVAL if ``snapshot`` is
        not one (``meta_snapshot``'s answer).

        ``whole`` is a resync's: a node that was away may hold ops it applied as the metadata
        primary and never got acknowledged, while the next primary numbered other ops alike
        (the same sequence number, another mtime: fault simulator, mixed seed 13 once the nodes
        expelled silent peers). The ready primary it resyncs from holds every acknowledged op."""
        if not isinstance(snapshot, dict) or not all(isinstance(snapshot.get(k), t) for k, t in SNAPSHOT_FIELDS.items()):
            raise RemoteError("EINVAL", "meta_restore: not a namespace snapshot (meta_snapshot's answer)")
        if (snapshot.get("tag", 0), snapshot["seq"]) > self.meta.stamp or whole and snapshot != self.meta.snapshot():
            had = {fid: [tuple(c) for c in cuts] for fid, cuts in self.meta.cuts.table.items()}
            self.meta = Meta.restore(snapshot)
            self.last = None  # (and not settled by this node: ``settled`` stays as it was)
            self._save()
            # what the truncates freed: all of them for a resync; those it did not hold for a
            # node that took it to catch up (kept, a write that grew the file again landed on
            # the old bytes on both homes: CI's chaos soak, seed 3)
            self.prune(None if whole else had)

    def prune(self, held: dict | None = None) -> None:
        """Drop the stripes this namespace no longer has (effects.py)."""
        self.effects.prune(self.meta, held)

    def drop_freed(self, held: dict | None = None) -> None:
        """Drop what this namespace's truncates (but those in ``held``) freed and this node
        missed (effects.py)."""
        self.effects.drop_freed(self.meta, held)

    async def rpc_meta_snapshot(self, whole: bool = False) -> dict:
        """This node's namespace. ``whole`` (a resync, which takes it in place of its own and
        drops the stripes of files it lacks): EAGAIN unless this node holds every acknowledged
        op (``Serving.holds_all``). A primary restarted empty while a view made before its
        crash still names it would have every file's stripes dropped (read from the code beside
        fault simulator seed 1663, where the order of two resyncs spared it). One expelled and
        named again under a new lease, still in its hand-over, lacks the ops acknowledged while
        it was out: a resync took that namespace whole, the primary's catch-up then read it
        back from the node just resynced, and its next op, stamped with the newer epoch,
        replaced the namespace of the node that held them (mixed seed 208: an acknowledged
        write's extend lost)."""
        if whole and not self.serving.holds_all():
            raise RemoteError("EAGAIN", f"node {self.serving.name} has not caught up since it last rejoined: its namespace is not the cluster's")
        return self.meta.snapshot()

    async def _caught_up(self) -> None:
        """Namespace reads only from a node that serves and has taken its work back (EAGAIN
        otherwise: the client asks again). A node just named by a view, not yet handed its
        namespace, answered lookups from its old one: a file just created, a snapshot just
        taken, a rename's source were ENOENT (chaos --views, seed 1)."""
        await self.leading.admit(None)

    async def rpc_lookup(self, parent: int, name: str, snap: int = 0, alias: bool = False) -> dict:
        await self._caught_up()
        view = self.meta.view(snap)
        return view.lookup_or_model(parent, name) if alias else view.lookup(parent, name)

    async def rpc_getattr(self, ino: int, snap: int = 0) -> dict:
        """An inode's attributes; a file its writers have not finished (``writers``, W1) says
        too whether one of them is gone (``writer_gone``, W3): not heard from here, or the file is
        a snapshot's copy, which no writer can finish. A mount opens such a file only to rewrite it."""
        await self._caught_up()
        attr = self.meta.view(snap).attr(ino)
        if attr.get("writers"):
            attr["writer_gone"] = bool(snap) or not all(self.writer_heard(w) for w in attr["writers"])
        return attr

    async def rpc_readdir(self, ino: int, snap: int = 0) -> dict:
        await self._caught_up()
        return {"entries": self.meta.view(snap).readdir(ino)}

    async def rpc_snapshots(self) -> dict:
        await self._caught_up()
        return {"snapshots": {n: {"id": s["id"], "time_ns": s["time_ns"]} for n, s in self.meta.snapshots.items()}}

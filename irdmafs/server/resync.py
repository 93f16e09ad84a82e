"""Resync: how a PS node that was away (started, restarted, fenced) catches up before it serves.

It takes the namespace of the metadata primary whole (``Namespace.restore``), then every stripe
it should hold (live, snapshot, optimizer state) from its ready peers, the newest version winning
(what they freed meanwhile is dropped), then the push bookkeeping of those stripes that it lacks
(an index of each peer's first: ``pull_records``); it logs its
progress and shows it in heartbeats (``work``). A rebalance pulls the stripes a new membership gives a node the same
way (``pull_stripes`` with ``strict``), and the hand-over fetches single stripes
(``fetch_stripe``). What ``pull_stripes`` takes, from whom, and what each outcome means are
server/resyncplan.py's rules (pure); this module makes the calls and the store's changes.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

import trio

from ..held import extent_end
from ..errors import AccessError, NodeDown, RemoteError, TransportError
from ..runtime.notify import notify
from ..progress import Progress
from ..util import single_exception
from .core import NodeCore
from .meta import Meta
from .missing import Missing
from .resyncplan import Fetch, PullPlan, StripePull, Tally
from .rounds import RecordError, StripeTraining
from .records import RECORDS_PAGE, PushRecords
from .updates import StripeKey

FETCHES = 8  # stripes fetched at once (a resync, a hand-over's catch-up): a GB's 1 MiB stripes one by one took tens of seconds
LOOKS = 3  # a stripe's key asked for this many times at most while its region goes before the read (fetch_stripe)
MOVED_LOOKS = 20  # ... and while a trained stripe's version moves between the answer and the read
RECORD_KEYS = 4096  # records asked for in one train_records call at most (the request's size)

log = logging.getLogger(__name__)


class Resync:
    def __init__(self, core: NodeCore, records: PushRecords, meta: Callable[[], Meta], restore_meta: Callable[..., None], missing: Missing):
        """``missing``: where a resync records the written stripes of this node that it ended
        without (missing.py: their reads get EIO, never zeros)."""
        self.name, self.cfg, self.cluster, self.store, self.stripe_locks, self.serving = core
        self.records, self.meta, self.restore_meta, self.missing = records, meta, restore_meta, missing
        self.work: dict = {}  # long work under way (resync, rebalance): shown by heartbeats

    async def resync(self) -> None:
        """Take the namespace and every stripe this node should hold from its peers.

        A stripe listed newer on a peer than here but not fetched fails the resync (it begins
        again): a node that said ready without it served zeros or old bytes for it (found by
        scripts/chaos.py, when its peers refused the fetches). It resyncs from every other
        member that answers, ready or still syncing, but not one the view expelled (it may hold what it applied and never got acknowledged), the newest copy
        winning.
        After a coordinator outage every node fenced at once: the first back, resyncing
        from ready peers alone, found none, led with what it held, and its copy, older than one
        a still-syncing peer held (it had been expelled before the outage), was given versions
        of the new epoch that then won everywhere (fault simulator, mixed seed 48)."""
        ready = [n for n in self.cluster.roles.ready() if n != self.name]
        t0 = time.monotonic()
        primary = self.cluster.roles.meta_primary()
        if primary is not None and primary != self.name and primary in ready:
            self.restore_meta(await self.cluster.call(primary, "meta_snapshot", {"whole": True}), whole=True)
        peers = [n for n in self.cluster.roles.members.names if n != self.name and n not in self.cluster.roles.view.expelled]
        live = set(peers) | {self.name}

        def mine(fid: int, idx: int) -> bool:
            return self.name in [n for n in self.cluster.roles.stripe_rank(fid, idx) if n in live][: self.cluster.roles.members.replicas]

        await self.pull_stripes("resync", peers, mine, converge=True, newer_or_fail=True)
        self.missing.found(mine)
        await self.pull_records(peers, mine)
        log.info("resync of node %s done in %.2fs", self.name, time.monotonic() - t0)

    async def pull_records(self, peers: list[str], mine: Callable[[int, int], bool]) -> None:
        """The push bookkeeping of the stripes this node holds, from its peers: a node that
        becomes a stripe's primary again must know how many pushes each rank made.

        A model of GBs in the middle of a bsp round holds its gradients' sums in its records,
        hundreds of MB on each peer. Fetched whole (base64, page by page) they took 14 s of a
        resync under a 1 GiB model, while a node still named by the view answered EAGAIN for its
        stripes and its heartbeats showed no progress, so pushes waiting on it timed out (chaos
        --model-gib 1, seed 125172). So each peer is asked first for an index (``train_index``:
        each record's stamp and push count, no arrays), and only the records
        ``Training.take_records`` would take are fetched (of a stripe this node holds at the
        record's stamp, with more pushes than its own record), each from the peer with the most,
        at most ``RECORDS_PAGE`` bytes of arrays a call. A peer lost meanwhile leaves its keys to
        the next best. Its progress shows in heartbeats (``work``), so waits on this node last
        while it moves (runtime/silence.py)."""
        wanted: dict[tuple[int, int], list[tuple[int, str]]] = {}  # key -> [(progress, peer)], most first
        sizes: dict[tuple[int, int], int] = {}
        for peer in peers:
            try:
                index = [(int(f), int(i), tuple(s) if s else None, int(p), int(b)) for f, i, s, p, b in (await self.cluster.call(peer, "train_index"))["index"]]
            except (NodeDown, RemoteError) as exc:
                log.warning("resync: no training records from %s: %s", peer, exc)
                continue
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("resync: the record index of %s is malformed (%s): none taken from it", peer, exc)
                continue
            for fid, idx, stamp, progress, nbytes in index:
                if mine(fid, idx) and self.records.would_take(fid, idx, stamp, progress):
                    wanted.setdefault((fid, idx), []).append((progress, peer))
                    sizes[(fid, idx)] = max(sizes.get((fid, idx), 0), nbytes)
        for offers in wanted.values():
            offers.sort(key=lambda o: -o[0])  # stable: of equal counts, the first peer's
        self.work = {"what": "resync records", "done": 0, "total": len(wanted), "bytes": 0}
        try:
            while wanted:
                by_peer: dict[str, list[tuple[int, int]]] = {}
                for key, offers in wanted.items():
                    by_peer.setdefault(offers[0][1], []).append(key)
                lost = set()
                for peer, keys in by_peer.items():
                    try:
                        for batch in _batches(sorted(keys), sizes, RECORDS_PAGE, RECORD_KEYS):
                            await self._records_of(peer, batch, mine)
                            for key in batch:
                                del wanted[key]
                            self.work.update(done=self.work["done"] + len(batch), bytes=self.work["bytes"] + sum(sizes[k] for k in batch))
                    except (NodeDown, RemoteError) as exc:
                        log.warning("resync: training records from %s not all taken: %s", peer, exc)
                        lost.add(peer)
                for key in list(wanted):
                    wanted[key] = [o for o in wanted[key] if o[1] not in lost]
                    if not wanted[key]:
                        del wanted[key]
        finally:
            self.work = {}

    async def _records_of(self, peer: str, keys: list[tuple[int, int]], mine: Callable[[int, int], bool]) -> None:
        """The records of ``keys`` from ``peer``, taken (``train_records``, page by page)."""
        after = None
        while True:
            page = await self.cluster.call(peer, "train_records", {"keys": [list(k) for k in keys], "after": after})
            await self.records.take_records(page["records"], mine)
            after = page.get("next")
            if not after:
                return

    def _in_extent(self, fid: int, idx: int, snap: int) -> bool:
        """Whether stripe ``idx`` of file ``fid`` holds bytes of the file as the namespace says:
        inside its size, before a model's tensors' start (``setmodel`` drops the stripes past
        it, with no cut), in snapshot ``snap``'s view for a snapshot's copy (False for a snapshot
        gone). Never for optimizer state (snapshots -1, -2): it goes with its step's record,
        which a resync takes from the peers."""
        meta = self.meta()
        if snap < 0 or (snap > 0 and snap not in meta.snapshot_ids().values()):
            return False
        node = meta.view(snap).inodes.get(fid)
        if not node or not node.get("unit"):
            return False
        return idx * node["unit"] < extent_end(node)

    async def pull_stripes(self, what: str, peers: list[str], mine, *, strict: bool = False, converge: bool = False, newer_or_fail: bool = False) -> dict:
        """Fetch, from ``peers``, the newest copy of every stripe (live, snapshot, optimizer
        state) for which ``mine(fid, idx)`` holds and that this node lacks or holds older. With
        ``strict``, a peer that cannot be listed or a stripe that cannot be fetched is an error
        (a rebalance must not switch over without every copy); otherwise it is logged. A stripe
        that every peer holding its newest copy has freed meanwhile (a namespace op: unlink,
        truncate) has nothing to copy, and this node's copy of it goes too (``_drop_freed``).

        With ``converge`` (a resync: this node was away, its ready peers hold the truth), a
        stripe of this node that its peers hold at a *lower* version is replaced by theirs,
        and one that no home peer holds any more is dropped, unless it changed since the
        listing (a write replicated here meanwhile) or still holds bytes of its file
        (``_in_extent``: then the homes that lack it lost it). A stripe freed by a truncate this node
        missed and then written again starts over at version 1 on its peers: keeping the old
        copy because its version is higher would serve old bytes (found by scripts/chaos.py).
        Never theirs from an older epoch than this node's copy, though: that is a copy
        a stand-in was left with, and an acknowledged version would go back (fault simulator,
        mixed seed 15, once resyncs listed syncing peers too).

        With ``newer_or_fail``, a stripe listed newer on a peer than here that no holder gave is
        an error (EAGAIN) once every stripe was tried, whatever ``strict`` says of the rest.

        Answers how many stripes it tried and their bytes; ``fetched``, the keys it copied, and
        ``listed``, every key a peer listed (a rebalance's pre-copy: membership.py)."""
        before = {key: s.stamp for key, s in self.store.stripes.items()} if converge else {}
        plan = PullPlan(what, strict=strict, converge=converge, newer_or_fail=newer_or_fail)
        await self._list_peers(plan, peers)
        todo = self._choose(plan, mine, before)
        if converge:
            self._drop_gone(plan, before)
        tally = await self._fetch_all(plan, todo, len(peers))
        error = plan.verdict()
        if error is not None:
            raise error
        return {"stripes": len(todo), "bytes": tally.bytes, "fetched": plan.fetched, "listed": plan.newest.keys()}

    async def _list_peers(self, plan: PullPlan, peers: list[str]) -> None:
        """Each peer's listing of its stripes, into ``plan``."""
        for peer in peers:
            try:
                answer = await self.cluster.call(peer, "stripes")
                listing = answer["stripes"]
            except (NodeDown, RemoteError) as exc:
                error = plan.unlisted(peer, exc)
                if error is not None:
                    raise error from None
                log.warning("%s: cannot list %s: %s", plan.what, peer, exc)
                continue
            plan.took(peer, listing, bool(answer.get("complete")))

    def _held(self, key: tuple[int, int, int]) -> tuple[int, int] | None:
        stripe = self.store.get(*key)
        return stripe.stamp if stripe is not None else None

    def _choose(self, plan: PullPlan, mine, before: dict) -> list[Fetch]:
        """The stripes to fetch, as ``plan`` chooses them from what this node holds now."""
        live_files = self.meta().files()
        files = {0: live_files, -1: live_files, -2: live_files} | {sid: self.meta().view(sid).files() for sid in self.meta().snapshot_ids().values()}
        todo = plan.todo(self._held, files, mine, before, self.serving.led, self.serving.suspect_since)
        for item in todo:
            if item.instead is not None:
                log.info(
                    "%s: stripe %d:%d (snapshot %d) is at %s here (led here before the fence), %s on its peers: taking theirs",
                    plan.what,
                    item.fid,
                    item.idx,
                    item.snap,
                    item.had,
                    plan.newest[(item.fid, item.idx, item.snap)][0],
                )
        return todo

    def _drop_gone(self, plan: PullPlan, before: dict) -> None:
        """(converge) Drop this node's stripes that every other home freed while it was away."""
        replicas = self.cluster.roles.members.replicas
        gone, kept = plan.freed(self.name, before, self._held, lambda fid, idx: self.cluster.roles.stripe_rank(fid, idx)[:replicas], self._in_extent_of)
        for key in kept:
            log.warning("%s: stripe %d:%d (snapshot %d) is held by no other home; kept here", plan.what, *key)
        if gone:
            log.info("%s: %d stripes freed on every peer while this node was away: dropped here", plan.what, len(gone))
            self.store.drop_keys(gone)

    def _in_extent_of(self, key: tuple[int, int, int]) -> bool:
        return self._in_extent(*key)

    async def _fetch_all(self, plan: PullPlan, todo: list[Fetch], peers: int) -> Tally:
        """Fetch every stripe of ``todo``, FETCHES at once, each from its holders in turn; its
        progress in ``work`` (heartbeats), a bar in a terminal, else a log line a second."""
        what = plan.what
        total_bytes = sum(t.cap for t in todo)
        log.info("%s: %d stripes (%d bytes) to fetch from %d peers", what, len(todo), total_bytes, peers)
        tally = Tally(len(todo), total_bytes, time.monotonic())
        self.work = {"what": what, "done": 0, "total": len(todo), "bytes": 0, "total_bytes": total_bytes}
        bar = Progress(what, total_bytes, unit="B") if sys.stderr.isatty() and todo else None  # in a terminal
        fetching = trio.CapacityLimiter(FETCHES)

        async def one(item: Fetch) -> None:
            pull = StripePull(item)
            async with fetching:
                while (peer := pull.next()) is not None:
                    pull.outcome(await self.fetch_stripe(item.fid, item.idx, item.snap, peer, item.instead))
            end = plan.settle(pull)
            if end.drop:
                await self._drop_freed(item.fid, item.idx, item.snap, item.had)
            if end.error is not None:
                raise end.error
            tally.count(item.cap)
            self.work.update(done=tally.stripes, bytes=tally.bytes)
            if bar is not None:
                bar.update(tally.bytes)
            elif tally.due(time.monotonic()):
                log.info("%s: %d/%d stripes, %d/%d bytes", what, tally.stripes, len(todo), tally.bytes, total_bytes)
                notify(f"STATUS={what} {tally.stripes}/{len(todo)} stripes")

        try:
            with single_exception(RemoteError):  # strict: one stripe's EAGAIN is the answer
                async with trio.open_nursery() as n:
                    for item in todo:
                        n.start_soon(one, item)
        finally:
            self.work = {}
            if bar is not None:
                bar.close()
        return tally

    async def _drop_freed(self, fid: int, idx: int, snap: int, had: tuple[int, int]) -> None:
        """Every holder of a stripe's newest copy freed it after the listing (a truncate, an
        unlink, which this node, syncing, did not get): this node's copy, older or one it led
        before a fence, is of what was freed, and goes too unless it changed since the listing.
        Kept, it came back as the file grew again: the write landed on it and the range before
        the written one read back the old bytes (scripts/chaos.py --views, seed 1)."""
        async with self.stripe_locks((fid, idx)):
            held = self.store.get(fid, idx, snap)
            if held is not None and held.stamp == had:
                log.info("stripe %d:%d (snapshot %d) freed on its peers while it was fetched: dropped here too", fid, idx, snap)
                self.store.drop_keys([(fid, idx, snap)])
                if snap == 0:
                    self.records.drop_record(fid, idx)

    async def fetch_stripe(self, fid: int, idx: int, snap: int, peer: str, instead: tuple[int, int] | None = None) -> bool | None:
        """Copy one stripe from ``peer`` unless this node holds it as new: True once done, None
        if ``peer`` no longer holds it (freed; a region freed between its key and the read is
        asked for again), False if the copy failed. ``instead``: replace
        this node's copy whatever its stamp, if it is still at that stamp (a resync taking its
        peers' copy of what it led before a fence), its push bookkeeping with it."""
        gone = moved = 0  # keys found freed before the read; trained bytes that moved under it
        while True:
            try:
                reply, inc = await self.cluster.call_on(peer, "stripe_info", {"fid": fid, "idxs": [idx], "snap": snap, "resync": True})
                info = reply[str(idx)]
                if info is None:
                    log.info("stripe %d:%d (snapshot %d) is gone from %s (freed meanwhile)", fid, idx, snap, peer)
                    return None
                buf = bytearray(info["capacity"])
                head = await self.cluster.peers.read_stripe(peer, info["rkey"], 0, memoryview(buf), inc)
                record = StripeTraining.from_record(info["record"]) if snap == 0 and info.get("record") else None
                if record is None or head.version == info["version"]:
                    break
                # a trained stripe's bytes moved on between the answer and the read: the record
                # that came with the answer is not theirs (it goes with the bytes:
                # Training.take_fetched). Bytes without one are taken at any version (a file
                # rewritten every few ms failed three reads in a row and the resync with them)
                moved += 1
                if moved >= MOVED_LOOKS:
                    log.warning("stripe %d:%d from %s changed under its read %d times", fid, idx, peer, moved)
                    return False
            except RecordError as exc:
                log.warning("stripe %d:%d from %s: its push bookkeeping is not a record: %s", fid, idx, peer, exc)
                return False
            except AccessError as exc:
                # its region went between the key and the read: a snapshot dropped, a stripe
                # grown or copied on write (its old key freed). Ask again: gone, or a new key.
                # (Taken as a failed copy, a snapshot dropped mid-resync, as a training job's
                # rolling snapshots are every few seconds, failed the whole resync again and
                # again: 77 s for a node stopped 1.3 s, 1 GiB chaos soak.)
                gone += 1
                if gone >= LOOKS:
                    log.warning("stripe %d:%d from %s failed %d times: %s", fid, idx, peer, LOOKS, exc)
                    return False
            except (TransportError, RemoteError) as exc:
                log.warning("stripe %d:%d from %s failed: %s", fid, idx, peer, exc)
                return False
        async with self.stripe_locks((fid, idx)):
            mine = self.store.get(fid, idx, snap)
            theirs = (info.get("tag", 0), head.version)
            if (instead is not None and mine is not None and mine.stamp == instead) or mine is None or mine.stamp < theirs:
                # (else replication brought newer meanwhile.) Its push bookkeeping goes with the
                # bytes: the peer's comes with theirs. The same stamp is the same version of the
                # same primary, and its bookkeeping is kept (after a coordinator outage two
                # fenced nodes each took the other's copy; both dropped their records, and a
                # stand-in's old count won: fault simulator, mixed seed 92).
                if snap == 0 and (mine is None or mine.stamp != theirs):
                    self.records.take_fetched(fid, idx, record)
                self.store.replace(StripeKey(fid, idx, snap), memoryview(buf), 2 * self.cfg.stripe_unit, theirs, head.clock_word)
        return True


def _batches(keys: list, sizes: dict, limit: int, count: int):
    """``keys`` in runs of at most ``limit`` bytes (by ``sizes``) and ``count`` keys, each run
    at least one key."""
    run: list = []
    size = 0
    for key in keys:
        if run and (size + sizes[key] > limit or len(run) >= count):
            yield run
            run, size = [], 0
        run.append(key)
        size += sizes[key]
    if run:
        yield run

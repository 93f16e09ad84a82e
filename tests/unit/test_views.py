"""Views and leases (irdmafs/coord/views.py): rules V1-V6, on the in-memory model with trio's
MockClock, then under seeded fault schedules with one invariant checked at every tick: a node
that serves is named, with the lease it holds, by the view committed in the store, and one that
view marks expelled stops within a ttl."""

import os
import random

import pytest
import trio

from irdmafs.config import Members, NodeSpec
from irdmafs.errors import LeaseGone
from irdmafs.coord.memory import MemoryCoord
from irdmafs.coord.views import View, ViewKeeper, ViewReader

NAMES = ["n1", "n2", "n3"]
TTL = 2


def members(names, replicas=2) -> Members:
    return Members(tuple(NodeSpec(n, "host", 0) for n in names), replicas)


class Fleet:
    """Keepers of one cluster in one process; each can be paused (SIGSTOP) and resumed."""

    def __init__(self, coord, nursery, names=NAMES, configs=None, replicas=2):
        """``configs``: node -> the members its config names (default: ``names`` for all)."""
        self.coord = coord
        self.nursery = nursery
        configs = configs or {n: names for n in names}
        self.keepers = {n: ViewKeeper(coord, "c", n, lambda m=members(configs[n], replicas): m, ttl=TTL) for n in names}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.violations: list[str] = []
        self._committed = View()
        self.expelled_since: dict[tuple[str, int], float] = {}  # (node, lease) -> when first seen expelled

    async def start(self, name):
        scope = trio.CancelScope()
        self.scopes[name] = scope

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                async with trio.open_nursery() as n:
                    k = self.keepers[name]
                    n.start_soon(k.keep_lease)
                    n.start_soon(k.keep_views)
                    n.start_soon(self._announcer, k)
                    task_status.started()

        await self.nursery.start(run)

    async def _announcer(self, k):
        """A node announces itself whenever it holds a lease and is not announced (as a node
        does after its resync)."""
        while True:
            if k.lease.held() and not k.announced:
                try:
                    await k.announce()
                except Exception:
                    pass
            await trio.sleep(k.interval)

    def pause(self, name):
        self.scopes.pop(name).cancel()

    def committed(self) -> View:
        e = self.coord.keys.get("/irdmafs/c/view")
        if e is None:
            return View()
        if self._committed.epoch != e.mod_revision:
            self._committed = View.decode(e.value, e.mod_revision)
        return self._committed

    async def watch(self):
        """The safety invariant, checked every 10 ms of (mock) time."""
        while True:
            committed = self.committed()
            now = trio.current_time()
            for name in committed.expelled:
                self.expelled_since.setdefault((name, committed.lease_of(name)), now)
            for name, k in self.keepers.items():
                if name in self.scopes and k.serving() and committed.lease_of(name) != k.lease.id:
                    self.violations.append(f"t={now:.2f}: {name} serves under lease {k.lease.id:x}, view {committed}")
                since = self.expelled_since.get((name, k.lease.id))
                if name in self.scopes and k.serving() and since is not None and now - since > TTL:
                    self.violations.append(f"t={now:.2f}: {name} still serves {now - since:.2f}s after it was expelled")
            await trio.sleep(0.01)

    async def all_serving(self, timeout=30):
        with trio.fail_after(timeout):
            while not all(k.serving() for n, k in self.keepers.items() if n in self.scopes):
                await trio.sleep(0.05)


@pytest.fixture
async def fleet(nursery):
    f = Fleet(MemoryCoord(), nursery)
    nursery.start_soon(f.watch)
    for n in NAMES:
        await f.start(n)
    yield f
    assert f.violations == []


async def test_views_form_one_chain_and_name_every_alive_node(autojump_clock, fleet):
    """V1: every node serving, one view naming all three; epochs only grow."""
    await fleet.all_serving()
    view = fleet.committed()
    assert view.names == tuple(NAMES)
    assert view.epoch == fleet.coord.keys["/irdmafs/c/view"].mod_revision
    await trio.sleep(TTL / 2)  # every keeper reads the view once more
    assert all(k.view == view for k in fleet.keepers.values())
    for name, k in fleet.keepers.items():
        assert view.lease_of(name) == k.lease.id


async def test_a_stopped_node_is_dropped_only_after_its_lease_ended(autojump_clock, fleet):
    """V2, V3: n3 stops (SIGSTOP): the view keeps it until its lease has run out and ttl more;
    when it runs again it does not serve before it has been named again with a new lease."""
    await fleet.all_serving()
    k3 = fleet.keepers["n3"]
    old_lease, stopped_at = k3.lease.id, trio.current_time()
    fleet.pause("n3")
    with trio.fail_after(20):
        while "n3" in fleet.committed().names:
            await trio.sleep(0.05)
    dropped_at = trio.current_time()
    assert dropped_at - stopped_at >= TTL  # its own count ended by stopped_at + TTL at the latest
    assert not k3.serving()  # the moment it runs again, by its own clock
    await fleet.start("n3")
    await fleet.all_serving()
    assert k3.lease.id != old_lease and fleet.committed().lease_of("n3") == k3.lease.id
    assert fleet.committed().epoch > 0


async def test_while_the_coordinator_is_unreachable_nodes_serve_until_their_leases_end(autojump_clock, fleet):
    """V5: no new view while etcd is down; nodes stop when their leases end; afterwards they
    take new leases and a new view names them."""
    await fleet.all_serving()
    before = fleet.committed()
    fleet.coord.down = True
    down_at = trio.current_time()
    await trio.sleep(TTL / 2)
    assert all(k.serving() for k in fleet.keepers.values())
    await trio.sleep(TTL)
    assert not any(k.serving() for k in fleet.keepers.values())
    assert fleet.committed() == before
    assert all(k.reader.unreachable_since <= down_at + TTL / 4 for k in fleet.keepers.values())
    fleet.coord.down = False
    await fleet.all_serving()
    after = fleet.committed()
    assert after.epoch > before.epoch
    assert all(after.lease_of(n) != before.lease_of(n) for n in NAMES)


async def test_an_expelled_node_stops_before_the_view_drops_it(autojump_clock, fleet):
    """V6, V2: n1 commits a view expelling n2 and revokes its lease: n2 is not active at once,
    stops serving within a ttl, and comes back under a new lease, not expelled, as soon as it
    announces it (not a ttl after its old key went: a restarted node stayed named under its old
    lease, refusing the writes its stripes needed, for as long as the ttl)."""
    await fleet.all_serving()
    k2 = fleet.keepers["n2"]
    old_lease = k2.lease.id
    expelled_at = trio.current_time()
    with trio.fail_after(TTL):  # False while n1 holds an older view than the newest (it reads it then)
        while not await fleet.keepers["n1"].expel("n2"):
            await trio.sleep(0.01)
    assert fleet.committed().active == ("n1", "n3") and fleet.committed().expelled == ("n2",)
    assert fleet.keepers["n1"].view == fleet.committed()
    assert not await fleet.keepers["n1"].expel("n2")  # not active any more: nothing to do
    with trio.fail_after(TTL):
        while k2.serving() and k2.lease.id == old_lease:
            await trio.sleep(0.01)
    with trio.fail_after(20):
        while fleet.committed().lease_of("n2") == old_lease:
            await trio.sleep(0.01)
    assert fleet.committed().lease_of("n2") == k2.lease.id != old_lease
    assert trio.current_time() - expelled_at < TTL
    await fleet.all_serving()
    assert fleet.committed().lease_of("n2") == k2.lease.id != old_lease
    assert fleet.committed().expelled == ()


async def test_two_nodes_expelling_each_other_expel_one(autojump_clock, fleet):
    """V6: n1 and n2 each try to expel the other from the same view: one CAS wins, the other
    finds itself expelled and cannot expel anyone."""
    await fleet.all_serving()
    k1, k2 = fleet.keepers["n1"], fleet.keepers["n2"]
    with trio.fail_after(2 * TTL):  # both try again while a third view (or an older one held) beats them
        while not fleet.committed().expelled:
            async with trio.open_nursery() as n:
                n.start_soon(k1.expel, "n2")
                n.start_soon(k2.expel, "n1")
            await trio.sleep(0.01)
    view = fleet.committed()
    assert len(view.expelled) == 1 and view.expelled[0] in ("n1", "n2")
    loser = fleet.keepers[view.expelled[0]]
    with trio.fail_after(TTL):  # it stops at once if it lost the CAS, else when it reads the view
        while loser.serving():
            await trio.sleep(0.01)
    await fleet.all_serving()
    assert fleet.committed().expelled == ()


async def test_a_lost_lease_must_be_announced_again(autojump_clock, fleet):
    """V4: a node whose lease ended serves nothing until a view names its new lease."""
    await fleet.all_serving()
    k1 = fleet.keepers["n1"]
    old_lease = k1.lease.id
    await fleet.coord.revoke(old_lease)
    with trio.fail_after(TTL):  # its next keepalive finds the lease gone; it takes a new one
        while k1.lease.id in (old_lease, 0):
            await trio.sleep(0.01)
    # that it serves under the new one only once a view names it: the fixture's watch, every tick
    await fleet.all_serving()
    assert fleet.committed().lease_of("n1") == k1.lease.id
    with pytest.raises(LeaseGone):  # a keeper that holds no lease cannot say it is alive
        await ViewKeeper(fleet.coord, "c", "n4", lambda: members(NAMES), ttl=TTL).announce()


async def test_racing_proposers_make_one_chain(autojump_clock):
    """V1: two proposals from one epoch: one commits, the other fails and changes nothing."""
    coord = MemoryCoord()
    a = ViewKeeper(coord, "c", "n1", lambda: members(NAMES), ttl=TTL)
    b = ViewKeeper(coord, "c", "n2", lambda: members(NAMES), ttl=TTL)
    for k in (a, b):
        k.lease.id, k.lease.until = await coord.grant(TTL), trio.current_time() + TTL
        await k.announce()
    view, alive = await ViewReader(coord, "c").read()
    first = await a.propose(view, alive)
    revision = coord.revision
    second = await b.propose(view, alive)  # from the same (now old) epoch
    assert first.epoch > 0 and first.names == ("n1", "n2")
    assert coord.revision == revision and second.epoch != first.epoch  # b's CAS failed and wrote nothing
    committed = await coord.get("/irdmafs/c/view")
    assert committed.mod_revision == first.epoch
    assert View.decode(committed.value, committed.mod_revision) == first


async def test_a_node_started_for_a_rebalance_is_named_and_stays_named(autojump_clock, nursery):
    """V2 with configs that differ, as during a rebalance: n3, started with the new config,
    names itself; n1 and n2, still on the old one, neither add it nor drop it while its lease
    lives. Before, they dropped it at once and it named itself again: views flapped and n3 was
    fenced at each, so ``irdmafs rebalance`` found it not ready (CI, test_rebalance)."""
    old = ["n1", "n2"]
    f = Fleet(MemoryCoord(), nursery, configs={"n1": old, "n2": old, "n3": NAMES})
    nursery.start_soon(f.watch)
    for n in NAMES:
        await f.start(n)
    await f.all_serving()
    settled = f.committed()
    assert settled.active == tuple(NAMES)
    k3 = f.keepers["n3"]
    with trio.move_on_after(10 * TTL):
        while k3.serving():
            await trio.sleep(0.01)
    assert k3.serving(), f"n3 stopped serving in view {f.committed()}"
    assert f.committed() == settled  # no view since: nobody dropped it
    # n3 stops: the old members drop it by the alive-key rule, a ttl after its lease
    f.pause("n3")
    with trio.fail_after(4 * TTL):
        while "n3" in f.committed().names:
            await trio.sleep(0.05)
    assert f.violations == []


async def test_an_expel_counts_a_majority_of_the_members_only(autojump_clock):
    """V6 with a non-member named (a node started for a rebalance): n1 and n2 are the members,
    so n1 may not expel n2 though three nodes are active (one of two is no majority)."""
    coord = MemoryCoord()
    old = ["n1", "n2"]
    keepers = [ViewKeeper(coord, "c", n, lambda m=members(m): m, ttl=TTL) for n, m in (("n1", old), ("n2", old), ("n3", NAMES))]
    for k in keepers:
        k.lease.id, k.lease.until = await coord.grant(TTL), trio.current_time() + TTL
        await k.announce()
    view = await keepers[2].propose(*await ViewReader(coord, "c").read())
    assert view.active == tuple(NAMES)
    k1 = keepers[0]
    k1.reader.learn(view)
    assert k1.serving()
    assert not await k1.expel("n2")
    assert (await ViewReader(coord, "c").read())[0].expelled == ()


# six seeds in the quick suite, thirty in the long one (scripts/test --long, CI)
SEEDS = range(30 if os.environ.get("IRDMAFS_LONG") == "1" else 6)


@pytest.mark.parametrize("seed", SEEDS)
async def test_fault_schedules_never_let_a_dropped_node_serve(autojump_clock, nursery, seed):
    """Seeded schedules of pauses, resumes and coordinator outages; the invariant is checked
    every tick (the fixture's watch), and after healing every node serves again."""
    rnd = random.Random(seed)
    f = Fleet(MemoryCoord(), nursery)
    nursery.start_soon(f.watch)
    for n in NAMES:
        await f.start(n)
    paused: set[str] = set()
    for _ in range(40):
        await trio.sleep(rnd.uniform(0.05, 2.5 * TTL))
        kind = rnd.choice(["pause", "resume", "coord", "expel"])
        if kind == "pause" and len(paused) < 2:
            name = rnd.choice([n for n in NAMES if n not in paused])
            f.pause(name)
            paused.add(name)
        elif kind == "resume" and paused:
            name = rnd.choice(sorted(paused))
            await f.start(name)
            paused.discard(name)
        elif kind == "coord":
            f.coord.down = not f.coord.down
        elif kind == "expel":
            a, b = rnd.sample(NAMES, 2)
            if a not in paused and not f.coord.down:
                await f.keepers[a].expel(b)
    f.coord.down = False
    for name in sorted(paused):
        await f.start(name)
    await f.all_serving(timeout=60)
    assert f.violations == []
    assert fleet_names_all(f)


def fleet_names_all(f: Fleet) -> bool:
    view = f.committed()
    return all(view.lease_of(n) == k.lease.id for n, k in f.keepers.items())


@pytest.mark.parametrize("replicas", [1, 2, 3])
async def test_a_view_never_drops_more_than_r_minus_1_active_members(autojump_clock, nursery, replicas):
    """V7: every lease ends in a coordinator outage longer than the TTL; n2 and n3 stay
    stopped, so only n1 is announced again. The views name n1 under its new lease, but drop
    at most R-1 of the three: those kept stay named under their ended leases (their stripes
    unavailable, not led by n1, which never held them). Once they are back, the view names
    all three under their new leases."""
    f = Fleet(MemoryCoord(), nursery, replicas=replicas)
    nursery.start_soon(f.watch)
    for n in NAMES:
        await f.start(n)
    await f.all_serving()
    before = f.committed()
    f.coord.down = True
    await trio.sleep(2 * TTL)  # every lease ends
    f.pause("n2")
    f.pause("n3")
    f.coord.down = False
    k1 = f.keepers["n1"]
    with trio.fail_after(10 * TTL):
        while not k1.serving():
            await trio.sleep(0.05)
    await trio.sleep(5 * TTL)  # long past V2's ttl: whatever may be dropped has been
    view = f.committed()
    assert view.lease_of("n1") == k1.lease.id != before.lease_of("n1")
    assert len(view.active) == 3 - (replicas - 1)
    assert all(view.lease_of(n) == before.lease_of(n) for n in view.active if n != "n1")
    await f.start("n2")
    await f.start("n3")
    await f.all_serving()
    assert fleet_names_all(f)
    assert f.violations == []


async def test_an_expel_with_one_replica_is_refused(autojump_clock, nursery):
    """V7 for V6: with R=1 an expelled node's stripes would have no copy left."""
    f = Fleet(MemoryCoord(), nursery, replicas=1)
    for n in NAMES:
        await f.start(n)
    await f.all_serving()
    assert not await f.keepers["n1"].expel("n2")
    assert f.committed().expelled == ()

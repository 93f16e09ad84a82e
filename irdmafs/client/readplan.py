"""Whom a read of one stripe piece asks, what it waits for, and when it gives up: the replica
choice and retry rules of ``StripeIO._read_piece`` (client/stripe.py) as a state machine.

``ReadPlan`` takes what happened (the candidates the view names, a key a node gave, a clock
reached, a header read, a failure, a wait over) and answers the next ``Action``: look at the
candidates, check the key cache, ask a node for its key, wait for its clock, read it, wait for
the view to change, or end (``Done``: the bytes, or a hole; ``Fail``: EIO with its log line;
``Reraise``: the failure as it came). ``StripeIO`` performs each action and feeds back its
outcome; every action answered leads to exactly one next action.

The rules, with the reasons stripe.py's comments and docs/reliability.md give:

- **Order.** The candidates in the view's order (``Roles.read_candidates``), less those that
  answered "a hole here" (missing), "lost here" (gone: for the whole read), could not be reached
  (down) or are resyncing (EAGAIN: syncing), the ones whose clock did not move while waited on
  (behind) last, in the order they fell behind.
- **Keys.** A node's key is asked for when none is cached, or when the cached one is of another
  lease and this read did not ask for it itself; one cached past the piece's end, and not
  asked for here, is dropped and asked for again (the stripe may have grown). A key gone stale
  (AccessError) is dropped and asked for again, 10 times at most; the 11th is raised.
- **Clocks.** A pull waits for a node's clock (and, settled, its pending flag) before reading,
  unless the stripe is likely there already (``eager``): then it reads at once and waits only
  if the header it read is behind, reading once more after that.
- **A hole only when every home said so.** Zeros only when every home the view names active
  (every home, when none is) answered "a hole here"; a home that lost a stripe that holds bytes
  is never a hole: EIO naming it once every home answered, while another home may still come
  back with it the read waits.
- **Unavailable.** With no candidate left the read waits for the view (a short sleep and a
  heartbeat round for the first op timeout, then changes the heartbeats see) and asks every
  node again; it gives up (EIO) once ``op_timeout`` passed with none left, counted from the
  moment none was left after a node last answered (a key, a header: ``heard``), and given its
  ``op_timeout`` again whenever a resyncing node reports progress (its heartbeat's ``work``).
- **Torn reads** (writes keep landing): read again after 10 ms until ``op_timeout`` from the
  read's start, then raised. Never a hole.
- Any other refusal (a RemoteError but EAGAIN) is raised as it came.

Pure: no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import Unavailable


class Key(NamedTuple):
    """Where a node holds a stripe, as its ``stripe_info`` said: for one-sided reads."""

    rkey: int
    capacity: int
    inc: int  # the incarnation of the node that gave it (StaleKey once it restarted)
    lease: int  # the coordination lease it served under


class Lost(NamedTuple):
    """A node's word that it should hold a stripe that holds bytes and does not (it came back
    without it: server/missing.py). Never read as a hole: the read asks the other homes, and
    says EIO naming the stripe and the node if none holds it."""

    why: str


Entry = Key | Lost | None  # what a node's stripe_info said of a stripe (None: a hole there)

# -- actions: what the driver does next (each a type of its own: equal only to its like) --------


@dataclass(frozen=True, slots=True)
class Look:
    """Answer ``candidates`` with the nodes the view names for the stripe now."""


@dataclass(frozen=True, slots=True)
class Homes:
    """No candidate is left: answer ``homes`` with the stripe's homes and those named active."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait for the view: ``short``, 50 ms and a heartbeat round; else a change the heartbeats
    see (at most 0.5 s). Then answer ``waited`` with what each node of ``heed`` reports of its
    work."""

    short: bool
    heed: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Check:
    """Answer ``cached`` with what the key cache holds for ``node``."""

    node: str


@dataclass(frozen=True, slots=True)
class Lookup:
    """Ask ``node`` for its key (``stripe_info``); answer ``looked``, or ``failed``."""

    node: str


@dataclass(frozen=True, slots=True)
class Forget:
    """Drop the cached key of ``node``; answer ``forgot``."""

    node: str


@dataclass(frozen=True, slots=True)
class WaitClock:
    """Read ``node``'s header until its clock reaches ``min_clock`` (and, ``settled``, it is not
    pending), calling ``heard`` for each header it answers, for a clock slice at most (then
    ``failed(BEHIND)``) and never past ``deadline`` (trio.TooSlowError, the read's end); answer
    ``reached``, or ``failed``."""

    node: str
    key: Key
    min_clock: int
    settled: bool
    deadline: float


@dataclass(frozen=True, slots=True)
class Read:
    """Read ``k`` bytes of the piece from ``node`` (one-sided); answer ``got`` with the clock of
    the header read, or ``failed``."""

    node: str
    key: Key
    k: int


@dataclass(frozen=True, slots=True)
class Behind:
    """``node``'s clock did not move while waited on: tell the pusher (``on_behind``); answer
    ``told``."""

    node: str


@dataclass(frozen=True, slots=True)
class Pause:
    """The stripe kept changing on ``node``: say so (a warning), sleep ``seconds``; answer
    ``paused``."""

    node: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Done:
    """The end: the piece's first ``k`` bytes are read, the rest are zeros; ``record``: keep the
    last header read (the caller's ``clocks``)."""

    k: int
    record: bool


@dataclass(frozen=True, slots=True)
class Fail:
    """The end: log ``log`` (an error's format and arguments), raise ``error``."""

    error: Exception
    log: tuple


@dataclass(frozen=True, slots=True)
class Reraise:
    """The end: raise the failure last reported, as it came."""


Action = Look | Homes | Wait | Check | Lookup | Forget | WaitClock | Read | Behind | Pause | Done | Fail | Reraise

# -- failures a node's answer can be (``failed``) ---------------------------------------------

BEHIND = "behind"  # its clock did not reach the one waited for within a clock slice
STALE = "stale"  # AccessError: the key is no longer the stripe's (it moved, the node restarted)
DOWN = "down"  # NodeDown
REFUSED = "refused"  # RemoteError, with its code
TORN = "torn"  # TornRead: the stripe kept changing under the read

STALE_KEYS = 10  # stale keys a read looks up again; the next is raised
TORN_PAUSE = 0.01


class Want(NamedTuple):
    """What one plan reads: ``length`` bytes at ``offset`` of stripe ``idx`` of file ``fid``, once
    its clock is ``min_clock`` (and, ``settled``, not pending) within ``wait`` seconds."""

    fid: int
    idx: int
    offset: int
    length: int
    min_clock: int = 0
    settled: bool = False
    wait: float = 0.0


class ReadPlan:
    """One piece's read: ``start()``, then each action's answer in turn (see the module's
    docstring). ``now``: the clock of the caller (trio.current_time) at each event that needs
    it; ``op_timeout``: the bounds on no replica and on torn reads."""

    def __init__(self, piece: Want, now: float, op_timeout: float):
        self.piece = piece
        self.op_timeout = op_timeout
        self.missing: set[str] = set()  # homes that answered "a hole here"
        self.gone: dict[str, str] = {}  # homes that answered "lost here" (server/missing.py), and why
        self.lost: set[str] = set()  # replicas that could not be reached by this read
        self.syncing: set[str] = set()  # replicas that answered EAGAIN (resyncing): not trusted, not absent
        self.behind: list[str] = []  # replicas whose clock did not move while waited on: asked last
        self.looked_up: set[str] = set()  # nodes whose key this read asked for (not from the cache)
        self.stale_keys = 0
        self.torn_deadline = now + op_timeout  # a stripe that keeps changing (TornRead)
        self.clock_deadline = now + piece.wait
        # No replica to ask: counted from the moment none is left, not from the read's start,
        # and again each time a replica answered since (``reached``). A pull's read queued for
        # seconds behind a GB of others, its one home counted down for a second (a false alarm
        # of a busy mount) while the other resynced, ended in EIO at once; so did one that had
        # found no home for an instant, then waited seconds on a home's clock, which answered,
        # and lost it (1 GiB chaos soaks).
        self.unavailable: float | None = None  # the deadline on having no replica, once none is left
        self.none_since = 0.0
        self.seen: dict[str, Hashable] = {}  # what each syncing node last reported of its work
        self.reached = False  # the node last asked answered (a key, a header): a replica was there
        self.node = ""  # the node asked now
        self.key: Key | None = None
        self.k = 0  # bytes of the piece inside the stripe as ``key`` has it
        self.guess = False  # read at once, the clock checked in the same read (``eager``)
        self.again = False  # guessed wrong: waited, and read once more

    def start(self) -> Action:
        return Look()

    def heard(self) -> None:
        """The node asked answered (a key, a header): a replica was there."""
        self.reached = True

    # -- whom to ask ---------------------------------------------------------------------------
    def candidates(self, nodes: list[str]) -> Action:
        """``nodes``: the stripe's read candidates as the view names them now, in its order."""
        if self.reached:
            self.unavailable = None
        self.reached = False
        out = self.missing | self.lost | self.syncing | self.gone.keys()
        left = [c for c in nodes if c not in out]
        left.sort(key=lambda c: self.behind.index(c) + 1 if c in self.behind else 0)
        if not left:
            return Homes()
        self.node = left[0]
        return Check(self.node)

    def homes(self, now: float, every_home: list[str], active: list[str]) -> Action:
        """``every_home``: the stripe's homes (the first R of its ranking); ``active``: those the
        view names active (READY)."""
        fid, idx = self.piece.fid, self.piece.idx
        # the homes the view names active hold every acknowledged write
        homes = active or every_home
        said = self.missing | self.gone.keys()
        # a home that lost the stripe is no answer while another home may still come back with
        # it (syncing, down): that one is waited for below, as for EAGAIN
        if set(homes) <= said and (not self.gone or set(every_home) <= said):  # every home answered: nothing there
            if self.gone:  # ... but the stripe holds bytes that a home lost: never zeros
                why = "; ".join(f"{n}: {w}" for n, w in sorted(self.gone.items()))
                return Fail(Unavailable(f"stripe {idx} of file {fid}: lost ({why})"), ("stripe %d:%d: lost, no replica holds it (%s)", fid, idx, why))
            return Done(0, record=False)  # a hole
        if self.unavailable is None:
            self.unavailable, self.none_since, self.seen = now + self.op_timeout, now, {}
        if now < self.unavailable:
            # Our view of the nodes may be behind (a node just finished its resync): ask them
            # again before calling the data unavailable; a home that refused while it takes its
            # stripes back is waited for as long as it moves (past the first op timeout, woken by
            # a change the heartbeats see rather than asking every node again each 50 ms, for
            # each of a pull's stripes)
            return Wait(short=now - self.none_since < self.op_timeout, heed=tuple(self.syncing))
        # Zeros here could hide lost data: say so instead.
        down = [n for n in (every_home if self.gone else homes) if n not in self.missing and n not in self.gone]
        also = "; lost on " + ", ".join(sorted(self.gone)) if self.gone else ""
        error = Unavailable(f"stripe {idx} of file {fid}: replicas {down} unavailable{also}")
        return Fail(error, ("stripe %d:%d: no live replica holds it (down or syncing: %s%s)", fid, idx, ", ".join(down), also))

    def waited(self, now: float, work: dict[str, Hashable]) -> Action:
        """The wait is over; ``work``: what each node of the wait's ``heed`` reports of its work.
        Any that moved since it was last heeded gives the read its ``op_timeout`` again."""
        moved = False
        for node, progress in work.items():
            moved |= node in self.seen and self.seen[node] != progress
            self.seen[node] = progress
        if moved:
            self.unavailable = now + self.op_timeout
        self.missing.clear()
        self.lost.clear()
        self.syncing.clear()
        return Look()

    # -- the key -------------------------------------------------------------------------------
    def cached(self, present: bool, usable: bool, entry: Entry, eager: bool) -> Action:
        """What the cache holds for the node: ``present``, an entry; ``usable``, one in its lease
        (stripe.py's docstring); ``eager``: the caller expects the stripe's clock there already."""
        if not present or (self.node not in self.looked_up and not usable):
            return Lookup(self.node)
        return self._use(entry, eager)

    def looked(self, entry: Entry, eager: bool) -> Action:
        """The node gave its key (as the cache now holds it)."""
        self.looked_up.add(self.node)
        self.heard()
        return self._use(entry, eager)

    def forgot(self) -> Action:
        return Reraise() if self.stale_keys > STALE_KEYS else Look()

    def _use(self, entry: Entry, eager: bool) -> Action:
        p = self.piece
        if entry is None:
            self.missing.add(self.node)
            return Look()
        if isinstance(entry, Lost):
            self.gone[self.node] = entry.why
            return Look()
        if p.offset + p.length > entry.capacity and self.node not in self.looked_up:
            # past the stripe's end as cached: it may have grown since (into a new region) --
            # ask again before calling the rest zeros
            return Forget(self.node)
        self.key, self.again = entry, False
        self.k = max(0, min(p.length, entry.capacity - p.offset))
        self.guess = bool(p.min_clock and self.k and eager)
        if (p.min_clock or p.settled) and not self.guess:
            return WaitClock(self.node, entry, p.min_clock, p.settled, self.clock_deadline)
        return self._read()

    # -- the bytes -----------------------------------------------------------------------------
    def _read(self) -> Action:
        assert self.key is not None
        return Read(self.node, self.key, self.k) if self.k else Done(0, record=False)

    def reached_clock(self) -> Action:
        """The node's clock reached the one waited for."""
        return self._read()

    def got(self, clock: int) -> Action:
        """The bytes are read; ``clock``: the header's, read with them."""
        if self.guess and not self.again and clock < self.piece.min_clock:  # guessed wrong: wait, then read again
            self.again = True
            assert self.key is not None
            return WaitClock(self.node, self.key, self.piece.min_clock, False, self.clock_deadline)
        return Done(self.k, record=True)

    # -- failures ------------------------------------------------------------------------------
    def failed(self, why: str, now: float, code: str = "") -> Action:
        """The node asked failed: ``why`` one of BEHIND, STALE, DOWN, REFUSED (``code``: its
        errno name), TORN."""
        node = self.node
        if why == BEHIND:
            if node in self.behind:
                self.behind.remove(node)
            self.behind.append(node)
            return Behind(node)
        if why == STALE:  # the stripe moved to a new region
            self.stale_keys += 1
            return Forget(node)
        if why == DOWN:
            self.lost.add(node)
            return Look()
        if why == REFUSED:
            if code != "EAGAIN":
                return Reraise()
            # syncing: not trusted for reads yet, and not a home that answered "nothing here":
            # two resyncing homes once read as a hole, zeros (found by the chaos soak)
            self.syncing.add(node)
            return Look()
        assert why == TORN, why
        # Writes keep landing on this stripe: back off and read again (bounded by the deadline).
        # Never treat it as missing, which could read as a hole.
        if now >= self.torn_deadline:
            return Reraise()
        return Pause(node, TORN_PAUSE)

    def told(self) -> Action:
        return Look()

    def paused(self) -> Action:
        return Look()

"""The control calls of a PS node as typed messages: each call's request and its reply, one value
type each, and the one table of them (``CALLS``: method -> ``Call``) that the node's dispatch
(server/node.py, ``Node.handle``) reads. Pure: no I/O, no transport, no trio; it imports only
irdmafs.errors, so the client and the server may both import it.

What a request type checks. A request is a NamedTuple, one field per argument of its call's
handler (``rpc_<method>``), each annotated ``Annotated[<python type>, <Kind>]``: the ``Kind`` says
which values the field takes, its type *and* its range (a non-negative integer, a non-empty
string, a list of [fid, idx] pairs, ...). ``parse(args)`` answers ``RemoteError("EINVAL",
"<method>: <field> ...")``, naming the field, for

- a field the call does not have (as the handler's signature refused it before),
- a required field missing (one without a default),
- a field of another type or outside its range; a bool is never an integer here (``True`` is
  an ``int`` to ``isinstance``: every integer kind asks ``type(v) is int``), nor a number;

and otherwise gives the message with every field, defaults included. The dispatch parses first
and only then counts and runs the handler, with the parsed fields as keyword arguments
(``kwargs``): nothing of the node is touched by a malformed call. What a field's value then means
(a stripe that exists, a staging range that is there, a record that decodes, a stripe unit a node
holds, bounds that live in other modules) is still the handler's to judge, as before. An open
request (``heartbeat``, whose handler takes ``**args``) has a last field ``more``: the fields it
does not name, passed through unchecked.

What a reply type checks. Each call declares its reply the same way; the dispatch checks what the
handler returned against it (``Call.check_reply``: a key it does not declare, a declared key
missing or of another kind) and answers EIO, logged with its traceback, for a reply that breaks
its declaration: that is a fault of the node, not the caller's. Replies are checked shallowly (a
list is a list; its rows are the handler's), and an optional key (one with a default) may be
absent; an open reply (a namespace op's result, an inode's attributes, the status of a
heartbeat) declares ``more``. The handler's dict is answered as it was returned.

The wire is unchanged: a call is still its method and a JSON object of its arguments, the same
keys and values as before, and a reply the same JSON object; only what is refused, and where, is
new. A peer of before and one of now talk as ever.

A new call: its handler ``rpc_<method>`` on a service of the node, and here a request type whose
fields are the handler's parameters (same names, same defaults) and a reply type, registered with
``@call("<method>", <Reply>)``. A handler without a registered type stops the node at its start,
and tests/unit/test_calls.py fails for it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Callable, NamedTuple, get_type_hints

from .errors import RemoteError

__all__ = ["CALLS", "Call", "Kind", "call"]


# -- kinds: what one field takes -------------------------------------------------------------------


class Kind(NamedTuple):
    """The values a field takes: ``ok(value)``; ``what`` names them in an error; ``example`` is
    one of them (tests build valid messages from it)."""

    what: str
    ok: Callable[[Any], bool]
    example: Any


def integer(lo: int | None = None, hi: int | None = None, what: str = "an integer") -> Kind:
    """An integer (never a bool) from ``lo`` to ``hi``."""

    def ok(v: Any) -> bool:
        return type(v) is int and (lo is None or v >= lo) and (hi is None or v <= hi)

    return Kind(what, ok, lo if lo is not None else 0)


def number(lo: float, what: str) -> Kind:
    """An integer or a float (never a bool, never NaN) of at least ``lo``."""
    return Kind(what, lambda v: type(v) in (int, float) and v >= lo, lo)


def list_of(kind: Kind, what: str) -> Kind:
    return Kind(what, lambda v: type(v) is list and all(kind.ok(x) for x in v), [kind.example])


def row(*kinds: Kind, what: str) -> Kind:
    """A list of ``len(kinds)`` values, each of its kind (a stripe range, a key, a stamp)."""

    def ok(v: Any) -> bool:
        return type(v) is list and len(v) == len(kinds) and all(k.ok(x) for k, x in zip(kinds, v))

    return Kind(what, ok, [k.example for k in kinds])


def maybe(kind: Kind) -> Kind:
    """``kind``, or None."""
    return Kind(f"{kind.what} or null", lambda v: v is None or kind.ok(v), None)


NAT = integer(0, what="a non-negative integer")
POSITIVE = integer(1, what="a positive integer")
SNAP = integer(-2, what="a stripe's snapshot (0 live, -1 and -2 its optimizer state, above 0 a snapshot's copy)")
STATE = integer(0, 2, what="a number of optimizer-state stripes from 0 to 2")
BOOL = Kind("a boolean", lambda v: type(v) is bool, False)
TEXT = Kind("a string", lambda v: type(v) is str, "")
NAME = Kind("a non-empty string", lambda v: type(v) is str and v != "", "n1")
DICT = Kind("an object", lambda v: type(v) is dict, {})
LIST = Kind("a list", lambda v: type(v) is list, [])
SECONDS = number(0, "a number of seconds (0 or more)")
REAL = Kind("a number", lambda v: type(v) in (int, float) and not math.isnan(v), 0)
PAIR = row(NAT, NAT, what="[fid, idx]")
STAMP = row(NAT, NAT, what="a stamp [tag, seq]")
STAGED = row(NAT, NAT, what="a staging range [rkey, offset]")
RANGE = row(NAT, NAT, SNAP, NAT, NAT, POSITIVE, what="a stripe range [fid, idx, snap, offset, length, unit]")
WAIT = row(NAT, NAT, NAT, BOOL, what="[rkey, incarnation, clock, settled]")
MEMBER = Kind(
    "a member {name, host, port}",
    lambda v: type(v) is dict and type(v.get("name")) is str and type(v.get("host")) is str and integer(0, 65535).ok(v.get("port")),
    {"name": "n1", "host": "mem", "port": 9000},
)
UPDATES = Kind(
    "a list of apply arguments (objects without sender and epoch)",
    lambda v: type(v) is list and all(type(u) is dict and "sender" not in u and "epoch" not in u for u in v),
    [],
)
MORE = Kind("the other fields (an open message)", lambda v: v is None or type(v) is dict, None)

# the fields, by what they are (the annotations below)
Nat = Annotated[int, NAT]  # a file or inode number, a stripe index, a rank, a count, a version
Epoch = Annotated[int, NAT]  # a view's or a membership's epoch (0: none learnt yet)
Positive = Annotated[int, POSITIVE]
Snap = Annotated[int, SNAP]
SnapId = Annotated[int, POSITIVE]  # a snapshot of the namespace (ids start at 1)
Flag = Annotated[bool, BOOL]
Text = Annotated[str, TEXT]  # a string, maybe empty (a sender, a name a handler checks itself)
Name = Annotated[str, NAME]  # an owner, a token, a node's name
Doc = Annotated[dict, DICT]  # an object the handler reads (a namespace op, a record, a snapshot)
Seconds = Annotated[float, SECONDS]
Real = Annotated[float, REAL]
List = Annotated[list, LIST]  # in a reply: its rows are the handler's
Int = Annotated[int, integer()]  # an integer of any sign (a lease id, a use that may dip)
More = Annotated[dict | None, MORE]


# -- the machinery ---------------------------------------------------------------------------------


class Field(NamedTuple):
    name: str
    kind: Kind
    required: bool
    default: Any


class Spec(NamedTuple):
    """A message type's fields, read once from its annotations; ``open``: its last is ``more``."""

    fields: tuple[Field, ...]
    names: frozenset[str]
    open: bool


def _spec(cls: type) -> Spec:
    hints = get_type_hints(cls, include_extras=True)
    fields = []
    for name in cls._fields:
        kinds = [m for m in getattr(hints[name], "__metadata__", ()) if isinstance(m, Kind)]
        if len(kinds) != 1:
            raise TypeError(f"{cls.__name__}.{name}: annotate it Annotated[<type>, <Kind>]")
        fields.append(Field(name, kinds[0], name not in cls._field_defaults, cls._field_defaults.get(name)))
    is_open = bool(fields) and fields[-1].kind is MORE
    if any(f.kind is MORE for f in fields[:-1]) or is_open and fields[-1].name != "more":
        raise TypeError(f"{cls.__name__}: only a last field named more holds an open message's other fields")
    named = tuple(fields[:-1]) if is_open else tuple(fields)
    return Spec(named, frozenset(f.name for f in named), is_open)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse(cls: type, doc: Any, fail: Callable[[str], Exception]) -> Any:
    """``cls`` from the JSON object ``doc``, or ``fail(why)`` raised, why naming the field."""
    spec: Spec = cls.SPEC
    if type(doc) is not dict:
        raise fail(f"the fields are an object, not {_show(doc)}")
    more = None
    for key in doc:
        if key not in spec.names:
            if not spec.open:
                raise fail(f"unknown field {key!r}")
            more = more or {}
            more[key] = doc[key]
    values = []
    for f in spec.fields:
        if f.name in doc:
            value = doc[f.name]
            if not f.kind.ok(value):
                raise fail(f"{f.name} is {f.kind.what}, not {_show(value)}")
        elif f.required:
            raise fail(f"{f.name} is missing ({f.kind.what})")
        else:
            value = f.default
        values.append(value)
    if spec.open:
        values.append(more or {})
    return cls(*values)


def _kwargs(message: Any) -> dict:
    """The keyword arguments its handler takes: every field (defaults included), and an open
    message's other fields."""
    out = message._asdict()
    if message.SPEC.open:
        out.update(out.pop("more") or {})
    return out


class Call(NamedTuple):
    """One control call: its method, its request type and its reply type."""

    method: str
    request: type
    reply: type

    def parse(self, args: Any) -> Any:
        """The request, or EINVAL naming the field that is wrong."""
        return _parse(self.request, args, lambda why: RemoteError("EINVAL", f"{self.method}: {why}"))

    def check_reply(self, reply: Any) -> None:
        """ValueError unless ``reply`` is what this call declares it answers."""
        _parse(self.reply, reply, lambda why: ValueError(f"{self.method} reply: {why}"))


CALLS: dict[str, Call] = {}  # method -> its call: the one table the node's dispatch reads


def _typed(cls: type, fail: Callable[[str], Exception]) -> None:
    if "SPEC" not in cls.__dict__:
        cls.SPEC = _spec(cls)
        cls.parse = classmethod(lambda c, doc: _parse(c, doc, fail))
        cls.kwargs = _kwargs


def call(method: str, reply: type) -> Callable[[type], type]:
    """Register ``method``: the decorated request type and ``reply``."""

    def register(request: type) -> type:
        if method in CALLS or "SPEC" in request.__dict__:
            raise TypeError(f"{method}: one request type per call, registered once")
        _typed(request, lambda why: RemoteError("EINVAL", f"{method}: {why}"))
        _typed(reply, lambda why: ValueError(f"{reply.__name__}: {why}"))
        request.METHOD = method
        CALLS[method] = Call(method, request, reply)
        return request

    return register


# -- replies ---------------------------------------------------------------------------------------


class Done(NamedTuple):
    """An empty answer: the call did what it was asked."""


class MaybeStale(NamedTuple):
    """Applied or held (empty), or ``stale``: the sender sends the whole (a stripe, the namespace)."""

    stale: Flag = False


class Open(NamedTuple):
    """An object whose keys the handler decides (an inode's attributes: server/tree.py)."""

    more: More = None


class Released(NamedTuple):
    released: Nat


class Busy(NamedTuple):
    busy: List


class TrainInfo(NamedTuple):
    sync: Text
    workers: Nat
    active: List
    pushed: Nat
    timeout: Real
    tensor: Doc
    compress: Text


class Next(NamedTuple):
    next: Nat


class Pushed(NamedTuple):
    pushed: Nat


class Index(NamedTuple):
    index: List


class RecordsPage(NamedTuple):
    records: List
    next: Annotated[list | None, maybe(LIST)]


class MetaResult(NamedTuple):
    """A namespace op's result (server/meta.py), and the view it was acknowledged in."""

    acked_in: Epoch
    more: More = None


class NameLease(NamedTuple):
    """A mount's name cache lease (server/namecache.py)."""

    lease: Real
    held: Real
    fresh: Flag
    acked: Nat
    inval: List


class Snapshot(NamedTuple):
    """The whole namespace (``Meta.snapshot``)."""

    seq: Nat
    more: More = None


class Entries(NamedTuple):
    entries: List


class Snapshots(NamedTuple):
    snapshots: Doc


class Stripes(NamedTuple):
    stripes: List
    complete: Flag


class Copied(NamedTuple):
    bytes: Nat


class StripeInfo(NamedTuple):
    """Each index asked ("<idx>": its description, or None, or {"lost": why}) and the lease."""

    lease: Int
    more: More = None


class Versions(NamedTuple):
    versions: List


class Committed(NamedTuple):
    version: Nat
    acked_in: Epoch


class Reached(NamedTuple):
    reached: List


class Results(NamedTuple):
    results: List


class Status(NamedTuple):
    """A node's status (server/node.py, ``rpc_heartbeat``)."""

    name: Name
    state: Name
    gen: Int
    caught_up: Flag
    more: More = None


class Statfs(NamedTuple):
    capacity: Nat
    used: Int
    files: Nat


class Region(NamedTuple):
    rkey: Nat
    size: Positive


class Handed(NamedTuple):
    stripes: List
    records: List
    meta_stamp: List
    arrays: List = None  # (absent: the arrays are in a cut)
    cut: Doc = None


class Pieces(NamedTuple):
    pieces: List
    next: Annotated[list | None, maybe(LIST)]


class Members(NamedTuple):
    epoch: Epoch
    replicas: Nat
    nodes: List


class Pulled(NamedTuple):
    stripes: Nat
    bytes: Nat


class Dropped(NamedTuple):
    dropped: Nat


class InEpoch(NamedTuple):
    epoch: Epoch


# -- requests: the data path (server/datapath.py, server/clocks.py, server/tails.py) ---------------


@call("stripes", Stripes)
class ListStripes(NamedTuple):
    """Every stripe held here."""


@call("snap_copy", Copied)
class SnapCopy(NamedTuple):
    snap: SnapId


@call("stripe_info", StripeInfo)
class StripeInfoOf(NamedTuple):
    fid: Nat
    idxs: Annotated[list, list_of(NAT, "a list of stripe indices")]
    snap: Snap = 0
    resync: Flag = False


@call("stripe_versions", Versions)
class StripeVersions(NamedTuple):
    stripes: Annotated[list, list_of(PAIR, "a list of [fid, idx]")]


@call("commit", Committed)
class Commit(NamedTuple):
    fid: Nat
    idx: Nat
    offset: Nat
    length: Nat
    unit: Positive
    staged: Annotated[list, STAGED]
    epoch: Epoch = 0


@call("apply", MaybeStale)
class Apply(NamedTuple):
    """The fields of server/datapath.py's ``Apply`` (its handler takes ``**message``)."""

    where: Annotated[list, RANGE]
    staged: Annotated[list, STAGED]
    version: Nat
    clock: Nat
    full: Flag
    record: Annotated[dict | None, maybe(DICT)] = None
    pending: Flag = False
    state: Annotated[int, STATE] = 0
    sender: Text = ""
    epoch: Epoch = 0
    tag: Nat = 0
    base_tag: Nat = 0


@call("apply_batch", Results)
class ApplyBatch(NamedTuple):
    updates: Annotated[list, UPDATES]
    sender: Text = ""
    epoch: Epoch = 0


@call("clock_wait", Reached)
class ClockWait(NamedTuple):
    stripes: Annotated[list, list_of(WAIT, "a list of [rkey, incarnation, clock, settled]")]
    timeout: Seconds


@call("release_tails", Released)
class ReleaseTails(NamedTuple):
    owner: Text
    fid: Nat
    idxs: Annotated[list, list_of(NAT, "a list of stripe indices")]


# -- requests: training (server/training.py, server/records.py) ------------------------------------


@call("train_busy", Busy)
class TrainBusy(NamedTuple):
    fids: Annotated[list, list_of(NAT, "a list of inode numbers")]


@call("train_info", TrainInfo)
class TrainInfoOf(NamedTuple):
    fid: Nat
    rank: Nat
    epoch: Epoch = 0


@call("train_next", Next)
class TrainNext(NamedTuple):
    fid: Nat
    idx: Nat
    rank: Nat


@call("train_wait", Pushed)
class TrainWait(NamedTuple):
    fid: Nat
    idx: Nat
    rank: Nat
    pushed: Nat
    timeout: Seconds


@call("train_record", Done)
class TrainRecord(NamedTuple):
    fid: Nat
    idx: Nat
    record: Doc
    lengths: Annotated[list | None, maybe(list_of(NAT, "a list of array lengths"))] = None
    staged: Annotated[list | None, maybe(STAGED)] = None
    sender: Text = ""
    epoch: Epoch = 0


@call("train_index", Index)
class TrainIndex(NamedTuple):
    """Every stripe's push bookkeeping, in short (a resync)."""


@call("train_records", RecordsPage)
class TrainRecords(NamedTuple):
    after: Annotated[list | None, maybe(PAIR)] = None
    keys: Annotated[list | None, maybe(list_of(PAIR, "a list of [fid, idx]"))] = None


# -- requests: the namespace (server/namespace.py) -------------------------------------------------


@call("meta", MetaResult)
class MetaOp(NamedTuple):
    op: Doc  # its fields: server/meta.py, ``OP_FIELDS`` (``Meta.check``)
    epoch: Epoch = 0


@call("cache_wait", NameLease)
class CacheWait(NamedTuple):
    owner: Name
    acked: Nat = 0
    epoch: Epoch = 0


@call("meta_apply", MaybeStale)
class MetaApply(NamedTuple):
    seq: Nat
    op: Doc
    sender: Text = ""
    epoch: Epoch = 0
    tag: Nat = 0
    prev: Annotated[list | None, maybe(STAMP)] = None


@call("meta_restore", Done)
class MetaRestore(NamedTuple):
    snapshot: Doc  # its fields: server/namespace.py, ``SNAPSHOT_FIELDS``


@call("meta_snapshot", Snapshot)
class MetaSnapshot(NamedTuple):
    whole: Flag = False


@call("lookup", Open)
class Lookup(NamedTuple):
    parent: Nat
    name: Text  # (server/meta.py judges it: a name that may not be is ENOENT or EINVAL there)
    snap: Nat = 0
    alias: Flag = False


@call("getattr", Open)
class GetAttr(NamedTuple):
    ino: Nat
    snap: Nat = 0


@call("readdir", Entries)
class ReadDir(NamedTuple):
    ino: Nat
    snap: Nat = 0


@call("snapshots", Snapshots)
class ListSnapshots(NamedTuple):
    """Every snapshot of the namespace."""


# -- requests: the node itself (server/node.py) ----------------------------------------------------


@call("heartbeat", Status)
class Heartbeat(NamedTuple):
    """Open: its handler takes ``**args`` (``from``: who asks, "status" for the counts of
    ``leading``), passed through as they come."""

    owner: Annotated[str | None, maybe(TEXT)] = None
    more: More = None


@call("statfs", Statfs)
class StatFs(NamedTuple):
    """The node's capacity and use."""


@call("freeze", Done)
class Freeze(NamedTuple):
    token: Name
    seconds: Seconds
    epoch: Epoch = 0


@call("thaw", Done)
class Thaw(NamedTuple):
    token: Name


@call("staging", Region)
class Staging(NamedTuple):
    owner: Name
    size: Positive  # (at most MAX_STAGING_PER_OWNER: server/staging.py)
    replace: Flag = False


@call("release", Done)
class Release(NamedTuple):
    owner: Name


# -- requests: membership (server/membership.py) ---------------------------------------------------


@call("joining", Done)
class Joining(NamedTuple):
    name: Name


@call("handover", Handed)
class Handover(NamedTuple):
    name: Name
    epoch: Epoch = 0


@call("handover_arrays", Pieces)
class HandoverArrays(NamedTuple):
    cut: Positive
    at: Annotated[list, row(NAT, NAT, what="a cursor [array, byte offset]")]


@call("handover_release", Done)
class HandoverRelease(NamedTuple):
    cut: Positive


@call("members", Members)
class ListMembers(NamedTuple):
    """The membership this node works with."""


@call("rebalance_pull", Pulled)
class RebalancePull(NamedTuple):
    nodes: Annotated[list, list_of(MEMBER, "a list of members {name, host, port}")]
    replicas: Positive
    settle: Flag = True


@call("rebalance_abort", Dropped)
class RebalanceAbort(NamedTuple):
    """A rebalance ended without switching."""


@call("reconfigure", InEpoch)
class Reconfigure(NamedTuple):
    nodes: Annotated[list, list_of(MEMBER, "a list of members {name, host, port}")]
    replicas: Positive
    epoch: Epoch

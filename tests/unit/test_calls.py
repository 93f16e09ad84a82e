"""The control calls as typed messages (irdmafs/calls.py): every ``rpc_*`` handler of a node has
one request type whose fields are its parameters; a malformed request (a bool where an integer
is wanted, another type, a field missing or unknown) is EINVAL naming the field before the
handler runs; a valid one reaches the handler as it was sent, defaults added; a reply that is not
its call's declared type is EIO. The wire stays as it was: the same JSON objects both ways."""

from __future__ import annotations

import inspect
import logging
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from irdmafs.calls import CALLS, Call
from irdmafs.config import from_dict
from irdmafs.coord.memory import MemoryCoord
from irdmafs.errors import RemoteError
from irdmafs.server.meta import Meta
from irdmafs.server.node import Node
from irdmafs.transport.memory import MemoryTransport

UNKNOWN = "no_such_field"
# values of other types than most fields take; each is tried where its field's kind refuses it
WRONG = ["x", "", -1, 1.5, float("nan"), None, [], [None], ["x", 1], {}, {"a": 1}, True, False]


def node() -> Node:
    doc = {"nodes": [{"name": "n1", "host": "mem", "port": 9000}], "token": "test-token-123", "replicas": 1, "transport": ["memory"]}
    cfg = from_dict(doc | {"coordinator": ["http://mem:2379"]})
    return Node(cfg, "n1", MemoryTransport(cfg.token), coord=MemoryCoord())


def valid(call: Call, everything: bool = True) -> dict:
    """A request of ``call`` built from its kinds' examples: every field, or the required ones."""
    return {f.name: f.kind.example for f in call.request.SPEC.fields if everything or f.required}


def with_defaults(call: Call, args: dict) -> dict:
    return {f.name: args.get(f.name, f.default) for f in call.request.SPEC.fields} | {k: v for k, v in args.items() if k not in call.request.SPEC.names}


def a_reply(call: Call) -> dict:
    return {f.name: f.kind.example for f in call.reply.SPEC.fields if f.required}


def as_bools(value):
    """``value`` with every integer in it a bool (None if it holds no integer)."""
    if type(value) is int:
        return value != 0
    if isinstance(value, list):
        out = [as_bools(v) for v in value]
        return None if all(o is None for o in out) else [o if o is not None else v for o, v in zip(out, value)]
    if isinstance(value, dict):
        out = {k: as_bools(v) for k, v in value.items()}
        return None if all(o is None for o in out.values()) else {k: o if o is not None else value[k] for k, o in out.items()}
    return None


def refused_naming(call: Call, args: dict, field: str) -> None:
    with pytest.raises(RemoteError) as err:
        call.parse(args)
    assert err.value.code == "EINVAL", (call.method, args)
    assert err.value.message.startswith(f"{call.method}: {field} ") or err.value.message == f"{call.method}: unknown field {field!r}", err.value.message


# -- the table and the handlers ---------------------------------------------------------------------


async def test_every_handler_has_exactly_one_type_whose_fields_are_its_parameters():
    n = node()
    assert set(n.calls) == set(CALLS), "a handler without a request type, or a type without a handler"
    assert len({c.request for c in CALLS.values()}) == len(CALLS), "one request type per call"
    for method, fn in n.calls.items():
        spec = CALLS[method].request.SPEC
        params = inspect.signature(fn).parameters.values()
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        open_ = any(p.kind is p.VAR_KEYWORD for p in params)
        if open_ and not named:  # ``**message``: the handler parses it itself, with its own type
            theirs = sys.modules[fn.__func__.__module__].__dict__[CALLS[method].request.__name__]
            assert not spec.open and theirs._fields == CALLS[method].request._fields, method
            assert theirs._field_defaults == {f.name: f.default for f in spec.fields if not f.required}, method
            continue
        assert [p.name for p in named] == [f.name for f in spec.fields], method
        for p, f in zip(named, spec.fields):
            assert (p.default is p.empty) == f.required, (method, p.name)
            assert f.required or p.default == f.default and type(p.default) is type(f.default), (method, p.name)
        assert open_ == spec.open, method


def test_every_example_is_of_its_kind_and_a_request_round_trips():
    for method, call in CALLS.items():
        for spec in (call.request.SPEC, call.reply.SPEC):
            for f in spec.fields:
                assert f.kind.ok(f.kind.example), (method, f.name)
        for everything in (True, False):
            args = valid(call, everything)
            message = call.parse(args)
            assert message.METHOD == method and isinstance(message, call.request)
            assert message.kwargs() == with_defaults(call, args), method
            assert call.request.parse(args) == message
        call.check_reply(a_reply(call))
    status = CALLS["heartbeat"].parse({"from": "status", "owner": "client:1"})
    assert status.kwargs() == {"from": "status", "owner": "client:1"}  # open: passed through


# -- malformed requests: EINVAL naming the field, before the handler runs --------------------------


def malformed(call: Call):
    """(args, the field named) of every malformed request of ``call`` tried here."""
    good = valid(call)
    for f in call.request.SPEC.fields:
        bools = as_bools(f.kind.example)
        if bools is not None:  # a bool where an integer is wanted, at any depth
            yield good | {f.name: bools}, f.name
        for wrong in WRONG:
            if not f.kind.ok(wrong):
                yield good | {f.name: wrong}, f.name
        if f.required:
            yield {k: v for k, v in good.items() if k != f.name}, f.name
    if not call.request.SPEC.open:
        yield good | {UNKNOWN: 1}, UNKNOWN


async def test_a_malformed_request_is_einval_naming_its_field_and_the_handler_never_runs():
    n = node()
    ran = []

    def spy(call: Call):
        async def handler(**kw):
            ran.append((call.method, kw))
            return a_reply(call)

        return handler

    tried = 0
    for method, call in CALLS.items():
        n.calls[method] = spy(call)
        for args, field in malformed(call):
            with pytest.raises(RemoteError) as err:
                await n.handle(method, args)
            assert err.value.code == "EINVAL", (method, args)
            assert field in err.value.message and err.value.message.startswith(f"{method}: "), (method, err.value.message)
            tried += 1
        assert not ran and not n.counters, "refused before the handler ran, and before it was counted"
        args = valid(call, everything=False)
        assert await n.handle(method, args) == a_reply(call)
        assert ran == [(method, with_defaults(call, args))]  # the fields as sent, defaults added
        ran.clear()
        n.counters.clear()
    assert tried > 10 * len(CALLS)
    with pytest.raises(RemoteError) as err:
        await n.handle("no_such_method", {})
    assert err.value.code == "ENOSYS"
    for args in (None, [], "x"):  # the arguments are an object
        with pytest.raises(RemoteError) as err:
            await n.handle("getattr", args)
        assert err.value.code == "EINVAL"


async def test_an_open_request_passes_what_it_does_not_name_through():
    n = node()
    got = []

    async def heartbeat(owner=None, **args):
        got.append((owner, args))
        return {"name": "n1", "state": "ready", "gen": 1, "caught_up": True, "anything": [1]}

    n.calls["heartbeat"] = heartbeat
    assert (await n.handle("heartbeat", {"from": "status", "owner": "c", "x": True}))["anything"] == [1]
    assert got == [("c", {"from": "status", "x": True})]
    with pytest.raises(RemoteError) as err:
        await n.handle("heartbeat", {"owner": 5})
    assert err.value.code == "EINVAL" and "owner" in err.value.message


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(
    st.sampled_from([(m, f.name) for m, c in CALLS.items() for f in c.request.SPEC.fields]),
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=4),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=8,
    ),
)
def test_any_value_a_field_does_not_take_is_einval_naming_it(which, value):
    method, name = which
    call = CALLS[method]
    kind = next(f.kind for f in call.request.SPEC.fields if f.name == name)
    assume(not kind.ok(value))
    refused_naming(call, valid(call) | {name: value}, name)


@given(st.sampled_from([(m, f.name) for m, c in CALLS.items() for f in c.request.SPEC.fields if type(f.kind.example) is int]), st.booleans())
def test_a_bool_is_never_an_integer(which, flag):
    method, name = which
    refused_naming(CALLS[method], valid(CALLS[method]) | {name: flag}, name)


# -- replies ---------------------------------------------------------------------------------------


async def test_a_reply_not_of_its_declared_type_is_eio_and_one_that_is_goes_as_returned(caplog):
    n = node()
    answer: dict = {}

    async def commit(**kw):
        return answer

    n.calls["commit"] = commit
    args = valid(CALLS["commit"])
    for bad in ({}, {"version": True, "acked_in": 1}, {"version": 1, "acked_in": 1, "extra": 0}, {"version": "1", "acked_in": 1}):
        answer = bad
        with pytest.raises(RemoteError) as err:
            await n.handle("commit", args)
        assert err.value.code == "EIO" and "commit reply" in err.value.message, bad
    assert any(r.exc_info and r.levelno == logging.ERROR for r in caplog.records)  # a fault of the node, logged
    answer = {"version": 7, "acked_in": 3}
    assert await n.handle("commit", args) is answer  # not re-encoded: the wire is as it was
    for method, reply in (("apply", {}), ("apply", {"stale": True}), ("meta", {"ino": 5, "acked_in": 2}), ("getattr", {"ino": 1, "size": 0})):
        answer = reply
        n.calls[method] = commit
        assert await n.handle(method, valid(CALLS[method])) is answer
    answer = {"stale": 1}
    with pytest.raises(RemoteError) as err:
        await n.handle("apply", valid(CALLS["apply"]))
    assert err.value.code == "EIO"


# -- the namespace ops' schema (server/meta.py) ------------------------------------------------------


def test_a_namespace_op_takes_no_bool_for_an_integer():
    ops = [
        {"op": "mkdir", "parent": True, "name": "x", "mode": 0o755},
        {"op": "mkdir", "parent": 1, "name": "x", "mode": False},
        {"op": "create", "parent": 1, "name": "x", "mode": 0o644, "rdev": True},
        {"op": "extend", "ino": 2, "size": True},
        {"op": "extend", "ino": 2, "size": 10, "made": False},
        {"op": "pack", "bucket": 2, "tensors": [], "count": True, "final": False},
    ]
    for op in ops:
        with pytest.raises(RemoteError) as err:
            Meta.check(op)
        assert err.value.code == "EINVAL", op
    Meta.check({"op": "pack", "bucket": 2, "tensors": [], "count": 1, "final": True})  # a bool where a bool is wanted
    Meta.check({"op": "cacher", "owner": "m", "on": False})
    Meta.check({"op": "mkdir", "parent": 1, "name": "x", "mode": 0o755, "uid": 0})

"""Pushes as they arrive on a PS node: a client's fused pushes in one WRITE with immediate
(``PushIntake.on_imm``), each descriptor checked into a ``Push`` (``descriptor``) and its gradient
read from the staged bytes (``gradient``), before the node's training (training.py) takes it.

One WRITE carries ``imm`` bytes of JSON descriptors, then the gradients they point at. Each push
gets its own answer, so one refused push does not fail the others: a descriptor that is not one
is EINVAL naming the field, a gradient longer than what was staged is EINVAL, a fault is EIO; a
node stopping answers EAGAIN for what it did not take. The answer also carries the policy of
every tensor involved, which keeps the client's cache fresh without calls.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from functools import partial
from typing import Awaitable, Callable, NamedTuple

import numpy as np
import trio

from ..errors import RemoteError
from ..metrics import Latency
from ..runtime.cluster import Cluster
from .store import NoSpace

log = logging.getLogger(__name__)

_NUMBER = (int, float)


class Push(NamedTuple):
    """Gradient push ``step`` of ``rank`` for the ``count`` elements of stripe (fid, idx)
    starting at byte ``offset``, in dtype ``wire``: all of them, or with ``spans`` only the
    [start, length] element runs listed (chunk sparsification; the rest is zero). ``busy``:
    the pusher's compute time per step; ``paced``: how long it waited for its r2sp slot."""

    fid: int
    idx: int
    offset: int
    count: int
    rank: int
    step: int
    wire: str
    unit: int
    spans: list | None = None
    busy: float | None = None
    paced: float = 0.0
    epoch: int = 0  # the pusher's view epoch (serving.py, check_epoch)
    layout: int = -1  # a bucket's push: the bucket's version the pusher laid its step out by
    early: bool = False  # the pusher pulls next (a step stream): a round it closes may be answered before its backups hold it


# the types of a push descriptor's fields (``descriptor``); ``spans`` and ``busy`` may be null
PUSH_TYPES = {
    "fid": int, "idx": int, "offset": int, "count": int, "rank": int, "step": int, "unit": int,
    "wire": str, "spans": list, "busy": _NUMBER, "paced": _NUMBER, "epoch": int, "layout": int, "early": bool,
}
PUSH_REQUIRED = frozenset(k for k, p in inspect.signature(Push).parameters.items() if p.default is inspect.Parameter.empty)


def descriptor(data: memoryview, d: dict) -> tuple[memoryview, Push]:
    """A push descriptor, checked: where its gradient starts in the pushed bytes (``at``)
    and the ``Push`` it describes, every field of its type; EINVAL saying what is wrong."""
    at = d.pop("at", None)
    if not isinstance(at, int) or not 0 <= at <= len(data):
        raise RemoteError("EINVAL", f"bad push descriptor: gradient at {at!r} of {len(data)} bytes pushed")
    if not PUSH_REQUIRED <= d.keys() <= PUSH_TYPES.keys():
        missing, unknown = sorted(PUSH_REQUIRED - d.keys()), sorted(d.keys() - PUSH_TYPES.keys())
        raise RemoteError("EINVAL", f"bad push descriptor: missing {missing}, unknown {unknown}")
    wrong = [k for k, v in d.items() if not isinstance(v, PUSH_TYPES[k]) and not (v is None and k in ("spans", "busy"))]
    if wrong:
        raise RemoteError("EINVAL", f"bad push descriptor: {', '.join(wrong)} of the wrong type")
    return data[at:], Push(**d)


def gradient(staged: memoryview, count: int, wire: np.dtype, spans: list | None, work: np.dtype) -> np.ndarray:
    """The staged gradient as a dense array in the working dtype (accumulation precision),
    except that a dense float16 gradient for float32 work stays float16 (summed by
    native.acc_f16 without a temporary)."""

    def take(nbytes: int) -> memoryview:
        if nbytes > len(staged):
            raise RemoteError("EINVAL", f"push of {nbytes} bytes, {len(staged)} staged")
        return staged[:nbytes]

    if spans is None:
        dense = np.frombuffer(take(count * wire.itemsize), wire)
        # A view of the staging slot when it is in the working dtype, or float16 for
        # float32 work (the round sum takes it in one pass: native.acc_f16): whatever keeps
        # it past the push copies it (rounds.StripeTraining.take/accept). Else converted now.
        return dense if wire == work or (wire, work) == (np.float16, np.float32) else dense.astype(work)
    total, end = 0, 0
    for start, length in spans:
        if not (isinstance(start, int) and isinstance(length, int)) or start < end or length < 1 or start + length > count:
            raise RemoteError("EINVAL", f"bad span [{start}, {length}] for {count} elements")
        end = start + length
        total += length
    values = np.frombuffer(take(total * wire.itemsize), wire)
    grad = np.zeros(count, work)
    pos = 0
    for start, length in spans:
        grad[start : start + length] = values[pos : pos + length]
        pos += length
    return grad


class PushIntake:
    """Takes a WRITE with immediate of fused pushes apart and hands each to ``push(staged, p,
    answer)`` (training.py ``Training.push``), at once, in the node's nursery; ``policy_info(fid)``
    is what the answer tells the client of each tensor's model."""

    def __init__(self, name: str, cluster: Cluster, latency: Latency, push: Callable[..., Awaitable[dict]], policy_info: Callable[[int], dict]):
        self.name, self.cluster, self.latency = name, cluster, latency
        self.push, self.policy_info = push, policy_info

    async def on_imm(self, region, offset: int, length: int, imm: int) -> dict:
        """A client's fused pushes, delivered by one WRITE with immediate into its staging slot:
        ``imm`` bytes of JSON descriptors, then the gradients they point at. Each push gets its
        own result, so one refused push does not fail the others; the reply also carries the
        policy of every tensor involved, which keeps the client's cache fresh without calls."""
        if region is None or not 0 < imm <= length:
            raise RemoteError("EINVAL", "notification without a descriptor")
        try:
            descs = json.loads(bytes(region.buf[offset : offset + imm]))
        except (ValueError, RecursionError):
            raise RemoteError("EINVAL", "malformed push descriptor") from None
        # checked, not asserted: python -O drops asserts, and this is a peer's input
        if not isinstance(descs, list) or not all(isinstance(d, dict) for d in descs):
            raise RemoteError("EINVAL", "malformed push descriptor: not a list of objects")
        data = region.buf[offset + imm : offset + length]
        results: list[dict | None] = [None] * len(descs)
        answered = [trio.Event() for _ in descs]

        def answer(i: int, result: dict) -> None:
            if results[i] is None:
                results[i] = result
                answered[i].set()

        def failed(i: int, d: dict, result: dict) -> None:
            if results[i] is None:
                answer(i, result)
            else:  # answered once applied here: its pusher keeps it until the round is seen closed
                log.info("node %s: round of stripe %s:%s applied, not settled: %s", self.name, d.get("fid"), d.get("idx"), result["message"])

        async def one(i: int, d: dict) -> None:
            try:
                answer(i, await self.push(*descriptor(data, d), partial(answer, i)))
            except RemoteError as exc:
                failed(i, d, {"error": exc.code, "message": exc.message})
            except NoSpace as exc:
                failed(i, d, {"error": "ENOSPC", "message": str(exc)})
            except Exception as exc:  # a fault here, not in the descriptor (checked above)
                log.exception("node %s: push to stripe %s:%s failed", self.name, d.get("fid"), d.get("idx"))
                failed(i, d, {"error": "EIO", "message": f"{type(exc).__name__}: {exc}"})
            finally:  # cancelled (the node stopping): never leave the batch waiting for it
                if results[i] is None:
                    answer(i, {"error": "EAGAIN", "message": "the node stopped before it took this push"})

        t0 = time.perf_counter()
        # in the node's nursery: a push answered once applied here (``_push_now``) settles its round
        # after this answer has gone
        for i, d in enumerate(descs):
            self.cluster.nursery.start_soon(one, i, dict(d))
        for ev_ in answered:
            await ev_.wait()
        self.latency.observe("push", time.perf_counter() - t0)
        info = {}
        for fid in {d.get("fid") for d in descs if isinstance(d.get("fid"), int)}:
            try:
                info[str(fid)] = self.policy_info(fid)
            except RemoteError:  # not a tensor (its push said so)
                pass
        return {"results": results, "info": info, "acked_in": self.cluster.roles.view_epoch}  # runtime/heartbeats.py, follow_acked

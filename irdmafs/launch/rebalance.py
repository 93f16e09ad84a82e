"""``irdmafs rebalance``: move a running cluster to a new membership (a node added or removed).

    irdmafs rebalance --from cluster.toml --to cluster-new.toml

Every node of both configs must be running and ready (start an added node first, with the new
config; keep a removed node running until the rebalance is done). Then, as a coordinator:

1. pre-copy, while writes go on: every node of the new membership copies the stripes it holds
   under the new placement and lacks, from whichever node has the newest copy
   (``rebalance_pull`` with ``settle`` false), with progress shown here; again while a round
   still moved more than ``SETTLED`` bytes (at most ``PRECOPIES`` rounds);
2. freeze commits and pushes on every node (the snapshot barrier; kept alive while it works):
   reads go on, writes wait, and each node copies what changed since its pre-copy
   (``rebalance_pull``, ``settle``: a stripe newer on a peer, and a pre-copied one no node lists
   any more, freed meanwhile, dropped); if any copy fails, nothing switches: the cluster thaws on
   the old membership, nothing lost, and each node drops what the pre-copy brought that it does
   not hold there (``rebalance_abort``). Writers wait for this copy only, not for the whole data
   (the freeze once lasted the whole copy, and grew with the data);
3. every node switches to the new membership (``reconfigure``, with a new epoch); clients and
   mounts learn it from their next heartbeat, and the coordinator waits for that before it
4. thaws. Waiting writes find their stripe's new primary and go on. Nodes drop the stripes they
   no longer hold after a grace period, so a client still on the old membership reads them until
   it has switched.

Write the new config where mounts and nodes will read it on their next start: running ones
follow the epoch, and a process started later from the old file learns it from the nodes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace

import trio

from ..runtime.cluster import READY, Cluster
from ..errors import NodeDown, RemoteError
from ..config import ClusterConfig
from ..progress import Progress
from ..transport.select import choose
from ..util import single_exception

log = logging.getLogger(__name__)

KEEPALIVE = 10.0  # seconds between extensions of the freeze (nodes thaw by themselves after 30 s)
PRECOPIES = 3  # pre-copy rounds at most, before the freeze
SETTLED = 64 << 20  # a pre-copy round that moved less than this is the last one


class RebalanceError(Exception):
    """The rebalance could not start or a copy failed; the cluster stays on its old membership."""


async def rebalance(old: ClusterConfig, new: ClusterConfig, *, show_progress: bool = True) -> dict:
    if old.token != new.token:
        raise RebalanceError("the two configs have different tokens")
    union = replace(new, nodes=[*new.nodes, *[n for n in old.nodes if n.name not in new.names]])
    members = [asdict(n) for n in new.nodes]
    transport = choose(new.transport, new.token, op_timeout=new.op_timeout)
    token = f"rebalance:{time.time_ns()}"
    epoch = time.time_ns()
    with single_exception():
        return await _run(old, new, union, members, transport, token, epoch, show_progress)


async def _run(old, new, union, members, transport, token: str, epoch: int, show_progress: bool) -> dict:
    names = union.names
    async with trio.open_nursery() as nursery:
        cluster = Cluster(union, transport, nursery)
        cluster.heartbeats.follow_membership = False
        await cluster.heartbeats.refresh()
        missing = [n for n in names if cluster.roles.node_state(n) != READY]
        if missing:
            raise RebalanceError(f"not running and ready: {', '.join(missing)} (start added nodes with the new config first)")
        # an added node started with the new config fetched its share as it started (its own
        # resync): the copy below then finds it there. Said in the summary, which once read "0
        # stripes, 0 bytes copied" of a node that had fetched 45 MB
        held = {n: {k: int(cluster.liveness.info.get(n, {}).get(k, 0)) for k in ("stripes", "bytes")} for n in new.names if n not in old.names}
        frozen: list[str] = []
        switched = False
        precopied = {"stripes": 0, "bytes": 0}  # every round's copies: the summary counts them all
        try:
            for _ in range(PRECOPIES):
                round_ = await _copy(cluster, new, members, show_progress, settle=False)
                precopied = {k: precopied[k] + round_[k] for k in precopied}
                if round_["bytes"] < SETTLED:
                    break
            for n in names:
                await cluster.call(n, "freeze", {"token": token, "seconds": 30.0, "epoch": cluster.roles.view_epoch})
                frozen.append(n)
            nursery.start_soon(_keep_frozen, cluster, names, token)
            moved = await _copy(cluster, new, members, show_progress)
            for n in names:
                switched = True  # (a node told to switch may have: nothing is abandoned from here)
                await cluster.call(n, "reconfigure", {"nodes": members, "replicas": new.replicas, "epoch": epoch})
            # clients switch at their next heartbeat; writes waiting on old primaries then
            # find the new ones
            await trio.sleep(2 * max(old.heartbeat, new.heartbeat) + 0.5)
        except (NodeDown, RemoteError) as exc:
            raise RebalanceError(f"{exc}; the cluster stays on its old membership") from None
        finally:
            with trio.CancelScope(shield=True):
                for n in names:  # a freeze that timed out here may have landed there
                    try:
                        await cluster.call(n, "thaw", {"token": token})
                    except (NodeDown, RemoteError) as exc:  # it thaws by itself
                        if n in frozen:
                            log.warning("thaw of %s failed: %s", n, exc)
                if not switched:
                    await _abandon(cluster, new.names)
            nursery.cancel_scope.cancel()
    # what was copied: the pre-copy's rounds and the frozen copy (it once counted the frozen
    # copy alone, "0 stripes, 0 bytes copied" after a pre-copy that moved 45 MB)
    total = {k: precopied[k] + moved[k] for k in moved}
    log.info(
        "rebalance done: membership %d, %d stripes (%d bytes) copied, %d (%d bytes) of them under the freeze",
        *(epoch, total["stripes"], total["bytes"], moved["stripes"], moved["bytes"]),
    )
    return {"epoch": epoch, **total, "precopy": precopied, "frozen": moved, "held_before": held}


async def _abandon(cluster: Cluster, names: list[str]) -> None:
    """The rebalance ends on the old membership: each node drops what the pre-copy brought it
    that it does not hold under that membership (``rebalance_abort``). Best effort: a node not
    reached keeps those copies until the next rebalance (it says so in its log)."""
    for n in names:
        try:
            await cluster.call(n, "rebalance_abort", {}, timeout=60.0)
        except (NodeDown, RemoteError) as exc:
            log.warning("%s keeps the copies of the abandoned rebalance: %s", n, exc)


async def _keep_frozen(cluster: Cluster, names: list[str], token: str) -> None:
    """Extend the freeze on every node each KEEPALIVE. One that cannot be extended (a node lost,
    or in another view than this process: ESTALE) ends the rebalance: that node thaws by itself
    and takes commits again, which the copy under way would miss and the switch then lose."""
    while True:
        await trio.sleep(KEEPALIVE)
        for n in names:
            try:
                await cluster.call(n, "freeze", {"token": token, "seconds": 30.0, "epoch": cluster.roles.view_epoch})
            except (NodeDown, RemoteError) as exc:
                raise RebalanceError(f"the freeze of {n} could not be kept ({exc}); the cluster stays on its old membership") from None


async def _copy(cluster: Cluster, new: ClusterConfig, members: list[dict], show_progress: bool, settle: bool = True) -> dict:
    """One copy round on every node of the new membership (``rebalance_pull``): the stripes
    and bytes they copied."""
    results: dict[str, dict] = {}
    bar = Progress("rebalance" if settle else "rebalance pre-copy", 0, unit="B") if show_progress else None
    args = {"nodes": members, "replicas": new.replicas, "settle": settle}

    async def pull(name: str) -> None:
        results[name] = await cluster.call(name, "rebalance_pull", args, timeout=24 * 3600)

    async with trio.open_nursery() as n:
        for name in new.names:
            n.start_soon(pull, name)
        if bar is not None:
            n.start_soon(_watch, cluster, new.names, results, bar)
    if bar is not None:
        bar.update(sum(r["bytes"] for r in results.values()), max(bar.total, sum(r["bytes"] for r in results.values())))
        bar.close()
    return {"stripes": sum(r["stripes"] for r in results.values()), "bytes": sum(r["bytes"] for r in results.values())}


async def _watch(cluster: Cluster, names: list[str], results: dict, bar: Progress) -> None:
    """The nodes' copy progress, from their heartbeats, until every pull answered."""
    totals: dict[str, tuple[int, int]] = {}
    while len(results) < len(names):
        for name in names:
            if name in results:
                totals[name] = (results[name]["bytes"], results[name]["bytes"])
                continue
            try:
                work = (await cluster.call(name, "heartbeat", {"from": "rebalance"})).get("work") or {}
            except (NodeDown, RemoteError):
                continue
            if str(work.get("what", "")).startswith("rebalance"):
                totals[name] = (work["bytes"], work["total_bytes"])
        bar.update(sum(d for d, _ in totals.values()), sum(t for _, t in totals.values()))
        await trio.sleep(0.2)

"""What a client knows of the nodes, for status tables and ``statfs``: each node's state and
figures from its last heartbeat, the cluster's capacity, and the client's own counters."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..held import extent_end
from ..errors import NodeDown, RemoteError

if TYPE_CHECKING:
    from .client import Client

# what a node's heartbeat reports that status tables show
NODE_FIGURES = (
    *("pid", "stripes", "bytes", "capacity", "held", "loop_lag", "loop_busy", "transport", "uptime"),
    *("calls", "served_bytes", "replicas_behind", "caught_up", "degraded", "lost"),
    *("engine", "kernels"),  # what serves its data plane, with the transport (runtime/dataplane.py)
)


def table(client: "Client") -> list[dict]:
    """Every node as this client sees it (state from its last heartbeat)."""
    cluster, out = client.cluster, []
    for spec in client.cluster.roles.members.nodes:
        # the view may still serve a node that stopped answering (two nodes: the one left is
        # no majority and cannot expel it); what this client's heartbeats hear says it is down
        heard, served = cluster.liveness.state.get(spec.name, "down"), cluster.roles.node_state(spec.name)
        alive = served != "down" and heard != "down"
        state = served if alive else ("syncing" if heard == "syncing" else "down")
        info = cluster.liveness.info.get(spec.name, {}) if alive else {}  # no stale figures
        out.append(
            {
                "name": spec.name,
                "address": f"{spec.host}:{spec.port}",
                "state": state,
                "alive": alive,
                **{k: info[k] for k in NODE_FIGURES if k in info},
                # the process last heard from, even when down now: what 'irdmafs down' stops
                # (a node restarted by hand or by the soak is not the one 'up' started)
                "last_pid": cluster.liveness.info.get(spec.name, {}).get("pid"),
            }
        )
    return out


async def statfs(client: "Client") -> dict:
    """The cluster's capacity and use, divided by R (what a file system can hold)."""
    total = used = 0
    for node in client.cluster.roles.ready():
        with contextlib.suppress(NodeDown, RemoteError):
            r = await client.cluster.call(node, "statfs")
            total += r["capacity"]
            used += r["used"]
    replicas = client.cluster.roles.members.replicas
    return {"capacity": total // replicas, "used": used // replicas}


def figures(client: "Client") -> dict:
    """The client's counters: bytes moved, calls made, and what it runs with."""
    return {
        "bytes_read": client.io.bytes_read,
        "bytes_written": client.io.bytes_written,
        "bytes_pushed": client.io.bytes_pushed,
        "metadata_calls": client.meta.calls,
        "control_calls": client.cluster.peers.calls,
        "control_calls_by_method": dict(client.cluster.peers.calls_by_method),
        "replicas": client.cluster.roles.members.replicas,
        "stripe_unit": client.cfg.stripe_unit,
        "transport": client.cluster.peers.transport.name,
    }


async def stray_stripes(client: "Client") -> list[tuple[str, int, int]]:
    """Live stripes the nodes hold past their file's end, or of no file: memory nobody can
    read (a failed write that kept what it committed held 450 MB of a full cluster). None at
    rest: a write in flight may hold one until its ``extend`` (the ENOSPC tests and the chaos
    soak ask once every writer has stopped). (node, file, stripe) of each."""
    out: list[tuple[str, int, int]] = []
    attrs: dict[int, dict | None] = {}
    for name in client.cluster.roles.ready():
        for fid, idx, snap, *_ in (await client.cluster.call(name, "stripes"))["stripes"]:
            if snap != 0:
                continue  # a snapshot's (it keeps its own extent), or optimizer state
            if fid not in attrs:
                try:
                    attrs[fid] = await client.getattr(fid)
                except RemoteError as exc:
                    if exc.code != "ENOENT":
                        raise
                    attrs[fid] = None
            a = attrs[fid]
            if a is None or not a.get("unit") or idx * a["unit"] >= extent_end(a):
                out.append((name, fid, idx))
    return out

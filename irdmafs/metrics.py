"""Metrics of a node or a mount: gathered as plain numbers, served to Prometheus, shown by status.

``Latency`` keeps per-operation histograms in plain Python (the hot paths only add to a list).
``node_samples`` (here) and a mount's ``mount_samples`` (fs/status.py, so that a node loads no
client code) turn a process's state into samples: (name, type, help, labels, value). ``serve``
exposes them at ``/metrics`` on an HTTP endpoint (prometheus-client's WSGI app, in a thread of
its own; collection copies what it reads, so the trio thread never waits for a scrape) with the
process's own figures (RSS, CPU), and the same samples feed ``.irdma/stats`` and ``irdmafs
status``.
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable

log = logging.getLogger(__name__)

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Sample = tuple[str, str, str, dict, object]  # name, "counter"|"gauge"|"histogram", help, labels, value


class Latency:
    """Histograms of operation latency, per operation name."""

    def __init__(self) -> None:
        self.ops: dict[str, list] = {}  # op -> [counts per bucket (+Inf last), sum, count]

    def observe(self, op: str, seconds: float) -> None:
        h = self.ops.get(op)
        if h is None:
            h = self.ops[op] = [[0] * (len(BUCKETS) + 1), 0.0, 0]
        h[0][bisect.bisect_left(BUCKETS, seconds)] += 1
        h[1] += seconds
        h[2] += 1

    def snapshot(self) -> dict[str, dict]:
        out = {}
        for op, (counts, total, n) in list(self.ops.items()):
            cum, acc = [], 0
            for c in counts:
                acc += c
                cum.append(acc)
            out[op] = {"count": n, "sum": total, "buckets": cum}
        return out


def latency_samples(name: str, what: str, latency: Latency, label: str) -> list[Sample]:
    return [(name, "histogram", what, {label: op}, h) for op, h in latency.snapshot().items()]


def data_plane_sample(role: str, facts: dict) -> Sample:
    """``irdmafs_data_plane_info{role, transport, engine, kernels, ...} 1``: what serves this
    node's or mount's data plane (runtime/dataplane.py), with why for what is not native."""
    eng, ker = facts["engine"], facts["kernels"]
    labels = {
        "role": role,
        "transport": facts["transport"],
        "engine": eng["name"],
        "engine_why": eng["why"],
        "kernels": "native" if ker["native"] else "numpy",
        "kernels_why": ker["why"],
    }
    return ("irdmafs_data_plane_info", "gauge", "what serves the data plane: transport, engine (native or python), kernels (native or numpy)", labels, 1)


def node_samples(node) -> list[Sample]:
    """A PS node's figures: storage, calls, one-sided traffic served, peers, training clocks."""
    s: list[Sample] = [
        ("irdmafs_node_up", "gauge", "1 once the node serves (ready), 0 while it resyncs", {"state": node.state}, 1 if node.state == "ready" else 0),
        ("irdmafs_node_stripes", "gauge", "stripes held (live, snapshots, optimizer state)", {}, len(node.store.stripes)),
        ("irdmafs_node_bytes", "gauge", "bytes of stripe data held", {}, node.store.bytes_held),
        ("irdmafs_node_capacity_bytes", "gauge", "configured capacity", {}, node.cfg.capacity),
        ("irdmafs_node_snapshot_bytes", "gauge", "memory only snapshots hold (what changed since they were taken)", {}, node.store.snapshot_bytes),
        ("irdmafs_node_loop_lag_worst_seconds", "gauge", "the longest the node's loop ran late since start", {}, node.loop_lag.worst),
        ("irdmafs_node_loop_busy_worst_seconds", "gauge", "the longest the node's own work held its loop (CPU time of a lag)", {}, node.loop_lag.worst_busy),
        ("irdmafs_node_loop_lag_recent_seconds", "gauge", "the longest the node's loop ran late in the last 10 s", {}, node.loop_lag.recent),
    ]
    for kind, nbytes in list(node.budget.held.items()):
        s.append(("irdmafs_node_held_bytes", "gauge", "memory held against the capacity, by kind", {"kind": kind}, nbytes))
    for method, n in list(node.counters.items()):
        s.append(("irdmafs_node_calls_total", "counter", "control calls served, by method", {"method": method}, n))
    for op, (count, nbytes) in list(node.transport.served.items()):
        s.append(("irdmafs_node_served_total", "counter", "one-sided operations served (tcp; verbs ones bypass the CPU)", {"op": op}, count))
        s.append(("irdmafs_node_served_bytes_total", "counter", "bytes moved by one-sided operations served", {"op": op}, nbytes))
    if node.cluster is not None:
        states = [node.cluster.roles.node_state(n) for n in node.cluster.roles.members.names if n != node.name]
        for st in ("ready", "syncing", "down"):
            s.append(("irdmafs_node_peers", "gauge", "peers by state, as this node sees them", {"state": st}, states.count(st)))
        s.append(("irdmafs_node_replicas_behind", "gauge", "peers whose replicas are behind (syncing or down)", {}, sum(st != "ready" for st in states)))
        s.append(("irdmafs_node_caught_up", "gauge", "1 once the node serves and has taken its stripes back", {}, int(node.caught_up)))
        leading = node.leading()
        s.append(("irdmafs_node_stripes_degraded", "gauge", "stripes this node leads with a home that does not serve (not whole)", {}, leading["degraded"]))
        s.append(("irdmafs_node_led_bytes", "gauge", "bytes of the live stripes this node leads (their primary)", {}, leading["led_bytes"]))
    data_plane = getattr(node, "data_plane", None)  # (a stand-in node of the metrics tests has none)
    if data_plane is not None:
        s.append(data_plane_sample("node", data_plane))
    missing = getattr(node, "missing", None)  # (a stand-in node of the metrics tests has none)
    if missing is not None:
        lost = missing.summary()
        s.append(("irdmafs_node_lost_stripes", "gauge", "written stripes this node came back without and no peer held (reads get EIO)", {}, lost["stripes"]))
        s.append(("irdmafs_node_lost_bytes", "gauge", "bytes of those stripes", {}, lost["bytes"]))
    tails = getattr(node, "tails", None)
    if tails is not None:
        s.append(("irdmafs_node_trimmed_stripes_total", "counter", "stripes freed past their file's end after their writer was gone", {}, tails.trimmed))
    s += latency_samples("irdmafs_node_call_seconds", "control call latency on the node", node.latency, "method")
    s += training_samples(node)
    return s


def training_samples(node) -> list[Sample]:
    """Per tensor (file id) this node is primary for: each rank's pushes and the staleness."""
    pushes: dict[tuple[int, int], int] = {}
    for (fid, _idx), st in node.records.items():
        for rank, n in list(st.pushed.items()):
            pushes[(fid, rank)] = max(pushes.get((fid, rank), 0), n)
    s: list[Sample] = []
    by_fid: dict[int, list[int]] = {}
    for (fid, rank), n in sorted(pushes.items()):
        s.append(("irdmafs_worker_pushes", "gauge", "pushes of a rank applied to a tensor (its clock)", {"tensor": str(fid), "rank": str(rank)}, n))
        by_fid.setdefault(fid, []).append(n)
    for fid, ns in by_fid.items():
        s.append(("irdmafs_tensor_staleness_steps", "gauge", "fastest rank's pushes minus the slowest's", {"tensor": str(fid)}, max(ns) - min(ns)))
    return s


def as_dict(samples: list[Sample]) -> dict:
    """Samples as one JSON-able document: name -> list of {labels, value}."""
    out: dict[str, list] = {}
    for name, _kind, _help, labels, value in samples:
        out.setdefault(name, []).append({"labels": labels, "value": value})
    return out


def parse_address(address: str) -> tuple[str, int]:
    """``[HOST:]PORT`` (``[::1]:9100`` for IPv6) as (host, port); a port alone listens on every
    address. ValueError, saying what was expected, for anything else."""
    host, _, port = str(address).rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not [HOST:]PORT (a port number from 0 to 65535, e.g. 9100 or 127.0.0.1:9100)")
    return host, int(port)


def serve(address: str, samples: Callable[[], list[Sample]]) -> tuple[str, int]:
    """Serve ``samples()`` to Prometheus on ``[host:]port`` (port 0: any) at ``/metrics`` (any
    other path is 404: a scrape of a wrong path must not look like a working one), with the
    process's own figures (``process_resident_memory_bytes``, CPU seconds, open fds); returns
    the address. ValueError for an address that is not one, OSError (saying which address) when
    it cannot listen there; served from a thread of its own."""
    import socket
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    host, port = parse_address(address)

    class Collector:
        def collect(self):
            families: dict[str, object] = {}
            for _ in range(3):  # the trio thread may change a dict mid-copy: read again
                try:
                    got = samples()
                    break
                except RuntimeError:
                    continue
            else:
                return
            for name, kind, what, labels, value in got:
                key = (name, tuple(sorted(labels)))
                fam = families.get(key)
                if fam is None:
                    cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[kind]
                    fam = families[key] = cls(name.removesuffix("_total") if kind == "counter" else name, what, labels=sorted(labels))
                values = [labels[k] for k in sorted(labels)]
                if kind == "histogram":
                    bounds = [str(b) for b in BUCKETS] + ["+Inf"]
                    fam.add_metric(values, list(zip(bounds, value["buckets"], strict=True)), value["sum"])
                else:
                    fam.add_metric(values, value)
            yield from families.values()

    registry = CollectorRegistry()
    registry.register(Collector())
    ProcessCollector(registry=registry)  # RSS, CPU, fds of this process (from /proc)
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: the metrics are at /metrics\n"]
        return metrics_app(environ, start_response)

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:  # a scrape every few seconds is not news
            pass

    try:
        server = make_server(host, port, app, Server, handler_class=Quiet)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    bound = server.server_address[:2]
    log.info("metrics on http://%s:%d/metrics", *bound)
    return bound

"""The ``irdmafs`` command: up, down, serve, mount, rebalance, status.

User mistakes (a bad config, a mountpoint that is not a directory, nothing running) end with one
line on stderr and a non-zero exit (2 for a bad config or bad usage), never a traceback.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import trio

from .. import config as C
from ..client.nodes import NODE_FIGURES
from ..runtime import dataplane
from .etcd_process import LocalEtcd, LocalEtcdCluster, health_error, is_local_etcd
from .local import LocalCluster, pids_alive, probe, wait_settled, write_config
from ..server.node import setup_logging

log = logging.getLogger("irdmafs")


class QuietError(Exception):
    """An error for the user: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def state_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "irdmafs"


def registry_path(mountpoint: str) -> Path:
    key = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:16]
    return state_home() / "mounts" / f"{key}.json"


def load_config(path: str) -> C.ClusterConfig:
    try:
        return C.load(path)
    except C.ConfigError as exc:
        raise QuietError(str(exc), 2) from None


def check_mountpoint(mountpoint: str, options: list[str] | tuple = ()) -> str:
    """The absolute mountpoint, or one line saying why not: not a directory, already mounted,
    or not empty (a mount would hide what is there, as it once hid a checkout and its .venv)
    unless ``nonempty`` is among the options, as s3fs does."""
    from .mount import clear_dead_mount, is_mounted, require_fuse

    if not require_fuse():
        raise QuietError(
            "mounting needs pyfuse3, which does not import: pip install 'irdmafs[fuse]'; "
            "it builds against libfuse3 (Debian: apt-get install fuse3 libfuse3-dev pkg-config gcc)",
            2,
        )
    mp = os.path.abspath(mountpoint)
    if not os.path.isdir(mp):
        raise QuietError(f"{mountpoint}: not a directory", 2)
    clear_dead_mount(mp)  # a mount whose process died: mounting again over it recovers
    if is_mounted(mp):
        raise QuietError(f"{mountpoint}: already a mount point", 2)
    if "nonempty" not in options and os.listdir(mp):
        raise QuietError(f"{mountpoint}: not empty; a mount would hide what is in it (mount on an empty directory, or add -o nonempty)", 2)
    return mp


# -- up / down -------------------------------------------------------------------------------------
COORDINATOR_RECORD = "coordinator.json"  # in the state dir: the etcd 'up' started for its config


def start_coordinator(state: Path, *, fresh: bool, size: int = 1, ports: list[tuple[int, int]] | None = None) -> LocalEtcd | LocalEtcdCluster:
    """The etcd of the local cluster of ``state``: one member (data in state/etcd, log in
    state/etcd.log) or ``size`` members (data in state/etcd/m<i>, logs state/etcd-m<i>.log),
    recorded there so a later 'up' of the same state starts it again on the ports its config
    names. ``fresh``: its data go first (a new cluster, or nodes that come back empty: views of
    the data they held would be wrong)."""
    data = state / "etcd"
    if fresh:
        shutil.rmtree(data, ignore_errors=True)
    if size == 1:
        client_port, peer_port = ports[0] if ports else (None, None)
        etcd: LocalEtcd | LocalEtcdCluster = LocalEtcd(data, client_port=client_port, peer_port=peer_port, log_path=state / "etcd.log")
    else:
        etcd = LocalEtcdCluster(data, size, ports=ports, log_dir=state)
    try:
        etcd.start()
    except RuntimeError as exc:
        raise QuietError(f"could not start the coordination service (etcd): {exc}") from None
    record = {"endpoints": etcd.endpoints, "ports": [[m.client_port, m.peer_port] for m in etcd.members]}
    (state / COORDINATOR_RECORD).write_text(json.dumps(record, indent=1))
    return etcd


def restart_coordinator(state: Path, cfg: C.ClusterConfig, *, fresh: bool) -> LocalEtcd | LocalEtcdCluster | None:
    """The etcd an earlier 'up' started for this state's config, started again; None when the
    config names another coordinator (one run elsewhere)."""
    try:
        record = json.loads((state / COORDINATOR_RECORD).read_text())
    except (OSError, ValueError):
        return None
    if "endpoint" in record:  # as an 'up' of one member wrote it before clusters of several
        record = {"endpoints": [record["endpoint"]], "ports": [[record["client_port"], record["peer_port"]]]}
    if cfg.coordinator != record.get("endpoints"):
        return None
    ports = [tuple(p) for p in record["ports"]]
    return start_coordinator(state, fresh=fresh, size=len(ports), ports=ports)


UP_DEFAULTS = {"nodes": 3, "replicas": 2, "stripe_unit": "4MiB", "transport": "auto", "coordinators": 1}


def _made_dirs(path: str) -> list[Path]:
    """``path`` made with its missing parents; the directories this made, deepest first (what
    a failed 'up' removes again, and only that)."""
    made, p = [], Path(path).absolute()
    while not p.exists():
        made.append(p)
        p = p.parent
    os.makedirs(path, exist_ok=True)
    return made


def _remove_made(made: list[Path]) -> None:
    for d in made:
        try:
            d.rmdir()  # only if still empty: nothing of anyone else's goes
        except OSError:
            break


def _describe(cfg: C.ClusterConfig) -> str:
    unit = cfg.stripe_unit
    unit_text = f"{unit >> 20} MiB" if unit % (1 << 20) == 0 else f"{unit >> 10} KiB"
    transport = ",".join(cfg.transport)
    return f"{len(cfg.nodes)}-node R={cfg.replicas} config (stripe unit {unit_text}, transport {transport}, {len(cfg.coordinator)} coordinator(s))"


def check_same_config(args: argparse.Namespace, cfg: C.ClusterConfig, state: Path, stripe_unit: int | None) -> None:
    """An existing config in the state dir is what 'up' brings up: a flag given that says
    otherwise is refused, naming the config there (it once brought up the old 3-node R=2
    config of a mountpoint used before, silently, for '--nodes 2 --replicas 1')."""
    differs = []
    if args.nodes is not None and args.nodes != len(cfg.nodes):
        differs.append(f"--nodes {args.nodes}")
    if args.replicas is not None and args.replicas != cfg.replicas:
        differs.append(f"--replicas {args.replicas}")
    if stripe_unit is not None and stripe_unit != cfg.stripe_unit:
        differs.append(f"--stripe-unit {args.stripe_unit}")
    if args.transport is not None and cfg.transport != (list(C.DEFAULT_TRANSPORT) if args.transport == "auto" else [args.transport]):
        differs.append(f"--transport {args.transport}")
    if args.coordinators is not None and args.coordinators != len(cfg.coordinator):
        differs.append(f"--coordinators {args.coordinators}")
    if differs:
        raise QuietError(
            f"state dir {state} has a {_describe(cfg)}, not what {' '.join(differs)} asks; "
            "use --state elsewhere, or remove it (or leave those flags out to bring that config up)",
            2,
        )


def cmd_up(args: argparse.Namespace) -> int:
    given = {k: getattr(args, k) for k in UP_DEFAULTS}
    nodes, replicas, coordinators = (given[k] if given[k] is not None else UP_DEFAULTS[k] for k in ("nodes", "replicas", "coordinators"))
    if not 1 <= replicas <= nodes:  # before anything is made: a refused 'up' leaves nothing
        raise QuietError(f"--replicas must be between 1 and --nodes ({nodes})", 2)
    if coordinators < 1 or coordinators % 2 == 0:
        raise QuietError(f"--coordinators must be an odd number (1, 3, 5), not {coordinators}", 2)
    try:
        stripe_unit = C.parse_size(args.stripe_unit, "--stripe-unit") if args.stripe_unit is not None else None
    except C.ConfigError as exc:
        raise QuietError(str(exc), 2) from None
    made = _made_dirs(args.mountpoint)
    try:
        return _up(args, nodes, replicas, coordinators, stripe_unit)
    except BaseException:
        _remove_made(made)
        raise


def _up(args: argparse.Namespace, nodes: int, replicas: int, coordinators: int, stripe_unit: int | None) -> int:
    from .mount import MountFailed, mount_background

    mp = check_mountpoint(args.mountpoint, args.options.split(",") if args.options else [])
    reg = registry_path(mp)
    if reg.exists():
        raise QuietError(f"{mp} is already up (run: irdmafs down {mp})", 2)
    state = Path(args.state or state_home() / "clusters" / reg.stem).resolve()
    cfg_path = state / "cluster.toml"
    data = state / "data"  # where --persist keeps the nodes' data
    if cfg_path.exists():
        check_same_config(args, load_config(str(cfg_path)), state, stripe_unit)
    if not args.persist and data.is_dir() and any(data.iterdir()):
        raise QuietError(
            f"state dir {state} holds the data of an earlier 'up --persist' ({data}), which this 'up' would not load "
            "(the file system would start empty): add --persist to bring it back, or remove that directory to start empty",
            2,
        )
    etcd = None  # the coordination service, started before the nodes (they keep their views in it)
    if cfg_path.exists():  # the config as it is: restart the etcd it names if an earlier 'up' ran it here
        etcd = restart_coordinator(state, load_config(str(cfg_path)), fresh=not args.persist)
    else:
        state.mkdir(parents=True, exist_ok=True)
        etcd = start_coordinator(state, fresh=True, size=coordinators)
        transport = None if args.transport in (None, "auto") else [args.transport]  # auto: the config's default
        write_config(state, nodes, replicas, stripe_unit=stripe_unit or 4 << 20, transport=transport, coordinator=etcd.endpoints)
    lc = None
    try:
        lc = LocalCluster(cfg_path, persist=data if args.persist else None)
        lc.start_all()
        trio.run(wait_settled, lc.cfg)
        mount = mount_background(str(cfg_path), mp, args.options.split(",") if args.options else [], state / "mount.log")
    except BaseException as exc:
        if lc:
            lc.stop_all()
        if etcd:
            etcd.stop()
        if isinstance(exc, KeyboardInterrupt):
            raise
        why = exc.reason if isinstance(exc, MountFailed) else (str(exc) or type(exc).__name__)
        raise QuietError(f"could not bring the cluster up: {why} (logs in {state})") from None
    reg.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "mountpoint": mp,
        "state": str(state),
        "config": str(cfg_path),
        "persist": str(data) if args.persist else None,
        "mount_pid": mount.pid,
        "node_pids": {n: p.pid for n, p in lc.procs.items()},
    }
    if etcd:
        members = [{"endpoint": m.endpoint, "pid": m.pid, "data_dir": str(m.data_dir)} for m in etcd.members]
        record["coordinator"] = dict(members[0], members=members)
    reg.write_text(json.dumps(record, indent=1))
    coordinator = "coordinator " + ", ".join(etcd.endpoints if etcd else lc.cfg.coordinator)
    if args.persist:
        kept = f"data kept in {data} (a later 'up --persist --state {state}' brings it back)"
    else:
        kept = "data in memory only (gone at 'down'; --persist keeps it)"
    print(f"irdmafs: {len(lc.cfg.nodes)} nodes (R={lc.cfg.replicas}) mounted on {mp}; {coordinator}; config {cfg_path}; {kept}; logs in {state}")
    return 0


def _stop(pids: list[int], timeout: float = 10.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)  # a stopped (SIGSTOP) process must run to take SIGTERM
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids_alive(pids):
        os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    except OSError:
        return []


def _node_config(pid: int) -> str | None:
    """The config of ``pid`` if it is an irdmafs node process (``python -m irdmafs.server.node``
    or ``irdmafs serve``), as an absolute path; None for anything else (a mount, a pid reused)."""
    args = _cmdline(pid)
    is_node = any(a.endswith(b"irdmafs.server.node") for a in args) or (b"serve" in args and any(b"irdmafs" in a for a in args))
    if not is_node or b"--config" not in args[:-1]:
        return None
    config = os.fsdecode(args[args.index(b"--config") + 1])
    try:
        return os.path.join(os.readlink(f"/proc/{pid}/cwd"), config)
    except OSError:
        return config if os.path.isabs(config) else None


def _of_cluster(pid: int, config: str, token: bytes) -> bool:
    """Whether ``pid`` is a node process of the cluster of ``config``: run with that config, or
    with another one of the same token (a node started for a rebalance has the new config)."""
    theirs = _node_config(pid)
    if theirs is None:
        return False
    if os.path.realpath(theirs) == os.path.realpath(config):
        return True
    try:
        return C.load(theirs).token == token
    except C.ConfigError:
        return False


def _my_processes() -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == os.getuid() and int(entry.name) != os.getpid():
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def cluster_pids(info: dict) -> dict[str, set[int]]:
    """Every node process of the cluster ``up`` started, as far as can be known: the pids 'up'
    recorded, the ones the mount last heard in heartbeats (a node restarted by hand since, or
    one hung by SIGSTOP that no longer answers, or one a rebalance added), the ones answering
    heartbeats now, and any node process of this user run with a config of the same token (a
    node started for a rebalance that never became a member)."""
    found: dict[str, set[int]] = {n: {p} for n, p in info["node_pids"].items()}
    addresses: dict[str, str] = {}
    try:  # a hung mount must not hang 'down': read its status file in a child, with a deadline
        doc = subprocess.run(["cat", os.path.join(info["mountpoint"], ".irdma", "cluster")], capture_output=True, timeout=5).stdout
        for node in json.loads(doc or b"{}").get("nodes", []):
            addresses[node["name"]] = node.get("address", "")
            for key in ("pid", "last_pid"):
                if node.get(key):
                    found.setdefault(node["name"], set()).add(node[key])
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass
    cfg = C.load(info["config"])
    for spec in cfg.nodes:
        addresses.setdefault(spec.name, f"{spec.host}:{spec.port}")

    async def ask() -> None:
        for name, address in addresses.items():
            host, _, port = address.rpartition(":")
            if port.isdigit():
                status, _ = await probe(cfg, host, int(port))
                if status and status.get("pid"):
                    found.setdefault(name, set()).add(status["pid"])

    trio.run(ask)
    known = set().union(*found.values())
    for pid in _my_processes():
        if pid not in known and _of_cluster(pid, info["config"], cfg.token):
            args = _cmdline(pid)
            name = os.fsdecode(args[args.index(b"--node") + 1]) if b"--node" in args[:-1] else f"pid {pid}"
            found.setdefault(name, set()).add(pid)
    return {n: pids for n, pids in ((n, {p for p in pids if _of_cluster(p, info["config"], cfg.token)}) for n, pids in found.items()) if pids}


def cmd_down(args: argparse.Namespace) -> int:
    from .mount import unmount

    mp = os.path.abspath(args.mountpoint)
    reg = registry_path(mp)
    if not reg.exists():
        raise QuietError(f"{mp}: no cluster was brought up here by 'irdmafs up'", 2)
    info = json.loads(reg.read_text())
    nodes = cluster_pids(info)  # before unmounting: the mount knows the pids it heard
    if not unmount(mp):
        log.warning("%s is busy; detaching it lazily", mp)
        unmount(mp, lazy=True)
    _stop([info["mount_pid"]])
    pids = sorted(set().union(*nodes.values()))
    _stop(pids)
    coordinator = info.get("coordinator")  # after the nodes: they may still talk to it as they end
    if coordinator:
        members = coordinator.get("members", [coordinator])
        _stop([m["pid"] for m in members if is_local_etcd(m["pid"], m["data_dir"])])
    reg.unlink()
    also = " and the coordinator (etcd)" if coordinator else ""
    left = pids_alive(pids)
    if left:
        log.warning("node processes still running after SIGKILL: %s", ", ".join(map(str, left)))
    if info.get("persist"):
        kept = f"data kept in {info['persist']}: 'irdmafs up {mp} --persist --state {info['state']}' brings it back"
    elif "persist" in info:
        kept = f"the data are gone (in memory only: 'up --persist' keeps them); config and logs in {info['state']}"
    else:  # recorded by an 'up' before the record said
        kept = f"config and logs in {info['state']}"
    count = len(pids) - len(left)
    names = f" ({', '.join(sorted(nodes))})" if nodes else ""
    print(f"irdmafs: {mp} unmounted; {count} node process{'' if count == 1 else 'es'}{names}{also} stopped; {kept}")
    return 0


# -- serve / mount ------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from ..server.node import Node, choose_transport

    cfg = load_config(args.config)
    try:
        cfg.node(args.node)
    except C.ConfigError as exc:
        raise QuietError(str(exc), 2) from None
    mp = check_mountpoint(args.mount) if args.mount else None

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(Node(cfg, args.node, choose_transport(cfg), persist=args.persist).run)
            if mp:
                await wait_settled(cfg, [args.node], timeout=120)
                await n.start(mount_then_stop, n.cancel_scope)

    async def mount_then_stop(node_scope: trio.CancelScope, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The mount, until it ends (unmounted, or SIGTERM/SIGINT, which only the mount catches):
        then the node stops too, instead of running on without a way to be told to end."""
        from .mount import run_mount

        await run_mount(cfg, mp, [], task_status=task_status)
        node_scope.cancel()

    from .mount import MountError

    try:
        trio.run(main)
    except MountError as exc:
        raise QuietError(str(exc), 2) from None
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from ..metrics import parse_address
    from .mount import MountError, MountFailed, mount_background, run_mount

    cfg = load_config(args.config)
    options = [o for o in (args.options or "").split(",") if o]
    if args.metrics:
        try:
            parse_address(args.metrics)
        except ValueError as exc:
            raise QuietError(f"--metrics: {exc}", 2) from None
    mp = check_mountpoint(args.mountpoint, options)
    if args.foreground:
        from ..runtime import looplag

        try:
            trio.run(partial(run_mount, cfg, mp, options, metrics=args.metrics), instruments=looplag.instruments())
        except MountError as exc:
            raise QuietError(str(exc), 2) from None
        return 0
    log_dir = state_home() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"mount-{registry_path(mp).stem}.log"
    try:
        proc = mount_background(args.config, mp, options, log_path, metrics=args.metrics)
    except MountFailed as exc:
        raise QuietError(f"mount failed: {exc}", exc.code if exc.code == 2 else 1) from None
    except (RuntimeError, TimeoutError) as exc:
        raise QuietError(f"mount failed: {exc}") from None
    print(f"irdmafs: mounted on {mp} (pid {proc.pid}, log {log_path})")
    return 0


# -- rebalance -------------------------------------------------------------------------------------
def cmd_rebalance(args: argparse.Namespace) -> int:
    from .rebalance import RebalanceError, rebalance

    old, new = load_config(args.old), load_config(args.new)
    try:
        r = trio.run(partial(rebalance, old, new, show_progress=not args.quiet))
    except RebalanceError as exc:
        raise QuietError(f"rebalance: {exc}") from None
    pre, frozen = r["precopy"], r["frozen"]
    # what each added node already held: it fetched its share as it started, and then the
    # rebalance had little to copy
    held = "".join(f"; {n} held {h['stripes']} stripes, {h['bytes']} bytes before it (fetched as it started)" for n, h in r["held_before"].items())
    print(
        f"irdmafs: rebalanced to {', '.join(new.names)} (R={new.replicas}): {r['stripes']} stripes, {r['bytes']} bytes copied "
        f"({pre['stripes']} stripes, {pre['bytes']} bytes while writes went on; {frozen['stripes']}, {frozen['bytes']} under the freeze){held}"
    )
    return 0


# -- status ----------------------------------------------------------------------------------------
def coordinator_status(config_path: str | None) -> list[dict] | str:
    """Each etcd endpoint of the config, reachable or not (GET /health, 1 s each); or a line
    saying why that is not known."""
    if not config_path:
        return "unknown (no config path)"
    try:
        cfg = C.load(config_path)
    except C.ConfigError as exc:
        return f"unknown ({exc})"
    out = []
    for endpoint in cfg.coordinator:
        why = health_error(endpoint, timeout=1.0)
        out.append({"endpoint": endpoint, "reachable": why is None, **({"error": why} if why else {})})
    return out


def mount_root(path: str) -> str | None:
    """The mount ``path`` is in: itself or its nearest ancestor in the mount table (``status``
    run from inside a mount, with no argument); None if none is. From the mount table, not a
    stat: a hung mount must not hang the search."""
    from .mount import is_mounted

    p = os.path.abspath(path)
    while True:
        if is_mounted(p):
            return p
        if p == os.path.dirname(p):
            return None
        p = os.path.dirname(p)


def cmd_status(args: argparse.Namespace) -> int:
    if args.config:
        cfg = load_config(args.config)

        async def gather() -> list[dict]:
            out = []
            for spec in cfg.nodes:
                info, why = await probe(cfg, spec.host, spec.port)
                info = info or {}
                figures = {k: info[k] for k in NODE_FIGURES if k in info}
                out.append(
                    {"name": spec.name, "address": f"{spec.host}:{spec.port}", "state": info.get("state", "down"), "alive": bool(info), **figures}
                    | ({"error": why} if why else {})
                )
            return out

        nodes = trio.run(gather)
        transport = next((n["transport"] for n in nodes if "transport" in n), None)
        doc = {"config": os.path.abspath(args.config), "replicas": cfg.replicas, "transport": transport, "nodes": nodes}
    else:
        asked = os.path.abspath(args.mountpoint or ".")
        mp = mount_root(asked) or asked
        try:
            doc = json.loads(Path(mp, ".irdma", "cluster").read_text())
        except OSError as exc:
            raise QuietError(f"{asked}: not in an irdmafs mount ({exc.strerror})", 2) from None
        except ValueError:
            raise QuietError(f"{asked}: not in an irdmafs mount ({mp}/.irdma/cluster is not its status)", 2) from None
        add_degraded(doc)
    doc["coordinator"] = coordinator_status(doc.get("config"))
    doc["whole"], doc["whole_text"] = wholeness(doc["nodes"])
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0  # the document says what is down ("alive", "whole"); scripts read it
    print(f"config:    {doc.get('config')}")
    print(f"transport: {doc.get('transport')}    replicas: {doc.get('replicas')}")
    coordinator = doc["coordinator"]
    if isinstance(coordinator, str) or not coordinator:
        print(f"coordinator: {coordinator or 'none (no coordination service configured)'}")
    else:
        for c in coordinator:
            print(f"coordinator {c['endpoint']}: " + ("reachable" if c["reachable"] else f"UNREACHABLE ({c['error']})"))
    print(f"whole:     {doc['whole_text']}")
    widths = {"stripes": 8, "bytes": 14, "led": 14, "calls": 9, "served": 14, "behind": 6, "degraded": 8, "lost": 6}
    keys = ("stripes", "bytes", "led_bytes", "calls", "served_bytes", "replicas_behind", "degraded", "lost")
    print(f"{'node':10} {'address':22} {'pid':>8} {'state':8} " + " ".join(f"{h:>{w}}" for h, w in widths.items()))
    for n in doc["nodes"]:
        state = n["state"] if n.get("caught_up", True) or n["state"] != "ready" else "catching"  # ready, its hand-over not done
        row = dict(n, lost=(n.get("lost") or {}).get("stripes", "-") if n["alive"] else "-")
        cols = " ".join(f"{str(row.get(k, '-')):>{w}}" for k, w in zip(keys, widths.values()))
        print(f"{n['name']:10} {n['address']:22} {str(n.get('pid', '-')):>8} {state:8} {cols}")
    for n in doc["nodes"]:
        if n.get("error"):
            print(f"{n['name']}: {n['error']}")
    for ln in data_plane_lines(doc):
        print(ln)
    for n in doc["nodes"]:
        if "held" in n:
            print(memory_line(n))
    return 0 if all(n["alive"] for n in doc["nodes"]) else 1


def data_plane_lines(doc: dict) -> list[str]:
    """What serves each answering node's data plane, one line each (and the mount's, when the
    status is a mount's): its transport, engine (native or python) and kernels (native C or
    numpy), with why for what is not native (runtime/dataplane.py)."""
    out = []
    if doc.get("mountpoint") and "engine" in doc:
        out.append(f"data plane mount {doc['mountpoint']}: {dataplane.line(doc)}")
    for n in doc["nodes"]:
        if not n.get("alive"):
            continue
        if "engine" in n and "kernels" in n:
            out.append(f"data plane {n['name']}: {dataplane.line(n)}")
        else:  # a node of before this report
            out.append(f"data plane {n['name']}: transport {n.get('transport', '?')}, engine and kernels not reported")
    return out


def memory_line(n: dict) -> str:
    """What holds a node's memory against its capacity (server/budget.py), and its loop's worst
    lag; FULL once writes would get ENOSPC soon."""
    held, cap = n["held"], n.get("capacity") or 1
    used = sum(held.values())
    parts = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(held.items()))
    full = "  FULL: writes get ENOSPC (free space: rmdir a snapshot, delete files)" if used >= 0.95 * cap else ""
    lag = f"loop lag worst {n.get('loop_lag', 0):.3f} s ({n.get('loop_busy', 0):.3f} s its own work)"
    return f"memory {n['name']}: {used / 2**20:.0f} of {cap / 2**20:.0f} MiB ({parts} MiB); {lag}{full}"


def add_degraded(doc: dict) -> None:
    """The mount's table has its heartbeats' figures; the count of degraded stripes is asked of
    each node (it costs the node a look at every stripe it leads, so heartbeats leave it out),
    at the address the table gives: a node a rebalance added is in no config the mount read."""
    try:
        cfg = C.load(doc["config"])
    except (KeyError, TypeError, C.ConfigError):
        return

    async def ask() -> None:
        for n in doc["nodes"]:
            host, _, port = n.get("address", "").rpartition(":")
            if n["alive"] and port.isdigit():
                info, _ = await probe(cfg, host, int(port))
                n.update({k: info[k] for k in ("caught_up", "degraded", "led_bytes", "lost") if k in (info or {})})

    trio.run(ask)


def wholeness(nodes: list[dict]) -> tuple[bool | None, str]:
    """Whether every stripe has its R copies serving (server/health.py), as the nodes say, and
    the line that says so: True, False, or None when that is not known."""
    down = [n for n in nodes if not n["alive"]]
    if down:
        refused = [n["name"] for n in down if "token" in n.get("error", "")]
        if refused:
            return False, "no: " + ", ".join(refused) + " refused this config's cluster token (wrong cluster token)"
        return False, "no: " + ", ".join(n["name"] + (" syncing" if n["state"] == "syncing" else " not answering") for n in down)
    lost = [(n["name"], n["lost"]) for n in nodes if (n.get("lost") or {}).get("stripes")]
    if lost:
        count, nbytes = sum(x["stripes"] for _, x in lost), sum(x.get("bytes", 0) for _, x in lost)
        return False, f"no: {count} written stripes lost ({nbytes} bytes; on {', '.join(name for name, _ in lost)})"
    if not all(n.get("caught_up") for n in nodes):
        return False, "no: " + ", ".join(n["name"] for n in nodes if not n.get("caught_up")) + " not caught up"
    if any("degraded" not in n for n in nodes):
        return None, "unknown (ask with --config: the nodes count degraded stripes for it)"
    count = sum(n["degraded"] for n in nodes)
    return (False, f"no: {count} stripes with a copy not serving") if count else (True, "yes (every stripe has its R copies serving)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="irdmafs", description="A parameter server whose interface is a file system.")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    p = sub.add_parser("up", help="start a local etcd, nodes and a mount, in the background")
    p.add_argument("mountpoint", help="where to mount the cluster (an empty directory)")
    # defaults None: a flag given for a state dir whose config says otherwise is refused (cmd_up)
    p.add_argument("--nodes", type=int, help="how many PS node processes to start (default 3)")
    p.add_argument("--replicas", type=int, help="copies of every stripe, at most --nodes (default 2)")
    p.add_argument("--stripe-unit", help="unit of placement and of one transfer, e.g. 1MiB (default 4MiB)")
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "tcp"),
        help="auto (default): shared memory between the processes of this host (verbs where a device is); tcp: force TCP on loopback",
    )
    p.add_argument(
        "--state",
        help="directory for config, token and logs (default under ~/.local/state/irdmafs, one per mountpoint); a config already there is the one brought up",
    )
    p.add_argument("-o", dest="options", help="mount options, comma separated (e.g. allow_other)")
    p.add_argument(
        "--persist",
        action="store_true",
        help="nodes keep their data in STATE/data: a later 'up --persist' with the same --state brings it back; "
        "without it the data live in memory only and go at 'down'",
    )
    p.add_argument(
        "--coordinators",
        type=int,
        metavar="N",
        help="etcd members to run (odd: 1 (default), 3, 5); with 3 the cluster rides out one member stopped, killed or cut off, leader included",
    )
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("down", help="unmount and stop every process that 'up' started")
    p.add_argument("mountpoint", help="the mountpoint given to 'up'")
    p.set_defaults(fn=cmd_down)

    p = sub.add_parser("serve", help="run one PS node (and its own mount with --mount)")
    p.add_argument("--config", required=True, help="the cluster config (TOML)")
    p.add_argument("--node", required=True, help="the name of this node in the config")
    p.add_argument("--mount", help="also mount the file system here")
    p.add_argument("--persist", metavar="DIR", help="keep the node's stripes and namespace in DIR and load them at start")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("mount", help="mount a cluster")
    p.add_argument("--config", required=True, help="the cluster config (TOML)")
    p.add_argument("mountpoint", help="where to mount (an empty directory unless -o nonempty)")
    p.add_argument("-o", dest="options", help="mount options, comma separated")
    p.add_argument("-f", dest="foreground", action="store_true", help="stay in the foreground")
    p.add_argument("--metrics", metavar="[HOST:]PORT", help="serve Prometheus metrics here")
    p.set_defaults(fn=cmd_mount)

    p = sub.add_parser("rebalance", help="move a running cluster to the nodes of a new config")
    p.add_argument("--from", dest="old", required=True, help="the config the cluster runs with")
    p.add_argument("--to", dest="new", required=True, help="the new config (same token)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_rebalance)

    p = sub.add_parser("status", help="nodes, replicas, transport and config of a mount or a config")
    p.add_argument("mountpoint", nargs="?", help="a mounted cluster to ask")
    p.add_argument("--config", help="a cluster config to ask instead of a mount")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(fn=cmd_status)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging("irdmafs", logging.DEBUG if args.verbose else logging.INFO)
    try:
        code = args.fn(args)
        sys.stdout.flush()  # here, not at exit: a reader gone is a BrokenPipeError caught below
        return code
    except QuietError as exc:
        print(f"irdmafs: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader of our output went away (``irdmafs status | head``): quiet, as a Unix tool
        # is. Not SIGPIPE's default, which would also kill ``irdmafs serve``'s node mid-write.
        # Python flushes stdout again at exit: point it at /dev/null so that raises nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool SIGPIPE ended


if __name__ == "__main__":
    sys.exit(main())

"""A whole cluster on one machine: config, token, node processes on loopback, and their end.

This is the embedded default (``irdmafs up``) and the test bed: every node is a real
``python -m irdmafs.server.node`` process talking over real sockets. ``LocalCluster`` writes the
config into a state directory, starts the nodes, and waits until every node is ready and sees all
the others ready (writes made earlier than that could miss a replica).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import trio

from .. import config as C
from ..server.budget import machine_capacity
from ..errors import AuthError, TransportError
from ..transport.tcp import TcpTransport
from ..util import single_exception


HANDED_KEPT = 4096  # the last ports free_ports gave out, never given again (older ones were bound or dropped)
_HANDED: dict[tuple[str, int], None] = {}  # (host, port) -> None, oldest first


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, for servers started later.

    They are drawn below the kernel's ephemeral range: a port from that range (``bind`` to 0) can
    be taken, between the pick and the server's bind, as the local port of any outgoing
    connection on the machine, and the server then fails with EADDRINUSE. Below it only a bind
    can take a port, and this process never hands out one of its last HANDED_KEPT again."""
    top = min(_ephemeral_low(), 65536)
    low = 10000 if top > 12000 else 1024
    rng = secrets.SystemRandom()
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(64 * n + 64):
            if len(ports) == n:
                break
            port = rng.randrange(low, top)
            if (host, port) in _HANDED:
                continue
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
            _HANDED[(host, port)] = None
            if len(_HANDED) > HANDED_KEPT:
                del _HANDED[next(iter(_HANDED))]
    finally:
        for s in socks:
            s.close()
    if len(ports) < n:
        raise OSError(f"no {n} free ports on {host} between {low} and {top}")
    return ports


def write_config(
    state: Path,
    nodes: int,
    replicas: int,
    *,
    stripe_unit: int = 4 << 20,
    host: str = "127.0.0.1",
    transport: list[str] | None = None,
    coordinator: list[str],
    **extra: object,
) -> Path:
    """A fresh config (and a 0600 token file) for ``nodes`` nodes on ``host``; ``coordinator``:
    the etcd endpoints it names (``LocalEtcd`` runs one here; every config names one)."""
    state.mkdir(parents=True, exist_ok=True)
    token = state / "token"
    if not token.exists():
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
    extra.setdefault("capacity", machine_capacity(nodes))  # the nodes of this host fit in its memory
    doc = {
        "nodes": [{"name": f"n{i + 1}", "host": host, "port": p} for i, p in enumerate(free_ports(nodes, host))],
        "token_file": "token",
        "replicas": replicas,
        "stripe_unit": stripe_unit,
        "transport": transport or list(C.DEFAULT_TRANSPORT),
        "coordinator": coordinator,
        **extra,
    }
    cfg = C.from_dict(doc, base=state)
    path = state / "cluster.toml"
    path.write_text(C.dump(cfg))
    return path


async def node_status(cfg: C.ClusterConfig, name: str, *, timeout: float = 1.0) -> dict | None:
    """The node's heartbeat answer, or None if it cannot be reached."""
    spec = cfg.node(name)
    return (await probe(cfg, spec.host, spec.port, timeout=timeout))[0]


async def probe(cfg: C.ClusterConfig, host: str, port: int, *, timeout: float = 1.0) -> tuple[dict | None, str | None]:
    """The heartbeat answer of the node at ``host:port`` (one a config names, or one a
    rebalance added that it does not), and None; or None and why it did not answer (``wrong
    cluster token`` when it refused the config's token)."""
    transport = TcpTransport(cfg.token)
    try:
        with trio.fail_after(timeout), single_exception():
            async with trio.open_nursery() as n:
                conn = await transport.connect(host, port, nursery=n)
                try:
                    return await conn.call("heartbeat", {"from": "status"}), None
                finally:
                    await conn.aclose()
                    n.cancel_scope.cancel()
    except AuthError:
        return None, "wrong cluster token (the node refused this config's token)"
    except trio.TooSlowError:
        return None, f"no answer within {timeout:g} s"
    except (TransportError, OSError) as exc:
        return None, str(exc) or type(exc).__name__


async def wait_settled(cfg: C.ClusterConfig, names: list[str] | None = None, timeout: float = 30.0, *, whole_too: bool = True) -> None:
    """Until every node in ``names`` (default all) is ready, has caught up, sees all of them
    ready, and leads no stripe that is not whole (server/health.py): the cluster can lose any
    one node again without a read or a pull failing. ``whole_too=False``: ready and seeing them
    ready only (a node started for a rebalance, not yet a member, takes its stripes back only
    once the rebalance makes it one)."""
    names = names or cfg.names
    with trio.fail_after(timeout):
        while True:
            infos = [await node_status(cfg, n) for n in names]
            if all(whole(i, names) if whole_too else ready(i, names) for i in infos):
                return
            await trio.sleep(0.1)


def ready(info: dict | None, names: list[str]) -> bool:
    """A node's status (``node_status``) says it serves and sees ``names`` ready."""
    return bool(info) and info["state"] == "ready" and set(names) <= set(info["sees_ready"])


def whole(info: dict | None, names: list[str]) -> bool:
    """A node's status (``node_status``) says it serves whole: ready, caught up, seeing ``names``
    ready, and no stripe it leads degraded."""
    return ready(info, names) and info.get("caught_up", False) and not info.get("degraded")


class LocalCluster:
    """Node processes of one config, started and stopped from this process."""

    def __init__(self, config_path: Path, *, log_dir: Path | None = None, python: str = sys.executable, persist: Path | None = None):
        self.config_path = Path(config_path)
        self.persist = Path(persist) if persist else None  # nodes keep their data in persist/<name>
        self.cfg = C.load(self.config_path)
        self.log_dir = log_dir or self.config_path.parent
        self.python = python
        self.procs: dict[str, subprocess.Popen] = {}
        # node -> what runs its command (``ip netns exec NS`` for a node in a network namespace)
        self.launcher: dict[str, list[str]] = {}

    def command(self, name: str) -> list[str]:
        cmd = [self.python, "-m", "irdmafs.server.node", "--config", str(self.config_path), "--node", name]
        return self.launcher.get(name, []) + cmd + (["--persist", str(self.persist / name)] if self.persist else [])

    def start(self, name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(self.command(name), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start_all(self) -> None:
        for name in self.cfg.names:
            self.start(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(10)

    def stop_all(self) -> None:
        for name in list(self.procs):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                proc.send_signal(signal.SIGCONT)  # a stopped (SIGSTOP) node must run to take it
        deadline = time.monotonic() + 5
        for name, proc in list(self.procs.items()):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            del self.procs[name]

    def log_of(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"node {name} exited with {proc.returncode}:\n{self.log_of(name)[-3000:]}")


def end_on_sigterm() -> None:
    """SIGTERM (``timeout``, ``kill``, a job's end) ends this process as Ctrl-C does: as a
    KeyboardInterrupt, so the ``finally`` blocks and context managers that stop what it started
    (etcd, node processes, mounts) run, under trio too (trio's own SIGINT handler raises it
    where that is safe). A script that starts a cluster calls this first: SIGTERM's default
    ended one at once and left its etcd, nodes and mount running and mounted. A SIGTERM during
    that cleanup is ignored: the cleanup is bounded, and cutting it short left the same."""

    me, owner = os.path.basename(sys.argv[0]), os.getpid()

    def again(_sig: int, _frame) -> None:  # not SIG_IGN: a process started now would inherit it
        print(f"{me}: SIGTERM again: still stopping what it started", file=sys.stderr, flush=True)

    def on_term(_sig: int, _frame) -> None:
        if os.getpid() != owner:  # a forked worker (multiprocessing) ends as SIGTERM ends it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        signal.signal(signal.SIGTERM, again)
        print(f"{me}: SIGTERM: stopping what it started", file=sys.stderr, flush=True)
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            raise KeyboardInterrupt  # SIGINT ignored (started with & by a shell): raise it here
        signal.raise_signal(signal.SIGINT)  # trio's handler, or Python's, raises it

    signal.signal(signal.SIGTERM, on_term)


def pids_alive(pids: list[int]) -> list[int]:
    """The ones of ``pids`` still running: a zombie (ended, its parent has not reaped it yet) is
    not, or 'down' waited out its deadline for a node a test started and had not reaped."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:  # another user's: running, whatever it is
            pass
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except (OSError, IndexError):
            pass
        alive.append(pid)
    return alive

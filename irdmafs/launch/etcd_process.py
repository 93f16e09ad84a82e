"""The lifecycle of local etcd processes: find the binary, start a single-member etcd or a cluster
of several members (``LocalEtcdCluster``: three by default, as a real cluster runs), know when it
serves and which member leads, stop it; and the signals fault tests send a member (kill, pause,
resume).

This is what ``irdmafs up`` runs as the local cluster's coordination service and what tests
start in a temporary directory. It is plain blocking code (``subprocess``, ``urllib``): it runs
before any trio loop, or from a test fixture. Deployments run etcd their own way (``deploy/``).

Error handling: a binary that is missing, an etcd that exits while starting or does not answer
``/health`` in time all raise ``RuntimeError`` saying why (with the tail of etcd's log when there
is one); the process is gone when that happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from .local import free_ports

# etcd is cluster-internal: a proxy from the environment (http_proxy) would at best add a hop,
# and for 127.0.0.1 it answers with its own error page. Never go through one.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def find_etcd() -> str:
    """The path of the ``etcd`` binary (Debian's ``etcd-server`` puts it in /usr/bin)."""
    path = shutil.which("etcd")
    if path is None:
        raise RuntimeError("no etcd binary on PATH: run scripts/setup, which installs Debian's etcd-server (apt-get install etcd-server)")
    return path


def health_error(endpoint: str, timeout: float = 1.0) -> str | None:
    """Why the etcd at ``endpoint`` (``http://host:port``) is not healthy, or None if its
    ``GET /health`` answers ``{"health": "true"}`` within ``timeout`` seconds."""
    try:
        with _NO_PROXY.open(endpoint.rstrip("/") + "/health", timeout=timeout) as answer:
            body = answer.read()
    except urllib.error.HTTPError as exc:  # etcd answers 503 with {"health": "false"} without a leader
        return f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace').strip()}"
    except urllib.error.URLError as exc:
        return str(exc.reason)
    except (OSError, ValueError) as exc:  # a timeout while reading, a connection reset, a bad URL
        return str(exc) or type(exc).__name__
    try:
        doc = json.loads(body)
    except ValueError:
        return f"not etcd: {body[:80]!r}"
    if not isinstance(doc, dict) or doc.get("health") != "true":
        return f"unhealthy: {body[:200].decode(errors='replace')}"
    return None


class LocalEtcd:
    """One etcd member serving ``data_dir``, on ``host``: alone (a single-member etcd), or one of
    a ``LocalEtcdCluster`` (``name`` and ``peers``, every member's name and peer URL).

    Ports not given are picked free when the object is made, so ``endpoint`` is known before
    ``start()``. ``start()`` may be called again after the process ended (``kill``, ``stop``):
    the same data directory and ports come back, as a restarted member would.
    """

    NAME = "irdmafs"  # a single member's name; a data directory remembers it

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        log_path: Path | None = None,
        name: str = NAME,
        peers: list[tuple[str, str]] | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.host = host
        self.name = name
        self.peers = peers  # None: alone
        if client_port is None or peer_port is None:
            picked = free_ports(2, host)
            client_port = client_port if client_port is not None else picked[0]
            peer_port = peer_port if peer_port is not None else picked[1]
        self.client_port = client_port
        self.peer_port = peer_port
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    def _url(self, port: int) -> str:
        return f"http://[{self.host}]:{port}" if ":" in self.host else f"http://{self.host}:{port}"  # an IPv6 address goes in brackets

    @property
    def endpoint(self) -> str:
        return self._url(self.client_port)

    @property
    def peer_url(self) -> str:
        return self._url(self.peer_port)

    @property
    def endpoints(self) -> list[str]:
        """As ``LocalEtcdCluster``'s: what a config names."""
        return [self.endpoint]

    @property
    def members(self) -> list[LocalEtcd]:
        return [self]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        return [
            find_etcd(),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            ",".join(f"{n}={u}" for n, u in self.peers) if self.peers else f"{self.name}={self.peer_url}",
            # 3.4's default logger (capnslog) ignores --log-level for raft's lines and warns that
            # it is deprecated; zap honours it
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            "--log-level",
            "warn",
        ]

    def start(self, timeout: float = 15.0) -> str:
        """Start etcd and return its endpoint once ``/health`` says it serves."""
        self.launch()
        return self.wait_healthy(timeout)

    def launch(self) -> None:
        """Start the process, without waiting: a member of a cluster serves only once a majority
        of the members runs (``LocalEtcdCluster`` launches them all, then waits)."""
        if self.running:
            raise RuntimeError(f"etcd is already running (pid {self.pid})")
        cmd = self.command()
        for port in (self.client_port, self.peer_port):
            self._check_free(port)
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")
        else:
            out = subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()

    def wait_healthy(self, timeout: float = 15.0) -> str:
        """Until ``/health`` says the launched process serves: its endpoint. A process that exits
        or does not serve in time is ended (RuntimeError, with the tail of its log)."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        why = "not started"
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"etcd exited with status {self.proc.returncode} while starting{self._log_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"etcd at {self.endpoint} not healthy after {timeout:g} s ({why}){self._log_tail()}")
                why = health_error(self.endpoint, timeout=min(1.0, left))
                if why is None:
                    return self.endpoint
                time.sleep(0.1)
        except BaseException:  # a start that failed (or was interrupted) leaves no etcd behind
            if self.running:
                self._end(signal.SIGKILL)
            raise

    def _check_free(self, port: int) -> None:
        """Refuse a port something else listens on: an etcd already there would answer our
        health checks while ours exits, and we would report its endpoint as ours."""
        with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go's listeners do: TIME_WAIT is no obstacle
            try:
                s.bind((self.host, port))
            except OSError as exc:
                raise RuntimeError(f"etcd cannot listen on {self.host}:{port}: {exc.strerror}") from None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, and SIGKILL if it has not ended after ``timeout`` seconds. Idempotent."""
        if self.running:
            self._end(signal.SIGTERM, timeout)

    def _end(self, sig: int, timeout: float = 5.0) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.send_signal(signal.SIGCONT)  # a paused (SIGSTOP) etcd must run to take SIGTERM
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (a crash by default); a process ended by it is reaped."""
        if not self.running:
            raise RuntimeError("etcd is not running")
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: a hung etcd (connections accepted by the kernel, never answered)."""
        self.kill(signal.SIGSTOP)

    def resume(self) -> None:
        self.kill(signal.SIGCONT)

    def _log_tail(self, limit: int = 3000) -> str:
        if not self.log_path:
            return " (no log: etcd's output went to /dev/null)"
        try:
            text = self.log_path.read_bytes()[-limit:].decode(errors="replace")
        except OSError as exc:
            return f" (its log {self.log_path}: {exc.strerror})"
        return f"; the end of {self.log_path}:\n{text}"

    def __enter__(self) -> LocalEtcd:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalEtcd({self.endpoint}, data_dir={self.data_dir}, pid={self.pid})"


class LocalEtcdCluster:
    """``size`` etcd members (three by default: one can stop, be killed or lead no more and the
    others go on) on ``host`` (or member i on ``host[i]``: an address of its own, which a test
    can cut a node off from), member i in ``data_root``/m<i> with its log in ``log_dir``.

    ``ports``: each member's (client, peer) ports, for a cluster started again on its data;
    picked free otherwise. ``start()`` launches every member, then waits until each serves.
    The members are ``members``; ``leader()`` says which one leads now.
    """

    def __init__(
        self,
        data_root: Path,
        size: int = 3,
        *,
        host: str | list[str] = "127.0.0.1",
        ports: list[tuple[int, int]] | None = None,
        log_dir: Path | None = None,
    ):
        if size < 1 or size % 2 == 0:
            raise ValueError(f"an etcd cluster has an odd number of members, not {size}")
        hosts = [host] * size if isinstance(host, str) else list(host)
        picked = ports or [tuple(free_ports(2, h)) for h in hosts]
        if len(picked) != size or len(hosts) != size:
            raise ValueError(f"{len(picked)} port pairs and {len(hosts)} hosts for {size} members")
        names = [f"m{i}" for i in range(size)]

        def url(h: str, port: int) -> str:
            return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"

        peers = [(n, url(h, peer)) for n, h, (_, peer) in zip(names, hosts, picked)]
        log = (lambda n: Path(log_dir) / f"etcd-{n}.log") if log_dir else (lambda n: None)
        self.members = [
            LocalEtcd(Path(data_root) / n, host=h, client_port=c, peer_port=p, log_path=log(n), name=n, peers=peers)
            for n, h, (c, p) in zip(names, hosts, picked)
        ]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def running(self) -> bool:
        return any(m.running for m in self.members)

    def start(self, timeout: float = 20.0) -> list[str]:
        """Launch every member not running, then wait until each serves; the endpoints. A member
        that fails to start ends them all (RuntimeError)."""
        try:
            for m in self.members:
                if not m.running:
                    m.launch()
            for m in self.members:
                m.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def leader(self, timeout: float = 1.0) -> LocalEtcd | None:
        """The member that leads now, as the running members' status says; None if none knows."""
        for m in self.members:
            if not m.running:
                continue
            status = member_status(m.endpoint, timeout)
            if status is not None and status.get("leader") and status["leader"] == status.get("header", {}).get("member_id"):
                return m
        return None

    def __enter__(self) -> LocalEtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalEtcdCluster({', '.join(self.endpoints)})"


def member_status(endpoint: str, timeout: float = 1.0) -> dict | None:
    """The member's ``/v3/maintenance/status`` (its id, the leader's id, raft term), or None if
    it does not answer in ``timeout`` seconds."""
    request = urllib.request.Request(endpoint.rstrip("/") + "/v3/maintenance/status", data=b"{}", headers={"Content-Type": "application/json"})
    try:
        with _NO_PROXY.open(request, timeout=timeout) as answer:
            doc = json.loads(answer.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def is_local_etcd(pid: int, data_dir: Path | str) -> bool:
    """Whether ``pid`` is an etcd serving ``data_dir`` (not a pid reused by something else)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(args) and os.path.basename(args[0]) == b"etcd" and os.fsencode(str(data_dir)) in args

"""A seeded fault-injection soak: a local cluster and its mount under load while faults land.

    scripts/chaos.py --minutes 30 --seed 7 --json chaos.json
    scripts/chaos.py --seed 7 --schedule 20      # the first 20 faults of seed 7, then exit

Workers check content continuously through the mount, each in its own directory so that what
a file must hold is known exactly: files of random sizes written at random offsets, truncated,
renamed, read back byte for byte; tensors saved with ``np.save`` and loaded with ``np.load``;
snapshots taken and read back; a training job (2 ranks, bsp, SGD, through the step streams)
whose every pull must equal SGD's result; with ``--model-gib G``, a model of G GiB trained the
same way while a snapshot is taken every 3 steps and copied out by ``cp -a`` and ``rsync -a``,
every copy checked against the parameters of its step. Meanwhile a scheduler applies faults drawn from the
seed, one at a time, waiting until the cluster has settled (every node ready and resynced)
before the next, so never more than R-1 nodes are out at once:

- ``kill``: ``kill -9`` of a node, then its restart from its own command line;
- ``stop``: ``SIGSTOP`` (a hung node), then ``SIGCONT``;
- ``partition``: the node's veth taken down, then up (as root: nodes in network namespaces): it is
  cut off from every node, the mounts and the coordinator;
- ``cut``: only the links between the node and every other node cut (blackhole routes on both
  sides; as root): the mounts and the coordinator still reach it;
- ``mount``: ``kill -9`` of the mount process, then mounting again;
- ``etcd-stop``, ``etcd-kill``: the coordination service (a local etcd the soak starts, named in
  the cluster's config: its views choose every stripe's primary and replicas; three members
  unless ``--coordinators`` says otherwise) hung by ``SIGSTOP``, or killed and started again on
  its data: with one member, etcd itself; with several, one member (the target node's index
  picks which);
- ``etcd-leader-kill`` (several members): whichever member leads at that moment killed, and
  started again;
- ``etcd-minority`` (several members, as root): the node reaches only one member (blackhole
  routes in its namespace to the others' addresses). That member still has its majority and
  forwards to the leader, so the node keeps its lease and serves.

As root, when partitions are among the fault kinds, a second mount runs inside node n1's network
namespace, with its own file and tensor workers: when n1 is partitioned that mount is on the
minority side (without partitions it would only double the load: on two cores that load alone
made healthy nodes fence for a stalled event loop). Its calls may fail while
the partition lasts and until the cluster has settled (EIO, ETIMEDOUT, EAGAIN besides the
mount-outage errors), and what such a call touched is forgotten; nothing else is allowed, and
everything it was told succeeded must read back. A tensor save or file create that fails leaves
no expectation behind (its file is removed), so one failure is counted once, not again as lost
bytes.

The schedule (kinds, targets, durations, gaps) is a function of the seed alone: the same seed
replays the same faults. What a user call sees is counted: ``errors`` are errors outside the
documented window, ``lost`` bytes read back wrong or missing; both must be 0 (exit status 1
otherwise). The one window (README, Reliability): from a mount's kill until it is mounted again,
calls on it fail with ENOTCONN or ECONNABORTED, and paths below the bare mountpoint with ENOENT;
a file being changed then holds its old or its new content, so the checker forgets it (only
closed writes are promised). No other error is allowed, at any time.

Beside the workers, a *garbage peer* passes each node's handshake with the cluster's token and
sends it a broken frame (bad magic, an oversized document, a header cut short, a WRITE to no
region, random bytes), over and over: the node closes that connection only and goes on serving.
The data plane under test: ``--engine native`` (default: the engine where it is built) or
``python`` (every process with ``IRDMAFS_ENGINE=0``); ``--transport shm --stripe-unit 4`` is
the default cluster a user gets on one host (shared memory, 4 MiB stripes; loopback only, so
no partitions or cuts: abstract sockets are per network namespace).
"""

from __future__ import annotations

import argparse
import ast
import errno
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import trio

from irdmafs import config as C
from irdmafs import formats
from irdmafs.client.client import Client
from irdmafs.client.nodes import stray_stripes
from irdmafs.launch.etcd_process import LocalEtcd, LocalEtcdCluster
from irdmafs.launch.local import LocalCluster, free_ports, wait_settled
from irdmafs.server.budget import machine_capacity
from irdmafs.server.staging import STAGING_LEASE
from irdmafs.server.tails import SWEEP
from irdmafs.launch.mount import clear_dead_mount, is_mounted, mount_background, stop_background
from irdmafs.names import PACK_MIN_TENSORS
from irdmafs.worker.steps import pull_arrays, push_arrays
from irdmafs.errors import ProtocolError
from irdmafs.transport import protocol as P
from irdmafs.transport.base import client_proof, new_nonce

MiB = 1 << 20
WINDOW_ERRNOS = {errno.ENOTCONN, errno.ECONNABORTED, errno.ENOENT}
# what a mount on the minority side of a partition may answer while it lasts
MINORITY_ERRNOS = WINDOW_ERRNOS | {errno.EIO, errno.ETIMEDOUT, errno.EAGAIN, errno.EHOSTUNREACH}
ETCD_HOST = 250  # etcd member i listens on 10.<NET>.(250+i).1, an address the soak adds to the root namespace's lo
PREFIX, NET = "irdchaos", 83  # network namespaces irdchaos0.., addresses 10.83.i.2


# -- the schedule -----------------------------------------------------------------------------------
def schedule(seed: int, kinds: list[str], nodes: list[str]):
    """Faults of ``seed``, one after another: (kind, target, seconds out, seconds before it)."""
    rng = random.Random(seed)
    while True:
        kind = rng.choice(kinds)
        target = "mount" if kind == "mount" else rng.choice(nodes)
        yield {"kind": kind, "target": target, "down": round(rng.uniform(0.5, 4.0), 2), "gap": round(rng.uniform(1.0, 4.0), 2)}


# -- what every worker reports to ---------------------------------------------------------------------
class Tally:
    def __init__(self, errnos: set[int] = WINDOW_ERRNOS) -> None:
        self.errnos = errnos  # what a call may fail with inside a window
        self.lock = threading.Lock()
        self.ops: Counter = Counter()
        self.errors: list[dict] = []
        self.allowed: Counter = Counter()
        self.lost = 0
        self.checked = 0  # bytes compared against what they must be
        self.suspects: set[str] = set()  # "ino:idx" of stripes read back wrong (log_excerpt)
        self.windows: list[list[float]] = []  # [start, end] of each mount outage (end None: open)
        self.mount_up = threading.Event()
        self.mount_up.set()
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def in_window(self, begun: float) -> bool:
        """Whether an operation begun at ``begun`` and failing now overlapped a mount outage."""
        now = time.monotonic()
        with self.lock:
            return any(s <= now and (e is None or begun <= e) for s, e in self.windows)

    def error(self, what: str, exc: BaseException | str) -> None:
        with self.lock:
            self.errors.append({"t": round(time.monotonic() - self.t0, 2), "op": what, "error": repr(exc) if isinstance(exc, BaseException) else exc})
        print(f"chaos: ERROR {what}: {exc}", file=sys.stderr, flush=True)

    def compare(self, what: str, got: bytes, want: bytes) -> bool:
        n = min(len(got), len(want))
        a, b = np.frombuffer(got, np.uint8, n), np.frombuffer(want, np.uint8, n)
        wrong = int(np.count_nonzero(a != b)) + abs(len(got) - len(want))
        with self.lock:
            self.checked += len(want)
            self.lost += wrong
        if wrong:
            bad = np.flatnonzero(a != b)
            where = f", first at {int(bad[0])}, last at {int(bad[-1])}" if len(bad) else ""
            zeros = " (read as zeros)" if len(bad) and not a[bad[0] : bad[-1] + 1].any() else ""
            self.error(what, f"{wrong} bytes wrong or missing (read {len(got)}, expected {len(want)}{where}){zeros}")
        return not wrong

    def attempt(self, what: str, fn):
        """Run one user call: True once done, None if it failed inside a mount outage (its
        effect is unknown: the caller forgets what it touched), False for an error."""
        begun = time.monotonic()
        try:
            fn()
        except OSError as exc:
            if exc.errno in self.errnos and self.in_window(begun):
                with self.lock:
                    self.allowed[errno.errorcode.get(exc.errno, str(exc.errno))] += 1
                self.mount_up.wait()
                return None
            self.error(what, exc)
            return False
        except Exception as exc:  # np.load of a corrupt file and the like: never allowed
            self.error(what, exc)
            return False
        with self.lock:
            self.ops[what] += 1
        return True

    def pause(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def open_window(self) -> None:
        with self.lock:
            self.mount_up.clear()
            self.windows.append([time.monotonic(), None])

    def close_window(self) -> None:
        with self.lock:
            if self.windows and self.windows[-1][1] is None:
                self.windows[-1][1] = time.monotonic()
            self.mount_up.set()

    def merge(self, other: "Tally") -> None:
        """Count ``other``'s calls, errors and checks as this one's (the minority mount's)."""
        with self.lock:
            self.ops.update({f"minority_{k}": v for k, v in other.ops.items()})
            self.errors += [dict(e, op=f"minority {e['op']}") for e in other.errors]
            self.allowed.update({f"minority_{k}": v for k, v in other.allowed.items()})
            self.lost += other.lost
            self.checked += other.checked
            self.suspects |= other.suspects


# -- workers ---------------------------------------------------------------------------------------
def remove_unknown(tally: Tally, path: Path) -> None:
    """Remove a file whose content a mount outage left unknown (called once the mount is back)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        tally.error(f"unlink {path.name} after an outage", exc)


def old_bytes(before: bytes, lo: int, hi: int) -> bytes:
    """Bytes ``lo``..``hi`` of a file that held ``before`` (zeros past its end)."""
    return before[lo:hi] + bytes(max(0, hi - max(lo, len(before))))


def replica_report(config: Path, ino: int, first: int, last: int, want: bytes, before: bytes) -> str:
    """Each node's copy of the live stripes of file ``ino`` that bytes ``first``..``last`` fall
    in: its stamp, and whether its bytes there are the expected ones ("new"), those before the
    file's last change ("old"), or neither. Read one-sidedly as a resync does, ready or not: so
    a wrong read tells a lost write (no replica has it) from a stale copy served (one has)."""
    from irdmafs.runtime.cluster import Cluster
    from irdmafs.transport.select import choose

    cfg = C.load(config)
    unit = cfg.stripe_unit

    def kind(got: bytes, lo: int, hi: int) -> str:
        return "new" if got == want[lo:hi] else "old" if got == old_bytes(before, lo, hi) else "other"

    async def report() -> list[str]:
        out = []
        async with trio.open_nursery() as nursery:
            cluster = Cluster(cfg, choose(cfg.transport, cfg.token, op_timeout=cfg.op_timeout), nursery)
            for idx in range(first // unit, (last - 1) // unit + 1):
                lo, hi = max(first, idx * unit), min(last, (idx + 1) * unit)
                for node in cfg.names:
                    try:
                        reply, inc = await cluster.call_on(node, "stripe_info", {"fid": ino, "idxs": [idx], "resync": True})
                        info = reply[str(idx)]
                        if info is None:
                            out.append(f"{ino}:{idx} on {node}: none")
                            continue
                        buf = bytearray(max(info["capacity"], hi - idx * unit))
                        head = await cluster.peers.read_stripe(node, info["rkey"], 0, memoryview(buf)[: info["capacity"]], inc)
                        got = bytes(buf[lo - idx * unit : hi - idx * unit])
                        out.append(f"{ino}:{idx} on {node}: ({info['tag']}, {head.version}) {kind(got, lo, hi)}")
                    except Exception as exc:  # a diagnostic: whatever it meets is part of the answer
                        out.append(f"{ino}:{idx} on {node}: {type(exc).__name__} {exc}")
            await cluster.aclose()
            nursery.cancel_scope.cancel()
        return out

    return "; ".join(trio.run(report))


class FileWorker:
    """Files of random sizes changed at random offsets; ``self.files`` is what they must hold.
    ``config``: the cluster's, to tell which replicas hold what of a file read back wrong."""

    def __init__(self, tally: Tally, root: Path, seed: int, unit: int, config: Path | None = None) -> None:
        self.t, self.root, self.rng, self.unit = tally, root, np.random.default_rng(seed), unit
        self.config = config
        self.stripe_unit = C.load(config).stripe_unit if config is not None else unit
        self.files: dict[str, bytearray] = {}
        self.history: dict[str, list[str]] = {}  # what was done to each file, said when it reads back wrong
        self.before: dict[str, bytes] = {}  # each file's content before its last write or truncate
        self.n = 0

    def _did(self, name: str, what: str) -> None:
        self.history.setdefault(name, []).append(f"{time.monotonic() - self.t.t0:.1f}s {what}")

    def _check(self, name: str, got: bytes, want: bytes, what: str = "") -> None:
        if not self.t.compare(f"file {self.root.name}/{name}{what}", got, want):
            print(f"chaos: history of {self.root.name}/{name}: {'; '.join(self.history.get(name, [])[-12:])}", file=sys.stderr, flush=True)
            print(f"chaos: {self.root.name}/{name}: {self._diagnose(name, got, want)}", file=sys.stderr, flush=True)

    def _diagnose(self, name: str, got: bytes, want: bytes) -> str:
        """What the wrong bytes are (for the node logs): the file's inode (its id on the nodes),
        whether they are what the file held before its last change (a lost write) or something
        else (another write's bytes), whether a second read gets them right (a stale copy served
        once), and what each replica holds there (``replica_report``)."""
        try:
            ino = os.stat(self.root / name).st_ino
        except OSError as exc:
            return f"inode unknown ({exc})"
        n = min(len(got), len(want))
        bad = np.flatnonzero(np.frombuffer(got, np.uint8, n) != np.frombuffer(want, np.uint8, n))
        if not len(bad):
            return f"inode {ino}"
        first, last = int(bad[0]), int(bad[-1]) + 1
        with self.t.lock:
            self.t.suspects.update(f"{ino}:{idx}" for idx in range(first // self.stripe_unit, (last - 1) // self.stripe_unit + 1))
        before = self.before.get(name, b"")
        lost = got[first:last] == old_bytes(before, first, last)
        kind = "what it held before its last change" if lost else "neither the expected bytes nor those before its last change"
        said = f"inode {ino}; bytes {first}-{last - 1} read back as {kind}"
        try:
            said += "; read again: " + ("as expected" if (self.root / name).read_bytes() == want else "wrong again")
        except OSError as exc:
            said += f"; read again: {exc}"
        if self.config is not None:
            said += "; replicas: " + replica_report(self.config, ino, first, last, want, before)
        return said

    def _forget(self, *names: str) -> None:
        """A call on these failed in a mount outage: their content is unknown; remove them."""
        for name in names:
            self.files.pop(name, None)
            self.before.pop(name, None)
            remove_unknown(self.t, self.root / name)

    def step(self) -> None:
        r = self.rng
        names = sorted(self.files)
        choice = (
            "create"
            if len(names) < 3
            else r.choice(["create", "write", "write", "truncate", "rename", "check", "check", "delete"], p=[0.1, 0.25, 0.15, 0.1, 0.1, 0.15, 0.1, 0.05])
        )
        if choice == "create" or not names:
            if len(names) >= 8:
                choice = "check"
            else:
                self.n += 1
                name, data = f"f{self.n}", bytearray(r.bytes(int(r.integers(0, 3 * self.unit))))
                ok = self.t.attempt("file_create", lambda: (self.root / name).write_bytes(data))
                if ok:
                    self.files[name] = data
                    self._did(name, f"create {len(data)}")
                else:  # failed (counted once) or in an outage: no expectation is left behind
                    self._forget(name)
                return
        name = names[int(r.integers(len(names)))]
        cur = self.files[name]
        if choice == "write":
            off = int(r.integers(0, len(cur) + self.unit))
            data = r.bytes(int(r.integers(1, 2 * self.unit)))

            def write() -> None:
                fd = os.open(self.root / name, os.O_WRONLY)
                try:
                    os.pwrite(fd, data, off)
                    if r.random() < 0.2:
                        os.fsync(fd)
                finally:
                    os.close(fd)

            ok = self.t.attempt("file_write", write)
            if ok:
                self._did(name, f"write {len(data)} at {off}")
                self.before[name] = bytes(cur)
                if off > len(cur):
                    cur.extend(bytes(off - len(cur)))
                cur[off : off + len(data)] = data
        elif choice == "truncate":
            size = int(r.integers(0, int(len(cur) * 1.3) + 2))
            ok = self.t.attempt("file_truncate", lambda: os.truncate(self.root / name, size))
            if ok:
                self._did(name, f"truncate {len(cur)} to {size}")
                self.before[name] = bytes(cur)
                del cur[size:]
                cur.extend(bytes(size - len(cur)))
        elif choice == "rename":
            self.n += 1
            new = f"f{self.n}"
            ok = self.t.attempt("file_rename", lambda: os.rename(self.root / name, self.root / new))
            if ok:
                self.files[new] = self.files.pop(name)
                self.history[new] = self.history.pop(name, []) + [f"{time.monotonic() - self.t.t0:.1f}s renamed from {name}"]
                if name in self.before:
                    self.before[new] = self.before.pop(name)
            else:
                self._forget(name, new)
            return
        elif choice == "delete":
            ok = self.t.attempt("file_unlink", lambda: os.unlink(self.root / name))
            if ok:
                del self.files[name]
                self.before.pop(name, None)
            else:
                self._forget(name)
            return
        else:
            got: list[bytes] = []
            ok = self.t.attempt("file_check", lambda: got.append((self.root / name).read_bytes()))
            if ok:
                self._check(name, got[0], bytes(cur))
                self._did(name, "read back")
            return
        if not ok:  # failed (counted once) or in an outage: its content is unknown now
            self._forget(name)

    def verify_all(self) -> None:
        for name, want in sorted(self.files.items()):
            got: list[bytes] = []
            if self.t.attempt("final_check", lambda: got.append((self.root / name).read_bytes())):
                self._check(name, got[0], bytes(want), " (final)")


class GarbagePeer:
    """A peer with the token that sends each node, in turn, one broken frame after a valid
    handshake; counts the frames sent (``garbage``) and the nodes it found away (a fault)."""

    KINDS = ("bad-magic", "oversized", "short-header", "write-nowhere", "random")

    def __init__(self, tally: Tally, cfg, seed: int) -> None:
        self.t, self.cfg, self.rng = tally, cfg, random.Random(seed)

    def frame(self, kind: str) -> bytes:
        r = self.rng
        if kind == "bad-magic":
            return b"GARBAGE!" * 5
        if kind == "oversized":
            return P.pack(P.Header(P.Op.CALL, req_id=1, length=P.MAX_CONTROL + 1))
        if kind == "short-header":
            return P.pack(P.Header(P.Op.WRITE, req_id=1, length=100))[: r.randrange(1, 40)]
        if kind == "write-nowhere":
            return P.pack(P.Header(P.Op.WRITE, req_id=1, rkey=0xFFFFFFFF, length=64)) + bytes(64)
        return r.randbytes(r.randrange(1, 200))

    def step(self) -> None:
        if self.t.stop.wait(self.rng.uniform(0.5, 2.0)):
            return
        spec = self.cfg.node(self.rng.choice(self.cfg.names))
        kind = self.rng.choice(self.KINDS)
        try:
            with socket.create_connection((spec.host, spec.port), timeout=2) as s:
                h = P.unpack(recv_exactly(s, P.HEADER.size))
                snonce = recv_exactly(s, h.length)
                cnonce = new_nonce()
                s.sendall(P.pack(P.Header(P.Op.AUTH, length=64)) + cnonce + client_proof(self.cfg.token, snonce, cnonce))
                h = P.unpack(recv_exactly(s, P.HEADER.size))
                recv_exactly(s, h.length)
                if h.status != P.Status.OK:
                    self.t.error("garbage peer", f"{spec.name} refused the cluster's token: {h}")
                    return
                s.sendall(self.frame(kind))
                s.shutdown(socket.SHUT_WR)
                s.settimeout(5)
                while s.recv(65536):  # whatever it answers, until it closes
                    pass
        except (OSError, EOFError, ProtocolError):  # a node killed, stopped or cut off now: a fault's
            with self.t.lock:
                self.t.ops["garbage_away"] += 1
            return
        with self.t.lock:
            self.t.ops["garbage"] += 1

    def verify_all(self) -> None:
        pass  # what it checks is that the nodes go on: every other worker's final check


def recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


class TensorWorker:
    """Tensors saved with np.save and loaded with np.load."""

    SHAPES = [(1000,), (64, 64), (3, 128, 129), (300_000,), (2, 700, 1000)]
    DTYPES = [np.float32, np.float16, np.int64, np.float64]

    def __init__(self, tally: Tally, root: Path, seed: int) -> None:
        self.t, self.root, self.rng = tally, root, np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {}

    def step(self) -> None:
        r = self.rng
        name = f"t{int(r.integers(6))}.npy"
        if name not in self.tensors or r.random() < 0.4:
            shape = self.SHAPES[int(r.integers(len(self.SHAPES)))]
            a = (r.standard_normal(shape) * 100).astype(self.DTYPES[int(r.integers(len(self.DTYPES)))])
            ok = self.t.attempt("tensor_save", lambda: np.save(self.root / name, a))
            if ok:
                self.tensors[name] = a
            else:  # failed (counted once) or in an outage: no expectation is left behind
                self.tensors.pop(name, None)
                remove_unknown(self.t, self.root / name)
            return
        self.check(name)

    def check(self, name: str, what: str = "tensor_load") -> None:
        got: list[np.ndarray] = []
        if self.t.attempt(what, lambda: got.append(np.load(self.root / name))):
            want = self.tensors[name]
            if got[0].dtype != want.dtype or got[0].shape != want.shape:
                self.t.error(f"tensor {name}", f"{got[0].dtype}{got[0].shape} read, {want.dtype}{want.shape} saved")
                with self.t.lock:
                    self.t.lost += want.nbytes
            else:
                self.t.compare(f"tensor {name}", got[0].tobytes(), want.tobytes())

    def verify_all(self) -> None:
        for name in sorted(self.tensors):
            self.check(name, "final_check")


class SnapshotWorker:
    """A marker file written, a snapshot taken, the marker read back from the snapshot; the two
    newest snapshots are kept and checked again, older ones dropped."""

    def __init__(self, tally: Tally, mnt: Path, root: Path, seed: int) -> None:
        self.t, self.mnt, self.root, self.rng = tally, mnt, root, np.random.default_rng(seed)
        self.kept: list[tuple[str, bytes]] = []
        self.n = 0

    def snap(self, name: str) -> Path:
        return self.mnt / ".snapshots" / name / self.root.relative_to(self.mnt) / "marker"

    def step(self) -> None:
        self.t.pause(float(self.rng.uniform(2, 6)))
        if self.t.stop.is_set():
            return
        self.n += 1
        name, data = f"chaos-{self.n}", self.rng.bytes(int(self.rng.integers(1, 3 * MiB)))
        if not self.t.attempt("snapshot_marker", lambda: (self.root / "marker").write_bytes(data)):
            return
        ok = self.t.attempt("snapshot_take", lambda: os.mkdir(self.mnt / ".snapshots" / name))
        if ok is None:  # taken or not: drop it either way
            self.t.attempt("snapshot_drop", lambda: os.rmdir(self.mnt / ".snapshots" / name) if os.path.isdir(self.mnt / ".snapshots" / name) else None)
            return
        if not ok:
            return
        self.kept.append((name, data))
        self.verify_all("snapshot_check")
        while len(self.kept) > 2:
            old, _ = self.kept.pop(0)
            self.t.attempt("snapshot_drop", lambda: os.rmdir(self.mnt / ".snapshots" / old))

    def verify_all(self, what: str = "final_check") -> None:
        for name, want in self.kept:
            got: list[bytes] = []
            if self.t.attempt(what, lambda: got.append(self.snap(name).read_bytes())):
                self.t.compare(f"snapshot {name}", got[0], want)


class TrainingJob:
    """Two ranks under bsp with SGD through the step streams, run after run; every pull of
    every step must equal SGD's result exactly (float32 within rounding)."""

    LR, STEPS = 0.1, 25
    # and enough small tensors that the mount packs them into a bucket at the first step
    # (docs/buckets.md): the bucket's rounds go through every fault too
    SHAPES = {"w": (256, 300), "b": (300,)} | {f"bn{i}.weight": (64 + i,) for i in range(PACK_MIN_TENSORS)}

    def __init__(self, tally: Tally, mnt: Path, root: Path, seed: int) -> None:
        self.t, self.mnt, self.root, self.seed = tally, mnt, root, seed
        self.runs = 0

    @staticmethod
    def grad(shape, rank: int, step: int) -> np.ndarray:
        return np.full(shape, 1e-3 * (rank + 1) * (1 + step % 3), np.float32)

    def step(self) -> None:
        self.runs += 1
        model = f"train{self.runs}"
        rng = np.random.default_rng(self.seed * 1000 + self.runs)
        p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in self.SHAPES.items()}
        d = self.root / model

        def publish() -> None:
            os.mkdir(d)
            for key, value in {"sync": "bsp", "workers": "2", "optimizer": f"sgd lr={self.LR}", "timeout": "120"}.items():
                os.setxattr(d, f"user.irdma.{key}", value.encode())
            for k, a in p0.items():
                np.save(d / f"{k}.npy", a)

        if not self.t.attempt("train_publish", publish):
            self._drop(d)
            return
        model_path = str(d.relative_to(self.mnt))
        abandoned = threading.Event()
        # Both ranks decide together, before each step, whether to take it: under bsp a rank
        # that stopped alone would leave the other's pull waiting out the model's timeout
        # (ETIMEDOUT, an error no fault caused). The soak's end stops a run between steps.
        halt = [False]
        together = threading.Barrier(2, action=lambda: halt.__setitem__(0, abandoned.is_set() or self.t.stop.is_set()))

        def abandon() -> None:
            abandoned.set()
            together.abort()  # the other rank stops at its next step instead of waiting here

        def rank(r: int) -> None:
            out = {k: np.empty_like(a) for k, a in p0.items()}
            total = 0.0
            for i in range(self.STEPS):
                try:
                    together.wait()
                except threading.BrokenBarrierError:
                    return
                if halt[0]:
                    return
                grads = {k: self.grad(a.shape, r, i) for k, a in p0.items()}
                if not self.t.attempt("train_push", lambda: push_arrays(self.mnt, model_path, r, grads)) or not self.t.attempt(
                    "train_pull", lambda: pull_arrays(self.mnt, model_path, r, out)
                ):
                    abandon()
                    return
                total += np.mean([1e-3 * (q + 1) * (1 + i % 3) for q in range(2)])
                for k, a in out.items():
                    want = p0[k] - np.float32(self.LR * total)
                    bad = ~np.isclose(a, want, rtol=0, atol=2e-5)
                    if bad.any():
                        self.t.error(
                            f"training {model} rank {r} step {i}",
                            f"{k}: {int(bad.sum())} parameters differ from SGD's by up to {float(np.abs(a - want).max()):g}",
                        )
                        with self.t.lock:
                            self.t.lost += int(bad.sum()) * 4
                        abandon()
                        return
                    with self.t.lock:
                        self.t.checked += a.nbytes

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self._drop(d)

    def _drop(self, d: Path) -> None:
        remove_tree(self.t, d)

    def verify_all(self) -> None:
        pass  # every step was checked as it went


def run_tool(tool: list[str]) -> None:
    """Run a copy tool (``cp``, ``rsync``) on the mount. One that fails because the mount went
    away under it (a mount fault) fails with that fault's error, as a call of this process
    would: raised as the errno its message names (ENOTCONN, ECONNABORTED, ENOENT), so that the
    window's rules decide (``Tally.attempt``); anything else is an error, in the tool's words.
    (A bare exit status told nothing: rsync's 23, "partial transfer", in seed 13's 30 minutes.)"""
    done = subprocess.run(tool, capture_output=True, text=True)
    if done.returncode == 0:
        return
    said = done.stderr.strip()[-600:]
    code = next((c for c in sorted(WINDOW_ERRNOS) if os.strerror(c) in said), None)
    if code is not None:
        raise OSError(code, f"{tool[0]} exited {done.returncode}: {said}")
    raise RuntimeError(f"{tool[0]} exited {done.returncode}: {said}")


class BigModelJob:
    """A model of ``gib`` GiB (float32 tensors of 16 MiB) trained by 2 ranks (bsp, SGD) through
    the step streams, run after run, with a snapshot taken every ``SNAP_EVERY`` steps (the one
    before it dropped) and copied out of the mount, by ``cp -a`` and ``rsync -a`` in turn: every
    pull must equal SGD's result and every copy the parameters at its step, tensor by tensor
    (``--model-gib``; issue 41: a soak at a model's size). A tensor's start values are a ramp
    that differs from stripe to stripe and from tensor to tensor, so bytes of another stripe,
    tensor or step never pass for the right ones."""

    LR, SNAP_EVERY, TENSOR = 0.01, 3, 16 * MiB

    def __init__(self, tally: Tally, mnt: Path, root: Path, seed: int, gib: float, scratch: Path) -> None:
        self.t, self.mnt, self.root, self.seed, self.scratch = tally, mnt, root, seed, scratch
        self.names = [f"layer{i}" for i in range(max(1, int(gib * (1 << 30)) // self.TENSOR))]
        self.runs = self.steps = self.snapshots = 0
        self.step_seconds: list[float] = []  # each completed step's push and pull, both ranks

    def start(self, i: int) -> np.ndarray:
        n = self.TENSOR // 4
        return (np.arange(n, dtype=np.float32) % 1013) * np.float32(1e-3) + np.float32(i)

    def expected(self, i: int, total: float) -> np.ndarray:
        return self.start(i) - np.float32(self.LR * total)

    def check(self, what: str, got: np.ndarray, i: int, total: float) -> bool:
        bad = ~np.isclose(got, self.expected(i, total), rtol=0, atol=5e-4)
        with self.t.lock:
            self.t.checked += got.nbytes
            self.t.lost += int(bad.sum()) * 4
        if bad.any():
            self.t.error(what, f"{int(bad.sum())} parameters of {self.names[i]} differ from SGD's (step total {total:g})")
        return not bad.any()

    def step(self) -> None:
        self.runs += 1
        d = self.root / f"big{self.runs}"

        def publish() -> None:
            os.mkdir(d)
            for key, value in {"sync": "bsp", "workers": "2", "optimizer": f"sgd lr={self.LR}", "timeout": "120"}.items():
                os.setxattr(d, f"user.irdma.{key}", value.encode())
            for i, name in enumerate(self.names):
                np.save(d / f"{name}.npy", self.start(i))

        if not self.t.attempt("big_publish", publish):
            self._drop(d, [])
            return
        model = str(d.relative_to(self.mnt))
        outs = [{name: np.empty(self.TENSOR // 4, np.float32) for name in self.names} for _ in range(2)]
        grads = [np.full(self.TENSOR // 4, 1e-3 * (r + 1), np.float32) for r in range(2)]  # one array per rank, every tensor
        total, k, held = 0.0, 0, []
        while not self.t.stop.is_set():
            ok = [False, False]
            began = time.monotonic()

            def rank(r: int) -> None:
                g = {name: grads[r] for name in self.names}
                ok[r] = bool(self.t.attempt("big_push", lambda: push_arrays(self.mnt, model, r, g))) and bool(
                    self.t.attempt("big_pull", lambda: pull_arrays(self.mnt, model, r, outs[r]))
                )

            threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if not all(ok):
                break  # a fault's window: this run ends, the next publishes again
            k += 1
            total += 3e-3  # both ranks' gradients, summed by the PS (bsp)
            self.steps += 1
            self.step_seconds.append(round(time.monotonic() - began, 2))
            if not all(self.check(f"big model {d.name} rank {r} step {k}", outs[r][name], i, total) for r in range(2) for i, name in enumerate(self.names)):
                break
            if k % self.SNAP_EVERY == 0 and not self.snapshot(d, k, total, held):
                break
        self._drop(d, held)

    def snapshot(self, d: Path, k: int, total: float, held: list[str]) -> bool:
        """One snapshot of the model after step ``k``, copied out and checked; the one before it
        dropped."""
        name = f"{d.name}-step{k}"
        ok = self.t.attempt("big_snapshot", lambda: os.mkdir(self.mnt / ".snapshots" / name))
        if ok is None and os.path.isdir(self.mnt / ".snapshots" / name):
            held.append(name)
        if not ok:
            return False
        held.append(name)
        self.snapshots += 1
        src = self.mnt / ".snapshots" / name / d.relative_to(self.mnt)
        copy = self.scratch / name
        tool = ["cp", "-a", str(src), str(copy)] if self.snapshots % 2 else ["rsync", "-a", f"{src}/", f"{copy}/"]
        try:
            if not self.t.attempt(f"big_copy_{tool[0]}", lambda: run_tool(tool)):
                return False
            for i, n in enumerate(self.names):
                got: list[np.ndarray] = []
                if not self.t.attempt("big_copy_load", lambda: got.append(np.load(copy / f"{n}.npy"))):
                    return False
                if not self.check(f"snapshot {name} copied by {tool[0]}", got[0], i, total):
                    return False
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        while len(held) > 1:
            old = held.pop(0)
            self.t.attempt("big_snapshot_drop", lambda: os.rmdir(self.mnt / ".snapshots" / old))
        return True

    def _drop(self, d: Path, held: list[str]) -> None:
        self.t.mount_up.wait()
        for name in held:
            self.t.attempt("big_snapshot_drop", lambda: os.rmdir(self.mnt / ".snapshots" / name) if os.path.isdir(self.mnt / ".snapshots" / name) else None)
        remove_tree(self.t, d)

    def verify_all(self) -> None:
        pass  # every step and every copy was checked as it went

    def figures(self) -> dict:
        took = sorted(self.step_seconds)
        return {
            "model_gib": len(self.names) * self.TENSOR / (1 << 30),
            "big_runs": self.runs,
            "big_steps": self.steps,
            "big_snapshots": self.snapshots,
            "big_step_seconds": {"median": took[len(took) // 2], "worst": took[-1]} if took else None,
        }


def remove_tree(tally: Tally, d: Path) -> None:
    """A job's directory removed once the mount is up; an error only outside a mount outage."""
    tally.mount_up.wait()
    try:
        shutil.rmtree(d)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if not (exc.errno in WINDOW_ERRNOS and not tally.mount_up.is_set()):
            try:
                left = sorted(os.listdir(d))
            except OSError as again:
                left = [f"(not listed: {again})"]
            tally.error(f"removing {d.name}", f"{exc}; it lists {left[:8]}")


def loop(tally: Tally, worker) -> None:
    while not tally.stop.is_set():
        tally.mount_up.wait()
        worker.step()


# -- the cluster and the faults ------------------------------------------------------------------------
class Bed:
    """Node processes (in network namespaces when root), a local etcd, one mount, and as root
    with ``minority`` a second mount in n1's namespace; started and faulted."""

    def __init__(
        self, tmp: Path, nodes: int, replicas: int, netns: bool, minority: bool, coordinators: int, stack: ExitStack, transport: str = "tcp", unit: int = MiB
    ) -> None:
        self.tmp, self.netns = tmp, netns
        (tmp / "token").write_text(os.urandom(16).hex())
        etcd_hosts = ["127.0.0.1"] * coordinators
        if netns:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from netns import namespaces

            hosts = stack.enter_context(namespaces(nodes, None, prefix=PREFIX, net=NET))
            specs = [{"name": f"n{i + 1}", "host": h, "port": 7400} for i, h in enumerate(hosts)]
            # each etcd member on an address of the root namespace that stays up when a veth goes
            # down, one address each (``etcd-minority`` cuts a node off from some of them)
            etcd_hosts = [f"10.{NET}.{ETCD_HOST + i}.1" for i in range(coordinators)]
            for h in etcd_hosts:
                subprocess.run(["ip", "addr", "add", f"{h}/32", "dev", "lo"], check=True)
                stack.callback(subprocess.run, ["ip", "addr", "del", f"{h}/32", "dev", "lo"], capture_output=True)
        else:
            specs = [{"name": f"n{i + 1}", "host": "127.0.0.1", "port": p} for i, p in enumerate(free_ports(nodes))]
        if coordinators == 1:
            self.etcd: LocalEtcd | LocalEtcdCluster = LocalEtcd(tmp / "etcd", host=etcd_hosts[0], log_path=tmp / "etcd.log")
        else:
            self.etcd = LocalEtcdCluster(tmp / "etcd", coordinators, host=etcd_hosts, log_dir=tmp)
        self.etcd_hosts = etcd_hosts
        self.etcd.start()
        stack.callback(self.etcd.stop)
        self.undo: list[list[str]] = []  # what ends the fault under way (``outside``)
        doc = {
            "nodes": specs,
            "token_file": "token",
            "replicas": replicas,
            "stripe_unit": unit,
            "transport": [transport],
            "heartbeat": 0.2,
            "down_after": 1.0,
            "op_timeout": 3.0,
            "coordinator": self.etcd.endpoints,
            "capacity": machine_capacity(nodes),  # as irdmafs up sizes them: the host's memory shared
        }
        self.config = tmp / "cluster.toml"
        self.config.write_text(C.dump(C.from_dict(doc, base=tmp)))
        self.lc = LocalCluster(self.config, log_dir=tmp)
        self.cfg = self.lc.cfg
        if netns:
            self.lc.launcher = {name: ["ip", "netns", "exec", f"{PREFIX}{i}"] for i, name in enumerate(self.cfg.names)}
        self.mnt = tmp / "mnt"
        self.mnt.mkdir()
        self.mount_proc: subprocess.Popen | None = None
        self.minority_proc: subprocess.Popen | None = None
        self.minority = tmp / "mnt-n1" if netns and minority else None  # a mount inside n1's network namespace
        self.lc.start_all()  # restarts later run the same command lines, as a user would
        self.settle(60)
        self.mount()
        if self.minority is not None:
            self.minority.mkdir()
            launcher = ["nsenter", f"--net=/var/run/netns/{PREFIX}0"]
            self.minority_proc = mount_background(str(self.config), str(self.minority), [], tmp / "mount-n1.log", launcher=launcher)

    def settle(self, timeout: float) -> float:
        t = time.monotonic()
        trio.run(lambda: wait_settled(self.cfg, timeout=timeout))
        return time.monotonic() - t

    def mount(self) -> None:
        clear_dead_mount(str(self.mnt))
        self.mount_proc = mount_background(str(self.config), str(self.mnt), [], self.tmp / "mount.log")

    def apply(self, fault: dict, tally: Tally, minority: Tally) -> None:
        kind, name, down = fault["kind"], fault["target"], fault["down"]
        if kind == "mount":
            tally.open_window()
            self.mount_proc.kill()
            self.mount_proc.wait(10)
            deadline = time.monotonic() + 10
            while is_mounted(str(self.mnt)) and time.monotonic() < deadline:
                time.sleep(0.05)  # auto_unmount detaches it
            time.sleep(down)
            self.mount()
            tally.close_window()
            return
        if kind == "kill":
            self.lc.kill(name)
            time.sleep(down)
            self.lc.start(name)
        elif kind == "stop":
            pid = str(self.lc.procs[name].pid)
            self.outside([["kill", "-STOP", pid]], down, [["kill", "-CONT", pid]])
        elif kind == "partition":
            veth = f"{PREFIX}h{self.cfg.names.index(name)}"
            cut_off = self.minority is not None and name == self.cfg.names[0]  # n1's mount with it
            if cut_off:
                minority.open_window()
            self.outside([["ip", "link", "set", veth, "down"]], down, [["ip", "link", "set", veth, "up"]])
        elif kind == "cut":
            if self.minority is not None and name == self.cfg.names[0]:
                minority.open_window()  # its routes to the other nodes are n1's: cut with them
            routes = self.cut_routes(name)
            self.outside([["ip", "netns", "exec", f"{PREFIX}{a}", "ip", "route", "add", "blackhole", where] for a, where in routes], down,
                         [["ip", "netns", "exec", f"{PREFIX}{a}", "ip", "route", "del", "blackhole", where] for a, where in routes])
        elif kind == "etcd-stop":
            pid = str(self.member(name).pid)
            self.outside([["kill", "-STOP", pid]], down, [["kill", "-CONT", pid]])
        elif kind in ("etcd-kill", "etcd-leader-kill"):
            member = self.member(name) if kind == "etcd-kill" else self.etcd.leader() or self.member(name)
            fault["member"] = member.name
            member.kill()
            time.sleep(down)
            member.start()
        elif kind == "etcd-minority":
            i = self.cfg.names.index(name)
            keep = i % len(self.etcd_hosts)  # the one member it still reaches
            fault["member"] = self.etcd.members[keep].name
            routes = [f"{h}/32" for j, h in enumerate(self.etcd_hosts) if j != keep]
            self.outside([["ip", "netns", "exec", f"{PREFIX}{i}", "ip", "route", "add", "blackhole", r] for r in routes], down,
                         [["ip", "netns", "exec", f"{PREFIX}{i}", "ip", "route", "del", "blackhole", r] for r in routes])
        fault["settle"] = round(self.settle(120), 2)  # never a second node out: wait it back
        minority.close_window()

    def member(self, node: str) -> LocalEtcd:
        """The etcd member a fault targeting ``node`` hits: etcd itself with one member."""
        return self.etcd.members[self.cfg.names.index(node) % len(self.etcd.members)]

    def outside(self, begin: list[list[str]], seconds: float, end: list[list[str]]) -> None:
        """Run ``begin``, then ``end`` ``seconds`` later, from another process, and wait for it.
        A fault is begun and ended from outside this one: a worker thread in a call that holds
        the GIL while the mount waits on a stopped node (numpy's ``tofile`` closes its stdio
        stream holding it) froze this whole process until that call timed out, the SIGCONT
        with it (2-second stops lasted 30). The undo commands are kept for ``close``."""
        self.undo = end
        script = "; ".join([shlex.join(c) for c in begin] + [f"sleep {seconds:.3f}"] + [shlex.join(c) for c in end])
        subprocess.run(["sh", "-c", script])
        self.undo = []

    def cut_routes(self, name: str) -> list[tuple[int, str]]:
        """Blackhole routes, on both sides, between node ``name`` and every other node only (the
        mounts and the coordinator, routed through the root namespace, still reach it)."""
        i = self.cfg.names.index(name)
        return [(a, f"10.{NET}.{b}.2/32") for j in range(len(self.cfg.names)) if j != i for a, b in ((i, j), (j, i))]

    def close(self) -> None:
        for command in self.undo:  # a fault cut short (an error, ^C): its end, here
            subprocess.run(command, capture_output=True)
        for proc, mnt in ((self.mount_proc, self.mnt), (self.minority_proc, self.minority)):
            if proc is not None:
                stop_background(str(mnt), proc)
        self.lc.stop_all()


def fault_kinds(netns: bool, coordinators: int) -> list[str]:
    kinds = ["kill", "stop", "mount"] + (["partition", "cut"] if netns else []) + ["etcd-stop", "etcd-kill"]
    if coordinators > 1:
        kinds += ["etcd-leader-kill"] + (["etcd-minority"] if netns else [])
    return kinds


def run(args: argparse.Namespace) -> dict:
    netns = os.geteuid() == 0 and shutil.which("ip") is not None and not args.no_netns
    kinds = fault_kinds(netns, args.coordinators)
    if args.faults:
        kinds = [k for k in args.faults.split(",") if k in kinds]
    tally = Tally()
    minority = Tally(MINORITY_ERRNOS)
    minority.t0 = tally.t0
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="irdmafs-chaos-"))
        if not args.keep:
            stack.callback(shutil.rmtree, tmp, True)
        if args.engine == "python":
            os.environ["IRDMAFS_ENGINE"] = "0"  # every process this starts: nodes, mounts, this one's clients
        unit = int(args.stripe_unit * MiB)
        bed = Bed(tmp, args.nodes, args.replicas, netns, "partition" in kinds, args.coordinators, stack, args.transport, unit)
        stack.callback(bed.close)
        stack.callback(minority.stop.set)
        stack.callback(tally.stop.set)  # runs first when unwinding early: workers stop their loops
        root = bed.mnt / "chaos"
        for sub in ("files0", "files1", "tensors", "snap", "train", "minority-files", "minority-tensors"):
            (root / sub).mkdir(parents=True)
        workers = [
            FileWorker(tally, root / "files0", args.seed * 10 + 1, MiB, bed.config),
            FileWorker(tally, root / "files1", args.seed * 10 + 2, MiB, bed.config),
            TensorWorker(tally, root / "tensors", args.seed * 10 + 3),
            SnapshotWorker(tally, bed.mnt, root / "snap", args.seed * 10 + 4),
            TrainingJob(tally, bed.mnt, root / "train", args.seed * 10 + 5),
            GarbagePeer(tally, bed.cfg, args.seed * 10 + 9),
        ]
        if args.model_gib:
            (root / "big").mkdir()
            scratch = tmp / "copies"  # where snapshots are copied out to (cp -a, rsync -a)
            scratch.mkdir()
            workers.append(BigModelJob(tally, bed.mnt, root / "big", args.seed * 10 + 8, args.model_gib, scratch))
            print(f"chaos: a model of {len(workers[-1].names) * BigModelJob.TENSOR / (1 << 30):.2f} GiB trained beside the rest", flush=True)
        if bed.minority is not None:  # the same tree through the mount in n1's namespace
            other = bed.minority / "chaos"
            workers += [
                FileWorker(minority, other / "minority-files", args.seed * 10 + 6, MiB, bed.config),
                TensorWorker(minority, other / "minority-tensors", args.seed * 10 + 7),
            ]
        threads = [threading.Thread(target=loop, args=(w.t, w), daemon=True) for w in workers]
        for th in threads:
            th.start()
        print(f"chaos: seed {args.seed}, {args.minutes} min, {args.nodes} nodes R={args.replicas}, faults {', '.join(kinds)}; logs in {tmp}", flush=True)
        end = tally.t0 + args.minutes * 60
        applied: list[dict] = []
        for fault in schedule(args.seed, kinds, bed.cfg.names) if kinds else ():  # --faults none: a baseline
            if time.monotonic() + fault["gap"] + fault["down"] + 10 > end:
                break
            time.sleep(fault["gap"])
            fault["t"] = round(time.monotonic() - tally.t0, 2)
            try:
                bed.apply(fault, tally, minority)
            except Exception as exc:  # a node that never came back, a mount that did not mount
                tally.error(f"fault {fault['kind']} {fault['target']}", exc)
                tally.mount_up.set()
                applied.append(fault)
                break
            applied.append(fault)
            print(
                f"chaos: {fault['t']:8.1f}s {fault['kind']:9s} {fault['target']:5s} out {fault['down']:.1f}s, settled in {fault.get('settle', 0):.1f}s; "
                f"{sum(tally.ops.values())} operations, {len(tally.errors)} errors, {tally.lost} bytes lost",
                flush=True,
            )
        time.sleep(max(0.0, end - time.monotonic()))
        tally.stop.set()
        minority.stop.set()
        for th, w in zip(threads, workers):
            th.join(180)
            if th.is_alive():
                tally.error(type(w).__name__, "still in a call 180 s after the end: hung")
        for w in workers:
            w.verify_all()
        # held memory nobody can read: a failed write frees its own, a killed mount's are trimmed
        # by their primaries once its lease ends, but not by a primary that changed meanwhile
        # (server/tails.py's gap): reported, not counted as an error
        stray = trio.run(stray_of, bed.cfg)
        if stray:
            print(f"chaos: {len(stray)} live stripes past their files' ends at the end (first: {stray[:5]})", flush=True)
        tally.merge(minority)
        faults = Counter(f["kind"] for f in applied)
        excerpt = log_excerpt(tmp, tally.suspects) if tally.lost or tally.errors else []
        if excerpt:
            print(f"chaos: the logs on {', '.join(sorted(tally.suspects)) or 'the errors'} and who served (last {len(excerpt)} lines):", file=sys.stderr)
            print("\n".join(excerpt), file=sys.stderr, flush=True)
        return {
            "seed": args.seed,
            "minutes": args.minutes,
            "nodes": args.nodes,
            "replicas": args.replicas,
            "fault_kinds": kinds,
            "engine": args.engine,
            "transport": args.transport,
            "stripe_unit": unit,
            "coordinator": bed.etcd.endpoints,
            "minority_mount": str(bed.minority) if bed.minority else None,
            "operations": dict(sorted(tally.ops.items())) | {"total": sum(tally.ops.values())},
            "faults": dict(sorted(faults.items())) | {"total": len(applied)},
            "errors": len(tally.errors),
            "lost": tally.lost,
            "checked_bytes": tally.checked,
            "stray_stripes": len(stray),
            **unanswered_heartbeats(tmp, bed.cfg.down_after),
            "allowed": dict(tally.allowed),
            "error_list": tally.errors[:100],
            "log_excerpt": excerpt,
            "fault_log": applied,
            "training_runs": next(w.runs for w in workers if isinstance(w, TrainingJob)),
            **next((w.figures() for w in workers if isinstance(w, BigModelJob)), {}),
        }


UNANSWERED = re.compile(r"heartbeat to (\S+) unanswered in ([\d.]+) s \(its connection: (.*)\)$")
LAST_ANSWER = re.compile(r"last answer ([\d.]+) s ago")


# what a node's and a mount's log say of who serves: the timeline a lost write is read against
TIMELINE = re.compile(r"view \d+|fenced|expels|hand-over|resync|ready again|caught up|stalled|joining|took over|stand-in")


def log_excerpt(logs: Path, suspects: set[str], limit: int = 200) -> list[str]:
    """The lines of every process's log that name a stripe read back wrong (``ino:idx``) or
    tell the membership's timeline, oldest first, the last ``limit`` of them: printed when a
    run loses or errs, so that a red CI run, whose state directory is gone, says what happened
    (an acknowledged write lost once in the shm soak, seed 3, with its logs removed unread)."""
    named = re.compile("|".join(rf"(?<![\d:]){re.escape(k)}(?![\d])" for k in sorted(suspects))) if suspects else None
    out = []
    for path in sorted(logs.rglob("*.log")):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        out += [f"{path.name}: {line}" for line in lines if (named is not None and named.search(line)) or TIMELINE.search(line)]
    return out[-limit:]


def unanswered_heartbeats(logs: Path, down_after: float) -> dict:
    """The log line of a heartbeat unanswered on a connection still up (runtime/heartbeats.py),
    in every process's log: how often it fired, and how often while another socket of that
    connection had brought an answer within 0.9 x down_after (a node that lives, its probe held
    behind its other work: docs/design.md P1-P4, which should make that count 0)."""
    fired = live = 0
    for path in logs.rglob("*.log"):
        with open(path, errors="replace") as f:
            for line in f:
                m = UNANSWERED.search(line.rstrip("\n"))
                if m is None:
                    continue
                fired += 1
                ago = [float(x) for x in LAST_ANSWER.findall(m.group(3))]
                live += bool(ago) and min(ago) < 0.9 * down_after
    return {"heartbeats_unanswered": fired, "heartbeats_unanswered_live": live}


async def stray_of(cfg) -> list:
    """The live stripes the nodes hold past their files' ends once every worker stopped
    (client/nodes.py ``stray_stripes``): a failure must free what it took. A writer that failed
    frees its own at once; a mount killed mid-write leaves its stripes to the primaries, which
    trim them once its staging lease ends (server/tails.py): so this waits that long for them."""
    await wait_settled(cfg, timeout=120, whole_too=False)
    deadline = trio.current_time() + STAGING_LEASE + 3 * SWEEP + 30
    async with Client.connect(cfg) as c:
        while (stray := await stray_stripes(c)) and trio.current_time() < deadline:
            await trio.sleep(SWEEP)
        return stray


def main() -> int:
    # np.load parses each header with ast.literal_eval; this driver's workers are threads, and
    # CPython 3.11's AST constructor is not safe in two threads at once (formats.literal_eval).
    ast.literal_eval = formats.literal_eval
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="write the result here too")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--no-netns", action="store_true", help="loopback only, even as root (no partitions)")
    ap.add_argument("--engine", choices=("native", "python"), default="native", help="the data plane: the engine (where built) or Python's")
    ap.add_argument("--transport", choices=("tcp", "shm"), default="tcp", help="shm: shared memory between the processes (needs --no-netns)")
    ap.add_argument("--stripe-unit", type=float, default=1.0, metavar="MIB", help="the stripe unit in MiB (default 1; a user's default is 4)")
    ap.add_argument("--coordinators", type=int, default=3, metavar="N", help="etcd members (odd; default 3: member faults too)")
    ap.add_argument("--keep", action="store_true", help="keep the state directory (logs) afterwards")
    ap.add_argument("--faults", help="only these kinds, comma-separated (to chase one finding); none: no faults (a baseline)")
    ap.add_argument("--schedule", type=int, metavar="N", help="print the first N faults of the seed and exit")
    ap.add_argument(
        "--model-gib", type=float, default=0.0, metavar="G", help="also train a model of G GiB, a snapshot every 3 steps copied out (cp -a, rsync -a)"
    )
    args = ap.parse_args()
    # SIGTERM (timeout, a CI runner) unwinds like ^C: nodes, mount and namespaces are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.coordinators < 1 or args.coordinators % 2 == 0:
        ap.error("--coordinators: an odd number of etcd members (1, 3, 5)")
    if args.transport == "shm" and not args.no_netns and os.geteuid() == 0:
        ap.error("--transport shm: add --no-netns (each node in its own network namespace would reach the others over TCP)")
    if args.replicas < 2:
        ap.error("faults need --replicas 2 or more (one node out at a time)")
    if args.schedule:
        netns = os.geteuid() == 0 and shutil.which("ip") is not None and not args.no_netns
        kinds = fault_kinds(netns, args.coordinators)
        gen = schedule(args.seed, kinds, [f"n{i + 1}" for i in range(args.nodes)])
        print(json.dumps([next(gen) for _ in range(args.schedule)], indent=1))
        return 0
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    keys = ("operations", "faults", "errors", "lost", "checked_bytes", "allowed", "stray_stripes", "heartbeats_unanswered", "heartbeats_unanswered_live")
    summary = {k: result[k] for k in keys}
    print(json.dumps(summary, indent=1))
    return 0 if result["errors"] == 0 and result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

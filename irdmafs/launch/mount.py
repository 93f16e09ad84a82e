"""Process wiring for a mount: config -> transport -> Client -> VFS -> pyfuse3, in one nursery.

``run_mount`` mounts in the foreground until unmounted (``fusermount3 -u``) or until SIGINT or
SIGTERM, which end the FUSE main loop through ``pyfuse3.terminate`` so the mount is released
cleanly; the process ends within SHUTDOWN_PATIENCE seconds of that first signal whatever its
shutdown waits on, and at once on a second one. ``mount_background`` starts that in a new
process and returns once the mount is live.

Errors: a mount that cannot be made for a reason the user can fix (every node refuses the
config's token, ``--metrics`` cannot listen) is ``MountError``, one line, raised before the
mount exists; ``mount_background`` turns the mount process's own one-line reason into
``MountFailed``, with the log's path.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import trio

from ..client.client import Client
from ..config import ClusterConfig
from ..runtime import dataplane
from ..runtime.notify import notify
from ..transport.base import Transport
from ..errors import AuthError, TransportError
from ..transport.select import choose
from ..util import keep_freed_memory, single_exception

log = logging.getLogger(__name__)

UNMOUNT_PATIENCE = 5.0  # seconds a mount the kernel calls busy is asked again to unmount
SHUTDOWN_PATIENCE = 10.0  # seconds a mount's process has to end after its first SIGTERM/SIGINT


class MountError(Exception):
    """A mount that cannot be made, for a reason the user can fix: said in one line."""


class MountFailed(RuntimeError):
    """A background mount's process ended before the mount was live: ``reason`` is its own
    one-line reason (or its exit status), ``code`` its exit status, ``log_path`` its log."""

    def __init__(self, reason: str, code: int, log_path: Path | None):
        super().__init__(f"{reason} (log {log_path})" if log_path else reason)
        self.reason, self.code, self.log_path = reason, code, log_path

# auto_unmount: libfuse's fusermount3 stays behind and unmounts if the mount process dies (even
# by kill -9), so a dead mount never leaves a mountpoint that hangs or says ENOTCONN
BASE_OPTIONS = ("fsname=irdmafs", "subtype=irdmafs", "default_permissions", "auto_unmount")
# mount(8) options that concern when/who mounts, not the file system itself
# (and ``nonempty``, irdmafs's own: mount over a non-empty directory; libfuse 3 has no such option)
IGNORED_OPTIONS = {"nofail", "_netdev", "noauto", "auto", "user", "users", "defaults", "rw", "nonempty"}


def require_fuse() -> bool:
    """Whether pyfuse3 (the ``fuse`` extra) imports: mounting needs it, nothing else does."""
    try:
        import pyfuse3  # noqa: F401
    except ImportError:
        return False
    return True


def fuse_options(extra: list[str]) -> set[str]:
    opts = set(BASE_OPTIONS)
    for o in extra:
        if o and o not in IGNORED_OPTIONS:
            opts.add(o)
    return opts


async def run_mount(
    cfg: ClusterConfig, mountpoint: str, options: list[str] | None = None, *, metrics: str | None = None, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    import pyfuse3

    from ..fs.door_server import DoorServer
    from ..fs.ops import Operations, kernel_drop
    from ..runtime.looplag import LoopLag
    from ..fs.vfs import Vfs

    keep_freed_memory()  # request-sized buffers come and go by the hundred per step: reuse them
    transport = choose(cfg.transport, cfg.token, op_timeout=cfg.op_timeout)
    async with Client.connect(cfg, transport) as client:
        if all(client.cluster.liveness.is_down(n) for n in client.cluster.roles.members.names):
            # no node answered the first heartbeats: a token every node refuses is a mistake to
            # say now (a mount made anyway answered its first stat with ETIMEDOUT 30 s later,
            # and only the nodes' logs said why); nodes merely down may come: mount and wait
            await _say_why_none_answer(cfg, transport)
        status = {
            "config": os.path.abspath(cfg.path) if cfg.path else None,
            "mountpoint": os.path.abspath(mountpoint),
            "mount_pid": os.getpid(),
            **dataplane.facts(transport),  # transport, engine, kernels (runtime/dataplane.py)
            "replicas": cfg.replicas,
        }
        vfs = Vfs(client, status=status)
        vfs.door = DoorServer(vfs.streams)
        ops = Operations(vfs)
        if metrics:
            from ..fs.status import mount_samples
            from ..metrics import serve

            try:
                status["metrics"] = "http://%s:%d/metrics" % serve(metrics, lambda: mount_samples(vfs))
            except (OSError, ValueError) as exc:
                raise MountError(f"--metrics {metrics}: {exc}") from None
        pyfuse3.init(ops, mountpoint, fuse_options(options or []))
        plane = dataplane.line(status)  # one line: what serves its data plane, why for what is not native
        log.log(dataplane.level(status), "mounted %s on %s (%s; %d nodes, R=%d)", cfg.path, mountpoint, plane, len(cfg.nodes), cfg.replicas)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_terminate_on_signals)
                nursery.start_soon(LoopLag().run)  # a stall of this loop is logged (runtime/looplag.py)
                await nursery.start(vfs.door.serve)
                nursery.start_soon(vfs.names.run, kernel_drop)  # names cached by the kernel under a lease (fs/namelease.py)
                # stat()s the mount, which only answers once pyfuse3.main() below is serving
                nursery.start_soon(trio.to_thread.run_sync, _widen_readahead, mountpoint)
                task_status.started()
                notify(f"READY=1\nSTATUS=mounted on {mountpoint}")  # Type=notify units
                await pyfuse3.main()
                await vfs.names.release()  # unmounted: no change waits for this mount's lease
                nursery.cancel_scope.cancel()
        finally:
            pyfuse3.close(unmount=True)
            log.info("unmounted %s", mountpoint)


async def _say_why_none_answer(cfg: ClusterConfig, transport: Transport) -> None:
    """No node answered: MountError if one refuses this config's token (a token is the
    cluster's, so the config is wrong), else a warning naming why each did not answer."""
    why = {}
    for spec in cfg.nodes:
        try:
            with trio.fail_after(min(cfg.op_timeout, 5.0)), single_exception():
                async with trio.open_nursery() as n:
                    conn = await transport.connect(spec.host, spec.port, nursery=n)
                    await conn.aclose()
                    n.cancel_scope.cancel()
            why[spec.name] = "answers now"
        except AuthError:
            token = f"the token of {cfg.path}" if cfg.path else "this config's token"
            where = f"node {spec.name} ({spec.host}:{spec.port})"
            raise MountError(f"wrong cluster token: {where} refused {token} (its token or token_file is not the cluster's)") from None
        except (TransportError, OSError, trio.TooSlowError) as exc:
            why[spec.name] = str(exc) or type(exc).__name__
    log.warning("no node answers yet (%s): mounting; operations wait for them", "; ".join(f"{n}: {w}" for n, w in why.items()))


READAHEAD_KB = 4096


def _widen_readahead(mountpoint: str) -> None:
    """Let the kernel read ahead 4 MiB on this mount: buffered reads then reach us as 1 MiB
    requests instead of 128 KiB ones (measured: 4x the read throughput). Needs root; without it
    the kernel default stays and reads still work."""
    try:
        dev = os.stat(mountpoint).st_dev
    except OSError as exc:  # no node answers yet (the stat waits for the root's attributes)
        log.info("kept the kernel's readahead for %s (stat: %s)", mountpoint, exc.strerror)
        return
    path = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    try:
        path.write_text(str(READAHEAD_KB))
    except OSError as exc:
        log.info("kept the kernel's readahead for %s (%s: %s)", mountpoint, path, exc.strerror)


async def _terminate_on_signals() -> None:
    """The first SIGINT or SIGTERM ends the FUSE loop (the mount is released as at an unmount)
    and gives the process SHUTDOWN_PATIENCE seconds to end; a second one, or that time spent,
    ends it at once (a mount once outlived a second SIGTERM: what its shutdown waited on kept
    it; the kernel's mount goes with the process, auto_unmount)."""
    import pyfuse3

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            log.info("signal %s: unmounting", signal.Signals(sig).name)
            _exit_later(SHUTDOWN_PATIENCE, f"still running {SHUTDOWN_PATIENCE:.0f} s after {signal.Signals(sig).name}")
            pyfuse3.terminate()
            break
    # until the process ends: the handlers stay ours (the default one would end it without
    # pyfuse3's unmount, and one set by a caller might not end it at all)
    signal.signal(signal.SIGTERM, _exit_now)
    signal.signal(signal.SIGINT, _exit_now)


def _exit_now(sig: int, _frame=None) -> None:
    log.warning("second signal %s: exiting now", signal.Signals(sig).name)
    _hard_exit(128 + sig)


def _exit_later(seconds: float, why: str) -> None:
    """End the process in ``seconds`` unless it has ended by then, from a thread of its own: it
    fires whatever the trio thread waits on."""

    def fire() -> None:
        log.warning("%s: exiting now", why)
        _hard_exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def _hard_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def clear_dead_mount(mountpoint: str) -> bool:
    """If ``mountpoint`` is a FUSE mount whose process is gone (ENOTCONN), detach it; True if it
    did. A live mount, or no mount, is left alone."""
    if not is_mounted(mountpoint):
        return False
    try:
        os.listdir(mountpoint)  # not stat: the kernel may answer that from its cache
        return False
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            return False
    log.warning("%s: the mount's process is gone (ENOTCONN); detaching it", mountpoint)
    return unmount(mountpoint, lazy=True)


def is_mounted(mountpoint: str) -> bool:
    """From the mount table, without touching the file system (a stat of a FUSE mount whose
    daemon or cluster is gone could wait a long time)."""
    target = os.path.realpath(mountpoint)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if line.split()[4].replace("\\040", " ") == target:
                return True
    return False


def wait_for_mount(mountpoint: str, proc: subprocess.Popen | None, timeout: float = 30.0, log_path: Path | None = None, log_from: int = 0) -> None:
    """Until ``mountpoint`` is a mount; MountFailed at once if the mounting process died (its
    own one-line reason, from ``log_path`` past offset ``log_from``: this run's lines)."""
    deadline = time.monotonic() + timeout
    while not is_mounted(mountpoint):
        if proc is not None and proc.poll() is not None:
            raise MountFailed(_reason(log_path, log_from, proc.returncode), proc.returncode, log_path)
        if time.monotonic() > deadline:
            where = f" (log {log_path})" if log_path else ""
            raise TimeoutError(f"{mountpoint} not mounted after {timeout}s{where}")
        time.sleep(0.05)


def _reason(log_path: Path | None, log_from: int, code: int) -> str:
    """What a mount process that ended said of why: its last ``irdmafs: ...`` line (the CLI's
    one-line errors), else its exit status and last log line."""
    try:
        with open(log_path, "rb") as f:
            f.seek(log_from)
            lines = f.read().decode(errors="replace").splitlines()
    except (OSError, TypeError):
        lines = []
    said = [ln for ln in lines if ln.startswith("irdmafs: ")]
    if said:
        return said[-1].removeprefix("irdmafs: ")
    last = next((ln for ln in reversed(lines) if ln.strip()), "")
    return f"the mount process exited with {code}" + (f": {last.strip()}" if last else "")


def mount_background(
    config_path: str, mountpoint: str, options: list[str], log_path: Path, metrics: str | None = None, launcher: list[str] = ()
) -> subprocess.Popen:
    """``irdmafs mount -f`` in a new session, logging to ``log_path``; returns once it is live.
    ``launcher``: a command prefix (``nsenter --net=...``: the mount in a network namespace)."""
    cmd = [*launcher, sys.executable, "-m", "irdmafs", "mount", "--config", str(config_path), str(mountpoint), "-f"]
    if metrics:
        cmd += ["--metrics", metrics]
    if options:
        cmd += ["-o", ",".join(options)]
    with open(log_path, "ab") as logf:
        log_from = logf.tell()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    wait_for_mount(mountpoint, proc, log_path=log_path, log_from=log_from)
    return proc


def stop_background(mountpoint: str, proc: subprocess.Popen) -> None:
    """Undo ``mount_background``: detach the mount, then end its process (killed after 10 s)."""
    unmount(mountpoint, lazy=True)
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def unmount(mountpoint: str, lazy: bool = False) -> bool:
    """``fusermount3 -u`` (``-uz`` when lazy); True if it is no longer mounted. A mount the
    kernel calls busy (a file's last close may still be on its way) is asked again, for
    UNMOUNT_PATIENCE seconds at most; a refusal that stands is logged with what fusermount3
    said (a long CI run once left a mount in place right after a write and a read of it, and
    what fusermount3 said was not kept)."""
    deadline = time.monotonic() + UNMOUNT_PATIENCE
    args = ["fusermount3", "-u" + ("z" if lazy else ""), mountpoint]
    while is_mounted(mountpoint):
        r = subprocess.run(args, capture_output=True, text=True)
        if not is_mounted(mountpoint):
            return True
        said = r.stderr.strip() or f"fusermount3 exited {r.returncode}"
        if "busy" not in said.lower() or time.monotonic() > deadline:
            log.warning("%s not unmounted: %s", mountpoint, said)
            return False
        time.sleep(0.05)
    return True

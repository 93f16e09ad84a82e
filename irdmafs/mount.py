"""Process wiring for a mount: config -> transport -> Client -> VFS -> pyfuse3, in one nursery.

``run_mount`` mounts in the foreground until unmounted (``fusermount3 -u``) or until SIGINT or
SIGTERM, which end the FUSE main loop through ``pyfuse3.terminate`` so the mount is released
cleanly. ``mount_background`` starts that in a new process and returns once the mount is live.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio

from .client.client import Client
from .config import ClusterConfig
from .notify import notify
from .transport.select import choose
from .util import keep_freed_memory

log = logging.getLogger(__name__)

UNMOUNT_PATIENCE = 5.0  # seconds a mount the kernel calls busy is asked again to unmount

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

    from .fs.door import DoorServer
    from .fs.ops import Operations, kernel_drop
    from .looplag import LoopLag
    from .fs.vfs import Vfs

    keep_freed_memory()  # request-sized buffers come and go by the hundred per step: reuse them
    transport = choose(cfg.transport, cfg.token, op_timeout=cfg.op_timeout)
    async with Client.connect(cfg, transport) as client:
        status = {
            "config": os.path.abspath(cfg.path) if cfg.path else None,
            "mountpoint": os.path.abspath(mountpoint),
            "mount_pid": os.getpid(),
            "transport": transport.name,
            "replicas": cfg.replicas,
        }
        vfs = Vfs(client, status=status)
        vfs.door = DoorServer(vfs.streams)
        ops = Operations(vfs)
        if metrics:
            from .fs.status import mount_samples
            from .metrics import serve

            status["metrics"] = "http://%s:%d/metrics" % serve(metrics, lambda: mount_samples(vfs))
        pyfuse3.init(ops, mountpoint, fuse_options(options or []))
        log.info("mounted %s on %s (transport %s, %d nodes, R=%d)", cfg.path, mountpoint, transport.name, len(cfg.nodes), cfg.replicas)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_terminate_on_signals)
                nursery.start_soon(LoopLag().run)  # a stall of this loop is logged (looplag.py)
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


READAHEAD_KB = 4096


def _widen_readahead(mountpoint: str) -> None:
    """Let the kernel read ahead 4 MiB on this mount: buffered reads then reach us as 1 MiB
    requests instead of 128 KiB ones (measured: 4x the read throughput). Needs root; without it
    the kernel default stays and reads still work."""
    dev = os.stat(mountpoint).st_dev
    path = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    try:
        path.write_text(str(READAHEAD_KB))
    except OSError as exc:
        log.info("kept the kernel's readahead for %s (%s: %s)", mountpoint, path, exc.strerror)


async def _terminate_on_signals() -> None:
    import pyfuse3

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            log.info("signal %s: unmounting", signal.Signals(sig).name)
            pyfuse3.terminate()
            return


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


def wait_for_mount(mountpoint: str, proc: subprocess.Popen | None, timeout: float = 30.0, log_path: Path | None = None) -> None:
    """Until ``mountpoint`` is a mount; fails at once if the mounting process died."""
    deadline = time.monotonic() + timeout
    while not is_mounted(mountpoint):
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path and log_path.exists() else ""
            raise RuntimeError(f"the mount process exited with {proc.returncode}\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{mountpoint} not mounted after {timeout}s")
        time.sleep(0.05)


def mount_background(
    config_path: str, mountpoint: str, options: list[str], log_path: Path, metrics: str | None = None, launcher: list[str] = ()
) -> subprocess.Popen:
    """``irdmafs mount -f`` in a new session, logging to ``log_path``; returns once it is live.
    ``launcher``: a command prefix (``nsenter --net=...``: the mount in a network namespace)."""
    cmd = [*launcher, sys.executable, "-m", "irdmafs.cli", "mount", "--config", str(config_path), str(mountpoint), "-f"]
    if metrics:
        cmd += ["--metrics", metrics]
    if options:
        cmd += ["-o", ",".join(options)]
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    wait_for_mount(mountpoint, proc, log_path=log_path)
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

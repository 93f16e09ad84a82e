"""``mount.irdmafs``: the helper mount(8) runs for ``mount -t fuse.irdmafs`` and fstab lines.

    mount.irdmafs CONFIG MOUNTPOINT [-o OPT[,OPT...]] [-n] [-s] [-f] [-v]

mount(8) looks for ``/sbin/mount.fuse.irdmafs`` (link it there: ``ln -s $(command -v
mount.irdmafs) /sbin/mount.fuse.irdmafs``) and calls it as above; the fstab line is

    /etc/irdmafs/cluster.toml  /mnt/ps  fuse.irdmafs  defaults,_netdev,allow_other  0 0

Options that only tell mount(8) and systemd when or by whom to mount (``defaults``, ``nofail``,
``_netdev``, ``noauto``, ``auto``, ``user``, ``users``, ``rw``, ``x-*``, ``comment=*``) are dropped;
``metrics=[HOST:]PORT`` serves the mount's Prometheus metrics there; the rest go to FUSE. The helper returns once the mount is live (exit 0), or with the mount
process's last log lines and exit 1 if it failed; the mount process stays in the background,
logging to /var/log/irdmafs (root) or the user's state directory.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .mount import IGNORED_OPTIONS, clear_dead_mount, is_mounted, mount_background


def fuse_mount_options(opts: list[str]) -> list[str]:
    """The options of ``-o`` that are for the file system, in order."""
    keep = []
    for o in opts:
        if not o or o in IGNORED_OPTIONS or o.startswith(("x-", "comment=")):
            continue
        keep.append(o)
    return keep


def log_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/log/irdmafs")
    from .cli import state_home

    return state_home() / "logs"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mount.irdmafs", description="mount an irdmafs cluster (as mount(8) calls it)")
    ap.add_argument("config", help="the cluster config (the fstab 'device' field)")
    ap.add_argument("mountpoint", help="where to mount (the fstab 'dir' field)")
    ap.add_argument("-o", dest="options", action="append", default=[], help="mount options, comma separated")
    ap.add_argument("-n", action="store_true", help="(mount(8): do not write mtab) ignored")
    ap.add_argument("-s", action="store_true", help="(mount(8): sloppy) ignored")
    ap.add_argument("-f", action="store_true", help="(mount(8): fake) do everything but mount")
    ap.add_argument("-v", action="store_true", help="verbose")
    args = ap.parse_args(argv)
    opts = [o for group in args.options for o in group.split(",")]
    config = os.path.abspath(args.config)
    mp = os.path.abspath(args.mountpoint)
    from .. import config as C

    try:
        C.load(config)
    except C.ConfigError as exc:
        print(f"mount.irdmafs: {exc}", file=sys.stderr)
        return 1
    if not os.path.isdir(mp):
        print(f"mount.irdmafs: {args.mountpoint}: not a directory", file=sys.stderr)
        return 1
    clear_dead_mount(mp)
    if is_mounted(mp):
        print(f"mount.irdmafs: {args.mountpoint}: already a mount point", file=sys.stderr)
        return 1
    metrics = next((o.split("=", 1)[1] for o in opts if o.startswith("metrics=")), None)
    if metrics is not None:
        from ..metrics import parse_address

        try:
            parse_address(metrics)
        except ValueError as exc:
            print(f"mount.irdmafs: -o metrics=: {exc}", file=sys.stderr)
            return 1
    fuse_opts = fuse_mount_options([o for o in opts if not o.startswith("metrics=")])
    if args.v:
        print(f"mount.irdmafs: {config} on {mp} with {','.join(fuse_opts) or 'no options'}", file=sys.stderr)
    if args.f:
        return 0
    logs = log_dir()
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"mount-{mp.strip('/').replace('/', '-') or 'root'}.log"
    try:
        mount_background(config, mp, fuse_opts, log_path, metrics=metrics)
    except (RuntimeError, TimeoutError) as exc:
        print(f"mount.irdmafs: mount failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

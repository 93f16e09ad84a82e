#!/usr/bin/env python3
"""pjdfstest, the POSIX file system suite, against a directory of a real irdmafs mount.

Builds pjdfstest from the archive in ``../shared/third_party`` (never from the project: its
code is not ours) into a build directory outside the sources, then runs each chosen test
directory with ``prove`` from an empty directory inside the mount and prints, per directory,
the tests passed out of those run, and the failures' first lines. With no ``--mount`` it starts
its own local cluster (3 nodes, R=2) and mounts it with ``allow_other`` (pjdfstest switches
to other users, whom FUSE turns away otherwise). Needs root (pjdfstest's tests do).

    scripts/pjdfstest.py [--dirs chmod,link,...] [--mount DIR] [--json FILE] [--failures N]

Exit status 0 only if every test run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = ROOT.parent / "shared" / "third_party" / "pjdfstest-85a8aea.tar.gz"
BUILD = Path(os.environ.get("IRDMAFS_PJDFSTEST_BUILD", Path(tempfile.gettempdir()) / "irdmafs-pjdfstest-85a8aea"))
DEBIAN = {"autoreconf": "autoconf", "aclocal": "automake", "gcc": "gcc", "make": "make", "prove": "perl"}
# chflags, granular and posix_fallocate test BSD/Solaris features: on Linux each is one test
# that passes at once; they are run so that the count is the suite's whole (8,798)
ALL_DIRS = (
    "chflags", "chmod", "chown", "ftruncate", "granular", "link", "mkdir", "mkfifo", "mknod",
    "open", "posix_fallocate", "rename", "rmdir", "symlink", "truncate", "unlink", "utimensat",
)
PER_DIR_TIMEOUT = 1800


def build() -> Path:
    """The pjdfstest tree with its binary built (once per archive, reused after)."""
    src = BUILD / "pjdfstest"
    if (src / "pjdfstest").exists():
        return src
    if not ARCHIVE.exists():
        sys.exit(f"pjdfstest: no archive at {ARCHIVE}")
    missing = sorted({pkg for tool, pkg in DEBIAN.items() if shutil.which(tool) is None})
    if missing:
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(BUILD, ignore_errors=True)
    BUILD.mkdir(parents=True)
    subprocess.run(["tar", "xzf", str(ARCHIVE), "-C", str(BUILD)], check=True)
    log = BUILD / "build.log"
    with open(log, "w") as out:
        for cmd in (["autoreconf", "-ifs"], ["./configure"], ["make", "pjdfstest"]):
            if subprocess.run(cmd, cwd=src, stdout=out, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"pjdfstest: {' '.join(cmd)} failed; see {log}")
    return src


def run_dir(src: Path, name: str, where: Path) -> dict:
    """prove one test directory from an empty directory ``where``; counts and failures."""
    where.mkdir()
    t0 = time.monotonic()
    p = subprocess.run(["prove", "-r", "-v", str(src / "tests" / name)], cwd=where, capture_output=True, text=True, timeout=PER_DIR_TIMEOUT)
    passed = failed = todo = 0
    failures = []
    script, planned, ran = "", 0, 0

    def unrun() -> None:  # a script that died part way: its tests not run count as failed
        nonlocal failed
        if planned > ran:
            failed += planned - ran
            failures.append(f"{script}: {planned - ran} of its {planned} tests did not run")

    for line in p.stdout.splitlines():
        m = re.match(r"^(/\S+\.t) \.+", line)
        if m:
            unrun()
            script, planned, ran = Path(m.group(1)).relative_to(src / "tests").as_posix(), 0, 0
        elif re.match(r"^1\.\.\d+$", line):
            planned = int(line[3:])
        elif re.match(r"^ok \d+", line):
            passed, ran = passed + 1, ran + 1
        elif re.match(r"^not ok \d+ # TODO", line):
            # pjdfstest's own "known to fail on this OS" (Linux itself does not do it): a pass
            # for prove, as for every file system on Linux; counted apart so it shows
            passed, ran, todo = passed + 1, ran + 1, todo + 1
        elif re.match(r"^not ok \d+", line):
            failed, ran = failed + 1, ran + 1
            failures.append(f"{script}: {line}")
    unrun()
    return {"passed": passed, "failed": failed, "todo": todo, "seconds": round(time.monotonic() - t0, 1), "failures": failures}


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from irdmafs.launch.local import end_on_sigterm

    end_on_sigterm()  # SIGTERM (timeout, a CI runner) stops what this script started, as ^C does
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dirs", default=",".join(ALL_DIRS), help="comma-separated test directories")
    ap.add_argument("--mount", help="run inside this mounted directory instead of a fresh cluster")
    ap.add_argument("--json", help="write the counts here too")
    ap.add_argument("--failures", type=int, default=20, help="failure lines shown per directory")
    ap.add_argument("--jobs", type=int, default=3, help="test directories run at once (default 3)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("pjdfstest: run as root (its tests switch users and create device nodes)")
    dirs = [d for d in args.dirs.split(",") if d]
    unknown = [d for d in dirs if d not in ALL_DIRS]
    if unknown:
        sys.exit(f"pjdfstest: no test directory {unknown[0]!r} (known: {', '.join(ALL_DIRS)})")
    src = build()
    cleanup = []
    try:
        if args.mount:
            base = Path(args.mount)
        else:
            state = Path(tempfile.mkdtemp(prefix="irdmafs-pjd-state-"))
            mnt = Path(tempfile.mkdtemp(prefix="irdmafs-pjd-mnt-"))
            cli = [sys.executable, "-m", "irdmafs"]
            subprocess.run(
                [*cli, "up", str(mnt), "--nodes", "3", "--replicas", "2", "--state", str(state), "-o", "allow_other"],
                check=True,
                stdout=subprocess.DEVNULL,
                cwd=ROOT,
            )
            cleanup.append(
                lambda: (subprocess.run([*cli, "down", str(mnt)], stdout=subprocess.DEVNULL, cwd=ROOT), shutil.rmtree(state, ignore_errors=True), mnt.rmdir())
            )
            base = mnt
        work = Path(tempfile.mkdtemp(prefix="pjdfstest-", dir=base))
        os.chmod(work, 0o755)
        # each directory from a directory of its own, --jobs at a time (the tests wait on the
        # mount's round trips much more than they compute: two at once take the cores)
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            runs = {d: pool.submit(run_dir, src, d, work / d) for d in dirs}
            results = {}
            for d, run in runs.items():
                r = results[d] = run.result()
                todo = f", {r['todo']} of them TODO" if r["todo"] else ""
                print(f"pjdfstest {d:<15} {r['passed']:>5} of {r['passed'] + r['failed']:>5} passed ({r['seconds']} s{todo})", flush=True)
                for f in r["failures"][: args.failures]:
                    print(f"    {f}")
        passed = sum(r["passed"] for r in results.values())
        total = sum(r["passed"] + r["failed"] for r in results.values())
        todo = sum(r["todo"] for r in results.values())
        print(f"pjdfstest: {passed} of {total} passed ({todo} of them TODO: tests pjdfstest marks as failing on Linux itself)")
        if args.json:
            Path(args.json).write_text(json.dumps({"passed": passed, "total": total, "todo": todo, "dirs": results}, indent=1))
        shutil.rmtree(work, ignore_errors=True)
        return 0 if passed == total and total else 1
    finally:
        for fn in cleanup:
            fn()


if __name__ == "__main__":
    sys.exit(main())

"""Debian packages the long deploy tests need (slurm-wlm, munge, prometheus), installed by the
test that needs them when missing: they are for ``scripts/test --long`` only, so
``scripts/setup`` does not pay for them.

``missing(...)`` answers why a package cannot be had (a reason to skip with), or None once every
command it names is on PATH."""

import os
import shutil
import subprocess

_updated = False


def missing(packages: list[str], commands: list[str], timeout: float = 900) -> str | None:
    """Install ``packages`` with apt-get unless every one of ``commands`` is already found.

    The services the packages ship are not started: Debian's maintainer scripts start them through
    invoke-rc.d, which asks /usr/sbin/policy-rc.d first; one that denies everything is put there
    for the install if none is (and removed after), so nothing listens afterwards (prometheus on
    every interface, slurmctld with Debian's config) that the test did not start itself."""
    global _updated
    if all(shutil.which(c) for c in commands):
        return None
    if os.geteuid() != 0:
        return f"{', '.join(packages)} not installed and not root to install them"
    if not shutil.which("apt-get"):
        return f"{', '.join(packages)} not installed and no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    policy = "/usr/sbin/policy-rc.d"
    ours = not os.path.exists(policy)
    if ours:
        with open(policy, "w") as f:
            f.write("#!/bin/sh\n# put here by irdmafs' tests for an apt-get install: start no services\nexit 101\n")
        os.chmod(policy, 0o755)
    try:
        if not _updated:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=timeout, check=True)
            _updated = True
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
            env=env, capture_output=True, timeout=timeout, check=True,
        )
    except subprocess.CalledProcessError as e:
        return f"apt-get install {' '.join(packages)} failed: {(e.stderr or b'').decode(errors='replace')[-300:]}"
    except subprocess.TimeoutExpired:
        return f"apt-get install {' '.join(packages)} took over {timeout:.0f} s"
    finally:
        if ours:
            os.unlink(policy)
    absent = [c for c in commands if not shutil.which(c)]
    return f"installed {' '.join(packages)} but {', '.join(absent)} still missing" if absent else None

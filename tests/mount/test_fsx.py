"""Random file operations against a model of the file (scripts/fsx.py, the method of xfstests'
fsx), and the bugs it found, each pinned by a test of its own."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mount

FSX = Path(__file__).resolve().parents[2] / "scripts" / "fsx.py"
UNIT = 64 << 10  # small stripes: most operations cross stripe boundaries


@pytest.fixture
async def ps(local_cluster, mount):
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=UNIT)
    return lc, mount


@pytest.mark.long  # behind --long: the quick suite took 11 min 48 s on 2026-12-02 (docs/testing.md)
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_fsx_reads_writes_truncates_mmaps_and_reopens(ps, seed):
    lc, mount = ps
    m = mount(lc)
    r = subprocess.run(
        [sys.executable, str(FSX), str(m / "fsx.dat"), "--ops", "1200", "--seed", str(seed)]
        + ["--maxlen", "1500000", "--maxop", "150000", "--closeopen", "0.2", "--seconds", "240"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1200 operations passed" in r.stdout


async def test_open_with_o_trunc_empties_the_file(ps):
    """libfuse asks for atomic O_TRUNC: the open itself must truncate (no setattr comes)."""
    lc, mount = ps
    m = mount(lc)
    (m / "f").write_bytes(b"x" * 100_000)
    fd = os.open(m / "f", os.O_RDWR | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        os.pwrite(fd, b"y" * 10, 50)
    finally:
        os.close(fd)
    assert (m / "f").read_bytes() == bytes(50) + b"y" * 10


async def test_a_hole_read_then_written_reads_the_data_in_every_mount(ps):
    """A stripe read as a hole is not remembered as one: this mount's write, and another
    mount's (after a reopen), are read back."""
    lc, mount = ps
    a, b = mount(lc, "a"), mount(lc, "b")
    fd = os.open(a / "sparse", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, 3 * UNIT)
        assert os.pread(fd, 4096, UNIT) == bytes(4096)  # a hole: nothing stored yet
        os.pwrite(fd, b"a" * 10, UNIT + 100)
        os.fsync(fd)
        assert os.pread(fd, 10, UNIT + 100) == b"a" * 10
        assert (b / "sparse").read_bytes()[2 * UNIT : 2 * UNIT + 10] == bytes(10)  # b reads the hole
        with open(a / "sparse", "r+b") as f:
            f.seek(2 * UNIT)
            f.write(b"b" * 10)
        assert (b / "sparse").read_bytes()[2 * UNIT : 2 * UNIT + 10] == b"b" * 10
    finally:
        os.close(fd)


async def test_shrinking_over_unflushed_writes_then_growing_reads_zeros(ps):
    """Data written past the size the nodes know (write-behind, not yet flushed) is zeroed by a
    truncate below it: growing the file again shows zeros, not the old bytes."""
    lc, mount = ps
    m = mount(lc)
    fd = os.open(m / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"\xaa" * 20_000, 10_000)  # size 30,000, not yet flushed
        os.ftruncate(fd, 5_000)
        os.ftruncate(fd, 40_000)
        assert os.pread(fd, 40_000, 0) == bytes(40_000)
    finally:
        os.close(fd)
    assert (m / "f").read_bytes() == bytes(40_000)

"""A file never looks complete when it is not (docs/design.md W1-W4): a writer whose mount dies
before its last flush leaves a file that opens as EIO on every other mount, never as zeros under
its name, whether it died between ``rename`` and ``close`` (safetensors' ``save_file``) or between
``write`` and ``close`` (``torch.save``'s O_TRUNC rewrite); a rewrite with O_TRUNC or a removal
recovers it. A writer that closes, or a file created and closed unwritten, is never refused; a
snapshot taken mid-write holds the file as EIO, the live file reads whole once closed."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from irdmafs.client.client import Client
from irdmafs.launch.mount import clear_dead_mount, is_mounted, wait_for_mount

pytestmark = pytest.mark.mount

MiB = 1 << 20
SIZE = 3 * MiB + 12_345  # over several stripes of 1 MiB, and a part of one

# A writer that stops where the test says, then waits for ever (its mount is killed under it):
# "rename" is safetensors' save_file (O_RDWR|O_CREAT|O_EXCL, ftruncate, writes, rename, then
# close); "write" is torch.save's rewrite of an existing file (O_WRONLY|O_TRUNC, writes, close).
WRITER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    path, pattern, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if pattern == "sized":  # sized, a child forked and exec'd (a FLUSH), renamed, and not one byte written yet
        fd = os.open(path + ".tmp", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, size)
        subprocess.run(["true"], check=True)
        os.rename(path + ".tmp", path)
        print("stopped", flush=True)
        time.sleep(3600)
    if pattern == "rename":  # a real safetensors file: a tensor directory must not come of it either
        import numpy as np, safetensors.numpy
        data = safetensors.numpy.save({"w": np.arange(size // 4, dtype=np.float32), "b": np.ones(5, np.float32)})
        size = len(data)
    else:
        data = bytes((i * 7 + 3) % 251 for i in range(256)) * (size // 256 + 1)
    if pattern == "rename":
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, size)
        os.fsync(fd)  # a flush while it goes on writing ...
        subprocess.run(["true"], check=True)  # ... and a forked child's exec closing its copy: neither finishes it
        os.write(fd, data[:17_000])
        os.pwrite(fd, data[17_000:size], 17_000)
        os.rename(tmp, path)
    else:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.write(fd, data[: size // 2])
    print("stopped", flush=True)
    time.sleep(3600)
    """
)


def content(size: int) -> bytes:
    return (bytes((i * 7 + 3) % 251 for i in range(256)) * (size // 256 + 1))[:size]


def start_mount(lc, mp):
    mp.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "irdmafs", "mount", "--config", str(lc.config_path), str(mp), "-f"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_mount(str(mp), proc)
    return proc


def kill_mount(proc, mp, *also) -> None:
    """SIGKILL the mount's process (then ``also``: its writers), and wait until the dead mount is
    detached (auto_unmount; or detached here, as ``irdmafs mount`` over it would)."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    for p in also:
        p.kill()
        p.wait(10)
    deadline = time.monotonic() + 10
    while is_mounted(str(mp)) and time.monotonic() < deadline and not clear_dead_mount(str(mp)):
        time.sleep(0.05)
    assert not is_mounted(str(mp))


def open_errno(path) -> int | None:
    """None if ``path`` opens and reads, else the errno it got."""
    try:
        with open(path, "rb") as f:
            f.read()
        return None
    except OSError as exc:
        return exc.errno


def wait_for_eio(path, seconds: float = 30.0) -> None:
    """Until an open of ``path`` is EIO: once the nodes count the dead writer gone (down_after)."""
    deadline = time.monotonic() + seconds
    while (got := open_errno(path)) != errno.EIO:
        assert got is None, f"{path}: {errno.errorcode.get(got, got)} before EIO"
        assert time.monotonic() < deadline, f"{path} still opens {seconds} s after its writer's mount died"
        time.sleep(0.1)


# rename in the quick suite; the other two (7-8 s each) with --long, as CI runs them
@pytest.mark.parametrize("pattern", ["rename", pytest.param("sized", marks=pytest.mark.long), pytest.param("write", marks=pytest.mark.long)])
async def test_a_file_whose_writers_mount_died_before_its_last_flush_opens_as_eio_not_zeros(local_cluster, mount, tmp_path, pattern):
    lc = await local_cluster(nodes=2, replicas=2, stripe_unit=MiB)
    b = mount(lc, "b")
    a_mp = tmp_path / "a"
    a = start_mount(lc, a_mp)
    name = "model.safetensors" if pattern != "write" else "model.bin"
    old = os.urandom(SIZE)
    if pattern == "write":  # a complete file first, which the writer then rewrites
        (a_mp / name).write_bytes(old)
        assert (b / name).read_bytes() == old
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(a_mp / name), pattern, str(SIZE)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "stopped"
    except BaseException:
        writer.kill()
        raise
    kill_mount(a, a_mp, writer)  # the writer's mount dies between its rename (or write) and its close
    assert os.path.exists(b / name)  # under its name, the size it was given ...
    wait_for_eio(b / name)  # ... and an open of it is EIO, never its zeros
    with pytest.raises(OSError) as exc:
        os.open(b / name, os.O_RDWR)  # nor is it written in place
    assert exc.value.errno == errno.EIO
    assert not os.path.exists(b / "model")  # nor do its tensors show as a model (fs/models.py)
    assert "its writer" in (tmp_path / "b.log").read_text()  # the mount says why
    # a rewrite (O_TRUNC) makes it a file again, whole once closed
    new = os.urandom(SIZE // 3)
    (b / name).write_bytes(new)
    assert (b / name).read_bytes() == new
    a = start_mount(lc, a_mp)  # and on a new mount where it was written
    try:
        assert (a_mp / name).read_bytes() == new
    finally:
        kill_mount(a, a_mp)


async def test_a_closed_writer_or_a_file_created_and_closed_unwritten_is_never_refused(local_cluster, mount, tmp_path):
    lc = await local_cluster(nodes=2, replicas=2, stripe_unit=MiB)
    b = mount(lc, "b")
    a_mp = tmp_path / "a"
    a = start_mount(lc, a_mp)
    fd = os.open(a_mp / "st.tmp", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)  # safetensors' pattern, closed
    os.ftruncate(fd, SIZE)
    os.pwrite(fd, content(SIZE), 0)
    os.rename(a_mp / "st.tmp", a_mp / "st.bin")
    os.close(fd)
    (a_mp / "empty").touch()
    (a_mp / "cut").write_bytes(b"x" * 100)
    open(a_mp / "cut", "wb").close()  # cut by an O_TRUNC open, nothing written
    with open(a_mp / "appended", "wb") as f:
        f.write(b"first line\n")
    with open(a_mp / "appended", "ab") as f:  # written in place: marked at its first write, finished at close
        f.write(b"second line\n")
    kill_mount(a, a_mp)  # its writers were all closed: nothing is left unfinished ...
    async with Client.connect(lc.cfg) as c:  # ... as the namespace says: no file carries a mark (W2)
        for name in ("st.bin", "empty", "appended", "cut"):
            attr = await c.paths.stat(f"/{name}")
            assert "writers" not in attr, (name, attr)
    assert (b / "st.bin").read_bytes() == content(SIZE)
    assert (b / "empty").read_bytes() == b"" and (b / "cut").read_bytes() == b""
    assert (b / "appended").read_bytes() == b"first line\nsecond line\n"


async def test_a_snapshot_taken_mid_write_holds_the_file_as_eio_and_the_live_file_reads_whole_once_closed(local_cluster, mount):
    lc = await local_cluster(nodes=2, replicas=2, stripe_unit=MiB)
    m = mount(lc)
    f = open(m / "ckpt.bin", "wb")
    f.write(content(SIZE)[: SIZE // 2])
    f.flush()  # to the mount; not closed
    os.mkdir(m / ".snapshots" / "mid")
    f.write(content(SIZE)[SIZE // 2 :])
    f.close()
    assert (m / "ckpt.bin").read_bytes() == content(SIZE)
    assert open_errno(m / ".snapshots" / "mid" / "ckpt.bin") == errno.EIO

"""Real mounts (a subprocess each) of real node processes: what users and Unix tools do."""

import errno
import json
import multiprocessing as mp
import os
import subprocess
import threading

import numpy as np
import pytest
import trio

pytestmark = pytest.mark.mount

MiB = 1 << 20


@pytest.fixture
async def ps(local_cluster, mount):
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=MiB)
    return lc, mount(lc)


async def test_np_save_while_the_process_forks_and_execs_keeps_every_byte(ps):
    """Each fork-and-exec of a process (a subprocess call from any of its threads) closes the
    child's copies of its open files, and every close of a FUSE file is a FLUSH: one comes in
    the middle of an np.save of another thread. The file must still end whole, a tensor: the
    mount once marked the handle clean after that early flush, so the writer's own close
    flushed nothing and the file kept its early size, while np.save returned as if all was
    well (found by scripts/chaos.py, whose fault scheduler starts a shell per fault)."""
    _, m = ps
    os.makedirs(m / "saves")
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((256, 300 + i)).astype(np.float32) for i in range(100)]
    stop = threading.Event()

    def fork_and_exec():
        for _ in range(2000):  # bounded: the saves take a few seconds
            if stop.is_set():
                return
            subprocess.run(["true"], check=True)

    forker = threading.Thread(target=fork_and_exec, daemon=True)
    forker.start()
    try:
        for i, a in enumerate(arrays):
            np.save(m / "saves" / f"t{i}.npy", a)
    finally:
        stop.set()
        forker.join(60)
    for i, a in enumerate(arrays):
        path = m / "saves" / f"t{i}.npy"
        assert os.path.getsize(path) == 128 + a.nbytes, path
        assert np.array_equal(np.load(path), a)
        assert json.loads(os.getxattr(path, "user.irdma.shape")) == list(a.shape), path


async def test_numpy_save_load_mmap_and_tensor_xattrs(ps):
    _, m = ps
    os.makedirs(m / "bert")
    arr = np.random.default_rng(0).standard_normal((700, 1000)).astype(np.float32)  # > 2 stripes
    np.save(m / "bert" / "w.npy", arr)
    assert np.array_equal(np.load(m / "bert" / "w.npy"), arr)
    mm = np.load(m / "bert" / "w.npy", mmap_mode="r")
    assert np.array_equal(mm, arr)
    del mm
    assert os.getxattr(m / "bert" / "w.npy", "user.irdma.dtype") == b"<f4"
    assert json.loads(os.getxattr(m / "bert" / "w.npy", "user.irdma.shape")) == [700, 1000]
    os.setxattr(m / "bert", "user.irdma.sync", b"bsp")
    assert os.getxattr(m / "bert", "user.irdma.sync") == b"bsp"
    assert sorted(os.listdir(m)) == ["bert"]  # hidden entries are not listed
    status = json.loads((m / ".irdma" / "cluster").read_text())
    assert [n["state"] for n in status["nodes"]] == ["ready"] * 3 and status["config"]


async def test_posix_basics(ps):
    _, m = ps
    f = m / "f"
    f.write_bytes(b"0123456789" * 300_000)  # 3 MB over 3 stripes
    with open(f, "r+b") as h:
        h.seek(MiB - 3)
        h.write(b"ABCDEF")  # across a stripe boundary
        h.seek(5 * MiB)
        h.write(b"end")  # past the end: a hole of zeros
    data = f.read_bytes()
    assert data[MiB - 3 : MiB + 3] == b"ABCDEF" and data[-3:] == b"end" and data[3_000_000 : 5 * MiB] == bytes(5 * MiB - 3_000_000)
    os.truncate(f, 100)
    assert f.read_bytes() == b"0123456789" * 10
    os.truncate(f, 200)
    assert f.read_bytes()[100:] == bytes(100)
    (m / "g").write_bytes(b"new")
    os.rename(m / "g", f)  # over an existing file, as rsync does
    assert f.read_bytes() == b"new" and not (m / "g").exists()
    os.chmod(f, 0o600)
    os.utime(f, ns=(1_000_000_000, 2_000_000_000))
    st = os.stat(f)
    assert (st.st_mode & 0o777, st.st_mtime_ns) == (0o600, 2_000_000_000)
    os.makedirs(m / "d" / "e")
    with pytest.raises(OSError) as err:
        os.rmdir(m / "d")
    assert err.value.errno == errno.ENOTEMPTY
    with pytest.raises(OSError) as err:
        (m / ("x" * 256)).write_bytes(b"")
    assert err.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as err:
        os.mkdir(m / ".irdma")
    assert err.value.errno == errno.EEXIST
    with pytest.raises(OSError) as err:
        (m / ".irdma" / "cluster").write_text("x")
    assert err.value.errno in (errno.EACCES, errno.EPERM)
    os.unlink(f)
    assert not f.exists()
    sv = os.statvfs(m)
    assert sv.f_blocks > 0 and sv.f_bavail <= sv.f_blocks


async def test_cp_r_snapshot_and_restore_copies_parameters_only(ps, tmp_path):
    _, m = ps
    os.makedirs(m / "bert")
    arr = np.arange(300_000, dtype=np.float64)
    np.save(m / "bert" / "w.npy", arr)
    subprocess.run(["cp", "-r", str(m / "bert"), str(tmp_path / "backup")], check=True)
    assert os.listdir(tmp_path / "backup") == ["w.npy"]
    np.save(m / "bert" / "w.npy", arr * 0)
    subprocess.run(["cp", "-r", str(tmp_path / "backup") + "/.", str(m / "bert")], check=True)
    assert np.array_equal(np.load(m / "bert" / "w.npy"), arr)
    subprocess.run(["cp", "-r", str(m), str(tmp_path / "whole")], check=True)
    assert sorted(os.listdir(tmp_path / "whole")) == ["bert"]  # no .irdma, .snapshots, views


async def test_rsync_in_out_and_again_moves_nothing(ps, tmp_path):
    _, m = ps
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    rng = np.random.default_rng(1)
    for i in range(5):
        (src / "sub" / f"t{i}.bin").write_bytes(rng.bytes(int(rng.integers(1, 3 * MiB))))
    (src / "empty").write_bytes(b"")

    def rsync(a, b):
        r = subprocess.run(["rsync", "-a", "--stats", f"{a}/", f"{b}/"], capture_output=True, text=True, check=True)
        return int(next(line for line in r.stdout.splitlines() if "Number of regular files transferred" in line).split(":")[1].replace(",", ""))

    assert rsync(src, m / "copy") == 6
    assert rsync(src, m / "copy") == 0
    assert rsync(m / "copy", tmp_path / "out") == 6
    assert rsync(m / "copy", tmp_path / "out") == 0
    diff = subprocess.run(["diff", "-r", str(src), str(tmp_path / "out")], capture_output=True)
    assert diff.returncode == 0, diff.stdout


async def test_safetensors_view_with_numpy_and_torch(ps, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, m = ps
    tensors = {"emb.weight": np.ones((300, 64), np.float32), "enc/l0.b": np.arange(8, dtype=np.int64)}
    save_file(tensors, tmp_path / "ck.safetensors", metadata={"step": "7"})
    subprocess.run(["cp", str(tmp_path / "ck.safetensors"), str(m / "gpt.safetensors")], check=True)
    assert sorted(os.listdir(m / "gpt")) == ["emb.weight.npy", "enc"]
    back = load_file(m / "gpt.safetensors")
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())

    torch = pytest.importorskip("torch", reason="torch==2.13.0 (CPU) not installed")
    from safetensors.torch import load_file as tload, save_file as tsave

    tb = tload(m / "gpt.safetensors")
    assert torch.equal(tb["emb.weight"], torch.ones(300, 64))
    tsave({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, tmp_path / "t.safetensors")
    subprocess.run(["cp", str(tmp_path / "t.safetensors"), str(m / "tmodel.safetensors")], check=True)
    assert np.array_equal(np.load(m / "tmodel" / "w.npy"), np.arange(6, dtype=np.float32).reshape(2, 3))


async def test_bad_writes_lose_nothing(ps, caplog):
    lc, m = ps
    os.makedirs(m / "gpt")
    np.save(m / "gpt" / "w.npy", np.ones(10, np.float32))
    # a malformed safetensors stream: EINVAL at close, tensors untouched
    with pytest.raises(OSError) as err:
        with open(m / "gpt.safetensors", "wb") as f:
            f.write(b"\xff" * 8 + b"{}")
    assert err.value.errno == errno.EINVAL
    assert np.array_equal(np.load(m / "gpt" / "w.npy"), np.ones(10, np.float32))
    # a malformed .npy is kept as plain bytes and is no tensor
    (m / "gpt" / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    assert (m / "gpt" / "bad.npy").read_bytes() == b"\x93NUMPY garbage"
    with pytest.raises(OSError) as err:
        os.getxattr(m / "gpt" / "bad.npy", "user.irdma.dtype")
    assert err.value.errno == errno.ENODATA
    log = (m.parent / "mnt.log").read_text()
    assert "not a tensor" in log and "safetensors write to directory" in log


async def test_snapshots_point_in_time(ps):
    _, m = ps
    os.makedirs(m / "bert")
    np.save(m / "bert" / "w.npy", np.zeros(400_000, np.float32))
    os.mkdir(m / ".snapshots" / "step100")
    np.save(m / "bert" / "w.npy", np.ones(400_000, np.float32))
    (m / "bert" / "new").write_bytes(b"x")
    assert os.listdir(m / ".snapshots") == ["step100"]
    assert os.listdir(m / ".snapshots" / "step100" / "bert") == ["w.npy"]
    assert not np.load(m / ".snapshots" / "step100" / "bert" / "w.npy").any()
    with pytest.raises(OSError) as err:
        (m / ".snapshots" / "step100" / "bert" / "w.npy").write_bytes(b"x")
    assert err.value.errno == errno.EROFS
    subprocess.run(["cp", "-r", str(m / ".snapshots" / "step100" / "bert") + "/.", str(m / "bert")], check=True)  # restore
    assert not np.load(m / "bert" / "w.npy").any()
    os.rmdir(m / ".snapshots" / "step100")
    assert os.listdir(m / ".snapshots") == []


def _mount_bytes_read(m) -> int:
    stats = json.loads((m / ".irdma" / "stats").read_text())
    return next(s["value"] for s in stats["metrics"]["irdmafs_mount_bytes_total"] if s["labels"] == {"dir": "read"})


async def test_a_snapshot_is_read_from_the_page_cache_once_there(ps):
    """A snapshot never changes: its pages stay cached across opens and a second read asks the
    cluster for nothing. A snapshot name dropped and taken again shows the new one."""
    _, m = ps
    data = os.urandom(3 * MiB)
    (m / "ckpt").write_bytes(data)
    os.mkdir(m / ".snapshots" / "s")
    snap = m / ".snapshots" / "s" / "ckpt"
    assert snap.read_bytes() == data
    before = _mount_bytes_read(m)
    assert snap.read_bytes() == data  # again: from the page cache
    assert os.stat(snap).st_size == len(data)
    assert _mount_bytes_read(m) - before < MiB  # (status reads count nothing; a stray readahead little)
    # the same name taken again after a change: its own inodes, so none of the old pages
    other = os.urandom(3 * MiB)
    (m / "ckpt").write_bytes(other)
    os.rmdir(m / ".snapshots" / "s")
    os.mkdir(m / ".snapshots" / "s")
    assert snap.read_bytes() == other


def _worker(root, rank, n, q):
    try:
        rng = np.random.default_rng(rank)
        mine = rng.integers(0, 255, 3 * MiB + rank, dtype=np.uint8)
        for _ in range(3):
            (root / f"w{rank}").write_bytes(mine.tobytes())
            assert (root / f"w{rank}").read_bytes() == mine.tobytes()
            shared = (root / "shared").read_bytes()
            assert shared == bytes([7]) * (2 * MiB)
        q.put((rank, "ok"))
    except BaseException as exc:  # reported to the test
        q.put((rank, repr(exc)))


async def test_several_processes_read_and_write_at_once(ps):
    _, m = ps
    (m / "shared").write_bytes(bytes([7]) * (2 * MiB))
    q = mp.Queue()
    procs = [mp.Process(target=_worker, args=(m, r, 4, q)) for r in range(4)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(10)
    assert results == {r: "ok" for r in range(4)}


async def test_two_mounts_see_each_others_writes(local_cluster, mount):
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=MiB)
    a, b = mount(lc, "a"), mount(lc, "b")
    arr = np.arange(500_000, dtype=np.int32)
    np.save(a / "x.npy", arr)  # close() returns: b must see it
    assert np.array_equal(np.load(b / "x.npy"), arr)
    np.save(b / "x.npy", arr[:10] * 3)
    assert np.array_equal(np.load(a / "x.npy"), arr[:10] * 3)
    os.mkdir(b / ".snapshots" / "s")
    assert os.listdir(a / ".snapshots") == ["s"]


def _stats(m) -> dict:
    return json.loads((m / ".irdma" / "stats").read_text())


def _grew(before: dict, after: dict, group: str, key: str) -> int:
    return after[group].get(key, 0) - before[group].get(key, 0)


async def test_reads_and_writes_cost_no_metadata_round_trip_each(ps):
    """The kernel asks for a file's attributes before every read(2) unless it may cache them,
    and for its security.capability xattr before every buffered write(2): each was a request
    through the mount per MiB (and the xattr a metadata call to a node), which halved what a
    sequential read or write moved. The attributes are cached a moment (names are not), and
    security.* is answered by the mount."""
    _, m = ps
    data = os.urandom(32 * MiB)
    before = _stats(m)
    fd = os.open(m / "big", os.O_RDWR | os.O_CREAT, 0o644)  # may read: buffered writes
    for off in range(0, len(data), MiB):
        os.pwrite(fd, data[off : off + MiB], off)
    os.close(fd)
    after = _stats(m)
    assert _grew(before, after, "fuse", "write") >= 32
    assert _grew(before, after, "control_calls_by_method", "getattr") <= 6  # not one per write
    fd = os.open(m / "big", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: every byte from the cluster
    got = bytearray()
    while chunk := os.read(fd, MiB):
        got += chunk
    os.close(fd)
    assert got == data
    done = _stats(m)
    assert _grew(after, done, "fuse", "read") >= 8
    assert _grew(after, done, "fuse", "getattr") <= 8  # 32 read(2) calls


async def test_a_reader_sees_what_an_appender_of_this_mount_has_not_flushed_and_the_appends_stay(ps):
    """A log appended to (O_APPEND, write-only: around the page cache) and read meanwhile in the
    same mount: the reader gets every byte written so far, not a short read at the size last
    flushed, after which the kernel took the file for that short and the next append landed
    over the first bytes."""
    _, m = ps
    fd = os.open(m / "log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"a" * 5000)
        assert (m / "log").read_bytes() == b"a" * 5000
        os.write(fd, b"b" * 100)
    finally:
        os.close(fd)
    assert (m / "log").read_bytes() == b"a" * 5000 + b"b" * 100


async def test_a_stat_by_name_sees_another_mounts_change_while_this_one_caches_attributes(local_cluster, mount):
    """Attributes cached by the kernel never hide another mount's change from a path walk: each
    looks the name up again, and the answer carries the attributes (close-to-open)."""
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=MiB)
    a, b = mount(lc, "a"), mount(lc, "b")
    (a / "f").write_bytes(b"x" * 1000)
    with open(b / "f", "rb") as f:
        assert f.read() == b"x" * 1000 and os.fstat(f.fileno()).st_size == 1000  # cached now
        (a / "f").write_bytes(b"y" * 5000)
        assert os.stat(b / "f").st_size == 5000  # by name: at once, while b holds it open
    assert (b / "f").read_bytes() == b"y" * 5000
    os.rename(a / "f", a / "g")
    assert not (b / "f").exists() and os.stat(b / "g").st_size == 5000
    os.truncate(a / "g", 10)
    assert os.stat(b / "g").st_size == 10 and (b / "g").read_bytes() == b"y" * 10


async def test_reads_never_mix_within_a_stripe(ps):
    """A reader racing another client's whole-stripe writes sees each stripe all-old or all-new.

    The writer is a second client (as a remote worker would be); the reader uses O_DIRECT reads
    of one stripe each, so every read is one FUSE request. (Within one mount, the kernel's page
    cache mixes a concurrent read and write at page granularity, as any local file system does.)"""
    import mmap

    import trio

    from irdmafs.client.client import Client

    lc, m = ps
    f = m / "race"
    f.write_bytes(bytes([0]) * (4 * MiB))
    errors, reads = [], 0

    def reader(stop):
        nonlocal reads
        buf = mmap.mmap(-1, MiB)  # page-aligned, as O_DIRECT wants
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            while not stop.is_set():
                for s in range(4):
                    n = os.preadv(fd, [buf], s * MiB)
                    chunk = buf[:n]
                    reads += 1
                    if n != MiB or len(set(chunk)) != 1:
                        errors.append((s, n, sorted(set(chunk))[:5]))
        finally:
            os.close(fd)

    stop = threading.Event()
    async with Client.connect(lc.cfg) as c:
        attr = await c.paths.resolve("/race")
        t = threading.Thread(target=reader, args=(stop,))
        t.start()
        try:
            for v in range(1, 41):
                await c.write(attr["ino"], 0, bytes([v]) * (4 * MiB), attr)
        finally:
            stop.set()
            await trio.to_thread.run_sync(t.join, 60)
    assert reads > 0 and not errors, errors[:5]


async def test_a_file_unlinked_while_open_stays_usable_until_its_last_close(ps):
    _, ps = ps
    fd = os.open(ps / "tmp", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"hello" * 1000)
    os.unlink(ps / "tmp")
    assert not (ps / "tmp").exists() and "tmp" not in os.listdir(ps)
    assert not any(n.startswith(".irdmafs-unlinked-") for n in os.listdir(ps))  # hidden
    os.pwrite(fd, b"xyz", 10)
    assert os.pread(fd, 20, 0) == b"hellohelloxyzlohello"
    os.fsync(fd)
    os.ftruncate(fd, 100)
    assert os.fstat(fd).st_size == 100
    hidden = ps / f".irdmafs-unlinked-{os.fstat(fd).st_ino}"
    assert hidden.exists()  # reachable by name only, until the last close
    os.close(fd)
    # the kernel sends RELEASE after close() has returned: wait for the name to go (bounded)
    with trio.fail_after(60):
        while hidden.exists():
            await trio.sleep(0.01)


async def test_a_live_file_keeps_its_pages_until_a_mount_or_a_training_step_changes_it(local_cluster, mount):
    """A live file read again unchanged comes from the page cache: an open keeps the pages if
    the file's stamp (the view, its namespace version, every stripe's version: fs/pagecache.py)
    is the one its last open took. A write through another mount, a same-size overwrite
    through this one, and a training step (which moves no namespace version, only its stripes'
    versions) are each seen at the reader's next open, read from the cluster again
    (close-to-open). A file under the stamp's size floor is read again at every open."""
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=MiB)
    a, b = mount(lc, "a"), mount(lc, "b")
    data = os.urandom(3 * MiB + 5)
    (a / "ckpt").write_bytes(data)

    def read_counted(path, want):
        before = _mount_bytes_read(b)
        assert path.read_bytes() == want
        return _mount_bytes_read(b) - before

    assert read_counted(b / "ckpt", data) >= len(data)  # the first read: from the cluster
    assert read_counted(b / "ckpt", data) < MiB  # unchanged: from the page cache
    other = os.urandom(len(data))
    (a / "ckpt").write_bytes(other)  # another mount, the same size
    assert read_counted(b / "ckpt", other) >= len(data)
    assert read_counted(b / "ckpt", other) < MiB
    mine = os.urandom(len(data))
    with open(b / "ckpt", "r+b") as f:  # this mount, in place
        f.write(mine)
    assert read_counted(b / "ckpt", mine) >= len(data) - 2 * MiB  # (its own writes may be in the cache)
    assert read_counted(b / "ckpt", mine) < MiB
    small = os.urandom(64 << 10)
    (a / "small").write_bytes(small)
    assert read_counted(b / "small", small) >= len(small)
    assert read_counted(b / "small", small) >= len(small)  # under the floor: read again
    # a training step changes a tensor's bytes and no namespace version
    d = a / "net"
    d.mkdir()
    for k, v in (("sync", "asp"), ("workers", "1"), ("optimizer", "sgd lr=1")):
        os.setxattr(d, f"user.irdma.{k}", v.encode())
    w = np.zeros(600_000, np.float32)  # 2.4 MB: three stripes
    np.save(d / "w.npy", w)
    assert np.array_equal(np.load(b / "net" / "w.npy"), w)
    before = _mount_bytes_read(b)
    assert np.array_equal(np.load(b / "net" / "w.npy"), w)
    assert _mount_bytes_read(b) - before < MiB
    version = os.stat(b / "net" / "w.npy").st_mtime_ns
    np.save(a / ".workers" / "0" / "net" / "w.npy", np.ones_like(w))
    assert np.array_equal(np.load(b / "net" / "w.npy"), w - 1)
    assert os.stat(b / "net" / "w.npy").st_mtime_ns == version  # the namespace did not move


async def test_a_model_file_keeps_its_pages_until_a_mount_changes_one_of_its_tensors(local_cluster, mount):
    """A model file (a safetensors file copied in: its bytes are its tensors') read again
    unchanged comes from the page cache: its stamp takes every stripe of its tensors (one call
    per node) and of its own header only. A tensor rewritten in place through another mount is
    seen at the reader's next open, read from the cluster again."""
    from safetensors.numpy import load, save

    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=MiB)
    a, b = mount(lc, "a"), mount(lc, "b")
    rng = np.random.default_rng(5)
    tensors = {f"layer{i}.weight": rng.standard_normal((300, 1000)).astype(np.float32) for i in range(3)}
    tensors |= {f"layer{i}.bias": rng.standard_normal(1000).astype(np.float32) for i in range(20)}
    blob = save(tensors)
    (a / "model.safetensors").write_bytes(blob)
    size = len(blob)
    assert "a model of" not in (a.parent / "a.log").read_text()  # its close copied nothing
    assert (a / "model").is_dir()  # wanted as a model (its tensors looked up): converted
    assert "a model of 23 tensors" in (a.parent / "a.log").read_text()

    def read_counted(want: bytes) -> int:
        before = _mount_bytes_read(b)
        assert (b / "model.safetensors").read_bytes() == want
        return _mount_bytes_read(b) - before

    assert read_counted(blob) >= size - MiB  # the first read: from the cluster
    assert read_counted(blob) < 64 << 10  # unchanged: from the page cache
    tensors["layer1.weight"] += 1  # the same dtype and shape, new values, rewritten in place
    new = save(tensors)
    at = new.index(tensors["layer1.weight"].tobytes()[:64])
    with open(a / "model.safetensors", "r+b") as f:
        f.seek(at)
        f.write(tensors["layer1.weight"].tobytes())
    assert read_counted(new) >= 1_200_000  # that tensor's bytes at least, from the cluster
    assert read_counted(new) < 64 << 10
    assert all(np.array_equal(v, tensors[k]) for k, v in load((b / "model.safetensors").read_bytes()).items())


async def test_a_snapshot_copies_nothing_until_the_live_file_changes(ps):
    """Copy-on-write through a real mount and real nodes (docs/design.md, S1-S4): taking a
    snapshot holds no memory of its own on any node; overwriting a file makes the snapshots hold
    that file's stripes (R copies), once, however many snapshots share them; the snapshots still
    read the old bytes; dropping them frees it all."""
    from irdmafs.launch.local import node_status

    lc, m = ps
    old, new = os.urandom(8 * MiB), os.urandom(8 * MiB)
    (m / "ckpt").write_bytes(old)
    (m / "other").write_bytes(os.urandom(4 * MiB))

    async def held() -> dict[str, int]:
        out: dict[str, int] = {}
        for name in lc.cfg.names:
            for kind, n in (await node_status(lc.cfg, name, timeout=10.0))["held"].items():
                out[kind] = out.get(kind, 0) + n
        return out

    before = await held()
    os.mkdir(m / ".snapshots" / "a")
    os.mkdir(m / ".snapshots" / "b")
    after = await held()
    assert after.get("snapshots", 0) == 0 and after["stripes"] == before["stripes"]
    (m / "ckpt").write_bytes(new)
    changed = await held()
    assert changed["snapshots"] == 2 * len(old), "each of ckpt's stripes copied once on each of R=2 nodes"
    assert changed["stripes"] == before["stripes"]
    for snap in ("a", "b"):
        assert (m / ".snapshots" / snap / "ckpt").read_bytes() == old
    assert (m / "ckpt").read_bytes() == new
    os.rmdir(m / ".snapshots" / "a")
    assert (await held())["snapshots"] == 2 * len(old)  # b still holds the copy
    os.rmdir(m / ".snapshots" / "b")
    assert (await held())["snapshots"] == 0


async def test_sparse_files_look_sparse(ps, tmp_path):
    """``st_blocks`` counts the stripes that hold bytes (held.py): a truncated file takes none,
    ``du`` shows what was written, and ``cp --sparse=always`` out allocates only that."""
    _, m = ps
    with open(m / "sparse", "wb") as f:
        f.truncate(100 * MiB)
    assert (m / "sparse").stat().st_blocks == 0
    with open(m / "sparse", "r+b") as f:
        f.seek(50 * MiB)
        f.write(os.urandom(MiB))  # one whole stripe
    st = (m / "sparse").stat()
    assert st.st_size == 100 * MiB and st.st_blocks * 512 == MiB
    (m / "dense").write_bytes(os.urandom(3 * MiB + 5))
    assert (m / "dense").stat().st_blocks == (3 * MiB + 5 + 511) // 512
    subprocess.run(["cp", "--sparse=always", str(m / "sparse"), str(tmp_path / "out")], check=True)
    assert (tmp_path / "out").read_bytes() == (m / "sparse").read_bytes()
    assert (tmp_path / "out").stat().st_blocks * 512 < 4 * MiB  # not 100 MiB


async def test_a_listing_has_dot_and_dotdot_and_the_root_has_its_times(ps):
    """``ls -a`` lists "." and ".."; the root's times are its creation's, not 1970 (the first
    namespace op's, which a mount's start makes)."""
    import time

    _, m = ps
    (m / "d").mkdir()
    out = subprocess.run(["ls", "-a", str(m), str(m / "d")], capture_output=True, text=True, check=True).stdout.split()
    assert out.count(".") == 2 and out.count("..") == 2 and "d" in out
    assert abs(os.stat(m).st_mtime - time.time()) < 3600 and os.stat(m).st_atime > 1e9
    assert sorted(os.listdir(m)) == ["d"]  # the dots are the kernel's to hide from listdir

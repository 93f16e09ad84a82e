"""The VFS awaited directly over an in-process cluster: what each path means, and its errnos."""

import errno
import json
import os
import stat as S

import numpy as np
import pytest
import pyfuse3
import trio

from irdmafs import formats
from irdmafs.client.client import Client
from irdmafs.fs import inodes as I
from irdmafs.fs import vfs as V
from irdmafs.fs import views
from irdmafs.fs.ops import Operations, entry, file_info
from irdmafs.errors import RemoteError
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster

W = os.O_WRONLY


@pytest.fixture
async def fs(nursery):
    cfg = config()
    await start_cluster(nursery, cfg)
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as client:
        yield V.Vfs(client, status={"config": "test"})


async def write_file(fs, parent, name, data):
    fh, st = await fs.create(parent, name, 0o644, W, 0, 0)
    await fs.write(fh, 0, data)
    await fs.release(fh)
    return st["st_ino"]


async def read_all(fs, ino, size=1 << 24):
    fh = await fs.open(ino, os.O_RDONLY)
    data = bytes(await fs.read(fh, 0, size))
    await fs.release(fh)
    return data


def npy(arr):
    return formats.encode_header(arr) + arr.tobytes()


async def test_hidden_entries_are_reachable_but_never_listed(fs):
    await fs.mkdir(1, "bert", 0o755, 0, 0)
    assert [n for n, _ in await fs.readdir(1)] == ["bert"]
    for name in (".irdma", ".snapshots", ".workers"):
        assert S.S_ISDIR((await fs.lookup(1, name))["st_mode"])
    assert sorted(n for n, _ in await fs.readdir(I.IRDMA_DIR)) == ["cluster", "stats"]
    status = json.loads(await read_all(fs, I.CLUSTER_FILE))
    assert status["config"] == "test" and [n["state"] for n in status["nodes"]] == ["ready"] * 3


async def test_tensor_detection_and_xattrs(fs):
    d = await fs.mkdir(1, "m", 0o755, 0, 0)
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    ino = await write_file(fs, d["st_ino"], "w.npy", npy(arr))
    assert await fs.getxattr(ino, "user.irdma.dtype") == b"<f4"
    assert json.loads(await fs.getxattr(ino, "user.irdma.shape")) == [3, 4]
    assert await fs.getxattr(ino, "user.irdma.version") == b"1"
    assert await fs.listxattr(ino) == []  # derived: read by name, never listed (test_xattrs.py)
    # a malformed .npy is kept as plain bytes: no tensor attributes, the bytes intact
    bad = b"\x93NUMPY\x01\x00" + b"\x10\x00{'descr': oops}" + b"x" * 40
    ino2 = await write_file(fs, d["st_ino"], "bad.npy", bad)
    assert await read_all(fs, ino2) == bad
    with pytest.raises(V.FsError) as err:
        await fs.getxattr(ino2, "user.irdma.dtype")
    assert err.value.errno == errno.ENODATA
    # user xattrs: set, get, list, remove; derived ones are read-only
    await fs.setxattr(d["st_ino"], "user.irdma.sync", b"bsp")
    assert await fs.getxattr(d["st_ino"], "user.irdma.sync") == b"bsp"
    await fs.setxattr(d["st_ino"], "user.irdma.sync", None)
    for name, value, code in [("user.irdma.dtype", b"x", errno.EPERM), ("trusted.x", b"1", errno.ENOTSUP)]:
        with pytest.raises(V.FsError) as err:
            await fs.setxattr(ino, name, value)
        assert err.value.errno == code


async def test_safetensors_view_read_and_write(fs):
    from safetensors.numpy import load, save

    d = await fs.mkdir(1, "gpt", 0o755, 0, 0)
    tensors = {"a.b": np.ones((2, 3), np.float32), "enc/w": np.arange(5, dtype=np.int64), "z": np.zeros(0, np.float16)}
    # a directory of no tensors has no view; beside a directory of tensors, gpt.safetensors is
    # its view: written, it sets the tensors
    with pytest.raises(V.FsError) as err:
        await fs.lookup(1, "gpt.safetensors")
    assert err.value.errno == errno.ENOENT
    await write_file(fs, d["st_ino"], "a.b.npy", npy(np.zeros((2, 3), np.float32)))
    view = await fs.lookup(1, "gpt.safetensors")
    assert view["st_ino"] == I.VIEW | d["st_ino"]
    fh = await fs.open(view["st_ino"], W)
    await fs.write(fh, 0, save(tensors, metadata={"k": "v"}))
    await fs.release(fh)
    assert sorted(n for n, _ in await fs.readdir(d["st_ino"])) == ["a.b.npy", "enc", "z.npy"]
    view = await fs.lookup(1, "gpt.safetensors")
    whole = await read_all(fs, view["st_ino"])
    assert view["st_size"] == len(whole)
    back = load(whole)
    assert set(back) == set(tensors) and all(np.array_equal(back[k], v) for k, v in tensors.items())
    # partial reads of the view at odd offsets give the same bytes
    fh = await fs.open(view["st_ino"], os.O_RDONLY)
    assert bytes(await fs.read(fh, 5, 100)) == whole[5:105]
    await fs.release(fh)
    # a malformed stream: EINVAL at flush, tensors as they were
    fh = await fs.open(view["st_ino"], W)
    await fs.write(fh, 0, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(V.FsError) as err:
        await fs.flush(fh)
    assert err.value.errno == errno.EINVAL
    await fs.release(fh)
    back = load(await read_all(fs, view["st_ino"]))
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())
    # a bad tensor name is refused before anything changes
    fh = await fs.open(view["st_ino"], W)
    await fs.write(fh, 0, save({"../escape": np.ones(1, np.float32)}))
    with pytest.raises(V.FsError):
        await fs.flush(fh)
    await fs.release(fh)
    assert sorted(n for n, _ in await fs.readdir(d["st_ino"])) == ["a.b.npy", "enc", "z.npy"]


async def test_a_safetensors_file_is_a_model_read_back_byte_for_byte(fs):
    from safetensors.numpy import load, save

    tensors = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "enc/w": np.ones(700_000, np.float16), "a.x": np.zeros(0, np.int64)}
    data = save(tensors, metadata={"format": "np"})
    sub = await fs.mkdir(1, "ckpt", 0o755, 0, 0)
    ino = await write_file(fs, sub["st_ino"], "m.safetensors", data)
    # listed as written, nothing else; the tensors are m/<name>.npy, reachable by name (the
    # lookup of m makes the file a model: models.py)
    assert [n for n, _ in await fs.readdir(sub["st_ino"])] == ["m.safetensors"]
    st = await fs.lookup(sub["st_ino"], "m.safetensors")
    assert st["st_ino"] == ino and st["st_size"] == len(data) and S.S_ISREG(st["st_mode"])
    assert await read_all(fs, ino) == data
    m = await fs.lookup(sub["st_ino"], "m")
    assert S.S_ISDIR(m["st_mode"]) and sorted(n for n, _ in await fs.readdir(m["st_ino"])) == ["a.x.npy", "b.npy", "enc"]
    b = await fs.lookup(m["st_ino"], "b.npy")
    assert await read_all(fs, b["st_ino"]) == npy(tensors["b"])
    # the file's own stripes keep its header only: the tensors' bytes live once
    attr = await fs.client.getattr(ino)
    model = json.loads(attr["xattrs"]["irdmafs.model"])
    assert model["dir"] == m["st_ino"]
    raw = await fs.client.read(ino, 0, len(data), attr)
    kept = -(-model["start"] // attr["unit"]) * attr["unit"]  # the stripes the header touches
    assert raw[: model["start"]] == data[: model["start"]] and kept < len(data) and not any(raw[kept:])
    assert "irdmafs.model" not in await fs.listxattr(ino)
    with pytest.raises(V.FsError):
        await fs.getxattr(ino, "irdmafs.model")
    # a write through the tensor's .npy shows in the file; a partial read at odd offsets too
    fh = await fs.open(b["st_ino"], W | os.O_TRUNC)
    await fs.write(fh, 0, npy(tensors["b"] + 1))
    await fs.release(fh)
    back = load(await read_all(fs, ino))
    assert np.array_equal(back["b"], tensors["b"] + 1) and np.array_equal(back["enc/w"], tensors["enc/w"])
    whole = await read_all(fs, ino)
    fh = await fs.open(ino, os.O_RDONLY)
    assert bytes(await fs.read(fh, 77, 1000)) == whole[77:1077]
    await fs.release(fh)
    # chmod and times as on any file; the tensor directory follows the mode
    await fs.setattr(ino, {"mode": 0o600, "mtime_ns": 123})
    st = await fs.getattr(ino)
    assert S.S_IMODE(st["st_mode"]) == 0o600 and st["st_mtime_ns"] == 123
    assert S.S_IMODE((await fs.getattr(m["st_ino"]))["st_mode"]) == 0o700
    # a policy set on the file is its tensors'
    await fs.setxattr(ino, "user.irdma.sync", b"asp")
    assert (await fs.client.getattr(m["st_ino"]))["xattrs"]["user.irdma.sync"] == "asp"
    # a rename into another directory takes the tensors along
    other = await fs.mkdir(1, "other", 0o755, 0, 0)
    await fs.rename(sub["st_ino"], "m.safetensors", other["st_ino"], "n.safetensors", 0)
    await fs.rmdir(1, "ckpt")  # nothing of the model was left behind
    n = await fs.lookup(other["st_ino"], "n")
    assert n["st_ino"] == m["st_ino"] and load(await read_all(fs, ino))["b"].sum() == (tensors["b"] + 1).sum()
    # written in place (no O_TRUNC): the bytes come back into the file, which is plain bytes
    # until it is wanted as a model again
    start, entries, _ = formats.st_parse(data, len(data))
    at = start + next(e.begin for e in entries if e.name == "b")
    fh = await fs.open(ino, W)
    await fs.write(fh, at, np.float32(42).tobytes())  # b[0, 0], in place
    await fs.release(fh)
    changed = load(await read_all(fs, ino))
    assert changed["b"][0, 0] == 42 and changed["b"][1, 2] == tensors["b"][1, 2] + 1
    assert not (await fs.client.getattr(ino))["xattrs"].get("irdmafs.model")  # plain bytes
    # a tensor rewritten with another shape through its .npy makes the header untrue: EIO
    # (nothing lost: the tensor file holds its data), until the file is written again
    n = await fs.lookup(other["st_ino"], "n")  # wanted as a model: made one again
    assert (await fs.client.getattr(ino))["xattrs"].get("irdmafs.model")
    b = await fs.lookup(n["st_ino"], "b.npy")
    fh = await fs.open(b["st_ino"], W | os.O_TRUNC)
    await fs.write(fh, 0, npy(np.ones(4, np.float32)))
    await fs.release(fh)
    fh = await fs.open(ino, os.O_RDONLY)
    with pytest.raises(V.FsError) as err:
        await fs.read(fh, 0, 100)
    assert err.value.errno == errno.EIO
    await fs.release(fh)
    fh = await fs.open(ino, W | os.O_TRUNC)
    await fs.write(fh, 0, data)
    await fs.release(fh)
    assert await read_all(fs, ino) == data
    # removed: the tensor directory goes too
    await fs.unlink(other["st_ino"], "n.safetensors")
    assert await fs.client.readdir(other["st_ino"]) == []


async def test_a_safetensors_file_that_does_not_map_stays_plain_bytes(fs, caplog):
    from safetensors.numpy import save

    cases = {
        "garbage.safetensors": b"garbage that is no safetensors stream at all",
        "json.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}",
        "escape.safetensors": save({"../x": np.ones(1, np.float32)}),
        "tail.safetensors": save({"x": np.ones(3, np.float32)}) + b"tail",
    }
    for name, data in cases.items():
        ino = await write_file(fs, 1, name, data)
        with pytest.raises(RemoteError) as gone:  # wanted as a model: it is none
            await fs.lookup(1, name[: -len(".safetensors")])
        assert gone.value.code == "ENOENT"
        assert await read_all(fs, ino) == data
        assert "irdmafs.model" not in (await fs.client.getattr(ino))["xattrs"]
    assert sorted(n for n, _ in await fs.readdir(1)) == sorted(cases)
    assert "kept as plain bytes, not a model" in caplog.text
    # a name the mount keeps for itself cannot be made
    with pytest.raises(V.FsError) as err:
        await fs.create(1, ".irdmafs-model-12", 0o644, W, 0, 0)
    assert err.value.errno == errno.EPERM


async def test_snapshots_via_mkdir_and_rmdir(fs):
    ino = await write_file(fs, 1, "f", b"old")
    snap = await fs.mkdir(I.SNAPSHOTS_DIR, "s1", 0o755, 0, 0)
    await write_file(fs, 1, "g", b"new file")
    fh = await fs.open(ino, W)
    await fs.write(fh, 0, b"NEW")
    await fs.release(fh)
    assert [n for n, _ in await fs.readdir(snap["st_ino"])] == ["f"]
    f = await fs.lookup(snap["st_ino"], "f")
    assert await read_all(fs, f["st_ino"]) == b"old"
    assert S.S_IMODE(f["st_mode"]) == 0o644  # its own mode: writes get EROFS (test_xattrs.py)
    for call in (fs.open(f["st_ino"], W), fs.create(snap["st_ino"], "x", 0o644, W, 0, 0), fs.unlink(snap["st_ino"], "f"), fs.setattr(f["st_ino"], {"size": 0})):
        with pytest.raises(V.FsError) as err:
            await call
        assert err.value.errno == errno.EROFS
    await fs.rmdir(I.SNAPSHOTS_DIR, "s1")
    assert await fs.readdir(I.SNAPSHOTS_DIR) == []


@pytest.mark.parametrize(
    "call, code",
    [
        (lambda fs: fs.mkdir(1, ".irdma", 0o755, 0, 0), errno.EEXIST),
        (lambda fs: fs.create(1, ".snapshots", 0o644, W, 0, 0), errno.EEXIST),
        (lambda fs: fs.create(I.IRDMA_DIR, "x", 0o644, W, 0, 0), errno.EPERM),
        (lambda fs: fs.mkdir(I.WORKERS_DIR, "0", 0o755, 0, 0), errno.EPERM),
        (lambda fs: fs.open(I.CLUSTER_FILE, W), errno.EACCES),
        (lambda fs: fs.rmdir(1, ".snapshots"), errno.EPERM),
        (lambda fs: fs.rename(1, ".irdma", 1, "x", 0), errno.EPERM),
        (lambda fs: fs.lookup(I.IRDMA_DIR, "nope"), errno.ENOENT),
    ],
)
async def test_hidden_entries_refuse_what_they_must(fs, call, code):
    with pytest.raises(V.FsError) as err:
        await call(fs)
    assert err.value.errno == code


async def test_ops_maps_every_error_to_one_errno(fs, caplog):
    ops = Operations(fs)
    with pytest.raises(pyfuse3.FUSEError) as err:
        await ops.lookup(1, b"missing", None)
    assert err.value.errno == errno.ENOENT
    with pytest.raises(pyfuse3.FUSEError) as err:
        await ops.mkdir(1, b"x" * 256, 0o755, type("Ctx", (), {"uid": 0, "gid": 0})())
    assert err.value.errno == errno.ENAMETOOLONG

    async def broken(*a):
        raise ZeroDivisionError("bug")

    fs.getattr = broken
    with pytest.raises(pyfuse3.FUSEError) as err:
        await ops.getattr(1, None)
    assert err.value.errno == errno.EIO
    assert "unexpected error" in caplog.text  # logged with context, not sent to the kernel


async def test_write_size_is_pending_until_flush(fs):
    fh, st = await fs.create(1, "f", 0o644, W, 0, 0)
    await fs.write(fh, 0, b"x" * 1000)
    assert (await fs.getattr(st["st_ino"]))["st_size"] == 1000  # this mount sees it at once
    assert (await fs.client.getattr(st["st_ino"]))["size"] == 0  # the cluster at flush
    await fs.flush(fh)
    assert (await fs.client.getattr(st["st_ino"]))["size"] == 1000
    await fs.release(fh)


async def test_a_write_that_comes_while_an_early_flush_waits_is_flushed_at_the_close(fs, nursery):
    """np.save writes the header, then the data through a dup'd fd; a process that forks and
    execs meanwhile (any subprocess call) closes its copies of the fds, and each close is a
    FLUSH that comes mid-write. A write landing while that flush waits for the cluster must
    leave the handle dirty: marked clean, the writer's own close flushed nothing, and the file
    kept the early flush's size (a tensor cut short, "not a tensor", np.save none the wiser)."""
    d = await fs.mkdir(1, "m", 0o755, 0, 0)
    arr = np.arange(3000, dtype=np.float32).reshape(30, 100)
    data = npy(arr)
    fh, st = await fs.create(d["st_ino"], "w.npy", 0o644, W, 0, 0)
    head = 128
    await fs.write(fh, 0, data[:head])
    entered, go_on = trio.Event(), trio.Event()
    extend = fs.client.data.extend

    async def slow_extend(ino, size):
        entered.set()
        await go_on.wait()  # the cluster answers later
        return await extend(ino, size)

    fs.client.data.extend = slow_extend
    early_done = trio.Event()

    async def early_flush():
        await fs.flush(fh)  # the forked child's close
        early_done.set()

    nursery.start_soon(early_flush)
    await entered.wait()
    await fs.write(fh, head, data[head:])  # the writer goes on meanwhile
    fs.client.data.extend = extend
    go_on.set()
    await early_done.wait()
    await fs.flush(fh)  # then the writer's own close
    await fs.release(fh)
    ino = st["st_ino"]
    assert (await fs.client.getattr(ino))["size"] == len(data)
    assert await read_all(fs, ino) == data
    assert json.loads(await fs.getxattr(ino, "user.irdma.shape")) == [30, 100]  # a tensor


async def test_a_flush_whose_tensor_detection_failed_decides_again_at_the_next_close(fs):
    """A forked child's close of a dup'd fd is a FLUSH whose error nobody reads. When its
    bytes were sent but recording what the file holds failed (the metadata primary stalled:
    set_tensor timed out), the handle must stay dirty so that the writer's own close decides
    again: marked clean, that close flushed nothing and succeeded, and the model's layout
    lacked the tensor for good (1 GiB chaos soak: "tensor 'b' is not in this model")."""
    d = await fs.mkdir(1, "m", 0o755, 0, 0)
    arr = np.arange(300, dtype=np.float32)
    data = npy(arr)
    fh, st = await fs.create(d["st_ino"], "b.npy", 0o644, W, 0, 0)
    await fs.write(fh, 0, data)
    set_tensor = fs.client.set_tensor

    async def timed_out(ino, tensor):
        raise TimeoutError("the metadata primary did not answer")

    fs.client.set_tensor = timed_out
    with pytest.raises(TimeoutError):
        await fs.flush(fh)  # the child's close: its error is lost
    fs.client.set_tensor = set_tensor
    await fs.flush(fh)  # the writer's own close
    await fs.release(fh)
    ino = st["st_ino"]
    assert json.loads(await fs.getxattr(ino, "user.irdma.shape")) == [300]  # a tensor after all
    _, parts = await views.layout(fs.client, d["st_ino"])
    assert [e.name for e, _ in parts] == ["b"]  # the step streams' layout names it


async def test_links_and_special_files_through_the_vfs_and_the_client(fs):
    ops, ctx = Operations(fs), type("Ctx", (), {"uid": 7, "gid": 8})()
    d = await fs.mkdir(1, "blobs", 0o755, 0, 0)
    ino = await write_file(fs, d["st_ino"], "x", b"payload")
    snap = await fs.mkdir(1, "snap", 0o755, 0, 0)
    link = await ops.symlink(snap["st_ino"], b"w", b"../blobs/x", ctx)
    assert S.S_ISLNK(link.st_mode) and (link.st_uid, link.st_gid) == (7, 8)
    assert await ops.readlink(link.st_ino, ctx) == b"../blobs/x"
    with pytest.raises(pyfuse3.FUSEError) as err:
        await ops.readlink(ino, ctx)  # not a link
    assert err.value.errno == errno.EINVAL
    hard = await ops.link(ino, 1, b"again", ctx)
    assert hard.st_ino == ino and hard.st_nlink == 2
    with pytest.raises(pyfuse3.FUSEError) as err:
        await ops.link(d["st_ino"], 1, b"dir2", ctx)
    assert err.value.errno == errno.EPERM
    fifo = await ops.mknod(1, b"p", S.S_IFIFO | 0o600, 0, ctx)
    dev = await ops.mknod(1, b"c", S.S_IFBLK | 0o600, (8 << 8) | 1, ctx)
    assert S.S_ISFIFO(fifo.st_mode) and S.S_ISBLK(dev.st_mode) and dev.st_rdev == (8 << 8) | 1
    # the client's own paths follow links as the kernel does
    c = fs.client
    assert (await c.paths.resolve("snap/w"))["ino"] == ino and (await c.paths.resolve("snap/w", follow=False))["ino"] == link.st_ino
    assert await c.paths.read_file("snap/./w") == b"payload"
    await c.symlink(1, "loop", "loop")
    await c.symlink(1, "abs", "/mnt/elsewhere")
    for path, code in (("loop", "ELOOP"), ("abs", "ENOENT"), ("blobs/x/y", "ENOTDIR")):
        with pytest.raises(RemoteError) as e:
            await c.paths.resolve(path)
        assert e.value.code == code
    # a snapshot keeps links; names cannot point from it into the live tree
    s = await fs.mkdir(I.SNAPSHOTS_DIR, "s1", 0o755, 0, 0)
    frozen = await fs.lookup((await fs.lookup(s["st_ino"], "snap"))["st_ino"], "w")
    assert await fs.readlink(frozen["st_ino"]) == "../blobs/x"
    with pytest.raises(V.FsError) as err:
        await fs.link(I.snap_ino(split_sid(s["st_ino"]), ino), 1, "from-snapshot")
    assert err.value.errno == errno.EXDEV


def split_sid(ino):
    return I.split_snap(ino)[0]


async def test_what_the_kernel_may_cache_of_a_file_and_of_its_opens(fs):
    """A regular file's attributes are cached a moment (the kernel asks before every read(2)
    otherwise); names are not (a path walk looks each up: close-to-open). A write-only open
    goes around the page cache; one that may read does not. security.* names are answered
    here: the kernel asks for security.capability before every buffered write(2)."""
    fh, st = await fs.create(1, "f", 0o644, W, 0, 0)
    assert file_info(fh, fs.handles.get(fh)).direct_io  # created write-only
    await fs.write(fh, 0, b"x" * 1000)
    await fs.release(fh)
    ino = st["st_ino"]
    e = entry(await fs.getattr(ino))
    assert e.attr_timeout == I.FILE_ATTR_SECONDS > 0 and e.entry_timeout == 0
    assert entry(await fs.lookup(1, "f")).entry_timeout == 0
    d = await fs.mkdir(1, "d", 0o755, 0, 0)
    assert entry(d).attr_timeout == I.DIR_ATTR_SECONDS
    for flags, direct in ((os.O_WRONLY, True), (os.O_WRONLY | os.O_TRUNC, True), (os.O_RDWR, False), (os.O_RDONLY, False)):
        fh = await fs.open(ino, flags)
        assert file_info(fh, fs.handles.get(fh)).direct_io is direct, flags
        await fs.release(fh)
    reader = await fs.open(ino, os.O_RDONLY)  # open here already: its pages would go stale
    fh = await fs.open(ino, os.O_WRONLY)
    assert not file_info(fh, fs.handles.get(fh)).direct_io
    await fs.release(fh)
    await fs.release(reader)
    await fs.setattr(ino, {"mode": S.S_IFREG | 0o4777})  # set-user-ID: the kernel clears it at a
    fh = await fs.open(ino, os.O_WRONLY)  # write only through the page cache (pjdfstest chmod/12)
    assert not file_info(fh, fs.handles.get(fh)).direct_io
    await fs.release(fh)
    calls = fs.client.cluster.peers.calls
    for _ in range(5):
        with pytest.raises(V.FsError) as err:
            await fs.getxattr(ino, "security.capability")
        assert err.value.errno == errno.ENODATA
    assert fs.client.cluster.peers.calls == calls  # no metadata call for them
    await fs.setxattr(ino, "user.k", b"v")
    assert await fs.getxattr(ino, "user.k") == b"v"



@pytest.mark.parametrize("closed_after", ["rename applied", "rename sent"])
async def test_a_last_close_during_an_unlink_of_an_open_file_leaves_it_one_remover(fs, nursery, monkeypatch, closed_after):
    """An unlink of a file open here renames it out of sight; the kernel's RELEASE of its last
    handle may come while that rename is on its way (close(2) does not wait for it). Whichever
    way they cross, the unlink succeeds and the file is gone under both names, once."""
    ino = await write_file(fs, 1, "f", b"x" * 100)
    fh = await fs.open(ino, os.O_RDONLY)
    real, paused, go = fs.client.rename, trio.Event(), trio.Event()

    async def rename(*args):
        if closed_after == "rename sent":
            paused.set()
            await go.wait()
        r = await real(*args)
        if closed_after == "rename applied":
            paused.set()
            await go.wait()
        return r

    monkeypatch.setattr(fs.client, "rename", rename)
    unlinked, failure = trio.Event(), []

    async def unlink():
        try:
            await fs.unlink(1, "f")
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            failure.append(exc)
        unlinked.set()

    nursery.start_soon(unlink)
    await paused.wait()
    await fs.release(fh)  # the last close, while the unlink's rename has not answered
    go.set()
    await unlinked.wait()
    assert failure == []
    assert [n for n, _ in await fs.readdir(1)] == []
    for name in ("f", f"{I.UNLINKED}{ino}"):
        with pytest.raises(RemoteError) as err:
            await fs.client.lookup(1, name)
        assert err.value.code == "ENOENT", name

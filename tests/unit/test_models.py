"""Model files (fs/models.py) through the VFS awaited directly: a close copies nothing, the
first use converts, links, renames, writers racing a conversion, concurrent readers, and the
tensor directory kept to its tensors."""

import errno
import os
from stat import S_ISDIR

import numpy as np
import pytest
import trio

from irdmafs.fs import vfs as V
from irdmafs.errors import RemoteError

from .test_vfs import W, fs, read_all, write_file  # noqa: F401 - fs is a fixture

RW = os.O_RDWR


def checkpoint(seed: int = 0) -> tuple[dict, bytes]:
    from safetensors.numpy import save

    rng = np.random.default_rng(seed)
    tensors = {"w": rng.standard_normal((300, 100)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    return tensors, save(tensors)


async def tensor_dirs(fs, parent) -> list[str]:
    """The hidden entries of ``parent`` (tensor directories), as the nodes list them."""
    return [n for n, _ in await fs.client.readdir(parent) if n.startswith(".irdmafs-model-")]


async def write_model(fs, parent, name, data) -> int:
    """``data`` written as ``name`` (a ``*.safetensors``), then wanted as a model: its tensor
    directory looked up, which converts it."""
    ino = await write_file(fs, parent, name, data)
    await fs.lookup(parent, name[: -len(".safetensors")])
    return ino


async def test_a_close_copies_nothing_and_the_first_use_converts(fs):
    tensors, data = checkpoint()
    writes = []
    real = fs.client.io.write

    async def counted(fid, *args, **kw):
        writes.append(fid)
        return await real(fid, *args, **kw)

    fs.client.io.write = counted
    ino = await write_file(fs, 1, "m.safetensors", data)
    before = list(writes)
    assert set(before) == {ino}  # the file's own stripes only: no tensor file made at its close
    assert await tensor_dirs(fs, 1) == [] and "irdmafs.model" not in (await fs.client.getattr(ino))["xattrs"]
    assert await read_all(fs, ino) == data
    assert (await fs.lookup(1, "m"))["st_ino"] != ino  # wanted as a model: converted now
    assert len(await tensor_dirs(fs, 1)) == 1 and set(writes[len(before):]) - {ino}  # its tensors' files written
    assert (await fs.client.getattr(ino))["xattrs"].get("irdmafs.model")
    w = await fs.lookup((await fs.lookup(1, "m"))["st_ino"], "w.npy")
    assert np.array_equal(np.load(__import__("io").BytesIO(await read_all(fs, w["st_ino"]))), tensors["w"])
    assert await read_all(fs, ino) == data


async def test_a_file_that_does_not_map_is_enoent_as_a_model_and_looked_at_once_per_version(fs, caplog):
    ino = await write_file(fs, 1, "bad.safetensors", stream(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(4)))
    reads = []
    real = fs.client.read

    async def counted(*args, **kw):
        reads.append(args)
        return await real(*args, **kw)

    fs.client.read = counted
    for _ in range(3):
        with pytest.raises(RemoteError) as err:
            await fs.lookup(1, "bad")
        assert err.value.code == "ENOENT"
    assert len(reads) == 1 and caplog.text.count("kept as plain bytes, not a model") == 1
    # rewritten so that it maps (a new version): looked at again, and a model
    fh = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
    good = stream(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', np.float32(3).tobytes())
    await fs.write(fh, 0, good)
    await fs.release(fh)
    assert S_ISDIR((await fs.lookup(1, "bad"))["st_mode"])
    assert await read_all(fs, ino) == good


async def test_no_conversion_while_a_handle_of_this_mount_writes_the_file(fs):
    _, data = checkpoint()
    fh, st = await fs.create(1, "m.safetensors", 0o644, RW, 0, 0)
    await fs.write(fh, 0, data)
    with pytest.raises(RemoteError) as err:
        await fs.lookup(1, "m")  # its writer has not closed it: not a model yet
    assert err.value.code == "ENOENT"
    await fs.release(fh)
    assert S_ISDIR((await fs.lookup(1, "m"))["st_mode"])
    assert await read_all(fs, st["st_ino"]) == data


async def test_hard_links_and_renames_keep_one_tensor_directory_and_leave_none(fs):
    _, data = checkpoint()
    a = await fs.mkdir(1, "a", 0o755, 0, 0)
    b = await fs.mkdir(1, "b", 0o755, 0, 0)
    ino = await write_model(fs, a["st_ino"], "m.safetensors", data)
    assert len(await tensor_dirs(fs, a["st_ino"])) == 1
    await fs.link(ino, b["st_ino"], "m.safetensors")
    await fs.unlink(a["st_ino"], "m.safetensors")  # another name is left: the tensors stay
    assert await read_all(fs, (await fs.lookup(b["st_ino"], "m.safetensors"))["st_ino"]) == data
    await fs.unlink(b["st_ino"], "m.safetensors")  # the last name: the tensors go, wherever they are
    assert await tensor_dirs(fs, a["st_ino"]) == [] and await tensor_dirs(fs, b["st_ino"]) == []
    await fs.rmdir(1, "a")
    # a model renamed over another: the replaced one's tensors go, the moved one's follow it
    one = await write_model(fs, b["st_ino"], "one.safetensors", data)
    _, other = checkpoint(1)
    await write_model(fs, 1, "two.safetensors", other)
    await fs.rename(1, "two.safetensors", b["st_ino"], "one.safetensors", 0)
    assert len(await tensor_dirs(fs, b["st_ino"])) == 1 and await tensor_dirs(fs, 1) == []
    assert await read_all(fs, (await fs.lookup(b["st_ino"], "one.safetensors"))["st_ino"]) == other
    with pytest.raises(RemoteError) as gone:
        await fs.getattr(one)  # freed with its name
    assert gone.value.code == "ENOENT"
    # a name the mount keeps for itself cannot be the target of a rename; other dot names are listed
    await write_file(fs, 1, ".irdmafs-notes", b"mine")
    assert ".irdmafs-notes" in [n for n, _ in await fs.readdir(1)]
    with pytest.raises(V.FsError) as err:
        await fs.rename(1, ".irdmafs-notes", 1, ".irdmafs-model-3", 0)
    assert err.value.errno == errno.EPERM


async def test_the_tensor_directory_holds_the_tensors_only(fs):
    tensors, data = checkpoint()
    await write_file(fs, 1, "m.safetensors", data)
    d = await fs.lookup(1, "m")  # wanted as a model: made one
    for op in (
        lambda: fs.create(d["st_ino"], "config.json", 0o644, W, 0, 0),
        lambda: fs.mkdir(d["st_ino"], "sub", 0o755, 0, 0),
        lambda: fs.unlink(d["st_ino"], "w.npy"),
        lambda: fs.rename(d["st_ino"], "w.npy", 1, "w.npy", 0),
        lambda: fs.rename(1, "m.safetensors", d["st_ino"], "x", 0),
    ):
        with pytest.raises(V.FsError) as err:
            await op()
        assert err.value.errno == errno.EPERM
    # nor through its own name, nor in a subdirectory of tensors
    hidden = next(n for n, _ in await fs.client.readdir(1) if n.startswith(".irdmafs-model-"))
    for op in (lambda: fs.rmdir(1, hidden), lambda: fs.rename(1, hidden, 1, "mine", 0)):
        with pytest.raises(V.FsError) as err:
            await op()
        assert err.value.errno == errno.EPERM
    assert await read_all(fs, (await fs.lookup(1, "m.safetensors"))["st_ino"]) == data


async def test_a_model_file_in_a_subdirectory_of_tensors_is_kept_whole(fs):
    from safetensors.numpy import save

    data = save({"enc/w": np.ones(3, np.float32), "b": np.zeros(2, np.float32)})
    await write_file(fs, 1, "n.safetensors", data)
    enc = await fs.lookup((await fs.lookup(1, "n"))["st_ino"], "enc")
    with pytest.raises(V.FsError) as err:
        await fs.unlink(enc["st_ino"], "w.npy")
    assert err.value.errno == errno.EPERM
    # the model record is the file system's: no client sets it by hand
    with pytest.raises(RemoteError) as bad:
        await fs.client.setxattr(1, "irdmafs.model", '{"dir": 1, "start": 8}')
    assert bad.value.code == "EPERM"


async def test_an_open_for_writing_without_a_write_leaves_a_model_alone(fs):
    _, data = checkpoint()
    ino = await write_model(fs, 1, "m.safetensors", data)
    fh = await fs.open(ino, RW)
    assert bytes(await fs.read(fh, 0, 64)) == data[:64]
    await fs.release(fh)
    await fs.setattr(ino, {"size": len(data)})  # truncate to the same size: nothing changes
    assert (await fs.client.getattr(ino))["xattrs"].get("irdmafs.model") and len(await tensor_dirs(fs, 1)) == 1


async def test_a_writer_racing_a_conversion_loses_nothing(fs, monkeypatch):
    """A write that comes while a conversion copies the tensors waits for it, then brings the
    bytes back into the file (the conversion is held mid-copy until the write is waiting)."""
    import trio.testing

    tensors, data = checkpoint()
    ino = await write_file(fs, 1, "m.safetensors", data)
    start = 8 + int.from_bytes(data[:8], "little")
    fh = await fs.open(ino, RW)
    go = trio.Event()
    real = fs.models._tensor_dir

    async def held(*args):
        await go.wait()
        return await real(*args)

    monkeypatch.setattr(fs.models, "_tensor_dir", held)
    async with trio.open_nursery() as n:  # a lookup of its tensors converts while a writer writes a tensor byte
        n.start_soon(fs.lookup, 1, "m")
        await trio.testing.wait_all_tasks_blocked()  # the conversion holds the file's lock
        n.start_soon(fs.write, fh, start, np.float32(42).tobytes())
        await trio.testing.wait_all_tasks_blocked()  # the write waits for it
        go.set()
    monkeypatch.setattr(fs.models, "_tensor_dir", real)
    await fs.release(fh)
    want = bytearray(data)
    want[start : start + 4] = np.float32(42).tobytes()
    assert await read_all(fs, ino) == bytes(want)
    await fs.lookup(1, "m")  # and as a model again: the same bytes
    assert (await fs.client.getattr(ino))["xattrs"].get("irdmafs.model") and await read_all(fs, ino) == bytes(want)


async def test_concurrent_reads_of_one_tensor_share_one_settled_read(fs, monkeypatch):
    tensors, data = checkpoint()
    ino = await write_model(fs, 1, "m.safetensors", data)
    calls = []
    real = fs.client.io.read_settled

    async def counted(fid, *args, **kw):
        calls.append(fid)
        await trio.sleep(0.01)  # the others arrive while it reads
        return await real(fid, *args, **kw)

    monkeypatch.setattr(fs.client.io, "read_settled", counted)
    fh = await fs.open(ino, os.O_RDONLY)
    got = {}

    async def one(off):
        got[off] = bytes(await fs.read(fh, off, 4096))

    async with trio.open_nursery() as n:
        for off in range(200, 100_000, 8192):
            n.start_soon(one, off)
    await fs.release(fh)
    assert all(v == data[k : k + 4096] for k, v in got.items())
    assert len(calls) == len(set(calls)) == 1  # tensor "w" (120,000 bytes) read once


def stream(header: bytes, data: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header + data


async def test_bad_safetensors_headers_stay_plain_and_say_why(fs, caplog):
    cases = {
        "json.safetensors": stream(b"{not json}", b""),
        "deep.safetensors": stream(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b""),
        "surrogate.safetensors": stream(b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', bytes(4)),
        "gap.safetensors": stream(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}', bytes(12)),
        "dtype.safetensors": stream(b'{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}', bytes(4)),
    }
    for name, data in cases.items():
        ino = await write_file(fs, 1, name, data)
        with pytest.raises(RemoteError):  # wanted as a model: it does not map
            await fs.lookup(1, name[: -len(".safetensors")])
        assert await read_all(fs, ino) == data
        assert "irdmafs.model" not in (await fs.client.getattr(ino))["xattrs"]
    assert caplog.text.count("kept as plain bytes, not a model") == len(cases), caplog.text

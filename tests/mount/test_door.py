"""The shared-memory door (irdmafs/worker/door.py, fs/door_server.py) through a real mount: who may come in,
what bad requests get, a model that changes under an open door, torch parameters living in the
region, and the mount going on after all of it. (The step values and the stream semantics run
through both doors in test_step_streams.py.)"""

import errno
import json
import os
import socket
import sys
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import trio

from irdmafs.worker import steps
from irdmafs.worker.door import Door, door_path

from ..conftest import fuse_unavailable

from .ranks import each_rank
from .test_permissions import as_nobody, public_mount, root_with_setpriv  # noqa: F401 -- fixtures

pytestmark = pytest.mark.mount

SHAPES = {"w": (1000, 300), "b": (300,)}


def setup_model(m, workers=1, sync="bsp"):
    d = m / "net"
    d.mkdir()
    for k, v in (("sync", sync), ("workers", str(workers)), ("optimizer", "sgd lr=1"), ("timeout", "5")):
        os.setxattr(d, f"user.irdma.{k}", v.encode())
    for name, shape in SHAPES.items():
        np.save(d / f"{name}.npy", np.zeros(shape, np.float32))


@pytest.fixture
async def m(local_cluster, mount):
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=1 << 20)
    mp = mount(lc)
    setup_model(mp)
    steps.close_doors()
    yield mp
    steps.close_doors()


def raw(m, ticket=None):
    """A socket to the door, the ticket read from the file (or the one given)."""
    doc = json.loads(door_path(m, "net", 0).read_bytes())
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect("\0" + doc["socket"])
    return s, ticket if ticket is not None else doc["ticket"]


def frame(doc) -> bytes:
    body = json.dumps(doc).encode()
    return struct.pack("<I", len(body)) + body


def answer(s):
    data, fds, _, _ = socket.recv_fds(s, 1 << 16, 4)
    for fd in fds:
        os.close(fd)
    n = struct.unpack("<I", data[:4])[0]
    return json.loads(data[4 : 4 + n]), len(fds)


async def test_a_door_step_gives_sgd_and_agrees_with_the_files(m):
    d = Door.open(m, "net", 0)
    g = {"w": np.full(SHAPES["w"], 0.5, np.float32), "b": np.arange(300, dtype=np.float32)}
    d.push(g)
    out = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}
    d.pull(out)
    assert np.array_equal(out["w"], -g["w"]) and np.array_equal(out["b"], -g["b"])
    assert np.array_equal(d.params["b"], -g["b"])  # the pull area itself
    assert np.array_equal(np.load(m / "net" / "b.npy"), -g["b"])
    # a partial push (only "b") is a partial step, as with the stream file
    os.setxattr(m / "net", "user.irdma.sync", b"asp")
    d.push({"b": np.ones(300, np.float32)})
    d.fsync()
    assert np.array_equal(np.load(m / "net" / "b.npy"), -g["b"] - 1)
    assert np.array_equal(np.load(m / "net" / "w.npy"), -g["w"])
    d.close()


async def test_bad_pushes_get_einval_and_push_nothing(m):
    d = Door.open(m, "net", 0)
    with pytest.raises(OSError) as err:
        d.push({"w": np.zeros((300, 1000), np.float32)})
    assert err.value.errno == errno.EINVAL and "'w'" in str(err.value)
    with pytest.raises(OSError) as err:
        d.push({"nope": np.zeros(3, np.float32)})
    assert err.value.errno == errno.EINVAL
    # a worker that scribbles over the header in its push area: the mount refuses it whole
    d.region[:8] = (10**9).to_bytes(8, "little")
    with pytest.raises(OSError) as err:
        d.push({n: np.ones(s, np.float32) for n, s in SHAPES.items()})
    assert err.value.errno == errno.EINVAL
    s, ticket = raw(m)
    s.sendall(frame({"ticket": ticket}))
    doc, nfds = answer(s)
    assert doc["ok"] == 1 and nfds == 1
    s.sendall(frame({"op": "push", "only": "w"}))  # only must be a list
    assert answer(s)[0]["errno"] == errno.EINVAL
    s.sendall(frame({"op": "launch"}))
    assert answer(s)[0]["errno"] == errno.EINVAL
    s.close()
    assert np.array_equal(np.load(m / "net" / "w.npy"), np.zeros(SHAPES["w"], np.float32))
    d.close()


async def test_tickets_are_single_use_and_garbage_closes_only_that_connection(m):
    s, ticket = raw(m)
    s.sendall(frame({"ticket": ticket}))
    assert answer(s)[0]["ok"] == 1
    s.close()
    s, _ = raw(m, ticket)  # the same ticket again
    s.sendall(frame({"ticket": ticket}))
    doc, nfds = answer(s)
    assert doc["errno"] == errno.EACCES and nfds == 0
    s.close()
    s, _ = raw(m, "f" * 32)  # one never issued
    s.sendall(frame({"ticket": "f" * 32}))
    assert answer(s)[0]["errno"] == errno.EACCES
    s.close()
    for junk in (b"\xff\xff\xff\xff" + b"x" * 10, b"\x05\x00\x00\x00notjs", struct.pack("<I", 2) + b"[]"):
        s, _ = raw(m)
        s.sendall(junk)
        s.shutdown(socket.SHUT_WR)
        try:
            assert s.recv(100) == b""  # closed, nothing handed out
        except ConnectionResetError:  # closed with our junk unread: the same
            pass
        s.close()
    # the mount goes on: a real door still works
    d = Door.open(m, "net", 0)
    d.push({n: np.ones(s, np.float32) for n, s in SHAPES.items()})
    d.pull()
    assert np.allclose(d.params["b"], -1)
    d.close()
    with pytest.raises(PermissionError):  # a ticket is only read
        os.open(door_path(m, "net", 0), os.O_WRONLY)


async def test_nothing_a_worker_sends_or_does_takes_the_mount_down(m):
    # a frame whose JSON nests past the recursion limit, before any ticket
    s, _ = raw(m)
    body = b"[" * 3000
    s.sendall(struct.pack("<I", len(body)) + body)
    s.close()
    # an oversized first frame (only a ticket may come before the ticket is checked)
    s, _ = raw(m)
    s.sendall(struct.pack("<I", 1 << 19) + b"x" * 100)
    s.close()
    # a worker that would shrink its region under the mount: the region is sealed
    s, ticket = raw(m)
    s.sendall(frame({"ticket": ticket}))
    data, fds, _, _ = socket.recv_fds(s, 1 << 16, 4)
    assert len(fds) == 1
    with pytest.raises(PermissionError):
        os.ftruncate(fds[0], 0)
    os.close(fds[0])
    s.sendall(frame({"op": "pull"}))
    s.close()  # gone before its answer
    d = Door.open(m, "net", 0)  # the mount still serves doors and files
    d.push({n: np.ones(s, np.float32) for n, s in SHAPES.items()})
    d.pull()
    assert np.allclose(d.params["b"], -1) and np.allclose(np.load(m / "net" / "b.npy"), -1)
    d.close()


async def test_a_model_that_changes_under_an_open_door_is_reopened(m):
    out = {"b": np.empty(300, np.float32)}
    steps.push_arrays(m, "net", 0, {n: np.ones(s, np.float32) for n, s in SHAPES.items()})
    steps.pull_arrays(m, "net", 0, out)
    first = steps.door(m, "net", 0)
    np.save(m / "net" / "c.npy", np.zeros(5, np.float32))  # a new tensor: a new layout
    steps.push_arrays(m, "net", 0, {"b": np.ones(300, np.float32), "w": np.ones(SHAPES["w"], np.float32), "c": np.ones(5, np.float32)})
    steps.pull_arrays(m, "net", 0, out)
    assert steps.door(m, "net", 0) is not first
    assert np.allclose(out["b"], -2) and np.allclose(np.load(m / "net" / "c.npy"), -1)


async def test_torch_parameters_live_in_the_door(m):
    torch = pytest.importorskip("torch")
    from irdmafs.worker.torch import ParameterServer

    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(SHAPES["w"]))
    module.b = torch.nn.Parameter(torch.zeros(SHAPES["b"]))
    ps = ParameterServer(m, "net", 0)
    for step in range(3):
        ps.pull(module)
        module.w.grad = torch.full(SHAPES["w"], 0.25)
        module.b.grad = torch.full(SHAPES["b"], 0.5)
        ps.push(module)
    ps.pull(module)
    d = steps.door(m, "net", 0)
    assert module.b.data_ptr() == d.params["b"].__array_interface__["data"][0]  # no copy at all
    assert torch.allclose(module.w, torch.full(SHAPES["w"], -0.75)) and torch.allclose(module.b, torch.full(SHAPES["b"], -1.5))


async def test_another_user_needs_the_ticket_files_permission(local_cluster, public_mount, root_with_setpriv, tmp_path):
    lc = await local_cluster(nodes=3, replicas=2)
    mp = public_mount(lc, "allow_other")
    setup_model(mp)
    for mode in (0o700, 0o755, 0o775):  # nobody may not write root's model: no door either
        os.chmod(mp / "net", mode)
        code, _, err = as_nobody("cat", str(door_path(mp, "net", 0)))
        assert code != 0 and "Permission denied" in err, oct(mode)
    os.chmod(mp / "net", 0o700)
    # a ticket root read is no good to nobody (the mount checks the peer's uid)
    public = Path(tempfile.mkdtemp(prefix="irdmafs-door-"))  # (tmp_path's parents are 0700)
    public.chmod(0o755)
    script = public / "use.py"
    script.write_text(
        "import json, socket, struct, sys\n"
        "doc = json.loads(sys.argv[1])\n"
        "s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect('\\0' + doc['socket'])\n"
        "b = json.dumps({'ticket': doc['ticket']}).encode(); s.sendall(struct.pack('<I', len(b)) + b)\n"
        "data, fds, _, _ = socket.recv_fds(s, 65536, 4)\n"
        "print(json.loads(data[4:]).get('errno'), len(fds))\n"
    )
    os.chmod(script, 0o644)
    ticket = door_path(mp, "net", 0).read_text()
    code, out, err = as_nobody(sys.executable, str(script), ticket)
    assert code == 0, err
    assert out.split() == [str(errno.EACCES), "0"]
    # with the directory open to others, nobody gets in by the file, and steps use the door
    os.chmod(mp / "net", 0o777)
    code, out, err = as_nobody("cat", str(door_path(mp, "net", 0)))
    assert code == 0 and "ticket" in out


async def test_a_remounted_mount_gets_a_new_door_and_a_dead_one_says_enotconn(local_cluster, tmp_path):
    from irdmafs.launch.mount import mount_background, unmount

    if fuse_unavailable():
        pytest.skip(fuse_unavailable())
    lc = await local_cluster(nodes=3, replicas=2)
    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = mount_background(str(lc.config_path), str(mp), [], tmp_path / "m1.log")
    try:
        setup_model(mp)
        steps.close_doors()
        out = {"b": np.empty(300, np.float32)}
        steps.push_arrays(mp, "net", 0, {n: np.ones(s, np.float32) for n, s in SHAPES.items()})
        steps.pull_arrays(mp, "net", 0, out)
        first = steps.door(mp, "net", 0)
        proc.kill()
        proc.wait(10)
        with pytest.raises(OSError) as err:  # as the stream files would answer
            steps.pull_arrays(mp, "net", 0, out)
        # a dead mount, or (auto_unmount) the bare mountpoint below it
        assert err.value.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.ENOENT)
        unmount(str(mp), lazy=True)
        proc = mount_background(str(lc.config_path), str(mp), [], tmp_path / "m2.log")
        steps.push_arrays(mp, "net", 0, {n: np.ones(s, np.float32) for n, s in SHAPES.items()})
        steps.pull_arrays(mp, "net", 0, out)
        assert steps.door(mp, "net", 0) not in (first, None)
        assert np.allclose(out["b"], -2)
    finally:
        steps.close_doors()
        unmount(str(mp), lazy=True)
        proc.terminate()
        proc.wait(10)


async def test_a_fused_step_is_a_push_then_a_pull(m):
    """Door.step overlaps each tensor's pull with the pushes of the others; the result is
    exactly push-then-pull's, for two ranks under bsp and for a partial step."""
    os.setxattr(m / "net", "user.irdma.workers", b"2")
    outs = {r: {n: np.empty(s, np.float32) for n, s in SHAPES.items()} for r in (0, 1)}

    def rank(r):
        for i in range(3):
            steps.step_arrays(m, "net", r, {n: np.full(s, r + 1 + i, np.float32) for n, s in SHAPES.items()}, outs[r])

    each_rank(rank)
    want = -sum((1 + i + 2 + i) / 2 for i in range(3))  # sgd lr=1 on the mean of the ranks
    for r in (0, 1):
        assert all(np.allclose(a, want) for a in outs[r].values()), r
    # a step the mount refuses (its header overwritten in the push area) pushes nothing
    before = {n: np.load(m / "net" / f"{n}.npy") for n in SHAPES}
    d = steps.door(m, "net", 0)
    d.region[:8] = (10**9).to_bytes(8, "little")
    with pytest.raises(OSError) as err:
        d.step({n: np.ones(s, np.float32) for n, s in SHAPES.items()})
    assert err.value.errno == errno.EINVAL
    assert all(np.array_equal(np.load(m / "net" / f"{n}.npy"), before[n]) for n in SHAPES)


async def test_torch_step_keeps_gradients_and_parameters_in_the_door(m):
    torch = pytest.importorskip("torch")
    from irdmafs.worker.torch import ParameterServer

    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(SHAPES["w"]))
    module.b = torch.nn.Parameter(torch.zeros(SHAPES["b"]))
    ps = ParameterServer(m, "net", 0)
    ps.pull(module)
    for step in range(3):
        module.zero_grad(set_to_none=False)
        ((module.w * 0.25).sum() + (module.b * 0.5).sum()).backward()
        ps.step(module)
    d = steps.door(m, "net", 0)
    assert module.b.grad.data_ptr() == d.grads["b"].__array_interface__["data"][0]
    assert module.b.data_ptr() == d.params["b"].__array_interface__["data"][0]
    assert torch.allclose(module.w, torch.full(SHAPES["w"], -0.75)) and torch.allclose(module.b, torch.full(SHAPES["b"], -1.5))
    ps.push(module)  # a push on its own moves an adopted gradient out of the area
    assert module.b.grad.data_ptr() != d.grads["b"].__array_interface__["data"][0]
    assert torch.allclose(module.b.grad, torch.full(SHAPES["b"], 0.5))


async def test_many_models_keep_a_bounded_set_of_doors_and_high_descriptors_work(m):
    """A process that trains model after model (a sweep, the chaos soak) keeps at most
    MAX_DOORS doors, so its descriptors and the mount's regions do not pile up; and a door works
    in a process whose descriptors run past select()'s FD_SETSIZE (the soak found both)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.skip(f"open-file limit {hard}: cannot hold 1100 descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    ballast = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        fds_before = len(os.listdir("/proc/self/fd"))
        n = steps.MAX_DOORS + 6
        for k in range(n):
            d = m / f"model{k}"
            d.mkdir()
            os.setxattr(d, "user.irdma.optimizer", b"sgd lr=1")
            np.save(d / "w.npy", np.zeros(8, np.float32))
            out = {"w": np.empty(8, np.float32)}
            steps.step_arrays(m, f"model{k}", 0, {"w": np.ones(8, np.float32)}, out)
            assert np.allclose(out["w"], -1)
            assert steps.door(m, f"model{k}", 0) is not None
        assert len(steps._doors) <= steps.MAX_DOORS
        assert len(os.listdir("/proc/self/fd")) - fds_before <= 2 * steps.MAX_DOORS + 4
        # an evicted model opens a new door again, and it still trains
        steps.step_arrays(m, "model0", 0, {"w": np.ones(8, np.float32)}, out)
        assert np.allclose(out["w"], -2)
    finally:
        for fd in ballast:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_door_evicted_while_a_request_runs_through_it_stays_open_until_it_ends(m, monkeypatch):
    """A process keeps at most MAX_DOORS doors, least recently used out first; a door another
    thread's doors push out while a request runs through it closes when that request ends,
    never under it: one closed mid-pull emptied the pull's areas, and its copy-out found no
    tensor (KeyError, chaos --model-gib 1, seed 125172)."""
    monkeypatch.setattr(steps, "MAX_DOORS", 2)
    for k in range(2):
        d = m / f"other{k}"
        d.mkdir()
        os.setxattr(d, "user.irdma.optimizer", b"sgd lr=1")
        np.save(d / "w.npy", np.zeros(8, np.float32))
    out = {name: np.empty(shape, np.float32) for name, shape in SHAPES.items()}
    held = []

    def pull_while_others_open(d):
        held.append(d)
        for k in range(2):  # what other threads' steps do meanwhile: "net" is pushed out
            assert steps.door(m, f"other{k}", 0) is not None
        assert ("net" not in {key[1] for key in steps._doors}) and set(d.params) == set(SHAPES)
        d.pull(out)

    assert steps.through_door(m, "net", 0, pull_while_others_open)
    assert all(np.array_equal(out[name], np.zeros(shape, np.float32)) for name, shape in SHAPES.items())
    assert held[0].params == {}  # closed once its request ended
    again = steps.door(m, "net", 0)
    assert again is not held[0] and set(again.params) == set(SHAPES)


def _door_maps(pid: int) -> int:
    """How many mappings of door regions process ``pid`` holds."""
    with open(f"/proc/{pid}/maps") as f:
        return sum("irdmafs-door" in line for line in f)


async def test_a_worker_that_leaves_frees_its_region_in_the_mount(m):
    """A door's region (push and pull areas, the model's size twice) is unmapped in the mount
    when its worker leaves, by a worker thread (a GB model's held the mount's loop 1.7 s: its
    kept pushes copied and the region unmapped in line; issue 41); rounds still open when it
    left keep their pushes, copied out, and are pulled right."""
    pid = json.loads((m / ".irdma" / "cluster").read_text())["mount_pid"]
    base = _door_maps(pid)
    os.setxattr(m / "net", "user.irdma.workers", b"2")  # rank 1 never pushes: rank 0's round stays open
    d = Door.open(m, "net", 0)
    g = {"w": np.full(SHAPES["w"], 2.0, np.float32), "b": np.ones(300, np.float32)}
    d.push(g)
    assert _door_maps(pid) == base + 1
    d.close()
    for _ in range(200):  # the session ends as the mount reads the worker's hang-up
        if _door_maps(pid) == base:
            break
        await trio.sleep(0.05)
    assert _door_maps(pid) == base
    e = Door.open(m, "net", 1)
    e.push({"w": np.zeros(SHAPES["w"], np.float32), "b": np.zeros(300, np.float32)})
    out = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}
    e.pull(out)  # the round closes with rank 0's kept push: its bytes were copied, not lost
    assert np.array_equal(out["w"], -g["w"] / 2) and np.array_equal(out["b"], -g["b"] / 2)  # bsp: the mean
    e.close()

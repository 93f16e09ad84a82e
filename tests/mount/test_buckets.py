"""Small tensors packed in buckets (docs/buckets.md) through a real mount and real node
processes: a model's small tensors are packed when its first step is laid out, trained as one
bucket, and every path that shows a tensor shows the same bytes; a partial step, a whole
rewrite and a write in place each give the tensor its own bytes back without losing one."""

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from irdmafs.client.client import Client
from irdmafs.names import MODEL_XATTR, PACK_MIN_TENSORS
from irdmafs.packing import in_force
from irdmafs.worker.steps import close_doors, pull_arrays, push_arrays
from .ranks import each_rank

pytestmark = pytest.mark.mount

SMALL = [f"bn{i}.weight" for i in range(PACK_MIN_TENSORS + 8)]
SHAPES = {name: (32 + i,) for i, name in enumerate(SMALL)} | {"big": (300_000,)}
LR = 0.1


@pytest.fixture(params=["door", "files"])
async def model(request, local_cluster, mount, monkeypatch):
    monkeypatch.setenv("IRDMAFS_DOOR", "1" if request.param == "door" else "0")
    close_doors()
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=1 << 20)
    m = mount(lc)
    d = m / "net"
    d.mkdir()
    for k, v in (("sync", "bsp"), ("workers", "2"), ("optimizer", f"sgd lr={LR}"), ("timeout", "10")):
        os.setxattr(d, f"user.irdma.{k}", v.encode())
    rng = np.random.default_rng(7)
    values = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    for name, v in values.items():
        np.save(d / f"{name}.npy", v)
    yield lc, m, values
    close_doors()


def both_ranks(m: Path, grads: list[dict], model: str = "net") -> None:
    each_rank(lambda r: push_arrays(m, model, r, grads[r]))


def full(value: float, names=SHAPES) -> dict:
    return {n: np.full(SHAPES[n], value, np.float32) for n in names}


def pulled(m: Path, rank: int = 0) -> dict:
    out = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}
    pull_arrays(m, "net", rank, out)
    return out


async def packing(lc) -> tuple[dict, dict[str, list]]:
    """name -> its bucket pointer (None: unpacked); node -> the files it holds pushes of."""
    async with Client.connect(lc.cfg) as c:
        attrs = {n: await c.paths.resolve(f"/net/{n}.npy") for n in SHAPES}
        fids = [a["ino"] for a in attrs.values()] + sorted({in_force(a)["fid"] for a in attrs.values() if in_force(a)})
        busy = {node: (await c.cluster.call(node, "train_busy", {"fids": fids}))["busy"] for node in c.cluster.roles.live()}
    return {n: in_force(a) for n, a in attrs.items()}, {"fids": [a["ino"] for a in attrs.values()], **busy}


# the other way behind --long: the quick suite took 10 min 45 s on 2026-12-03 (docs/testing.md)
@pytest.mark.parametrize("model", ["door", pytest.param("files", marks=pytest.mark.long)], indirect=True)
async def test_a_first_step_packs_the_small_tensors_and_they_train_as_one(model):
    lc, m, values = model
    both_ranks(m, [full(1.0), full(3.0)])
    out = pulled(m)
    for n, v in values.items():
        assert np.allclose(out[n], v - LR * 2.0), n  # sgd on the mean of 1 and 3
        assert np.array_equal(np.load(m / "net" / f"{n}.npy"), out[n]), n  # the file shows the bucket's bytes
    where, busy = await packing(lc)
    buckets = {p["fid"] for n, p in where.items() if p}
    assert all(where[n] for n in SMALL) and where["big"] is None and len(buckets) == 1
    bucket = buckets.pop()
    trained = set().union(*(set(v) for k, v in busy.items() if k != "fids"))
    # the step went to the bucket, not to its members' own stripes
    assert bucket in trained and not trained & {busy["fids"][i] for i in range(len(SMALL))}
    assert sorted(os.listdir(m / "net")) == sorted(f"{n}.npy" for n in SHAPES)  # never listed
    from safetensors.numpy import load

    view = load((m / "net.safetensors").read_bytes())
    assert all(np.array_equal(view[n], out[n]) for n in SHAPES)
    both_ranks(m, [full(2.0), full(2.0)])
    again = pulled(m, 1)
    assert all(np.allclose(again[n], out[n] - LR * 2.0) for n in SHAPES)


# the other way behind --long: the quick suite took 10 min 45 s on 2026-12-03 (docs/testing.md)
@pytest.mark.parametrize("model", ["door", pytest.param("files", marks=pytest.mark.long)], indirect=True)
async def test_a_partial_step_unpacks_the_bucket_and_loses_nothing(model):
    lc, m, values = model
    both_ranks(m, [full(1.0), full(1.0)])  # packed, one step
    some = SMALL[:3] + ["big"]
    both_ranks(m, [full(1.0, some), full(1.0, some)])  # frozen layers: the rest not pushed
    out = pulled(m)
    for n, v in values.items():
        steps = 2 if n in some else 1
        assert np.allclose(out[n], v - LR * steps), n
        assert np.array_equal(np.load(m / "net" / f"{n}.npy"), out[n]), n
    where, _ = await packing(lc)
    assert not any(where.values())
    both_ranks(m, [full(1.0), full(1.0)])  # every tensor alone now
    assert all(np.allclose(pulled(m)[n], out[n] - LR) for n in SHAPES)


@pytest.mark.parametrize("model", ["door"], indirect=True)  # (writes: the same through either door)
async def test_writes_to_a_packed_tensor_keep_every_byte(model):
    lc, m, values = model
    both_ranks(m, [full(1.0), full(1.0)])
    now = pulled(m)
    d = m / "net"
    new = np.arange(SHAPES[SMALL[0]][0], dtype=np.float32)
    np.save(d / f"{SMALL[0]}.npy", new)  # a whole rewrite: the tensor leaves its bucket
    assert np.array_equal(np.load(d / f"{SMALL[0]}.npy"), new)
    where, _ = await packing(lc)
    assert where[SMALL[0]] is None and all(where[n] for n in SMALL[1:])
    with open(d / f"{SMALL[1]}.npy", "r+b") as f:  # in place: the bucket is unpacked first
        mm = np.load(d / f"{SMALL[1]}.npy", mmap_mode="r")
        offset = mm.offset
        del mm
        f.seek(offset + 4)
        f.write(np.float32(42.0).tobytes())
    now[SMALL[1]][1] = 42.0
    for n in SMALL[1:] + ["big"]:
        assert np.array_equal(np.load(d / f"{n}.npy"), now[n]), n
    where, _ = await packing(lc)
    assert not any(where.values())
    os.mkdir(m / "other")
    shutil.move(str(d / f"{SMALL[2]}.npy"), str(m / "other" / "x.npy"))
    assert np.array_equal(np.load(m / "other" / "x.npy"), now[SMALL[2]])
    shutil.rmtree(d)  # the bucket cannot be seen; its last tensor took it along
    assert not (m / "net").exists()


@pytest.mark.parametrize("model", ["door"], indirect=True)
async def test_a_rename_out_of_the_directory_copies_and_rmdir_frees_the_bucket(model):
    lc, m, values = model
    both_ranks(m, [full(1.0), full(1.0)])
    now = pulled(m)
    d = m / "net"
    snap = m / ".snapshots" / "s1"
    os.mkdir(snap)
    os.mkdir(m / "other")
    with pytest.raises(OSError) as e:
        os.rename(d / f"{SMALL[0]}.npy", m / "other" / "x.npy")
    assert e.value.errno == 18  # EXDEV: mv copies it, written whole
    shutil.move(str(d / f"{SMALL[0]}.npy"), str(m / "other" / "x.npy"))
    assert np.array_equal(np.load(m / "other" / "x.npy"), now[SMALL[0]])
    both_ranks(m, [full(1.0, [n for n in SHAPES if n != SMALL[0]])] * 2)
    for n in SHAPES:  # the snapshot kept the bucket as it was
        assert np.array_equal(np.load(snap / "net" / f"{n}.npy"), now[n]), n
    shutil.rmtree(d)
    assert not d.exists()


async def test_a_safetensors_model_file_is_packed_and_reads_as_trained(local_cluster, mount):
    from safetensors.numpy import load, save_file

    close_doors()
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=1 << 20)
    m = mount(lc)
    rng = np.random.default_rng(3)
    values = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    save_file(values, str(m / "x.safetensors"))
    for k, v in (("sync", "bsp"), ("workers", "2"), ("optimizer", f"sgd lr={LR}"), ("timeout", "10")):
        os.setxattr(m / "x.safetensors", f"user.irdma.{k}", v.encode())
    both_ranks(m, [full(1.0), full(3.0)], "x")
    out = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}
    pull_arrays(m, "x", 0, out)
    read = load((m / "x.safetensors").read_bytes())  # the model file reads its tensors' bytes: the bucket's
    for n, v in values.items():
        assert np.allclose(out[n], v - LR * 2.0), n
        assert np.array_equal(read[n], out[n]), n
    async with Client.connect(lc.cfg) as c:
        f = await c.paths.resolve("/x.safetensors")
        d = json.loads(f["xattrs"][MODEL_XATTR])["dir"]  # its tensor directory (fs/models.py)
        packed = [n for n, a in await c.readdir(d) if in_force(a)]
    assert sorted(packed) == sorted(f"{n}.npy" for n in SMALL)
    close_doors()


async def test_ranks_on_two_mounts_pack_once_and_step_alike(local_cluster, mount):
    """Each mount packs at its first layout; the one whose pack is refused (the other's is
    under way, or done) waits for it and lays the model out again: both step by one bucket."""
    close_doors()
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=1 << 20)
    mounts = [mount(lc, "a"), mount(lc, "b")]
    d = mounts[0] / "net"
    d.mkdir()
    for k, v in (("sync", "bsp"), ("workers", "2"), ("optimizer", f"sgd lr={LR}"), ("timeout", "10")):
        os.setxattr(d, f"user.irdma.{k}", v.encode())
    values = {name: np.full(shape, 1.0, np.float32) for name, shape in SHAPES.items()}
    for name, v in values.items():
        np.save(d / f"{name}.npy", v)
    grads = [full(1.0), full(3.0)]
    each_rank(lambda r: push_arrays(mounts[r], "net", r, grads[r]))
    for r in (0, 1):
        out = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}
        pull_arrays(mounts[r], "net", r, out)
        assert all(np.allclose(out[n], 1.0 - LR * 2.0) for n in SHAPES), r
    where, busy = await packing(lc)
    assert len({p["fid"] for n, p in where.items() if p}) == 1 and all(where[n] for n in SMALL)
    close_doors()


@pytest.mark.parametrize("model", ["door"], indirect=True)
async def test_a_push_through_a_packed_tensors_own_file_unpacks_and_is_applied_once(model):
    """``.workers/<rank>/net/<t>.npy`` written for a packed tensor: the node refuses it as a
    push to a stale layout, the mount unpacks the bucket and pushes it again; the step is
    applied once, and the bucket's other tensors keep their bytes."""
    lc, m, values = model
    both_ranks(m, [full(1.0), full(1.0)])  # packed, one step
    now = pulled(m)
    t = SMALL[4]
    each_rank(lambda r: np.save(m / ".workers" / str(r) / "net" / f"{t}.npy", np.full(SHAPES[t], 2.0, np.float32)))
    got = np.load(m / ".workers" / "0" / "net" / f"{t}.npy")
    assert np.allclose(got, now[t] - LR * 2.0)
    for n in SHAPES:
        want = now[n] - LR * 2.0 if n == t else now[n]
        assert np.allclose(np.load(m / "net" / f"{n}.npy"), want), n
    where, _ = await packing(lc)
    assert not any(where.values())


async def test_a_step_whose_bucket_was_unpacked_elsewhere_fails_loudly_once(local_cluster, mount):
    """A door laid out with a bucket, the bucket unpacked through another mount (a push of one
    of its tensors there), then the door's next step: the bucket's push is refused
    (LAYOUT_CHANGED) after the step's other tensors may have been taken, so the step is EIO,
    not ESTALE (which a door client answers by repeating the step: those would count twice);
    the step after it is laid out afresh and every tensor holds each push exactly once."""
    close_doors()
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=1 << 20)
    a, b = mount(lc, "a"), mount(lc, "b")
    d = a / "net"
    d.mkdir()
    for k, v in (("sync", "asp"), ("workers", "1"), ("optimizer", "sgd lr=1"), ("timeout", "10")):
        os.setxattr(d, f"user.irdma.{k}", v.encode())
    for name, shape in SHAPES.items():
        np.save(d / f"{name}.npy", np.zeros(shape, np.float32))
    push_arrays(a, "net", 0, full(1.0))  # packed by mount a, one step
    t = SMALL[0]
    np.save(b / ".workers" / "0" / "net" / f"{t}.npy", np.full(SHAPES[t], 1.0, np.float32))  # unpacks through b
    with pytest.raises(OSError) as e:
        push_arrays(a, "net", 0, full(1.0))
    assert e.value.errno == errno.EIO
    push_arrays(a, "net", 0, full(1.0))  # laid out afresh: every tensor alone
    pushes = {n: np.load(d / f"{n}.npy") for n in SHAPES}
    # each push applied once: the step refused took "big" (its own push went) or not, nothing twice
    assert np.all(pushes[t] == -3.0), pushes[t][:3]
    assert all(np.all(pushes[n] == -2.0) for n in SMALL[1:]), {n: pushes[n][0] for n in SMALL[1:]}
    assert np.all(np.isin(pushes["big"], (-2.0, -3.0))) and len(set(pushes["big"].tolist())) == 1
    close_doors()

"""A training step as one stream per direction (.workers/<rank>/<model>.safetensors) through a
real mount: the values, the format, bad streams refused whole, and no control calls; each through
both doors that push_arrays/pull_arrays use: the mount's shared memory and the stream files."""

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from irdmafs.worker.steps import pull_arrays, push_arrays, stream_path
from .ranks import each_rank

pytestmark = pytest.mark.mount

# a tensor over two 1 MiB stripes, small ones, and one in a subdirectory (name "enc/w")
SHAPES = {"big": (300_000,), "fc.bias": (10,), "fc.weight": (10, 64), "enc/w": (5, 7)}


@pytest.fixture(params=["door", "files"])
async def model(request, local_cluster, mount, monkeypatch):
    from irdmafs.worker import steps

    monkeypatch.setenv("IRDMAFS_DOOR", "1" if request.param == "door" else "0")
    steps.close_doors()
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=1 << 20)
    m = mount(lc)
    d = m / "net"
    (d / "enc").mkdir(parents=True)
    for k, v in (("sync", "bsp"), ("workers", "2"), ("optimizer", "sgd lr=0.1"), ("timeout", "5")):
        os.setxattr(d, f"user.irdma.{k}", v.encode())
    for name, shape in SHAPES.items():
        np.save(d / f"{name}.npy", np.zeros(shape, np.float32))
    yield m
    # the door this test used was the one asked for
    used = [v for k, v in steps._doors.items() if k[0] == str(m) and k[1] == "net"]
    assert used and all((v is not None) == (request.param == "door") for v in used)
    steps.close_doors()


def grads(value: float) -> dict[str, np.ndarray]:
    return {n: np.full(s, value, np.float32) for n, s in SHAPES.items()}


def both_ranks(m: Path, values=(1.0, 3.0)) -> None:
    each_rank(lambda r: push_arrays(m, "net", r, grads(values[r])), timeout=30)


async def test_a_step_through_the_streams_is_the_average_of_the_ranks(model):
    m = model
    both_ranks(m)
    out = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}
    pull_arrays(m, "net", 0, out)
    for n in SHAPES:
        assert np.allclose(out[n], -0.1 * 2.0), n  # sgd lr=0.1 on the mean of 1 and 3
        assert np.array_equal(np.load(m / "net" / f"{n}.npy"), out[n])  # the files agree
    both_ranks(m, (2.0, 2.0))
    pull_arrays(m, "net", 1, out)
    assert np.allclose(out["big"], -0.4)


async def test_the_pull_stream_is_a_safetensors_file_of_every_tensor(model):
    from safetensors.numpy import load

    m = model
    both_ranks(m)
    path = stream_path(m, "net", 0)
    data = path.read_bytes()
    assert len(data) == path.stat().st_size
    tensors = load(data)
    assert sorted(tensors) == sorted(SHAPES)
    assert all(tensors[n].shape == s and np.allclose(tensors[n], -0.2) for n, s in SHAPES.items())


@pytest.mark.parametrize(
    "bad",
    [
        "garbage",  # no header at all
        "wrong-shape",
        "unknown-tensor",
        "named-twice",
        "short",  # the header promises more data than was written
    ],
)
async def test_a_bad_push_stream_is_refused_whole_and_pushes_nothing(model, bad):
    m = model
    path = stream_path(m, "net", 0)
    g = grads(1.0)
    if bad == "garbage":
        blob = b"\xff" * 64
    else:
        from irdmafs.formats import st_layout

        names = list(g)
        shapes = {n: a.shape for n, a in g.items()}
        if bad == "wrong-shape":
            shapes["fc.weight"] = (64, 10)
        if bad == "unknown-tensor":
            names.append("nope")
            g["nope"] = np.ones(3, np.float32)
            shapes["nope"] = (3,)
        header, _ = st_layout([(n, "<f4", shapes[n]) for n in names])
        body = b"".join(g[n].tobytes() for n in names)
        if bad == "named-twice":  # the same key twice in the JSON header
            text = header[8:].rstrip(b" ")
            end = len(body)
            text = text[:-1] + b',"fc.bias":{"dtype":"F32","shape":[10],"data_offsets":[%d,%d]}}' % (end, end + 40)
            text += b" " * (-len(text) % 8)
            header = len(text).to_bytes(8, "little") + text
            body += g["fc.bias"].tobytes()
        if bad == "short":
            body = body[:-40]
        blob = header + body
    fd = os.open(path, os.O_WRONLY)
    os.write(fd, blob)
    with pytest.raises(OSError) as err:
        os.close(fd)
    assert err.value.errno == errno.EINVAL
    # nothing of it counted: one good round still gives exactly one step
    both_ranks(m)
    assert np.allclose(np.load(m / "net" / "big.npy"), -0.2)


async def test_pull_arrays_says_what_does_not_fit(model):
    m = model
    with pytest.raises(KeyError, match="nope"):
        pull_arrays(m, "net", 0, {"nope": np.empty(3, np.float32)})
    with pytest.raises(ValueError, match="fc.weight"):
        pull_arrays(m, "net", 0, {"fc.weight": np.empty((64, 10), np.float32)})
    with pytest.raises(FileNotFoundError):
        pull_arrays(m, "no-such-model", 0, {})


async def test_steady_state_stream_steps_make_no_control_calls(model):
    m = model
    os.setxattr(m / "net", "user.irdma.workers", b"1")
    stats = m / ".irdma" / "stats"
    out = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}

    def step():
        pull_arrays(m, "net", 0, out)
        push_arrays(m, "net", 0, grads(1.0))

    for _ in range(3):  # warm-up: lookups, layout, stripe keys, staging, policy
        step()
    before = json.loads(stats.read_text())
    for _ in range(4):
        step()
    after = json.loads(stats.read_text())
    by = {k: v - before["control_calls_by_method"].get(k, 0) for k, v in after["control_calls_by_method"].items()}
    assert after["control_calls"] - before["control_calls"] == 0, {k: v for k, v in by.items() if v}
    assert after["metadata_calls"] - before["metadata_calls"] == 0
    assert after["bytes_pushed"] - before["bytes_pushed"] == 4 * sum(int(np.prod(s)) for s in SHAPES.values()) * 4
    assert np.allclose(np.load(m / "net" / "big.npy"), -0.1 * 7)

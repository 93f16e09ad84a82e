"""Hugging Face checkpoints through a real mount: copied in and out byte for byte by cp, rsync
and tar, loaded by ``from_pretrained`` from the mount, a snapshot and the copy out, and trained
where they lie (each safetensors file a model, fs/models.py) by two workers through
``irdmafs.worker.torch``, after which the live file and a snapshot hold what SGD gives.

The checkpoints are made in the test by transformers itself (a tiny BERT, no download)."""

import filecmp
import json
import os
import subprocess
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.mount
torch = pytest.importorskip("torch", reason="torch==2.13.0 (CPU) not installed")
transformers = pytest.importorskip("transformers", reason="transformers not installed")

LR = 0.1
STEPS = 6
VOCAB = 300  # the word embeddings span three 16 KiB stripes


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40, max_position_embeddings=48
    )
    return transformers.BertModel(config).eval()  # eval: no dropout, so gradients are exact


def checkpoint(root, sharded: bool):
    """A hub-like checkpoint directory: config, tokenizer files, a pooling folder, weights."""
    tiny_bert().save_pretrained(root, max_shard_size="40KB" if sharded else "1GB")
    (root / "vocab.txt").write_text("".join(f"w{i}\n" for i in range(97)))
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32}))
    os.chmod(root / "vocab.txt", 0o600)
    os.utime(root / "config.json", ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    return root


def same_tree(a, b):
    """diff -r says nothing, and the listings are the same."""
    r = subprocess.run(["diff", "-r", str(a), str(b)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for dirpath, dirs, files in os.walk(a):
        rel = os.path.relpath(dirpath, a)
        assert sorted(os.listdir(os.path.join(b, rel))) == sorted(dirs + files)


def state(path):
    return {k: v.detach().clone() for k, v in transformers.BertModel.from_pretrained(path).state_dict().items()}


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd}: {r.returncode}\n{r.stdout}{r.stderr}"


@pytest.fixture
async def ps(local_cluster, mount):
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=16 << 10)
    return mount(lc)


# sharded behind --long (the quick suite at 10 min 19 s on 2026-12-03): cp, rsync and tar of a
# directory of files stay quick in tests/mount/test_links.py and test_copies.py
@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=pytest.mark.long)], ids=["single", "sharded"])
async def test_cp_rsync_and_tar_round_trip_a_checkpoint_byte_for_byte(ps, tmp_path, sharded):
    m = ps
    src = checkpoint(tmp_path / "src", sharded)
    weights = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(weights) > 2 if sharded else weights == ["model.safetensors"]
    run(["cp", "-a", str(src), str(m / "cp")])
    run(["rsync", "-a", f"{src}/", f"{m / 'rsync'}/"])
    (m / "tar").mkdir()
    run(f"tar cf - -C {src} . | tar xf - -C {m / 'tar'}", shell=True)
    for name in ("cp", "rsync", "tar"):
        same_tree(src, m / name)
        for w in weights:  # each weights file is a model: its tensors are there by name
            assert (m / name / w[: -len(".safetensors")]).is_dir()
            assert os.stat(m / name / w).st_mode == os.stat(src / w).st_mode
    assert os.stat(m / "cp" / "config.json").st_mtime_ns == 1_600_000_000_000_000_000
    os.mkdir(m / ".snapshots" / "copied")
    # and out again, by each tool; a tarball made from the mount holds the files as written
    run(["cp", "-a", str(m / "cp"), str(tmp_path / "cp-out")])
    run(["rsync", "-a", f"{m / 'rsync'}/", f"{tmp_path / 'rsync-out'}/"])
    run(["tar", "cf", str(tmp_path / "out.tar"), "-C", str(m / "tar"), "."])
    (tmp_path / "tar-out").mkdir()
    run(["tar", "xf", str(tmp_path / "out.tar"), "-C", str(tmp_path / "tar-out")])
    for out in ("cp-out", "rsync-out", "tar-out"):
        same_tree(src, tmp_path / out)
    # the whole mount copied: each byte of a model once, never a file and its views
    run(["rsync", "-a", f"{m}/", f"{tmp_path / 'all'}/"])
    for name in ("cp", "rsync", "tar"):
        same_tree(src, tmp_path / "all" / name)
    assert sorted(os.listdir(tmp_path / "all")) == ["cp", "rsync", "tar"]
    # from_pretrained from the mount, a snapshot and the copy out: the same parameters
    want = state(src)
    for path in (m / "cp", m / ".snapshots" / "copied" / "tar", tmp_path / "cp-out"):
        got = state(path)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # chmod, chown and utimensat on a weights file behave as on any file
    w = m / "cp" / weights[0]
    os.chmod(w, 0o640)
    os.chown(w, 1234, 4321)
    os.utime(w, ns=(5, 7))
    st = os.stat(w)
    assert (st.st_mode & 0o777, st.st_uid, st.st_gid, st.st_mtime_ns) == (0o640, 1234, 4321, 7)
    assert filecmp.cmp(w, src / weights[0], shallow=False)


def grads_of(model, batch):
    model.zero_grad(set_to_none=False)
    out = model(input_ids=batch)
    (out.last_hidden_state.pow(2).mean() + out.pooler_output.pow(2).mean()).backward()


# the other way behind --long: the quick suite took 10 min 45 s on 2026-12-03 (docs/testing.md)
@pytest.mark.parametrize("sharded", [pytest.param(False, marks=pytest.mark.long), True], ids=["single", "sharded"])
async def test_two_workers_train_a_checkpoint_in_place(ps, tmp_path, sharded):
    from irdmafs.worker.steps import close_doors
    from irdmafs.worker.torch import ParameterServer

    m = ps
    src = checkpoint(tmp_path / "src", sharded)
    run(["cp", "-a", str(src), str(m / "hf")])
    batches = [torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(r)) for r in range(2)]
    ParameterServer(m, "hf/model", 0).configure(sync="bsp", workers="2", optimizer=f"sgd lr={LR}", timeout="20")

    # what SGD gives: the mean of both ranks' gradients, step after step, on one copy
    ref = transformers.BertModel.from_pretrained(src).eval()
    versions = [{k: v.detach().clone() for k, v in ref.state_dict().items()}]
    for _ in range(STEPS):
        total = None
        for b in batches:
            grads_of(ref, b)
            g = [p.grad.clone() for p in ref.parameters()]
            total = g if total is None else [x + y for x, y in zip(total, g)]
        with torch.no_grad():
            for p, g in zip(ref.parameters(), total):
                p -= LR * g / 2
        versions.append({k: v.detach().clone() for k, v in ref.state_dict().items()})

    errors = []

    def worker(rank):
        try:
            model = transformers.BertModel.from_pretrained(m / "hf").eval()
            ps_ = ParameterServer(m, "hf/model", rank)
            ps_.pull(model)
            for _ in range(STEPS):
                grads_of(model, batches[rank])
                ps_.step(model)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    weights = sorted(p.name for p in src.glob("*.safetensors"))
    mixed: list[str] = []
    reads = [0]

    def reader():
        """Reads every weights file while the workers train: each tensor must be one version."""
        from safetensors.torch import load

        deadline = time.monotonic() + 120
        while any(t.is_alive() for t in threads) and reads[0] < 200 and time.monotonic() < deadline:
            for w in weights:
                for k, v in load((m / "hf" / w).read_bytes()).items():
                    if not any(torch.allclose(v, ver[k], rtol=1e-5, atol=1e-6) for ver in versions):
                        mixed.append(f"{w}:{k} after {reads[0]} reads")
            reads[0] += 1

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.join(120)
    watcher.join(130)
    close_doors()
    assert not errors, errors
    assert reads[0] >= 1 and not mixed, mixed
    assert not any(t.is_alive() for t in threads)
    os.mkdir(m / ".snapshots" / "trained")
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    start = state(src)
    for path in (m / "hf", m / ".snapshots" / "trained" / "hf"):
        got = state(path)
        for k in want:
            assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6), k
        assert any(not torch.equal(got[k], start[k]) for k in want)  # it did train
    # what was not trained is as it was: the header, the other files
    for w in src.glob("*.safetensors"):
        head = 8 + int.from_bytes(w.read_bytes()[:8], "little")
        assert (m / "hf" / w.name).read_bytes()[:head] == w.read_bytes()[:head]
    assert (m / "hf" / "vocab.txt").read_bytes() == (src / "vocab.txt").read_bytes()
    # a tensor of the model is a .npy by its name too, in the directory named after its file
    name = "embeddings.word_embeddings.weight"
    shard = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name] if sharded else "model.safetensors"
    emb = np.load(m / "hf" / shard[: -len(".safetensors")] / f"{name}.npy")
    assert np.allclose(emb, want[name].numpy(), rtol=1e-5, atol=1e-6)


async def test_safetensors_and_save_pretrained_write_straight_into_the_mount(ps, tmp_path):
    from safetensors.torch import load_file, save_file

    m = ps
    tensors = {"conv1__weight": torch.randn(64, 3, 7, 7), "fc.bias": torch.zeros(10)}
    save_file(tensors, str(m / "net.safetensors"))
    save_file(tensors, str(tmp_path / "net.safetensors"))
    assert (m / "net.safetensors").read_bytes() == (tmp_path / "net.safetensors").read_bytes()
    assert sorted(os.listdir(m / "net")) == ["conv1__weight.npy", "fc.bias.npy"]
    assert sorted(os.listdir(m)) == ["net.safetensors"]
    back = load_file(str(m / "net.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    tiny_bert().save_pretrained(m / "direct")
    tiny_bert().save_pretrained(tmp_path / "direct")
    same_tree(tmp_path / "direct", m / "direct")
    assert (m / "direct" / "model").is_dir()

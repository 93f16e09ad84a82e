"""Symbolic links, hard links, FIFOs and device nodes through real mounts, and the workflows that
rely on them: a Hugging Face cache (blobs plus symlinked snapshots) copied in with ``cp -a`` and
out with ``rsync -a``, and ``tar`` of a model directory."""

import errno
import os
import stat as S
import subprocess
import tarfile
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.mount

MiB = 1 << 20


@pytest.fixture
async def two(local_cluster, mount):
    """Two mounts of one 3-node cluster (R=2): what one makes, the other must see."""
    lc = await local_cluster(nodes=3, replicas=2, stripe_unit=MiB)
    return lc, mount(lc, "a"), mount(lc, "b")


async def test_symlinks_resolve_on_every_mount_and_in_snapshots(two):
    _, a, b = two
    (a / "blobs").mkdir()
    (a / "blobs" / "x").write_bytes(b"payload")
    os.symlink("../blobs/x", a / "link")  # dangling until followed from the right place
    (a / "snap").mkdir()
    os.symlink("../blobs/x", a / "snap" / "w")
    os.symlink("/nowhere/at/all", a / "dangling")
    assert os.readlink(b / "snap" / "w") == "../blobs/x" and (b / "snap" / "w").read_bytes() == b"payload"
    st = os.lstat(b / "snap" / "w")
    assert S.S_ISLNK(st.st_mode) and st.st_size == len("../blobs/x")
    assert not (b / "dangling").exists() and (b / "dangling").is_symlink()
    with pytest.raises(FileNotFoundError):
        (b / "dangling").read_bytes()
    os.symlink("loop2", a / "loop1")
    os.symlink("loop1", a / "loop2")
    with pytest.raises(OSError) as e:
        open(b / "loop1")
    assert e.value.errno == errno.ELOOP
    os.mkdir(a / ".snapshots" / "s1")
    os.unlink(a / "snap" / "w")
    frozen = a / ".snapshots" / "s1" / "snap" / "w"
    assert os.readlink(frozen) == "../blobs/x" and frozen.read_bytes() == b"payload"
    with pytest.raises(OSError) as e:
        os.symlink("x", a / ".snapshots" / "s1" / "new")
    assert e.value.errno == errno.EROFS


async def test_hard_links_share_content_and_count_names(two):
    _, a, b = two
    data = np.random.default_rng(2).bytes(3 * MiB + 17)  # several stripes
    (a / "f").write_bytes(data)
    os.mkdir(a / "d")
    os.link(a / "f", a / "d" / "g")
    assert os.stat(b / "f").st_nlink == 2 and os.stat(b / "f").st_ino == os.stat(b / "d" / "g").st_ino
    with open(b / "d" / "g", "r+b") as f:  # written through one name, read through the other
        f.seek(MiB)
        f.write(b"\xab" * 100)
    want = data[:MiB] + b"\xab" * 100 + data[MiB + 100 :]
    assert (a / "f").read_bytes() == want
    os.unlink(a / "f")
    assert os.stat(b / "d" / "g").st_nlink == 1 and (b / "d" / "g").read_bytes() == want
    with pytest.raises(OSError) as e:
        os.link(a / "d", a / "d2")
    assert e.value.errno == errno.EPERM
    with open(a / "d" / "g", "rb") as f:  # the last name of an open file: nlink 0, still readable
        os.unlink(a / "d" / "g")
        assert os.fstat(f.fileno()).st_nlink == 0 and f.read() == want


async def test_fifos_carry_data_and_device_nodes_are_names(two):
    _, a, b = two
    os.mkfifo(a / "pipe", 0o640)
    assert S.S_ISFIFO(os.stat(b / "pipe").st_mode) and S.S_IMODE(os.stat(b / "pipe").st_mode) == 0o640
    got = []
    reader = threading.Thread(target=lambda: got.append((b / "pipe").read_bytes()))
    reader.start()  # the kernel's pipe between two opens of one name, through the other mount
    with open(b / "pipe", "wb") as f:
        f.write(b"through the fifo")
    reader.join(10)
    assert got == [b"through the fifo"]
    if os.geteuid() != 0:
        pytest.skip("creating a device node needs root")
    null = os.stat("/dev/null").st_rdev
    os.mknod(a / "null", S.S_IFCHR | 0o666, null)
    st = os.stat(b / "null")
    assert S.S_ISCHR(st.st_mode) and st.st_rdev == null
    with pytest.raises(PermissionError):  # a FUSE mount is nodev: the node is a name, never a door
        (b / "null").write_bytes(b"x")
    os.mknod(a / "sock", S.S_IFSOCK | 0o600)
    assert S.S_ISSOCK(os.lstat(b / "sock").st_mode)


def hf_cache(root):
    """A Hugging Face hub cache: content-addressed blobs, snapshots of symlinks into them,
    refs naming the snapshot; returns {path: bytes} of what reading through the links gives."""
    rng = np.random.default_rng(5)
    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    files = {"config.json": b'{"hidden": 8}', "model.safetensors": rng.bytes(2 * MiB + 5), "tokenizer/vocab.txt": b"a\nb\n"}
    seen = {}
    for name, data in files.items():
        blob = f"{abs(hash(data)):x}"
        (repo / "blobs" / blob).write_bytes(data)
        link = repo / "snapshots" / "abc123" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(repo / "blobs" / blob, link.parent), link)
        seen[f"snapshots/abc123/{name}"] = data
    return repo, seen


def tree(top):
    """What a tree holds, links as links (diff would follow them): path -> kind and content,
    mode, whole-second mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            rel, st = os.path.relpath(p, top), os.lstat(p)
            if S.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif S.S_ISDIR(st.st_mode):
                out[rel] = ("dir", S.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", S.S_IMODE(st.st_mode), int(st.st_mtime), open(p, "rb").read())
    return out


async def test_hf_cache_in_with_cp_a_and_out_with_rsync_a(two, tmp_path):
    _, a, b = two
    repo, seen = hf_cache(tmp_path / "hub")
    subprocess.run(["cp", "-a", str(repo), str(a / "hub")], check=True)
    for rel, data in seen.items():  # through the links, on the other mount
        assert S.S_ISLNK(os.lstat(b / "hub" / rel).st_mode) and (b / "hub" / rel).read_bytes() == data
    subprocess.run(["rsync", "-a", f"{b / 'hub'}/", f"{tmp_path / 'out'}/"], check=True)
    assert tree(tmp_path / "out") == tree(repo)
    r = subprocess.run(["rsync", "-a", "--itemize-changes", f"{b / 'hub'}/", f"{tmp_path / 'out'}/"], check=True, capture_output=True, text=True)
    assert r.stdout == ""  # nothing moves the second time: sizes, times, links all kept


async def test_tar_of_a_model_directory_round_trips(two, tmp_path):
    _, a, b = two
    model = a / "model"
    (model / "enc").mkdir(parents=True)
    arrays = {"enc/w.npy": np.arange(200_000, dtype=np.float32), "b.npy": np.ones(7)}
    for rel, arr in arrays.items():
        np.save(model / rel, arr)
    os.symlink("enc/w.npy", model / "latest.npy")
    os.link(model / "b.npy", model / "b_again.npy")
    archive = tmp_path / "model.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(b), "model"], check=True)
    with tarfile.open(archive) as t:
        kinds = {m.name: m.type for m in t.getmembers()}
    assert kinds["model/latest.npy"] == tarfile.SYMTYPE and tarfile.LNKTYPE in (kinds["model/b.npy"], kinds["model/b_again.npy"])
    os.mkdir(a / "restored")
    subprocess.run(["tar", "-xf", str(archive), "-C", str(a / "restored")], check=True)
    back = b / "restored" / "model"
    for rel, arr in arrays.items():
        assert np.array_equal(np.load(back / rel), arr)
    assert os.readlink(back / "latest.npy") == "enc/w.npy" and np.array_equal(np.load(back / "latest.npy"), arrays["enc/w.npy"])
    assert os.stat(back / "b.npy").st_ino == os.stat(back / "b_again.npy").st_ino
    assert tree(back) == tree(model)

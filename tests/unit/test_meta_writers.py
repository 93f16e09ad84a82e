"""The unfinished mark of a file being written, as the state machine applies it (server/nsops.py,
docs/design.md W1-W2): set by a writer's create, its O_TRUNC's or ftruncate's setattr, or its
``writing`` op; cleared only by that writer's finishing ``extend``; carried by rename and by a
snapshot's copy; and a malformed mark refused with nothing changed."""

import stat as S

from irdmafs.names import ROOT
from irdmafs.server.meta import Meta

from .test_meta_links import code, run

MiB = 1 << 20


def test_a_writers_mark_is_set_by_its_first_change_and_cleared_only_by_its_own_finishing_extend():
    m = Meta()
    f = run(m, op="create", parent=ROOT, name="t", mode=S.S_IFREG | 0o644, unit=MiB, writer="a")
    assert f["writer"] == "a"
    run(m, op="setattr", ino=f["ino"], attrs={"size": 5 * MiB}, writer="a")  # its ftruncate
    assert run(m, op="rename", parent=ROOT, name="t", new_parent=ROOT, new_name="model")  # the mark goes with it
    assert m.lookup(ROOT, "model")["writer"] == "a"
    assert run(m, op="extend", ino=f["ino"], size=5 * MiB)["writer"] == "a"  # a flush that is not its last
    assert run(m, op="extend", ino=f["ino"], size=5 * MiB, done="b")["writer"] == "a"  # another writer's
    assert "writer" not in run(m, op="extend", ino=f["ino"], size=5 * MiB, done="a")
    run(m, op="writing", ino=f["ino"], writer="b")  # written in place by another: its mark
    run(m, op="snapshot", name="mid")
    assert "writer" not in run(m, op="extend", ino=f["ino"], size=5 * MiB, done="b")
    assert m.view(m.frozen.ids()["mid"]).attr(f["ino"])["writer"] == "b"  # the snapshot's copy keeps it
    g = run(m, op="create", parent=ROOT, name="plain", mode=S.S_IFREG | 0o644, unit=MiB)
    assert "writer" not in g  # the Client API's own files carry none
    run(m, op="setattr", ino=g["ino"], attrs={"size": 10})  # nor does a truncate without a writer
    assert "writer" not in m.inode(g["ino"])


def test_a_malformed_mark_is_einval_and_changes_nothing():
    m = Meta()
    f = run(m, op="create", parent=ROOT, name="t", mode=S.S_IFREG | 0o644, unit=MiB)["ino"]
    d = run(m, op="mkdir", parent=ROOT, name="d", mode=0o755)["ino"]
    assert code(m, op="writing", ino=f, writer=7) == "EINVAL"
    assert code(m, op="writing", ino=f) == "EINVAL"
    assert code(m, op="writing", ino=d, writer="a") == "EINVAL"  # a directory is not written
    assert code(m, op="writing", ino=999, writer="a") == "ENOENT"
    assert code(m, op="create", parent=ROOT, name="u", mode=S.S_IFREG | 0o644, writer=["a"]) == "EINVAL"
    assert code(m, op="setattr", ino=f, attrs={"size": 1}, writer=1) == "EINVAL"
    assert code(m, op="extend", ino=f, size=1, done=True) == "EINVAL"

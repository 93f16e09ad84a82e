"""The unfinished mark of a file being written, as the state machine applies it (server/nsops.py,
docs/design.md W1-W2): a writer joins a file's ``writers`` by its create, its O_TRUNC's or
ftruncate's setattr, or its ``writing`` op, and leaves them only by its own ``written``; the
mark goes with rename and into a snapshot's copy; a malformed one is refused, nothing changed."""

import stat as S

from irdmafs.names import ROOT
from irdmafs.server.meta import Meta

from .test_meta_links import code, run

MiB = 1 << 20


def test_a_writer_marks_a_file_by_its_first_change_and_only_its_own_written_unmarks_it():
    m = Meta()
    f = run(m, op="create", parent=ROOT, name="t", mode=S.S_IFREG | 0o644, unit=MiB, writer="a")
    assert f["writers"] == ["a"]
    run(m, op="setattr", ino=f["ino"], attrs={"size": 5 * MiB}, writer="a")  # its ftruncate
    version, mtime = m.inode(f["ino"])["version"], m.inode(f["ino"])["mtime_ns"]
    run(m, op="rename", parent=ROOT, name="t", new_parent=ROOT, new_name="model")  # the mark goes with it
    assert m.lookup(ROOT, "model")["writers"] == ["a"]
    assert run(m, op="extend", ino=f["ino"], size=5 * MiB)["writers"] == ["a"]  # a flush does not finish it
    assert run(m, op="writing", ino=f["ino"], writer="b")["writers"] == ["a", "b"]  # a second writer, in place
    run(m, op="snapshot", name="mid")
    assert run(m, op="written", ino=f["ino"], writer="a")["writers"] == ["b"]  # b's mark stands
    after = run(m, op="written", ino=f["ino"], writer="b")
    assert "writers" not in after
    assert after["version"] == version + 1 and after["mtime_ns"] > mtime  # (the extend's); written moves nothing
    assert m.view(m.frozen.ids()["mid"]).attr(f["ino"])["writers"] == ["a", "b"]  # the snapshot's copy keeps it
    assert "writers" not in run(m, op="written", ino=f["ino"], writer="c")  # one not writing it: nothing
    run(m, op="writing", ino=f["ino"], writer="dead")
    run(m, op="setattr", ino=f["ino"], attrs={"size": 1}, writer="d")  # a cut by another keeps the dead one's mark
    assert m.inode(f["ino"])["writers"] == ["d", "dead"]
    run(m, op="setattr", ino=f["ino"], attrs={"size": 0}, writer="e")  # a rewrite (O_TRUNC) starts it afresh
    assert m.inode(f["ino"])["writers"] == ["e"]
    g = run(m, op="create", parent=ROOT, name="plain", mode=S.S_IFREG | 0o644, unit=MiB)
    assert "writers" not in g  # the Client API's own files carry none
    run(m, op="setattr", ino=g["ino"], attrs={"size": 10})  # nor does a truncate without a writer
    assert "writers" not in m.inode(g["ino"])


def test_a_malformed_mark_is_einval_and_changes_nothing():
    m = Meta()
    f = run(m, op="create", parent=ROOT, name="t", mode=S.S_IFREG | 0o644, unit=MiB)["ino"]
    d = run(m, op="mkdir", parent=ROOT, name="d", mode=0o755)["ino"]
    assert code(m, op="writing", ino=f, writer=7) == "EINVAL"
    assert code(m, op="writing", ino=f) == "EINVAL"
    assert code(m, op="written", ino=f, writer=None) == "EINVAL"
    assert code(m, op="writing", ino=d, writer="a") == "EINVAL"  # a directory is not written
    assert code(m, op="writing", ino=999, writer="a") == "ENOENT"
    assert code(m, op="written", ino=999, writer="a") == "ENOENT"
    assert code(m, op="create", parent=ROOT, name="u", mode=S.S_IFREG | 0o644, writer=["a"]) == "EINVAL"
    assert code(m, op="setattr", ino=f, attrs={"size": 1}, writer=1) == "EINVAL"

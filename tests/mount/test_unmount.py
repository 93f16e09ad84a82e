"""``irdmafs.launch.mount.unmount`` against a real mount the kernel calls busy (a file held open in
it): asked again while it is busy, it unmounts as soon as the file is closed; a refusal that
stands returns False and is logged with what fusermount3 said."""

import logging
import os
import threading

import pytest

from irdmafs.launch import mount as M

pytestmark = pytest.mark.mount


async def test_a_busy_mount_is_unmounted_once_its_last_file_closes(local_cluster, mount, monkeypatch):
    lc = await local_cluster(nodes=1, replicas=1)
    mp = mount(lc)
    fd = os.open(mp / "f", os.O_CREAT | os.O_RDWR)
    os.write(fd, b"held")
    asked = []
    sleep = M.time.sleep
    me = threading.get_ident()

    def closing_sleep(seconds):  # the event: unmount was refused once, busy; then the file closes
        if threading.get_ident() == me:  # unmount's own pause, not another thread's
            asked.append(seconds)
            if len(asked) == 1:
                os.close(fd)
        sleep(seconds)

    monkeypatch.setattr(M.time, "sleep", closing_sleep)
    assert M.unmount(str(mp)) is True
    assert asked and not M.is_mounted(str(mp))


async def test_a_refusal_that_stands_is_false_and_says_why(local_cluster, mount, monkeypatch, caplog):
    lc = await local_cluster(nodes=1, replicas=1)
    mp = mount(lc)
    fd = os.open(mp / "f", os.O_CREAT | os.O_RDWR)
    monkeypatch.setattr(M, "UNMOUNT_PATIENCE", 0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="irdmafs.launch.mount"):
            assert M.unmount(str(mp)) is False
        assert M.is_mounted(str(mp))
        assert any("not unmounted" in r.message and "busy" in r.message.lower() for r in caplog.records), caplog.text
    finally:
        os.close(fd)
    assert M.unmount(str(mp)) is True

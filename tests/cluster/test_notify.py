"""systemd readiness: a node started with NOTIFY_SOCKET (as Type=notify units do) says READY=1
once it serves, and not before."""

import socket

import pytest
import trio

from irdmafs.launch.local import LocalCluster, node_status, write_config
from irdmafs.runtime.notify import notify

pytestmark = pytest.mark.cluster


def test_notify_without_systemd_does_nothing(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False


async def test_a_node_sends_ready_once_it_serves(tmp_path, monkeypatch, etcd_endpoints):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    lc = LocalCluster(write_config(tmp_path / "c", 1, 1, transport=["tcp"], coordinator=etcd_endpoints))
    lc.start_all()
    try:
        with trio.fail_after(30):
            while True:
                try:
                    msg = sock.recv(4096).decode()
                    break
                except BlockingIOError:
                    await trio.sleep(0.05)
        assert msg.startswith("READY=1\nSTATUS=serving on 127.0.0.1:")
        status = await node_status(lc.cfg, lc.cfg.names[0])
        assert status is not None and status["state"] == "ready"
    finally:
        lc.stop_all()
        sock.close()

"""A local etcd's lifecycle (launch/etcd_process.py): started in a temporary directory, healthy,
serving the v3 JSON gateway, paused and resumed, stopped; a clear error without the binary."""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
import urllib.request

import pytest

from irdmafs.launch import etcd_process
from irdmafs.launch.etcd_process import LocalEtcd, find_etcd, health_error, is_local_etcd

needs_etcd = pytest.mark.skipif(not shutil.which("etcd"), reason="no etcd binary (scripts/setup installs Debian's etcd-server)")


def post(endpoint: str, path: str, body: dict, timeout: float = 5.0) -> dict:
    request = urllib.request.Request(endpoint + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def etcd(tmp_path):
    with LocalEtcd(tmp_path / "etcd", log_path=tmp_path / "etcd.log") as e:
        yield e


@needs_etcd
def test_starts_healthy_and_serves_the_v3_gateway(etcd, tmp_path):
    assert etcd.endpoint == f"http://127.0.0.1:{etcd.client_port}" and etcd.running
    assert health_error(etcd.endpoint) is None
    assert is_local_etcd(etcd.pid, tmp_path / "etcd") and not is_local_etcd(etcd.pid, tmp_path / "other")
    assert not is_local_etcd(os.getpid(), tmp_path / "etcd")
    post(etcd.endpoint, "/v3/kv/put", {"key": b64("irdmafs/view"), "value": b64("epoch 1")})
    got = post(etcd.endpoint, "/v3/kv/range", {"key": b64("irdmafs/view")})
    assert [base64.b64decode(kv["value"]).decode() for kv in got["kvs"]] == ["epoch 1"]
    assert (tmp_path / "etcd" / "member").is_dir()


@needs_etcd
def test_pause_makes_it_unreachable_and_resume_brings_it_back(etcd):
    etcd.pause()
    started = time.monotonic()
    why = health_error(etcd.endpoint, timeout=0.5)
    assert why is not None and time.monotonic() - started < 3  # bounded by the timeout, not hung
    etcd.resume()
    deadline = time.monotonic() + 10
    while health_error(etcd.endpoint) is not None:
        assert time.monotonic() < deadline, "etcd did not answer again after SIGCONT"
        time.sleep(0.1)
    got = post(etcd.endpoint, "/v3/kv/range", {"key": b64("nothing")})
    assert "kvs" not in got  # empty answers leave the field out


@needs_etcd
def test_stop_ends_the_process_and_start_brings_back_the_data(tmp_path):
    e = LocalEtcd(tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    e.start()
    pid = e.pid
    post(e.endpoint, "/v3/kv/put", {"key": b64("k"), "value": b64("kept")})
    e.stop()
    assert not e.running and gone(pid)
    assert health_error(e.endpoint, timeout=0.5) is not None
    e.stop()  # again: nothing to do
    e.start()  # the same data directory and ports
    try:
        assert e.pid != pid
        got = post(e.endpoint, "/v3/kv/range", {"key": b64("k")})
        assert base64.b64decode(got["kvs"][0]["value"]) == b"kept"
    finally:
        e.stop()
    assert gone(e.pid)


@needs_etcd
def test_kill_is_a_crash_and_a_paused_etcd_still_stops(tmp_path):
    e = LocalEtcd(tmp_path / "etcd")
    e.start()
    pid = e.pid
    e.kill()
    assert not e.running and gone(pid)
    with pytest.raises(RuntimeError, match="not running"):
        e.kill()
    e.start()
    e.pause()
    started = time.monotonic()
    e.stop()  # SIGTERM then SIGCONT: it runs to take it
    assert gone(e.pid) and time.monotonic() - started < 5


@needs_etcd
def test_an_etcd_that_exits_while_starting_says_why_with_its_log(tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    e = LocalEtcd(tmp_path / "not-a-dir", log_path=tmp_path / "etcd.log")
    with pytest.raises(RuntimeError, match="exited with status 1") as err:
        e.start()
    assert "etcd.log" in str(err.value) and "not a directory" in str(err.value)
    assert not e.running


@needs_etcd
def test_a_start_that_times_out_leaves_no_etcd_behind(tmp_path):
    e = LocalEtcd(tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    with pytest.raises(RuntimeError, match="not healthy after 0.001 s"):
        e.start(timeout=0.001)
    assert not e.running and gone(e.pid)


@needs_etcd
def test_a_port_in_use_is_refused_before_anything_starts(etcd, tmp_path):
    """Else the etcd already there would answer the health checks of one that cannot listen."""
    second = LocalEtcd(tmp_path / "second", client_port=etcd.client_port)
    with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{etcd.client_port}: Address already in use"):
        second.start()
    assert not second.running and second.pid is None


def test_a_missing_binary_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with pytest.raises(RuntimeError, match="run scripts/setup.*etcd-server"):
        find_etcd()
    e = LocalEtcd(tmp_path / "etcd")
    with pytest.raises(RuntimeError, match="scripts/setup"):
        e.start()
    assert not e.running and not (tmp_path / "etcd").exists()
    monkeypatch.setattr(etcd_process.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no etcd binary"):
        find_etcd()


def test_health_of_nothing_listening_says_why(tmp_path):
    from irdmafs.launch.local import free_ports

    [port] = free_ports(1)
    why = health_error(f"http://127.0.0.1:{port}", timeout=0.5)
    assert why and "refused" in why.lower()


def test_ports_are_picked_when_not_given(tmp_path):
    e = LocalEtcd(tmp_path / "etcd", client_port=23790)
    assert e.client_port == 23790 and e.peer_port not in (0, 23790)
    assert e.endpoint == "http://127.0.0.1:23790" and e.pid is None and not e.running

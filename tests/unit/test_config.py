"""The config's ``coordinator`` key: the etcd endpoints nodes keep views and leases in."""

from __future__ import annotations

import re

import pytest

from irdmafs import config as C
from irdmafs.launch.local import write_config

NODES = [{"name": "n1", "host": "127.0.0.1", "port": 7101}]


ETCD = "http://127.0.0.1:2379"


def cfg(**keys) -> C.ClusterConfig:
    return C.from_dict({"nodes": NODES, "token": "longenoughtoken", "coordinator": ETCD, **keys})


@pytest.mark.parametrize("keys", [{}, {"coordinator": []}], ids=["absent", "empty"])
def test_a_config_without_a_coordinator_is_refused_saying_how_to_get_one(keys):
    """Views in etcd are the only routing: no coordinator, no cluster (config.py says why it
    is refused rather than run on an embedded etcd)."""
    with pytest.raises(C.ConfigError) as err:
        C.from_dict({"nodes": NODES, "token": "longenoughtoken", **keys})
    assert str(err.value) == C.NO_COORDINATOR
    assert "coordinator: none named" in str(err.value) and "irdmafs up" in str(err.value)


@pytest.mark.parametrize(
    "value, endpoints",
    [
        ("http://127.0.0.1:2379", ["http://127.0.0.1:2379"]),  # one string is one endpoint
        (["http://etcd-0.etcd.ps.svc.cluster.local:2379", "http://10.0.0.2:2379/"], ["http://etcd-0.etcd.ps.svc.cluster.local:2379", "http://10.0.0.2:2379"]),
        (["http://[::1]:2379"], ["http://[::1]:2379"]),
    ],
)
def test_good_endpoints(value, endpoints):
    assert cfg(coordinator=value).coordinator == endpoints


@pytest.mark.parametrize(
    "value, message",
    [
        ("https://127.0.0.1:2379", "coordinator: 'https://127.0.0.1:2379' is not an etcd endpoint http://host:port"),
        (["http://a:2379", "etcd:2379"], "coordinator[1]: 'etcd:2379' is not an etcd endpoint"),
        (["http://a:2379", 2379], "coordinator[1]: 2379 is not a string"),
        (2379, "coordinator: 2379 is not a list of etcd endpoints"),
        ({"a": 1}, "coordinator: {'a': 1} is not a list"),
        ("http://a", "coordinator: {!r} is not an etcd endpoint"),  # no port
        ("http://a:0", "coordinator: {!r} is not an etcd endpoint"),
        ("http://a:70000", "coordinator: {!r} is not an etcd endpoint"),
        ("http://a:2379/v3", "coordinator: {!r} is not an etcd endpoint"),
        ("http://:2379", "coordinator: {!r} is not an etcd endpoint"),
        ("", "coordinator: {!r} is not an etcd endpoint"),
        (["http://a:2379", "http://a:2379/"], "coordinator: an endpoint is named twice"),
    ],
)
def test_bad_endpoints_name_the_key(value, message):
    with pytest.raises(C.ConfigError, match="^" + re.escape(message.replace("{!r}", repr(value)))):
        cfg(coordinator=value)


def test_a_bad_coordinator_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('token = "longenoughtoken"\ncoordinator = ["ftp://x:1"]\n[[nodes]]\nname = "a"\nhost = "h"\nport = 1\n')
    with pytest.raises(C.ConfigError, match=f"^{path}: coordinator\\[0\\]: 'ftp://x:1'"):
        C.load(path)


def test_dump_and_write_config_keep_the_coordinator(tmp_path):
    path = write_config(tmp_path / "a", 2, 1, coordinator=[ETCD])
    assert f'coordinator = ["{ETCD}"]' in path.read_text()
    assert C.load(path).coordinator == [ETCD]


def test_routing_is_views_only(tmp_path):
    """An earlier config's ``routing = "views"`` still loads; "heartbeats" (or anything else)
    is refused, naming the key, and nothing dumps it again."""
    assert cfg(routing="views").coordinator == [ETCD]
    for value in ("heartbeats", "leases"):
        with pytest.raises(C.ConfigError, match=f"^routing: '{value}': the heartbeat routing was removed"):
            cfg(routing=value)
    path = tmp_path / "cluster.toml"
    (tmp_path / "token").write_text("longenoughtoken")
    path.write_text(C.dump(cfg(routing="views")))
    assert "routing" not in path.read_text() and C.load(path).coordinator == [ETCD]


def test_name_lease_defaults_within_op_timeout_and_refuses_what_a_change_could_not_wait_for():
    """``name_lease`` (server/namecache.py): 4 s, or half of a shorter ``op_timeout``; 0 turns
    caching off; a lease a change could not wait out within ``op_timeout`` is refused."""
    assert cfg().name_lease == 4.0
    assert cfg(op_timeout=1).name_lease == 0.5
    assert cfg(name_lease=0).name_lease == 0.0
    for bad in (-1, 10, 12.5, "4", True):
        with pytest.raises(C.ConfigError, match="name_lease"):
            cfg(name_lease=bad)
    back = C.from_dict({"nodes": NODES, "token": "longenoughtoken", "coordinator": ETCD, "op_timeout": 1, "name_lease": 0.5})
    assert back.name_lease == 0.5 and "name_lease = 0.5" in C.dump(back)

"""A live node process fed bad requests: each gets a typed error, the node logs it and goes on."""

import pytest
import trio

from irdmafs.transport.base import AccessError, AuthError, RemoteError
from irdmafs.transport.tcp import TcpTransport

pytestmark = pytest.mark.cluster


async def test_bad_requests_get_typed_errors_and_the_node_survives(local_cluster, nursery):
    lc = await local_cluster(nodes=1, replicas=1)
    spec = lc.cfg.nodes[0]

    with pytest.raises(AuthError, match="wrong cluster token"):
        await TcpTransport(b"a-wrong-token").connect(spec.host, spec.port, nursery=nursery)

    conn = await TcpTransport(lc.cfg.token).connect(spec.host, spec.port, nursery=nursery)
    with pytest.raises(AccessError):
        await conn.read(123456, 0, bytearray(10))  # no such region
    staging = await conn.call("staging", {"owner": "t", "size": 4096})
    with pytest.raises(AccessError, match="outside"):
        await conn.write(staging["rkey"], 4000, b"x" * 200)  # past the end
    with pytest.raises(AccessError, match="does not allow"):
        await conn.read(staging["rkey"], 0, bytearray(10))  # staging is write-only

    commit = {"fid": 9, "idx": 0, "offset": 0, "length": 10, "soff": 0, "unit": 4 << 20}
    expected = [
        ("no_such_method", {}, "ENOSYS"),
        ("getattr", {"inode": 1}, "EINVAL"),  # wrong argument name
        ("getattr", {"ino": 999}, "ENOENT"),
        ("staging", {"owner": "t", "size": -5}, "EINVAL"),
        ("commit", dict(commit, rkey=424242), "EINVAL"),  # staging region that does not exist
        ("commit", dict(commit, rkey=staging["rkey"], offset=4 << 20), "EINVAL"),  # past the stripe
        ("meta", {"op": {"op": "explode"}}, "EINVAL"),
        ("meta", {"op": {"op": "mkdir", "parent": 1, "name": "../x", "mode": 0o755}}, "EINVAL"),
    ]
    for method, args, code in expected:
        with pytest.raises(RemoteError) as err:
            await conn.call(method, args)
        assert err.value.code == code, (method, err.value)

    # still serving, nothing leaked into the namespace
    assert (await conn.call("readdir", {"ino": 1}))["entries"] == []
    assert (await conn.call("heartbeat", {}))["state"] == "ready"
    lc.check_alive()
    await trio.sleep(0.2)
    log = lc.log_of("n1")
    assert "wrong cluster token" in log and "READ refused" in log and "WRITE refused" in log

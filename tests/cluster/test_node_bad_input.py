"""A live node process fed bad requests: each gets a typed error, the node logs it and goes on."""

import json

import pytest
import trio

from irdmafs.config import from_dict
from irdmafs.coord.memory import MemoryCoord
from irdmafs.server.node import Node
from irdmafs.errors import AccessError, AuthError, RemoteError
from irdmafs.transport.memory import MemoryTransport
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

    epoch = (await conn.call("heartbeat", {}))["view"]  # sent with the view it is in: the input is what is checked
    commit = {"fid": 9, "idx": 0, "offset": 0, "length": 10, "unit": 4 << 20, "epoch": epoch}
    expected = [
        ("commit", dict(commit, staged=[staging["rkey"], 0], epoch=epoch - 1), "ESTALE"),  # from an older view
        ("no_such_method", {}, "ENOSYS"),
        ("getattr", {"inode": 1}, "EINVAL"),  # wrong argument name
        ("getattr", {"ino": 999}, "ENOENT"),
        ("staging", {"owner": "t", "size": -5}, "EINVAL"),
        ("commit", dict(commit, staged=[424242, 0]), "EINVAL"),  # staging region that does not exist
        ("commit", dict(commit, staged=str(staging["rkey"])), "EINVAL"),  # not [rkey, offset]
        ("commit", dict(commit, staged=[staging["rkey"], 0], offset=4 << 20), "EINVAL"),  # past the stripe
        ("meta", {"op": {"op": "explode"}, "epoch": epoch}, "EINVAL"),
        ("meta", {"op": {"op": "mkdir", "parent": 1, "name": "../x", "mode": 0o755}, "epoch": epoch}, "EINVAL"),
        ("meta", {"op": {"op": "mkdir", "parent": 1, "name": "..", "mode": 0o755}, "epoch": epoch}, "EINVAL"),
        ("meta", {"op": {"op": "mkdir", "parent": 1, "name": "a\0b", "mode": 0o755}, "epoch": epoch}, "EINVAL"),
        ("meta", {"op": {"op": "mkdir", "parent": 1, "name": "x" * 256, "mode": 0o755}, "epoch": epoch}, "ENAMETOOLONG"),
        ("meta", {"op": {"op": "mkdir", "parent": 1, "name": "é" * 128, "mode": 0o755}, "epoch": epoch}, "ENAMETOOLONG"),  # 256 bytes
        # ops that are not what a client sends: checked, not found out by a KeyError
        ("meta", {"op": "mkdir", "epoch": epoch}, "EINVAL"),
        ("meta", {"op": {"op": "mkdir", "parent": 1, "mode": 0o755}, "epoch": epoch}, "EINVAL"),  # no name
        ("meta", {"op": {"op": "mkdir", "parent": "1", "name": "x", "mode": 0o755}, "epoch": epoch}, "EINVAL"),
        ("meta", {"op": {"op": "create", "parent": 1, "name": "x", "mode": 0o644, "rdev": "zero"}, "epoch": epoch}, "EINVAL"),
        ("meta", {"op": {"op": "setattr", "ino": 1, "attrs": {"size": "big"}}, "epoch": epoch}, "EINVAL"),
        ("meta_restore", {"snapshot": {"seq": 10**6}}, "EINVAL"),
        ("train_record", {"fid": 9, "idx": 0, "record": {"pushed": {"0": 1}}, "epoch": epoch}, "EINVAL"),
        ("train_wait", {"fid": 9, "idx": 0, "rank": 0, "pushed": 1, "timeout": -1}, "EINVAL"),
        ("rebalance_pull", {"nodes": [{"name": "n9"}], "replicas": 1}, "EINVAL"),
    ]
    for method, args, code in expected:
        with pytest.raises(RemoteError) as err:
            await conn.call(method, args)
        assert err.value.code == code, (method, err.value)

    # fused push descriptors that are not a list of objects (checked, not asserted: -O keeps it)
    for blob in (b'{"fid": 1}', b"[1, 2]", b"[" * 3000, b"\xff\xfe"):
        with pytest.raises(RemoteError) as err:
            await conn.write_imm(staging["rkey"], 0, blob, len(blob))
        assert err.value.code == "EINVAL" and "descriptor" in err.value.message, blob[:10]
    # a list of objects whose pushes are malformed: each refused on its own, EINVAL
    push = {"at": 0, "fid": 9, "idx": 0, "offset": 0, "count": 1, "rank": 0, "step": 0, "wire": "<f4", "unit": 4 << 20}
    for bad in ({"at": 0}, dict(push, at=-1), dict(push, fid="nine"), dict(push, color="red"), dict(push, spans=3)):
        blob = json.dumps([bad]).encode()
        [result] = (await conn.write_imm(staging["rkey"], 0, blob, len(blob)))["results"]
        assert result["error"] == "EINVAL" and "descriptor" in result["message"], (bad, result)

    # still serving, nothing leaked into the namespace
    assert (await conn.call("readdir", {"ino": 1}))["entries"] == []
    assert (await conn.call("heartbeat", {}))["state"] == "ready"
    lc.check_alive()
    await trio.sleep(0.2)
    log = lc.log_of("n1")
    assert "wrong cluster token" in log and "READ refused" in log and "WRITE refused" in log
    assert "Traceback" not in log  # bad input is refused, not taken for a fault of the node


async def test_a_fault_in_a_call_is_eio_with_its_traceback_not_einval(caplog):
    """What the caller sent wrong is EINVAL; anything else raised (here a KeyError no input
    caused) is a fault of the node: EIO, and logged with its traceback."""
    doc = {"nodes": [{"name": "n1", "host": "mem", "port": 9000}], "token": "test-token-123", "replicas": 1, "transport": ["memory"]}
    cfg = from_dict(doc | {"coordinator": ["http://mem:2379"]})
    node = Node(cfg, "n1", MemoryTransport(cfg.token), coord=MemoryCoord())

    async def broken() -> dict:
        return {}["a key nobody sent"]

    node.calls["stripes"] = broken
    with pytest.raises(RemoteError) as err:
        await node.handle("stripes", {})
    assert err.value.code == "EIO" and "KeyError" in err.value.message
    [logged] = [r for r in caplog.records if r.exc_info]
    assert logged.exc_info[0] is KeyError and "stripes" in logged.getMessage()
    with pytest.raises(RemoteError) as err:
        await node.handle("stripes", {"unexpected": 1})
    assert err.value.code == "EINVAL"


async def test_a_node_process_survives_thousands_of_random_frames(local_cluster):
    """Random headers (valid magic, wild fields) and random bytes, after a real handshake, against
    a real node process: it keeps serving and the data it holds is unchanged."""
    import random
    import socket

    import numpy as np

    from irdmafs.client.client import Client
    from irdmafs.launch.local import node_status
    from irdmafs.transport import protocol as P
    from irdmafs.transport.base import client_proof, new_nonce

    lc = await local_cluster(nodes=1, replicas=1)
    data = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)
    async with Client.connect(lc.cfg) as c:
        await c.paths.write_file("/keep", data)
    spec = lc.cfg.nodes[0]
    rng = random.Random(6)

    def session_frames(n):
        out = bytearray()
        for _ in range(n):
            if rng.random() < 0.2:
                out += rng.randbytes(rng.randint(1, 60))  # garbage: the node closes this session
                break
            op = rng.choice([P.Op.READ, P.Op.WRITE, P.Op.WRITE_IMM, P.Op.CALL, 0x55])
            length = rng.choice([0, 1, 16, 4096, rng.randint(0, 5000)])
            # rkeys no region has (an authenticated peer may legitimately write the ones it knows)
            rkey = rng.choice([0, rng.randint(1 << 24, 2**32 - 1)])
            h = P.Header(op, rng.getrandbits(64), rkey, rng.choice([0, 8, 1 << 20, 2**63, rng.getrandbits(64)]), length, 0, rng.getrandbits(32))
            out += P.pack(h) + rng.randbytes(P.payload_size(h) if op != P.Op.READ else 0)
        return bytes(out)

    def fuzz():
        sent = 0
        for _ in range(100):
            s = socket.create_connection((spec.host, spec.port), timeout=5)
            try:
                h = P.unpack(s.recv(40, socket.MSG_WAITALL))
                snonce = s.recv(h.length, socket.MSG_WAITALL)
                cnonce = new_nonce()
                s.sendall(P.pack(P.Header(P.Op.AUTH, length=64)) + cnonce + client_proof(lc.cfg.token, snonce, cnonce))
                s.sendall(session_frames(30))
                sent += 30
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
            except OSError:
                pass
            finally:
                s.close()
        return sent

    assert await trio.to_thread.run_sync(fuzz) >= 2000
    assert (await node_status(lc.cfg, spec.name))["state"] == "ready"
    lc.check_alive()
    async with Client.connect(lc.cfg) as c:
        ino = (await c.paths.resolve("/keep"))["ino"]
        assert np.array_equal(np.frombuffer(await c.read(ino, 0, len(data)), np.uint8), data)

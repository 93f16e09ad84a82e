"""Every transport implementation, served by a small echo/region handler, for the shared suite."""

import os

import pytest
import trio

from irdmafs.transport.base import Access
from irdmafs.errors import RemoteError
from irdmafs.transport.memory import MemoryTransport
from irdmafs.transport.shm import ShmTransport
from irdmafs.transport.tcp import TcpTransport

TOKEN = b"conformance-token"


def _verbs_transport(token):
    from irdmafs.transport import verbs

    return verbs.VerbsTransport(token)


def _verbs_reason():
    from irdmafs.transport import verbs

    return verbs.unusable_reason()


VERBS_REASON = _verbs_reason()


FACTORIES = {
    "memory": MemoryTransport,
    "tcp": TcpTransport,
    "shm": ShmTransport,
    "verbs": _verbs_transport,
}


class Served:
    """A serving transport with two regions (rw, read-only) and a control handler."""

    def __init__(self, kind, server, address):
        self.kind = kind
        self.server = server
        self.host, self.port = address
        self.rw = server.alloc_region(8 << 20, Access.RW)
        self.ro = server.alloc_region(1 << 20, Access.READ)
        self.ro.buf[:] = os.urandom(len(self.ro.buf))

    def client(self, token=TOKEN):
        return FACTORIES[self.kind](token)


async def handler(method, args):
    if method == "echo":
        return {"echo": args}
    if method == "fail":
        raise RemoteError(args.get("code", "ENOENT"), "asked to fail")
    if method == "crash":
        raise ZeroDivisionError("handler bug")
    if method == "slow":
        await trio.sleep(args["seconds"])
        return {"slept": args["seconds"]}
    raise RemoteError("ENOSYS", method)


@pytest.fixture(
    params=[
        "memory",
        "tcp",
        "shm",
        pytest.param("verbs", marks=pytest.mark.skipif(bool(VERBS_REASON), reason=f"verbs transport not runnable here: {VERBS_REASON}")),
    ]
)
async def served(request, nursery):
    server = FACTORIES[request.param](TOKEN)
    address = await nursery.start(server.serve, "127.0.0.1", 0, handler)
    return Served(request.param, server, address)

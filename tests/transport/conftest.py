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


def _tcp(engine):
    return lambda token: TcpTransport(token, engine=engine)


def _shm(engine):
    return lambda token: ShmTransport(token, engine=engine)


FACTORIES = {
    "memory": MemoryTransport,
    "tcp": TcpTransport,
    "shm": ShmTransport,
    "verbs": _verbs_transport,
}
# the socket transports over every pair of data planes: the native engine (transport/engine.py)
# and the Python one (tcp.py, the reference), serving and calling: kind -> (server, client)
PAIRS = {
    "tcp-native": (_tcp("native"), _tcp("native")),
    "tcp-python": (_tcp("python"), _tcp("python")),
    "tcp-native-serves-python": (_tcp("native"), _tcp("python")),
    "tcp-python-serves-native": (_tcp("python"), _tcp("native")),
    "shm-native": (_shm("native"), _shm("native")),
    "shm-python": (_shm("python"), _shm("python")),
}


def _engine_reason():
    from irdmafs.transport import engine

    return None if engine.AVAILABLE else engine.WHY


ENGINE_REASON = _engine_reason()


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
        if self.kind in PAIRS:
            return PAIRS[self.kind][1](token)
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


def _needs_engine(kind):
    if "native" not in kind:
        return ()
    return (pytest.mark.skipif(bool(ENGINE_REASON), reason=f"the native engine is not built here: {ENGINE_REASON}"),)


@pytest.fixture(
    params=[
        "memory",
        *(pytest.param(kind, marks=_needs_engine(kind)) for kind in PAIRS),
        pytest.param("verbs", marks=pytest.mark.skipif(bool(VERBS_REASON), reason=f"verbs transport not runnable here: {VERBS_REASON}")),
    ]
)
async def served(request, nursery):
    make = PAIRS[request.param][0] if request.param in PAIRS else FACTORIES[request.param]
    server = make(TOKEN)
    address = await nursery.start(server.serve, "127.0.0.1", 0, handler)
    return Served(request.param, server, address)

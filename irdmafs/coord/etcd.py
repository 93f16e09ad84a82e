"""etcd as the coordination service (contract.py), through its v3 JSON gateway, under trio.

etcd 3.4 (Debian's ``etcd-server``) answers HTTP POSTs of JSON on its client port: ``/v3/kv/range``,
``/v3/kv/put``, ``/v3/kv/txn``, ``/v3/kv/deleterange``, ``/v3/lease/grant``, ``/v3/lease/keepalive``
and ``/v3/lease/revoke``; keys and values travel base64-encoded, 64-bit integers as strings, and
fields at their zero value are left out (a failed ``txn`` has no ``succeeded``). There is no
maintained etcd client for trio, and the gateway needs nothing but HTTP/1.1, so this module speaks
it over ``trio.open_tcp_stream``: one short connection per request (the rate is a few requests a
second per node), each bounded by ``timeout``.

Endpoints are tried in order; one that cannot be reached or times out moves the next one first.
Anything that is not an answer (refused, reset, timed out, not JSON, an HTTP error status) is
``Unavailable``; etcd's own "lease not found" is ``LeaseGone``; any other error etcd gives is
``CoordError`` with its message.
"""

from __future__ import annotations

import base64
import json
from urllib.parse import urlsplit

import trio

from .contract import Coordinator, Entry
from ..errors import CoordError, LeaseGone, CoordUnavailable as Unavailable

# what a member answers when it cannot serve a request now, though another member may: it has no
# leader (cut off from a majority of the members), or the request timed out in raft
MEMBER_UNAVAILABLE = ("no leader", "request timed out", "leader changed", "not capable", "server stopped", "too many requests")
LEASE_NOT_FOUND = "requested lease not found"


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text or "")


def _prefix_end(prefix: str) -> str:
    """etcd's range end for "every key with this prefix": the prefix with its last byte + 1."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return _b64(b"\0")  # every key
    raw[-1] += 1
    return _b64(bytes(raw))


def _entry(kv: dict) -> Entry:
    return Entry(_unb64(kv["key"]).decode(), _unb64(kv.get("value", "")), int(kv.get("mod_revision", 0)), int(kv.get("lease", 0)))


def _dechunk(body: bytes) -> bytes:
    out, rest = bytearray(), body
    while rest:
        line, _, rest = rest.partition(b"\r\n")
        size = int(line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    return bytes(out)


class EtcdCoord(Coordinator):
    """A client of one etcd cluster, given its client endpoints (``http://host:port``)."""

    def __init__(self, endpoints: list[str], *, timeout: float = 2.0):
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoints = []
        for url in endpoints:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname or not parts.port:
                raise ValueError(f"an etcd endpoint is http://host:port, not {url!r}")
            self.endpoints.append((parts.hostname, parts.port))
        self.timeout = timeout
        self.requests = 0

    async def _post(self, path: str, body: dict) -> dict:
        """One request, to the first endpoint that answers."""
        failures = []
        for host, port in list(self.endpoints):
            try:
                with trio.fail_after(self.timeout):
                    answer = await self._post_to(host, port, path, body)
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, ValueError) as exc:
                # BrokenResourceError: etcd killed mid-answer reset the connection (it ended a
                # node's task, and the node with it: chaos --views, seed 2)
                failures.append(f"{host}:{port}: {exc or 'timed out'}")
                self.endpoints.remove((host, port))
                self.endpoints.append((host, port))
                continue
            if "error" in answer:
                message = str(answer.get("message") or answer["error"])
                if any(m in message for m in MEMBER_UNAVAILABLE):
                    # this member cannot serve now (it reaches no majority of its cluster, or is
                    # electing a leader): the next member may. Raised, it fenced a node whose
                    # other endpoints served (three members, one cut off).
                    failures.append(f"{host}:{port}: {message}")
                    self.endpoints.remove((host, port))
                    self.endpoints.append((host, port))
                    continue
                raise (LeaseGone if LEASE_NOT_FOUND in message else CoordError)(f"etcd {path}: {message}")
            return answer
        raise Unavailable(f"etcd {path}: " + "; ".join(failures))

    async def _post_to(self, host: str, port: int, path: str, body: dict) -> dict:
        self.requests += 1
        payload = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(head.encode() + payload)
            raw = bytearray()
            while chunk := await stream.receive_some(65536):
                raw += chunk
        header, sep, content = bytes(raw).partition(b"\r\n\r\n")
        if not sep:
            raise ValueError("no HTTP answer")
        lines = header.decode("latin-1").split("\r\n")
        status = lines[0].split(" ", 2)
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if fields.get("transfer-encoding", "").lower() == "chunked":
            content = _dechunk(content)
        try:
            answer = json.loads(content.decode() or "{}")
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"HTTP {status[1:]}: not JSON: {content[:200]!r}") from None
        if len(status) < 2 or (status[1] != "200" and "error" not in answer):
            raise ValueError(f"HTTP {' '.join(status[1:])}")
        if isinstance(answer, dict) and isinstance(answer.get("result"), dict):
            answer = answer["result"]  # a streamed answer (keepalive) comes wrapped
        if not isinstance(answer, dict):
            raise ValueError(f"not a JSON object: {answer!r}")
        return answer

    @staticmethod
    def _revision(answer: dict) -> int:
        return int(answer.get("header", {}).get("revision", 0))

    async def get(self, key: str) -> Entry | None:
        kvs = (await self._post("/v3/kv/range", {"key": _b64(key)})).get("kvs", [])
        return _entry(kvs[0]) if kvs else None

    async def range(self, prefix: str) -> tuple[list[Entry], int]:
        answer = await self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return sorted((_entry(kv) for kv in answer.get("kvs", [])), key=lambda e: e.key), self._revision(answer)

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return self._revision(await self._post("/v3/kv/put", body))

    async def cas(self, key: str, expect: int, value: bytes, lease: int = 0) -> tuple[bool, int]:
        put = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        compare = {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(expect)}
        answer = await self._post("/v3/kv/txn", {"compare": [compare], "success": [{"request_put": put}]})
        return bool(answer.get("succeeded", False)), self._revision(answer)

    async def create_all(self, entries: dict[str, bytes]) -> tuple[bool, int]:
        compare = [{"key": _b64(k), "target": "CREATE", "result": "EQUAL", "create_revision": "0"} for k in entries]
        puts = [{"request_put": {"key": _b64(k), "value": _b64(v)}} for k, v in entries.items()]
        answer = await self._post("/v3/kv/txn", {"compare": compare, "success": puts})
        return bool(answer.get("succeeded", False)), self._revision(answer)

    async def delete(self, key: str) -> int:
        return self._revision(await self._post("/v3/kv/deleterange", {"key": _b64(key)}))

    async def grant(self, ttl: int) -> int:
        return int((await self._post("/v3/lease/grant", {"TTL": str(max(1, int(ttl)))}))["ID"])

    async def keepalive(self, lease: int) -> int:
        try:
            return int((await self._post("/v3/lease/keepalive", {"ID": str(lease)})).get("TTL", 0))
        except LeaseGone:
            return 0

    async def revoke(self, lease: int) -> None:
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease)})
        except LeaseGone:
            pass

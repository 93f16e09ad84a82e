"""Sans-IO wire protocol of the socket transports: fixed struct layouts, no I/O here.

Every frame is a 40-byte header, optionally followed by a payload:

    offset size field
    0      4    magic     b"IRDM"
    4      1    version   1
    5      1    opcode    request opcode; responses set RESPONSE (0x80)
    6      2    status    Status (0 in requests)
    8      8    req_id    chosen by the requester, echoed in the response
    16     4    rkey      region key (READ/WRITE)
    20     4    imm       WRITE_IMM: the immediate value delivered with the data; AUTH reply: the
                          serving process's incarnation (new at every start); CALL: CALL_PROBE
                          for a liveness probe (probes.py); else 0
    24     8    offset    byte offset in the region (READ/WRITE)
    32     8    length    READ request: bytes wanted; every other frame: payload bytes that follow

The payload of a READ response is the data; of a WRITE or WRITE_IMM request the data; of a CALL,
and of a WRITE_IMM response, a JSON document; of an error response (status != OK) a UTF-8 message (JSON for a failed CALL). Because
payload sizes come from the header alone, a reader can always skip a frame it refuses, and it can
receive a payload straight into its final buffer.

Anything that is not a valid header raises ProtocolError; the byte stream cannot be resynchronised
after that, so the peer closes that one connection and goes on serving the others.
"""

from __future__ import annotations

import enum
import json
import struct
from typing import Any, NamedTuple

from ..errors import AccessError, AuthError, ProtocolError, RemoteError, TransportError

MAGIC = b"IRDM"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIIQQ")
assert HEADER.size == 40

MAX_IO = 1 << 30  # one READ/WRITE moves at most 1 GiB
MAX_CONTROL = 16 << 20  # a control document, error message or auth payload
RESPONSE = 0x80
CALL_PROBE = 1  # a CALL header's imm: a liveness probe, answered from the status board while valid (probes.py)


class Op(enum.IntEnum):
    CHALLENGE = 1  # server -> client, payload: server nonce
    AUTH = 2  # client -> server, payload: client nonce + client proof
    READ = 3
    WRITE = 4
    CALL = 5
    WRITE_IMM = 6  # WRITE, then the serving side's notification handler runs with ``imm``


class Status(enum.IntEnum):
    OK = 0
    ACCESS = 1  # bad rkey, out of bounds, wrong access
    BAD_REQUEST = 2  # unknown opcode or malformed request
    REMOTE = 3  # a control call raised; payload is {"code", "message"}
    AUTH = 4  # token refused
    PROTOCOL = 5  # the peer broke the protocol; the connection closes


class Header(NamedTuple):
    opcode: int
    req_id: int = 0
    rkey: int = 0
    offset: int = 0
    length: int = 0
    status: int = Status.OK
    imm: int = 0

    @property
    def is_response(self) -> bool:
        return bool(self.opcode & RESPONSE)

    @property
    def op(self) -> int:
        return self.opcode & ~RESPONSE


def pack(h: Header) -> bytes:
    try:
        return HEADER.pack(MAGIC, VERSION, h.opcode, h.status, h.req_id, h.rkey, h.imm, h.offset, h.length)
    except struct.error as exc:
        raise ProtocolError(f"field out of range in {h}: {exc}") from None


def pack_into(buf: bytearray | memoryview, h: Header) -> None:
    try:
        HEADER.pack_into(buf, 0, MAGIC, VERSION, h.opcode, h.status, h.req_id, h.rkey, h.imm, h.offset, h.length)
    except struct.error as exc:
        raise ProtocolError(f"field out of range in {h}: {exc}") from None


def unpack(data: bytes | bytearray | memoryview) -> Header:
    """Parse and validate one header; ProtocolError for anything malformed."""
    if len(data) != HEADER.size:
        raise ProtocolError(f"truncated header: {len(data)} of {HEADER.size} bytes")
    magic, version, opcode, status, req_id, rkey, imm, offset, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}")
    h = Header(opcode, req_id, rkey, offset, length, status, imm)
    size = payload_size(h)
    limit = MAX_IO if h.op in (Op.READ, Op.WRITE, Op.WRITE_IMM) and h.status == Status.OK and not (h.is_response and h.op == Op.WRITE_IMM) else MAX_CONTROL
    if size > limit or h.length > MAX_IO:
        raise ProtocolError(f"oversized frame: {h.length} bytes for opcode {opcode:#x}")
    return h


def payload_size(h: Header) -> int:
    """Bytes of payload that follow this header on the wire."""
    if h.opcode == Op.READ:  # a READ request names the bytes it wants; it carries none
        return 0
    return h.length


# --- control documents -------------------------------------------------------------------------


def encode_call(method: str, args: dict[str, Any]) -> bytes:
    return json.dumps({"m": method, "a": args}, separators=(",", ":")).encode()


def decode_call(payload: bytes | memoryview) -> tuple[str, dict]:
    try:
        doc = json.loads(bytes(payload))
        method, args = doc["m"], doc["a"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: "[[[[..." nested past the parser's depth
        raise ProtocolError(f"malformed call document: {exc}") from None
    if not isinstance(method, str) or not isinstance(args, dict):
        raise ProtocolError("malformed call document: wrong types")
    return method, args


def encode_result(result: dict) -> bytes:
    return json.dumps(result, separators=(",", ":")).encode()


def decode_result(payload: bytes | memoryview) -> dict:
    try:
        result = json.loads(bytes(payload))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"malformed call result: {exc}") from None
    if not isinstance(result, dict):
        raise ProtocolError("malformed call result: not an object")
    return result


def encode_remote_error(code: str, message: str) -> bytes:
    return json.dumps({"code": code, "message": message[:4096]}).encode()


def decode_remote_error(payload: bytes | memoryview) -> RemoteError:
    try:
        doc = json.loads(bytes(payload))
        return RemoteError(str(doc["code"]), str(doc.get("message", "")))
    except (ValueError, KeyError, TypeError):
        return RemoteError("EIO", bytes(payload)[:200].decode("utf-8", "replace"))


def status_error(status: int, payload: bytes | bytearray | memoryview) -> TransportError:
    """The error a refused request's answer (status != OK) stands for, as both data planes
    raise it (tcp.py, engine.py)."""
    text = bytes(payload).decode("utf-8", "replace")
    if status == Status.ACCESS:
        return AccessError(text)
    if status == Status.REMOTE:
        return decode_remote_error(payload)
    if status == Status.AUTH:
        return AuthError(text)
    return ProtocolError(f"peer refused request: {text}")

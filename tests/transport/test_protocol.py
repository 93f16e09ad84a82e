"""The wire format on bytes alone: round trips, and every malformed header refused."""

import pytest
from hypothesis import given, strategies as st

from irdmafs.transport import protocol as P
from irdmafs.errors import ProtocolError

headers = st.builds(
    P.Header,
    opcode=st.sampled_from([op.value | r for op in P.Op for r in (0, P.RESPONSE)]),
    req_id=st.integers(0, 2**64 - 1),
    rkey=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 2**64 - 1),
    length=st.integers(0, P.MAX_CONTROL),
    status=st.sampled_from(list(P.Status)),
    imm=st.integers(0, 2**32 - 1),
)


@given(headers)
def test_header_round_trip(h):
    raw = P.pack(h)
    assert len(raw) == 40
    assert P.unpack(raw) == h


@given(headers, st.integers(0, 39))
def test_truncated_header_is_a_protocol_error(h, cut):
    with pytest.raises(ProtocolError, match="truncated"):
        P.unpack(P.pack(h)[:cut])


@given(st.binary(min_size=40, max_size=40))
def test_garbage_is_refused_or_parsed_never_crashes(raw):
    try:
        h = P.unpack(raw)
    except ProtocolError:
        return
    # whatever parses is a real header: it packs back to the same bytes
    assert P.pack(h) == raw


def test_bad_magic_version_and_size():
    good = P.pack(P.Header(P.Op.CALL, length=10))
    with pytest.raises(ProtocolError, match="magic"):
        P.unpack(b"XXXX" + good[4:])
    with pytest.raises(ProtocolError, match="version"):
        P.unpack(good[:4] + bytes([9]) + good[5:])
    with pytest.raises(ProtocolError, match="oversized"):
        P.unpack(P.pack(P.Header(P.Op.CALL, length=P.MAX_CONTROL + 1)))
    with pytest.raises(ProtocolError, match="oversized"):
        P.unpack(P.pack(P.Header(P.Op.WRITE, length=P.MAX_IO + 1)))
    # a READ may ask for up to MAX_IO without carrying any payload
    assert P.payload_size(P.unpack(P.pack(P.Header(P.Op.READ, length=P.MAX_IO)))) == 0
    with pytest.raises(ProtocolError, match="out of range"):
        P.pack(P.Header(P.Op.READ, rkey=2**32))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@given(st.text(min_size=1, max_size=30), st.dictionaries(st.text(max_size=8), json_values, max_size=5))
def test_call_document_round_trip(method, args):
    assert P.decode_call(P.encode_call(method, args)) == (method, args)


@pytest.mark.parametrize("doc", [b"", b"{", b"[]", b'{"m": 1, "a": {}}', b'{"m": "x"}', b"\xff\xfe"])
def test_malformed_call_document(doc):
    with pytest.raises(ProtocolError):
        P.decode_call(doc)


def test_remote_error_document():
    err = P.decode_remote_error(P.encode_remote_error("ENOENT", "no such tensor"))
    assert (err.code, err.message) == ("ENOENT", "no such tensor")
    assert P.decode_remote_error(b"not json").code == "EIO"

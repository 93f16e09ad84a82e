"""The engine's frame parser (native/engine/frame.c, through irdmafs._engine.parse_header) against
the reference, transport/protocol.py: a differential test.

Every input goes to both ``protocol.unpack`` and ``_engine.parse_header``; they must make the same
decision, give the same fields when they accept, and refuse for the same reason (frame.h's
irdm_parse codes; Python's message starts with the C text). Inputs: every opcode with every
status and the lengths at the limits, every version byte, wrong magic, every truncated length;
Hypothesis's raw, structured and mutated headers; headers packed by ``protocol.pack`` (they
parse back to their fields); and the fuzzer's seed corpus (tests/transport/corpus/frame/, for
native/engine/fuzz_frame.c, scripts/fuzz) replayed as streams. scripts/sanitize runs this file
against an ASan/UBSan build of the engine.
"""

import os
import pathlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from irdmafs.errors import ProtocolError
from irdmafs.transport import protocol as P

_SANITIZED = os.environ.get("IRDMAFS_SANITIZED_ENGINE")  # set by scripts/sanitize
try:
    from irdmafs import _engine
except ImportError as exc:
    if _SANITIZED:
        raise  # the sanitizer run must test the engine, never skip it
    pytest.skip(
        f"irdmafs._engine does not import ({exc}): it is built from native/engine/ by ./scripts/setup (needs gcc and python3-dev)",
        allow_module_level=True,
    )
if _SANITIZED and os.path.realpath(_engine.__file__) != os.path.realpath(_SANITIZED):
    raise RuntimeError(f"scripts/sanitize asked for {_SANITIZED} but irdmafs._engine is {_engine.__file__}")

CORPUS = pathlib.Path(__file__).parent / "corpus" / "frame"

# frame.h's enum irdm_parse, and the text irdm_parse_error gives (protocol.py's messages start so)
OK, TRUNCATED, MAGIC, VERSION, OVERSIZED = 0, 1, 2, 3, 4
TEXT = {TRUNCATED: "truncated header", MAGIC: "bad magic", VERSION: "unsupported protocol version", OVERSIZED: "oversized frame"}

MAX_IO, MAX_CONTROL = P.MAX_IO, P.MAX_CONTROL
LENGTHS = [0, 1, MAX_CONTROL - 1, MAX_CONTROL, MAX_CONTROL + 1, MAX_IO - 1, MAX_IO, MAX_IO + 1, 2**32, 2**63, 2**64 - 1]
STATUSES = [s.value for s in P.Status] + [6, 0x7F, 0x80, 0xFF, 0x100, 0x8000, 0xFFFF]
# fields with high bits set in every byte position, so a swapped, shifted or sign-extended field shows
FIELDS = dict(req_id=0xF1E2D3C4B5A69788, rkey=0x8BADF00D, imm=0xFEEDFACE, offset=0xC0FFEE0123456789)


def raw(opcode=P.Op.CALL, status=0, length=0, magic=P.MAGIC, version=P.VERSION, **fields):
    f = {**FIELDS, **fields}
    return P.HEADER.pack(magic, version, opcode, status, f["req_id"], f["rkey"], f["imm"], f["offset"], length)


def reference(data):
    """protocol.unpack's verdict: ("accepted", fields in parse_header's order) or ("refused", code)."""
    try:
        h = P.unpack(data)
    except ProtocolError as exc:
        codes = [code for code, text in TEXT.items() if str(exc).startswith(text)]
        assert len(codes) == 1, f"protocol.unpack refused with a reason the engine has no code for: {exc}"
        return ("refused", codes[0])
    return ("accepted", (h.opcode, h.status, h.req_id, h.rkey, h.imm, h.offset, h.length))


def engine(data):
    """parse_header's verdict, in reference()'s form; its refusal must carry a known code and text."""
    try:
        fields = _engine.parse_header(data)
    except ValueError as exc:
        # ValueError(code, why) as engine.c raises it (PyErr_SetObject with the tuple), or ValueError((code, why))
        args = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], tuple) else exc.args
        assert len(args) == 2, f"parse_header raised ValueError{exc.args!r}, not (code, why)"
        code, why = args
        assert type(code) is int and code in TEXT, f"unknown refusal code {code!r} ({why!r})"
        assert why == TEXT[code], f"code {code} with the text {why!r}"
        return ("refused", code)
    assert type(fields) is tuple and len(fields) == 7 and all(type(v) is int for v in fields), fields
    return ("accepted", fields)


def disagreement(data):
    """None when both agree on data, else a line saying how they differ."""
    want, got = reference(data), engine(data)
    if want == got:
        return None
    return f"{bytes(data).hex()} ({len(data)} bytes): protocol.unpack {want}, _engine.parse_header {got}"


def assert_agree(cases):
    bad = [d for d in map(disagreement, cases) if d]
    assert not bad, f"{len(bad)} of {len(cases)} inputs differ, the first:\n" + "\n".join(bad[:10])


# --- exhaustive edges ------------------------------------------------------------------------


def test_every_opcode_with_and_without_the_response_bit_every_status_and_the_lengths_at_the_limits():
    cases = [raw(op, status, length) for op in range(256) for status in STATUSES for length in LENGTHS]
    assert len(cases) == 256 * len(STATUSES) * len(LENGTHS)
    assert_agree(cases)
    # both sides accepted and refused some: the sample is not all one kind
    verdicts = {reference(c)[0] for c in cases}
    assert verdicts == {"accepted", "refused"}


@pytest.mark.parametrize(
    "opcode, status, length, verdict",
    [
        (P.Op.WRITE, 0, MAX_IO, OK),
        (P.Op.WRITE, 0, MAX_IO + 1, OVERSIZED),
        (P.Op.WRITE, P.Status.REMOTE, MAX_CONTROL, OK),
        (P.Op.WRITE, P.Status.REMOTE, MAX_CONTROL + 1, OVERSIZED),
        (P.Op.WRITE_IMM, 0, MAX_IO, OK),
        (P.Op.WRITE_IMM | P.RESPONSE, 0, MAX_CONTROL, OK),
        (P.Op.WRITE_IMM | P.RESPONSE, 0, MAX_CONTROL + 1, OVERSIZED),
        (P.Op.READ, 0, MAX_IO, OK),  # a READ request names the bytes it wants and carries none
        (P.Op.READ, P.Status.ACCESS, MAX_IO, OK),
        (P.Op.READ, 0, MAX_IO + 1, OVERSIZED),
        (P.Op.READ | P.RESPONSE, 0, MAX_IO, OK),
        (P.Op.READ | P.RESPONSE, P.Status.ACCESS, MAX_CONTROL + 1, OVERSIZED),
        (P.Op.CALL, 0, MAX_CONTROL, OK),
        (P.Op.CALL, 0, MAX_CONTROL + 1, OVERSIZED),
        (P.Op.CHALLENGE, 0, MAX_CONTROL + 1, OVERSIZED),
        (0x7F, 0, MAX_CONTROL + 1, OVERSIZED),
        (0, 0xFFFF, 0, OK),
        (0xFF, 0, 2**64 - 1, OVERSIZED),
    ],
)
def test_the_limits_themselves(opcode, status, length, verdict):
    """The rules pinned on their own, so a mistake made on both sides still shows."""
    data = raw(opcode, status, length)
    assert disagreement(data) is None, disagreement(data)
    if verdict == OK:
        assert engine(data) == ("accepted", (opcode, status, FIELDS["req_id"], FIELDS["rkey"], FIELDS["imm"], FIELDS["offset"], length))
    else:
        assert engine(data) == ("refused", verdict)


def test_wrong_magic_in_every_byte_and_before_every_other_check():
    cases = []
    for pos in range(4):
        for byte in (0x00, P.MAGIC[pos] ^ 0x20, P.MAGIC[pos] ^ 0x01, 0x80, 0xFF):
            magic = bytearray(P.MAGIC)
            magic[pos] = byte
            for version, length in ((1, 0), (2, 0), (1, 2**64 - 1), (0, MAX_IO + 1)):
                cases.append(raw(P.Op.WRITE, 0, length, magic=bytes(magic), version=version))
    cases += [raw(magic=m) for m in (b"\0\0\0\0", b"MDRI", b"irdm", b"\xff\xff\xff\xff", b"IRD\0")]
    assert_agree(cases)
    assert {engine(c) for c in cases} == {("refused", MAGIC)}


def test_every_version_byte():
    cases = [raw(P.Op.CALL, 0, length, version=v) for v in range(256) for length in (0, MAX_CONTROL + 1)]
    assert_agree(cases)
    assert [engine(raw(version=v))[0] for v in range(256)].count("accepted") == 1


def test_every_truncated_length_and_one_byte_over():
    cases = []
    for base in (raw(), raw(P.Op.WRITE, 0, MAX_IO + 1), raw(magic=b"XXXX"), raw(version=9), bytes(40), b"\xff" * 40):
        cases += [base[:n] for n in range(40)]
        cases += [base + b"\0", base + b"\xff", base * 2, base + bytes(1000)]
    assert_agree(cases)
    assert {engine(c) for c in cases} == {("refused", TRUNCATED)}


def test_every_buffer_kind_protocol_unpack_takes():
    data = raw(P.Op.READ | P.RESPONSE, 0, 16)
    big = bytearray(b"\xaa" * 7 + data + b"\xbb" * 9)
    for buf in (data, bytearray(data), memoryview(data), memoryview(big)[7:47], memoryview(bytearray(data)).toreadonly()):
        assert disagreement(buf) is None, disagreement(buf)
        assert engine(buf)[0] == "accepted"


def test_what_is_not_a_buffer_is_a_type_error():
    for thing in (None, 40, "IRDM" + "\0" * 36, [0] * 40):
        with pytest.raises(TypeError):
            _engine.parse_header(thing)


# --- Hypothesis ------------------------------------------------------------------------------

u64 = st.integers(0, 2**64 - 1)
lengths = st.sampled_from(LENGTHS) | st.integers(MAX_CONTROL - 2, MAX_CONTROL + 2) | st.integers(MAX_IO - 2, MAX_IO + 2) | st.integers(0, 600) | u64


@st.composite
def structured(draw):
    """A header from fields: mostly the right magic and version, any opcode, wild values, the
    lengths near the limits; then maybe a few bytes replaced and maybe cut or extended."""
    data = bytearray(
        P.HEADER.pack(
            draw(st.just(P.MAGIC) | st.binary(min_size=4, max_size=4)),
            draw(st.just(P.VERSION) | st.integers(0, 255)),
            draw(st.sampled_from([op | r for op in P.Op for r in (0, P.RESPONSE)]) | st.integers(0, 255)),
            draw(st.sampled_from(STATUSES) | st.integers(0, 0xFFFF)),
            draw(u64),
            draw(st.integers(0, 2**32 - 1)),
            draw(st.integers(0, 2**32 - 1)),
            draw(u64),
            draw(lengths),
        )
    )
    for pos, byte in draw(st.lists(st.tuples(st.integers(0, 39), st.integers(0, 255)), max_size=3)):
        data[pos] = byte
    size = 40 if draw(st.integers(0, 3)) else draw(st.integers(0, 100))
    return bytes(data[:size]) + bytes(max(0, size - 40))


@settings(max_examples=1000, deadline=None)
@given(structured())
def test_structured_and_mutated_headers(data):
    assert disagreement(data) is None, disagreement(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=100) | st.binary(min_size=40, max_size=40))
@example(b"")
@example(P.MAGIC + bytes(36))
def test_raw_bytes(data):
    assert disagreement(data) is None, disagreement(data)


headers = st.builds(
    P.Header,
    opcode=st.integers(0, 255),
    req_id=u64,
    rkey=st.integers(0, 2**32 - 1),
    offset=u64,
    length=lengths,
    status=st.sampled_from(STATUSES) | st.integers(0, 0xFFFF),
    imm=st.integers(0, 2**32 - 1),
)


@settings(max_examples=1000, deadline=None)
@given(headers)
def test_what_protocol_pack_writes_parses_back_to_its_fields(h):
    data = P.pack(h)
    assert disagreement(data) is None, disagreement(data)
    fields = (h.opcode, h.status, h.req_id, h.rkey, h.imm, h.offset, h.length)
    if reference(data)[0] == "refused":
        assert engine(data) == ("refused", OVERSIZED)  # the one rule a packed header can break
        return
    assert engine(data) == ("accepted", fields)
    # and the engine's fields pack back to the identical bytes
    opcode, status, req_id, rkey, imm, offset, length = _engine.parse_header(data)
    assert P.pack(P.Header(opcode, req_id, rkey, offset, length, status, imm)) == data


# --- the fuzzer's seed corpus ----------------------------------------------------------------


def seeds():
    return sorted(CORPUS.iterdir()) if CORPUS.is_dir() else []


def test_the_seed_corpus_is_there_and_small():
    files = seeds()
    assert 10 <= len(files) <= 64, f"{len(files)} seeds in {CORPUS}"
    assert all(f.stat().st_size <= 64 for f in files), [f.name for f in files if f.stat().st_size > 64]


@pytest.mark.parametrize("path", seeds(), ids=lambda p: p.name)
def test_a_seed_read_as_a_stream(path):
    """As fuzz_frame.c reads it: headers and their payloads until one is refused or cut short;
    each header, 39 and 41 bytes at it, the rest of the stream and the whole file agree."""
    data = path.read_bytes()
    cases = [data]
    pos = 0
    while True:
        cases += [data[pos : pos + 40], data[pos : pos + 39], data[pos : pos + 41], data[pos:]]
        verdict = reference(data[pos : pos + 40])
        if verdict[0] == "refused":
            break
        pos += 40 + P.payload_size(P.unpack(data[pos : pos + 40]))
        if pos > len(data):
            break
    assert_agree(cases)


def test_the_seeds_start_with_every_verdict():
    codes = set()
    for path in seeds():
        verdict, what = engine(path.read_bytes()[:40])
        codes.add(OK if verdict == "accepted" else what)
    assert codes == {OK, TRUNCATED, MAGIC, VERSION, OVERSIZED}

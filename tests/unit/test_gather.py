"""Gather: a write-behind's run kept as the writes' own buffers, sliced without a copy."""

import pytest

from irdmafs.transport.base import Gather, as_buffers

BIG = Gather.SMALL  # appended by reference
SMALL = 1000  # copied together with its neighbours


def test_large_buffers_are_referenced_and_slices_cross_them_without_copies():
    a, b, c = bytes([1]) * BIG, bytes([2]) * BIG, bytes([3]) * (BIG + 5)
    g = Gather([a, b])
    g.append(c)
    assert len(g) == 3 * BIG + 5 and len(g.parts) == 3
    assert all(p.obj is src for p, src in zip(g.parts, (a, b, c)))  # no copy
    piece = g[BIG - 2 : 2 * BIG + 3]
    assert [len(p) for p in piece] == [2, BIG, 3] and piece[0].obj is a and piece[2].obj is c
    assert b"".join(piece) == a[-2:] + b + c[:3]
    assert bytes(g) == a + b + c
    assert g[0:0] == [] and g[len(g) : len(g) + 9] == []


def test_small_writes_are_coalesced_into_few_buffers():
    g = Gather()
    writes = [bytes([i % 251]) * SMALL for i in range(1000)]  # 1,000 writes of 1,000 bytes
    for w in writes:
        g.append(w)
    assert len(g.parts) <= len(g) // Gather.SMALL + 1
    assert bytes(g) == b"".join(writes)


def test_split_keeps_the_head_and_returns_the_tail_and_a_viewed_tail_stops_growing():
    g = Gather([b"abc", b"def"])  # both small: one coalesced buffer
    view = g[1:4]
    assert b"".join(view) == b"bcd"
    g.append(b"ghi")  # must not resize a buffer a view still holds (BufferError)
    assert b"".join(view) == b"bcd" and bytes(g) == b"abcdefghi"
    rest = g.split(4)
    assert (bytes(g), len(g)) == (b"abcd", 4) and (bytes(rest), len(rest)) == (b"efghi", 5)
    rest.append(b"jk")
    assert bytes(rest) == b"efghijk" and bytes(g) == b"abcd"
    assert bytes(g.split(99)) == b"" and bytes(g) == b"abcd"


def test_a_slice_is_what_every_transport_takes():
    g = Gather([bytes(range(200)) * 2000, b"tail"])
    assert b"".join(as_buffers(g[10:400_004])) == bytes(g)[10:400_004]
    with pytest.raises(ValueError):
        g[::2]

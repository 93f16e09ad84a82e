"""The layout of a stripe's region, shared by the node that serves it (server/store.py) and every
peer that reads it one-sidedly (cluster.py).

A region is ``[version: u64][clock: u64][data: capacity bytes]``, little-endian: a 16-byte
header, then the data. The version word is a seqlock: ``2 * version`` while the stripe is stable,
odd while an install is under way. The clock word counts the training steps applied to the stripe
(server/policies.py), so a pull waits for a step by reading the header alone.

Pure: no I/O.
"""

from __future__ import annotations

import struct

HEADER = 16  # bytes before a stripe's data: the version word, then the clock word
WORD = struct.Struct("<Q")
VERSION_AT = 0  # offset of the version word
CLOCK_AT = 8  # offset of the clock word


def read_header(buf) -> tuple[int, int]:
    """(version, clock) of a stripe header in ``buf`` (its version word halved: stable only if
    the word was even, which the caller checks)."""
    return WORD.unpack_from(buf, VERSION_AT)[0] // 2, WORD.unpack_from(buf, CLOCK_AT)[0]

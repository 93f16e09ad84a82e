"""The layout of a stripe's region, shared by the node that serves it (server/store.py) and every
peer that reads it one-sidedly (runtime/peers.py).

A region is ``[version: u64][clock: u64][data: capacity bytes]``, little-endian: a 16-byte
header, then the data. The version word is a seqlock: ``2 * version`` while the stripe is stable,
odd while an install is under way. The clock word counts the training steps applied to the stripe
and published (server/rounds.py), so a pull waits for a step by reading the header alone. Its
top bit (``PENDING``) says the data already holds a step whose clock is not published yet: a
primary installs a step, replicates it, and only then publishes its clock (server/training.py,
``_settle``), so meanwhile its bytes are newer than its clock says. A reader that wants the
stripes of a tensor all of one step (``StripeIO.read_settled``) reads such a stripe again once
it is published; a pull, which wants "this step or later", needs only the clock.

Pure: no I/O.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

HEADER = 16  # bytes before a stripe's data: the version word, then the clock word
WORD = struct.Struct("<Q")
VERSION_AT = 0  # offset of the version word
CLOCK_AT = 8  # offset of the clock word
PENDING = 1 << 63  # in the clock word: the data holds a step whose clock is not published yet
CLOCK_WAITS = 4096  # stripes one ``clock_wait`` names at most (server/clocks.py, client/clockwait.py)


class Header(NamedTuple):
    """A stripe header as read: ``version`` (its word halved: stable only if the word was even,
    which the caller checks), the published ``clock``, and whether the data is ``pending``,
    ahead of that clock."""

    version: int
    clock: int
    pending: bool = False

    @property
    def clock_word(self) -> int:
        """The clock word that says the same (what a copy of the stripe stores)."""
        return clock_word(self.clock, self.pending)


def clock_word(clock: int, pending: bool = False) -> int:
    return clock | PENDING if pending else clock


def read_header(buf) -> Header:
    word = WORD.unpack_from(buf, CLOCK_AT)[0]
    return Header(WORD.unpack_from(buf, VERSION_AT)[0] // 2, word & ~PENDING, bool(word & PENDING))

# A stripe's versions: (namespace op seq at its making) << VERSION_SHIFT + its commits since, so
# a stripe made after a truncate is newer than any copy from before it (server/datapath.py)
VERSION_SHIFT = 32

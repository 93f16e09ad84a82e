"""The value types a stripe's change travels as between nodes: which stripe (``StripeKey``), which
bytes of it (``StripeRange``), and the whole change a primary sends a backup (``Update``).

On the wire (``where`` of the ``apply`` call) a range is ``[fid, idx, snap, offset, length, unit]``; ``parse``
turns that back into a ``StripeRange`` or answers EINVAL saying what is wrong, before anything is
installed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from ..errors import RemoteError


class StripeKey(NamedTuple):
    """A stripe: its file, its index in the file, and its snapshot (0: live; -1, -2: the
    optimizer state of the live stripe; above 0: a snapshot's copy)."""

    fid: int
    idx: int
    snap: int = 0


class StripeRange(NamedTuple):
    """``length`` bytes at ``offset`` of a stripe of ``unit`` bytes."""

    key: StripeKey
    offset: int
    length: int
    unit: int

    def wire(self) -> list[int]:
        return [*self.key, self.offset, self.length, self.unit]

    @staticmethod
    def parse(value: object) -> "StripeRange":
        """A range as ``wire`` wrote it; EINVAL if it is not six integers."""
        if not (isinstance(value, list) and len(value) == 6 and all(type(v) is int for v in value)):
            raise RemoteError("EINVAL", f"a stripe range is [fid, idx, snap, offset, length, unit], not {value!r}")
        fid, idx, snap, offset, length, unit = value
        return StripeRange(StripeKey(fid, idx, snap), offset, length, unit)


@dataclass(frozen=True)
class Update:
    """What a primary sends a backup of one stripe: the bytes of ``range`` as they are in
    ``source`` (a store's Stripe) at ``version``, with the push bookkeeping (``record``) and the
    number of optimizer-state stripes (``state``, sent before with ``pending``) that go with
    them. ``pending``: an optimizer-state stripe, held aside by the backup until the
    parameters' update that names it arrives. ``clock``: the training clock that goes with
    them (None: the source's as it is; a primary's step gives its new clock here, as it
    publishes that clock itself only once every backup holds the step)."""

    range: StripeRange
    version: int
    source: object  # store.Stripe: its data and clock as they are when sent
    record: dict | None = None
    pending: bool = False
    state: int = 0
    full: bool = False  # the whole stripe, installed in place of what the backup holds if newer
    base_tag: int = 0  # the tag of the version this range was made on (``version - 1``)
    clock: int | None = None

    def whole(self) -> "Update":
        """The same update as the whole stripe (for a backup that is behind)."""
        r = self.range
        return replace(self, range=StripeRange(r.key, 0, self.source.capacity, r.unit), full=True)

    @property
    def clock_sent(self) -> int:
        """The clock the backup installs with these bytes."""
        return self.source.clock if self.clock is None else self.clock

    def bytes(self) -> memoryview:
        r = self.range
        return self.source.data[r.offset : r.offset + r.length]


def check_range(offset: int, length: int, unit: int, stripe_unit: int) -> None:
    """EINVAL unless ``unit`` is a stripe size a node holds (the config's, or a power of two of
    at least 4 KiB) and ``length`` bytes at ``offset`` lie inside one stripe of it."""
    if unit != stripe_unit and (unit < 4096 or unit & (unit - 1)):
        raise RemoteError("EINVAL", f"bad stripe unit {unit}")
    if offset < 0 or length < 0 or offset + length > unit:
        raise RemoteError("EINVAL", f"range {offset}+{length} outside a stripe of {unit}")

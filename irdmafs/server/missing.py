"""What a PS node should hold and does not: the stripes it came back without.

A stripe a node is a home of and does not hold is either a hole (never written: zeros) or lost
(written, acknowledged, and gone: the node restarted without its data, and no peer held another
copy, as at R=1, or a second fault before the first was repaired). The namespace knows which
stripes hold written bytes (held.py, ``Meta.written``); a resync that ends without a copy of
such a stripe of this node's records it here. Then, until the stripe is written again or freed:

- every read of it gets EIO: ``stripe_info`` answers ``{"lost": why}`` for it, not a hole, and
  the reader asks the stripe's other homes, and says EIO naming the stripe and the node when
  none holds it (client/stripe.py), never zeros;
- ``irdmafs status`` and the metrics count it (``summary``: stripes and bytes; ``whole: no``).

The rule (docs/filesystem.md, "A stripe no node holds"): **a stripe the namespace says holds
bytes, which a home of it came back without and no peer could give, is never read as zeros.**
Only a resync adds to the set, so a node that served all along answers as it always did (a
hole is a hole); a namespace from before the runs were kept knows no stripe as written and adds
nothing.

Concurrency: the node's trio thread only; nothing here awaits.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from .. import held
from ..held import extent_end
from ..errors import RemoteError
from .meta import Meta
from .store import Store

log = logging.getLogger(__name__)

Key = tuple[int, int, int]  # (file id, stripe index, snapshot id)
NAMED = 5  # keys a log line names at most


def written_keys(meta: Meta) -> Iterable[Key]:
    """Every (file, stripe, snapshot) the namespace says holds written bytes, live and in every
    snapshot, within each file's extent."""
    for snap in [0, *sorted(meta.snapshot_ids().values())]:
        view = meta.view(snap)
        for fid in view.files():
            node = view.inodes[fid]
            runs, unit = node.get("stripes"), node.get("unit")
            if runs is None or not unit:
                continue
            for lo, hi in held.cut(runs, -(-extent_end(node) // unit)):
                for idx in range(lo, hi):
                    yield fid, idx, snap


class Missing:
    """The stripes this node lost (see the module's docstring)."""

    def __init__(self, name: str, store: Store, meta: Callable[[], Meta]):
        self.name, self.store, self.meta = name, store, meta
        self.keys: set[Key] = set()

    def found(self, mine: Callable[[int, int], bool]) -> None:
        """After a resync: every written stripe of this node's (``mine``) that it does not hold
        is lost (its peers gave what they had). Logged once, with the count and bytes."""
        meta = self.meta()
        self.keys = {k for k in written_keys(meta) if mine(k[0], k[1]) and self.store.get(*k) is None}
        if self.keys:
            s = self.summary()
            named = ", ".join(f"{f}:{i}" + (f" (snapshot {sn})" if sn else "") for f, i, sn in sorted(self.keys)[:NAMED])
            log.error(
                "node %s came back without %d stripes (%d bytes) that no peer holds (%s%s): reads of them get EIO until they are written again",
                self.name,
                s["stripes"],
                s["bytes"],
                named,
                ", ..." if len(self.keys) > NAMED else "",
            )

    def frozen(self, snap: int) -> None:
        """Snapshot ``snap`` was taken here: what is lost of the live files is lost in it too
        (it shares no memory for those stripes: there is none)."""
        self.keys |= {(f, i, snap) for f, i, s in list(self.keys) if s == 0 and self.store.get(f, i) is None}

    def why(self, fid: int, idx: int, snap: int = 0) -> str | None:
        """Why stripe (fid, idx) of snapshot ``snap`` is not here though it holds bytes, or None
        (a hole, or held: the caller reads it)."""
        if (fid, idx, snap) not in self.keys or self.store.get(fid, idx, snap) is not None:
            return None
        try:
            if not self.meta().view(snap).written(fid, idx):
                return None
        except RemoteError:  # a snapshot dropped: nothing to read there
            return None
        return f"node {self.name} came back without it and no other replica held it"

    def summary(self) -> dict:
        """How many stripes are lost here now and their bytes (each up to its file's end); the
        keys written again or freed since are forgotten."""
        meta = self.meta()
        now, nbytes = set(), 0
        for fid, idx, snap in self.keys:
            try:
                view = meta.view(snap)
            except RemoteError:  # its snapshot dropped
                continue
            node = view.inodes.get(fid)
            if node is None or not view.written(fid, idx) or self.store.get(fid, idx, snap) is not None:
                continue
            now.add((fid, idx, snap))
            nbytes += max(0, min(node["unit"], extent_end(node) - idx * node["unit"]))
        self.keys = now
        return {"stripes": len(now), "bytes": nbytes}

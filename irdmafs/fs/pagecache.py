"""Which live files the kernel may keep cached pages of across opens.

Close-to-open consistency: an open sees every change made before it, by this mount or any other.
The mount used to drop a live file's cached pages at every open (``keep_cache=False``), so a
checkpoint read again, unchanged, came over the network again. Now an open of a live file for
reading, of at least ``MIN_SIZE`` bytes, takes the file's *stamp* and keeps the pages if it is the
stamp the previous open of that file took:

- the view epoch (a failover may give a version number of an unacknowledged write to other bytes;
  a new view comes with any failover);
- the namespace's version and size of the file (moved by every flush of a write, by any mount);
- the version of each of its stripes, from a home that serves it (``StripeIO.versions``: one
  call per node; moved by every install, a write's or a training step's, and never back): of
  its tensors' stripes too for a model file (models.py), whose bytes are theirs (its own end at
  its header), and of the bucket of a packed tensor (docs/buckets.md).

The pages the kernel holds were all read after the earlier open took its stamp; the same stamp now
means nothing changed since, so they are the file's bytes now. Any difference (or a stamp that
could not be taken: a home unreachable) drops them, as before. An open for writing drops them and
the stamp (the write changes it anyway). Snapshots keep their pages always (handles.py): they never
change. Small files are not worth the stamp's round trip: their pages are dropped at each open.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import FsError, TransportError
from ..packing import in_force
from . import models

if TYPE_CHECKING:
    from ..client.client import Client

log = logging.getLogger(__name__)

MIN_SIZE = 1 << 20  # smaller live files: pages dropped at each open, no stamp taken

Stamp = tuple


class PageCache:
    def __init__(self, client: "Client") -> None:
        self.client = client
        self._stamps: dict[int, Stamp] = {}  # inode -> the stamp its last open for reading took

    def forget(self, ino: int) -> None:
        """An open for writing: the next open for reading drops the pages."""
        self._stamps.pop(ino, None)

    async def keep(self, ino: int, attr: dict) -> bool:
        """An open of live file ``ino`` (attributes ``attr`` as the open fetched them) for
        reading: may the kernel keep the pages it has of it?"""
        if attr["size"] < MIN_SIZE:
            self._stamps.pop(ino, None)
            return False
        try:
            stamp = await self.stamp(attr)
        except TransportError as exc:  # a node lost, a read refused: no stamp
            log.info("inode %d: no stamp (%s): its cached pages are dropped", ino, exc)
            stamp = None
        before = self._stamps.pop(ino, None)
        if stamp is not None:
            self._stamps[ino] = stamp
        return stamp is not None and stamp == before

    async def stamp(self, attr: dict) -> Stamp | None:
        """The file's stamp (see above); None if a stripe's version could not be read."""
        files = [(attr["ino"], attr["size"], attr["unit"])]
        model = models.model_of(attr)
        if model is not None:
            # a model file's own stripes end at its header: its tensors' bytes are theirs (its
            # 110 stripes past the header were holes looked up at every open of a 438 MB one)
            files = [(attr["ino"], min(attr["size"], model["start"]), attr["unit"])]
            try:
                layout = await models.layout(self.client, attr)
            except FsError:  # a model file gone bad: its reads say so
                return None
            files += [(p.ino, p.attr["size"], p.attr["unit"]) for p in layout.parts]
            attrs = [attr] + [p.attr for p in layout.parts]
        else:
            attrs = [attr]
        # a packed tensor's bytes are its bucket's (docs/buckets.md): every bucket's stripes too
        files += sorted({(p["fid"], p["size"], p["unit"]) for p in map(in_force, attrs) if p})
        epoch = self.client.cluster.roles.view_epoch
        versions = await self.client.io.versions(files)
        if any(v is None for v in versions):
            return None
        return (epoch, attr["version"], attr["size"], tuple(versions))

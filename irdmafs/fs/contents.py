"""What a live file holds, and the changes that decide it: plain bytes; a tensor (a valid
``.npy``: dtype, shape, data offset, recorded when a handle that wrote it is flushed; a malformed
one stays plain bytes with a log line); a model file (a ``*.safetensors`` that maps: models.py);
a tensor packed into a bucket (docs/buckets.md).

Owns: the flush's detection (``detect``, ``detect_tensor``: each FileHandle's ``on_flushed``),
a model file becoming one or plain bytes again (``changed``: open files and layouts follow, a
handle's ``on_changed``), resizes (``resize``: under the file's model lock, waiting for this
mount's writes and zeroing past the new size) and the unpacking of a packed tensor before it is
written in place, cut short or given a policy of its own (``alone``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .. import formats
from ..packing import in_force
from . import models
from .handles import FileHandle
from .openfiles import OpenFiles

if TYPE_CHECKING:
    from ..client.client import Client
    from .streams import Layouts

log = logging.getLogger(__name__)


class FileContents:
    def __init__(self, client: "Client", files: OpenFiles, models_: models.ModelFiles, layouts: "Layouts") -> None:
        self.client = client
        self.files = files  # what the mount knows of each file it has open
        self.models = models_  # model files: conversions, tensor directories, kept names
        self.layouts = layouts  # the step streams' model layouts (forgotten when tensors change)

    async def resize(self, ino: int, changes: dict[str, Any], *, writing: bool = False) -> dict:
        """Change a cluster file's attributes; a new size waits for this mount's writes to it
        and zeroes what lies past it (under the file's model lock: no conversion meanwhile).
        ``writing``: a size set by a writer (an O_TRUNC open, an ftruncate), which marks the
        file unfinished until its last flush (W1). Returns the node's attributes."""
        if "size" not in changes:
            return await self._set(ino, changes)
        async with self.models.locked(ino):
            attr = await self._plain_if_resized(ino, changes)
            if changes["size"] > ((attr.get("tensor") or {}).get("offset") or 0):  # a packed tensor's data is kept
                await self.alone(ino, attr)
            return await self._set(ino, changes, self.client.owner if writing else None)

    async def alone(self, ino: int, attr: dict) -> dict:
        """A tensor packed into a bucket (docs/buckets.md) about to be written in place, cut
        short but not away, or given a policy of its own: its bucket is unpacked first (every
        member's bytes its own again); returns its attributes as they are then."""
        ptr = in_force(attr)
        if ptr is None:
            return attr
        await self.client.buckets.unpack(ptr["fid"])
        self.layouts.forget()
        return await self.client.getattr(ino)

    async def _set(self, ino: int, changes: dict[str, Any], writer: str | None = None) -> dict:
        written = 0
        f = self.files.get(ino)
        if "size" in changes and f:
            await f.drain()  # a truncate must not be overtaken by an earlier write
            f.forget_fetched()
            # data this mount wrote past the size the nodes know (not yet extended) is in the
            # stripes too: the truncate must zero it as well, or a later grow shows it again
            written = max([f.pending] + [h.size for h in f.handles])
            f.pending = 0
            for h in f.handles:
                h.size = min(h.size, changes["size"])
        attr = await self.client.setattr(ino, written=written, writer=writer, **changes)
        if f:
            f.update(attr)  # open files answer getattr: keep them current
            if writer is not None:
                f.marked, f.sized = True, max(f.sized, changes["size"])
        m = models.model_of(attr)
        if m is not None and {"mode", "uid", "gid"} & set(changes):  # its tensors follow
            mirrored = {k: v for k, v in changes.items() if k in ("uid", "gid")}
            if "mode" in changes:
                mirrored["mode"] = models.dir_mode(changes["mode"])
            await self.client.setattr(m["dir"], **mirrored)
        return attr

    async def _plain_if_resized(self, ino: int, changes: dict) -> dict:
        """A model file about to be truncated to another size is plain bytes first (models.py).
        Called with the file's model lock held; returns the file's attributes as they are then."""
        attr = await self.client.getattr(ino)
        if models.model_of(attr) is None or changes["size"] == attr["size"]:
            return attr
        attr = await (self.models.unmodel if changes["size"] == 0 else self.models.materialize)(attr)
        self.changed(ino, attr)
        return attr

    def changed(self, ino: int, attr: dict) -> None:
        """``ino`` became a model file or stopped being one: open files and layouts follow."""
        self.layouts.forget()
        f = self.files.get(ino)
        if f:
            f.changed(attr)

    async def detect(self, handle: FileHandle) -> None:
        """What a file just written holds: a tensor (.npy) or plain bytes. A ``*.safetensors``
        stays plain bytes here: it becomes a model where it is first wanted as one (models.py),
        never at its writer's close."""
        await self.detect_tensor(handle.ino, handle.attr, handle.name)

    async def detect_tensor(self, ino: int, attr: dict, name: str) -> bytes | None:
        """Record whether the file now holds a valid .npy (a tensor) or plain bytes; returns
        the first bytes read if it may be something else (no .npy magic), else None."""
        size = attr["size"]
        info = None
        prefix = await self.client.read(ino, 0, min(size, formats.PREFIX), attr) if size >= 10 else b""
        if prefix.startswith(formats.MAGIC):
            try:
                need = formats.header_length(prefix[:12])
                if need > len(prefix):
                    prefix = await self.client.read(ino, 0, need, attr)
                h = formats.parse_header(prefix)
                if h.data_offset + h.nbytes != size:
                    raise formats.NpyError(f"data is {size - h.data_offset} bytes, header says {h.nbytes}")
                info = formats.tensor_info(h)
            except formats.NpyError as exc:
                log.warning("%s (inode %d): not a tensor, kept as plain bytes: %s", name or "file", ino, exc)
        elif name.endswith(".npy"):
            log.warning("%s (inode %d): no .npy magic; kept as plain bytes, not a tensor", name, ino)
        if info != attr.get("tensor"):
            self.layouts.forget()  # a tensor came, went or changed shape
            await self.client.set_tensor(ino, info)
        self.client.training.forget_training(ino)  # written anew: its shape and push counts are refetched
        return None if prefix.startswith(formats.MAGIC) else prefix

"""``/.workers/<rank>/``: the tree as worker ``rank`` trains it.

- ``.workers/<rank>/.../t.npy``: writing pushes one gradient of tensor ``t`` (at flush),
  reading pulls its parameters as the model's sync policy lets the rank see them;
- ``.workers/<rank>/.../<model>.safetensors``: a whole step, one stream per direction
  (streams.py); for a model file ``<model>.safetensors`` (models.py), its tensors' streams;
- ``.workers/<rank>/.../<model>.door``: a one-time ticket to the same step through memory
  shared with the mount (worker/door.py), readable by whoever may push and pull.

Entries and attributes are cached by the kernel for WORK_CACHE_SECONDS: a step through the
mount then makes no metadata call.
"""

from __future__ import annotations

import errno
import stat as S
from typing import TYPE_CHECKING

import numpy as np

from ..names import ROOT
from ..errors import FsError, RemoteError
from . import models
from .handles import BytesHandle, PushHandle
from .inodes import (
    DOOR,
    DOOR_SUFFIX,
    STREAM,
    SUFFIX,
    WORK,
    WORK_CACHE_SECONDS,
    WORKERS_DIR,
    Family,
    dir_stat,
    door_ino,
    file_stat,
    rank_of,
    split_door,
    split_stream,
    split_work,
    stream_ino,
    work_ino,
    work_stat,
    writes,
)
from .streams import PullStreamHandle, PushStreamHandle, Streams

if TYPE_CHECKING:
    from .models import ModelFiles


class WorkerFiles(Family):
    def __init__(self, streams: Streams, models: "ModelFiles", door) -> None:
        self.streams = streams  # the client and the model layouts
        self.client = streams.client
        self.models = models  # the names the mount keeps, and X/ of a model file
        self.door = door  # () -> the mount's door server, or None

    def owns(self, ino: int) -> bool:
        return ino == WORKERS_DIR or bool(ino & (WORK | STREAM | DOOR))

    async def getattr(self, ino: int) -> dict:
        if ino == WORKERS_DIR:
            return dir_stat(ino, 0o555)
        if ino & WORK:
            # the kernel asks after every write to a file; for a tensor being trained, what the
            # push and pull paths cache answers without a call
            rank, i = split_work(ino)
            cached = self.client.training.cached_train_info(i, rank)
            return work_stat(cached["attr"] if cached else await self.client.getattr(i), ino)
        if ino & STREAM:
            # a step stream: the size of the model's pull stream (the layout is cached)
            _, model = split_stream(ino)
            d = await self.client.getattr(model)
            size = (await self.streams.layouts.get(model)).size
            st = file_stat(ino, size, d["mode"] & 0o666, d["mtime_ns"], d["uid"], d["gid"])
            return dict(st, entry_timeout=WORK_CACHE_SECONDS, attr_timeout=WORK_CACHE_SECONDS)
        # who may read the ticket may push and pull through the door: readable by a class
        # (owner, group, others) only where the model directory is readable and writable
        # for it, as the stream file is read (pull) and written (push)
        d = await self.client.getattr(split_door(ino)[1])
        mode = d["mode"] & 0o444 & ((d["mode"] & 0o222) << 1)
        return dict(file_stat(ino, 0, mode, d["mtime_ns"], d["uid"], d["gid"]), entry_timeout=WORK_CACHE_SECONDS)

    async def lookup(self, parent: int, name: str) -> dict:
        if parent == WORKERS_DIR:
            return work_stat(await self.client.getattr(ROOT), work_ino(rank_of(name), ROOT))
        if not parent & WORK:
            raise FsError(errno.ENOTDIR)
        rank, p = split_work(parent)
        try:
            attr = await self.models.entry(p, name)
        except RemoteError as exc:
            suffix = next((x for x in (SUFFIX, DOOR_SUFFIX) if name.endswith(x) and len(name) > len(x)), None)
            if exc.code != "ENOENT" or suffix is None or (suffix == DOOR_SUFFIX and self.door() is None):
                raise
            model = await self.models.entry(p, name[: -len(suffix)])
            if not S.S_ISDIR(model["mode"]):
                raise FsError(errno.ENOENT) from None
            return await self.getattr((stream_ino if suffix == SUFFIX else door_ino)(rank, model["ino"]))
        if name.endswith(SUFFIX) and models.model_of(attr) is None and S.S_ISREG(attr["mode"]):
            attr = await self.models.first_use(attr, name) or attr  # a plain *.safetensors trained: a model now, if it maps
        m = models.model_of(attr)
        if m is not None:  # a model file: its step streams are its tensor directory's
            return await self.getattr(stream_ino(rank, m["dir"]))
        return work_stat(attr, work_ino(rank, attr["ino"]))

    async def readdir(self, ino: int) -> list[tuple[str, dict]]:
        if ino == WORKERS_DIR:
            return []
        if not ino & WORK:
            raise FsError(errno.ENOTDIR)
        rank, i = split_work(ino)
        return [(n, work_stat(a, work_ino(rank, a["ino"]))) for n, a in await self.models.listed(i)]

    async def open(self, ino: int, flags: int, uid: int):
        if ino == WORKERS_DIR:
            raise FsError(errno.EISDIR)
        if ino & WORK:
            return await self._tensor(ino, flags)
        if ino & DOOR:
            if writes(flags):
                raise FsError(errno.EPERM, "a door ticket is only read")
            return BytesHandle(ino, self.door().ticket(*split_door(ino), uid), direct=True)
        rank, model = split_stream(ino)
        if writes(flags):
            push = PushStreamHandle(ino, self.streams, rank, model)
            await push.prepare()
            return push
        pull = PullStreamHandle(ino, self.streams, rank, model)
        try:
            await pull.pull()
        except BaseException:
            pull.close()
            raise
        return pull

    async def _tensor(self, ino: int, flags: int):
        """A tensor's push file (written) or its parameters as the rank may see them (read)."""
        rank, i = split_work(ino)
        if writes(flags):
            await self.client.training.train_info(i, rank)  # EINVAL now if it cannot take pushes
            return PushHandle(i, client=self.client, rank=rank)
        info = await self.client.training.train_info(i, rank)
        t = info["tensor"]
        out = np.empty(t["shape"], t["dtype"])
        header = await self.client.read(i, 0, t["offset"], info["attr"])
        await self.client.training.pull_into(i, rank, out)
        return BytesHandle(i, header + out.tobytes(), direct=True)

    async def setattr(self, ino: int, changes: dict) -> dict:
        if ino == WORKERS_DIR:
            raise FsError(errno.EPERM)
        if ino & DOOR:
            raise FsError(errno.EPERM, "a door ticket is only read")
        if set(changes) - {"size", "atime_ns", "mtime_ns"}:
            raise FsError(errno.EPERM, "a push file only takes gradients" if ino & WORK else "a step stream only takes gradients")
        if ino & STREAM:
            return await self.getattr(ino)  # O_TRUNC before a push: nothing to truncate
        # O_TRUNC before a push (np.save): nothing to truncate; answered from the cache
        rank, i = split_work(ino)
        return work_stat((await self.client.training.train_info(i, rank))["attr"], ino)

    async def fsyncdir(self, ino: int) -> None:
        """Until every push this mount made for the rank is applied."""
        rank, _ = split_work(ino)
        for tensor in self.client.training.pushed_tensors(rank):
            await self.client.training.wait_applied(tensor, rank)

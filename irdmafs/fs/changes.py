"""Changes to the live tree's names: what may be made, removed or renamed where (a snapshot's
names: EROFS; the mount's hidden entries, a model file's tensor directory and the names the
mount keeps for itself, inodes.RESERVED: EPERM), and mkdir, symlink, mknod, link, readlink,
rmdir, unlink and rename.

Owns POSIX's unlink of a file open here: it stays usable until its last close (as NFS does, the
mount renames it out of sight and unlinks it then: ``unlink``, ``closed``), one remover only.
A removal or rename that frees a model file frees its tensors (models.py).
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Callable

from ..errors import FsError, RemoteError
from ..names import ROOT
from . import models
from .handles import FileHandle
from .inodes import HIDDEN, RESERVED, SNAP, SUFFIX, UNLINKED, is_cluster, namespace_ino
from .openfiles import OpenFiles

if TYPE_CHECKING:
    from ..client.client import Client
    from .streams import Layouts

log = logging.getLogger(__name__)


class NameChanges:
    def __init__(self, client: "Client", files: OpenFiles, models_: models.ModelFiles, layouts: "Layouts", stat: Callable[[dict], dict]) -> None:
        self.client = client
        self.files = files  # what the mount knows of each file it has open
        self.models = models_  # model files: tensor directories, kept names
        self.layouts = layouts  # the step streams' model layouts (forgotten when tensors move)
        self.stat = stat  # the attributes the live tree answers (LiveFiles.stat)

    def check_create(self, parent: int, name: str) -> None:
        if parent & SNAP:
            raise FsError(errno.EROFS)
        if parent == ROOT and name in HIDDEN:
            raise FsError(errno.EEXIST, f"{name} is reserved")
        if RESERVED.fullmatch(name):
            raise FsError(errno.EPERM, f"{name} is a name the mount keeps for itself")
        self.check_changeable(parent, name)

    def check_changeable(self, parent: int, name: str) -> None:
        """Names in ``parent`` may be made, removed or renamed here (EROFS, EPERM if not)."""
        if parent & SNAP:
            raise FsError(errno.EROFS)
        if parent == ROOT and name in HIDDEN or not is_cluster(parent):
            raise FsError(errno.EPERM)
        if parent in self.models.tensor_dirs:
            raise FsError(errno.EPERM, "a model file's tensor directory holds its tensors only: change the file")
        if RESERVED.fullmatch(name):
            raise FsError(errno.EPERM, f"{name} is the mount's own: change the file it belongs to")

    async def mkdir(self, parent: int, name: str, mode: int, uid: int, gid: int) -> dict:
        self.check_create(parent, name)
        return self.stat(await self.client.mkdir(parent, name, mode, uid, gid))

    async def symlink(self, parent: int, name: str, target: str, uid: int, gid: int) -> dict:
        self.check_create(parent, name)
        return self.stat(await self.client.symlink(parent, name, target, uid, gid))

    async def mknod(self, parent: int, name: str, mode: int, rdev: int, uid: int, gid: int) -> dict:
        """A FIFO, socket or device node: only a name here; the kernel does its I/O."""
        self.check_create(parent, name)
        return self.stat(await self.client.mknod(parent, name, mode, rdev, uid, gid))

    async def link(self, ino: int, new_parent: int, new_name: str) -> dict:
        self.check_create(new_parent, new_name)
        if ino & SNAP:
            raise FsError(errno.EXDEV, "a snapshot's file cannot have a name in the live tree")
        if not is_cluster(ino):
            raise FsError(errno.EPERM)
        return self.stat(await self.client.link(ino, new_parent, new_name))

    async def readlink(self, ino: int) -> str:
        return await self.client.readlink(*namespace_ino(ino, errno.EINVAL))

    async def rmdir(self, parent: int, name: str) -> None:
        self.check_changeable(parent, name)
        await self.client.rmdir(parent, name)

    async def unlink(self, parent: int, name: str) -> None:
        self.check_changeable(parent, name)
        if self.files.files and await self._hidden_while_open(parent, name):
            return
        try:
            gone = await self.client.unlink(parent, name)
        except RemoteError as exc:
            if exc.code == "ENOENT" and name.endswith(SUFFIX):
                raise FsError(errno.EPERM, "remove the model directory, not its view") from None
            raise
        await self.models.forget(gone.get("model"), gone.get("freed"))  # the tensors of a model file it freed

    async def _hidden_while_open(self, parent: int, name: str) -> bool:
        """POSIX: a file unlinked while open stays usable until its last close. As NFS does,
        the last name of a file open here is renamed out of sight instead (and unlinked at
        that last close); True if it was."""
        try:
            found = await self.client.lookup(parent, name)
        except RemoteError:
            return False
        f = self.files.get(found["ino"])
        if not f or found["nlink"] > 1:  # with other names left, the file lives on anyway
            return False
        hidden = f"{UNLINKED}{found['ino']}"
        await self.client.rename(parent, name, parent, hidden)
        # One remover only. A last close while the rename was on its way found no hidden name
        # to remove (``unlinked`` is set only now) and left it here; the file's opener now
        # (that one, or one who opened it again meanwhile) removes it at its last close. Set
        # before the rename, both removed it: the closer first, then this unlink, answered
        # ENOENT to the user (chaos soak, seed 3, a write's RELEASE racing the next unlink).
        now = self.files.get(found["ino"])
        if now is not None:
            now.unlinked = (parent, hidden)
            return True
        gone = await self.client.unlink(parent, hidden)
        await self.models.forget(gone.get("model"), gone.get("freed"))  # the tensors of a model file it freed
        return True

    async def rename(self, parent: int, name: str, new_parent: int, new_name: str, flags: int) -> None:
        for p, n in ((parent, name), (new_parent, new_name)):
            self.check_changeable(p, n)
        if RESERVED.fullmatch(new_name):
            raise FsError(errno.EPERM, f"{new_name} is a name the mount keeps for itself")
        if flags & 2:  # RENAME_EXCHANGE
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        if flags & 1:  # RENAME_NOREPLACE
            try:
                await self.client.lookup(new_parent, new_name)
                raise FsError(errno.EEXIST)
            except RemoteError as exc:
                if exc.code != "ENOENT":
                    raise
        r = await self.client.rename(parent, name, new_parent, new_name)
        await self.models.forget(r.get("model"), r.get("freed"))  # the tensors of a model file it freed
        for h in self.files.handles(r.get("ino")):
            h.name = new_name  # its flush looks at what the file is under the name it has then
        # a model file's tensor directory moves along; a file newly named *.safetensors (rsync
        # and safetensors write a temporary name) stays plain bytes until it is wanted as a
        # model (models.py), but the step layouts by name are stale
        if r.get("ino") and (new_parent != parent or new_name.endswith(SUFFIX)):
            if new_parent != parent:
                await self.models.after_rename(r["ino"], new_parent, new_name)
            self.layouts.forget()

    async def closed(self, h: FileHandle) -> None:
        """``h`` was released: at the last close of a file unlinked while open, it goes."""
        last = self.files.close(h) if not h.snap else None
        if last is None or not last.unlinked:
            return
        parent, hidden = last.unlinked
        try:
            gone = await self.client.unlink(parent, hidden)
            await self.models.forget(gone.get("model"), gone.get("freed"))  # the tensors of a model file it freed
        except RemoteError as exc:
            log.warning("unlinked file %d not removed at its last close: %s", h.ino, exc)

"""The live tree: the namespace's files and directories as they are now.

- a file is striped bytes; a file whose content is a valid ``.npy`` is a tensor (recorded when a
  handle that wrote it is flushed: dtype, shape, data offset; a malformed one stays plain bytes
  with a log line); a ``*.safetensors`` that maps is a model file (models.py);
- ``X/`` (no real ``X``) is a model file's tensor directory, and ``X.safetensors`` (no real
  file) the view of a directory ``X`` of tensors (views.py); neither is listed, nor are the
  names the mount keeps for itself (inodes.RESERVED);
- POSIX: a file unlinked while open stays usable until its last close (as NFS does, the mount
  renames it out of sight and unlinks it then);
- user xattrs: listed are those a copy may set back as they are (policies, checked when set
  with the parsers the training path reads them with; a view's metadata; a user's own); the
  derived ones of a tensor (dtype, shape, version) and the mount's own are read by name only
  (``check_xattr``, ``listed_xattrs``).

Also the xattrs and links of a snapshot's inodes (read-only: EROFS to changes).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat as S
from typing import TYPE_CHECKING, Any

from .. import formats
from ..names import ROOT
from ..packing import in_force
from ..policy import POLICIES, check as check_policy
from ..errors import PolicyError
from ..errors import RemoteError
from . import models
from ..errors import FsError
from .handles import BATCH_XATTR, FileHandle
from .inodes import DERIVED_XATTRS, HIDDEN, HIDDEN_PREFIX, RESERVED, SNAP, SUFFIX, UNLINKED, Family, is_cluster, namespace_ino, stat_of, write_only, writes
from .namelease import NameCaches
from .openfiles import OpenFiles
from .pagecache import PageCache
from .views import META_XATTR, Views

if TYPE_CHECKING:
    from ..client.client import Client
    from .streams import Layouts

log = logging.getLogger(__name__)


class LiveFiles(Family):
    def __init__(self, client: "Client", files: OpenFiles, models_: models.ModelFiles, layouts: "Layouts", views: "Views", caches: NameCaches) -> None:
        self.client = client
        self.lookups = caches.lookups  # what the last lookups fetched, for the opens that follow
        self.names = caches.lease  # how long the kernel may cache names and attributes (namelease.py)
        self.listings = caches.listings  # whole directories kept while the lease holds (listings.py)
        self.pages = PageCache(client)  # which files' cached pages an open keeps
        self.files = files  # what the mount knows of each file it has open
        self.models = models_  # model files: conversions, tensor directories, kept names
        self.layouts = layouts  # the step streams' model layouts (forgotten when tensors change)
        self.views = views  # X.safetensors beside a directory X of tensors

    def owns(self, ino: int) -> bool:
        return is_cluster(ino)

    def stat(self, attr: dict) -> dict:
        return stat_of(attr, self.files.get(attr["ino"]))

    async def getattr(self, ino: int) -> dict:
        # The kernel asks before a read once its copy is older than FILE_ATTR_SECONDS (libfuse
        # turns auto_inval_data on); while this mount has the file open, what the open fetched
        # answers (close-to-open, as NFS does)
        f = self.files.get(ino)
        if f:
            return self.stat(f.attr)
        leased = self.names.begin()
        attr = (self.names.holds() and self.listings.attr(ino)) or await self.client.getattr(ino)
        return self.names.attrs(self.stat(attr), leased) if self._cacheable(ino, "", attr) else self.stat(attr)

    async def lookup(self, parent: int, name: str) -> dict:
        try:
            begun, leased = self.lookups.begin(), self.names.begin()
            attr = self.names.holds() and self.listings.entry(parent, name)
            if not attr:
                attr = await self.models.entry(parent, name)
                if S.S_ISREG(attr["mode"]):  # (a listed one's open asks: listings serve stat only)
                    self.lookups.note(("attr", attr["ino"]), attr, begun)
                if self.names.holds() and self._cacheable(parent, name, attr) and self.listings.asked(parent):
                    await self._list(parent)
            st = self.stat(attr)
            return self.names.entry(st, parent, name, leased) if self._cacheable(parent, name, attr) else st
        except RemoteError as exc:
            if exc.code != "ENOENT" or not name.endswith(SUFFIX) or len(name) == len(SUFFIX):
                raise
        return await self.views.beside(parent, name)

    async def readdir(self, ino: int) -> list[tuple[str, dict]]:
        leased, listing = self.names.begin(), self.listings.begin()
        listed = await self.models.listed(ino)
        if self.names.holds() and ino not in self.models.tensor_dirs:
            self.listings.keep(ino, listed, listing)
        return [(name, self.stat(attr) | ({"offer": (ino, name, leased)} if self._cacheable(ino, name, attr) else {})) for name, attr in listed]

    async def _list(self, parent: int) -> None:
        """List ``parent`` whole (its next lookups answer from the listing: listings.py)."""
        begun = self.listings.begin()
        self.listings.keep(parent, await self.models.listed(parent), begun)

    def _cacheable(self, parent: int, name: str, attr: dict) -> bool:
        """Whether the kernel may cache this entry and its attributes under the lease: a plain
        name of the namespace (not a model file's tensor directory or its alias, nor a name the
        mount keeps) of an inode not open here (its size is this mount's own then)."""
        return not (
            "alias_of" in attr
            or name.startswith(HIDDEN_PREFIX)
            or parent in self.models.tensor_dirs
            or attr["ino"] in self.models.tensor_dirs
            or self.files.get(attr["ino"]) is not None
        )

    # -- files ---------------------------------------------------------------------------------
    async def open(self, ino: int, flags: int, uid: int) -> FileHandle:
        # close-to-open: the attributes as the primary has them now; a listing kept under the
        # lease is that (another mount's change drops it before it returns; this mount's own
        # drop every listing), for a read: a write asks (what it unpacks or truncates)
        listed = not writes(flags) and self.names.holds() and self.listings.attr(ino)
        attr = self.lookups.take(("attr", ino)) or listed or await self.client.getattr(ino)
        if S.S_ISDIR(attr["mode"]):
            raise FsError(errno.EISDIR)
        if flags & os.O_TRUNC and writes(flags) and attr["size"]:
            # libfuse asks for atomic O_TRUNC: the kernel sends no setattr, the open truncates
            attr = await self.resize(ino, {"size": 0})
        elif writes(flags):  # written in place: a packed tensor's bytes are its own first
            attr = await self.alone(ino, attr)
        if writes(flags):
            self.pages.forget(ino)
            alone = self.files.get(ino) is None  # no other open of it here (handles.py, write_only)
            return self.file_handle(ino, attr, 0, write_only=alone and write_only(flags, attr["mode"]))
        return self.file_handle(ino, attr, 0, pages_current=await self.pages.keep(ino, attr))

    async def create(self, parent: int, name: str, mode: int, flags: int, uid: int, gid: int) -> tuple[FileHandle, dict]:
        self.check_create(parent, name)
        attr = await self.client.create(parent, name, mode, uid, gid)
        return self.file_handle(attr["ino"], attr, 0, name, write_only=write_only(flags, attr["mode"])), self.stat(attr)

    def file_handle(self, ino: int, attr: dict, snap: int, name: str = "", pages_current: bool = False, write_only: bool = False) -> FileHandle:
        """A handle of a cluster file, referring to what the mount knows of it (openfiles.py);
        the attributes fetched by this open are the file's from now on (close-to-open).
        ``pages_current``: the kernel's cached pages of it are its bytes now (pagecache.py);
        ``write_only``: opened for writing only (its writes go around the page cache)."""
        f = self.files.open(ino, attr, snap)
        f.update(attr)
        slots = self.files.write_slots
        h = FileHandle(ino, file=f, client=self.client, models=self.models, slots=slots, snap=snap, size=attr["size"], name=name)
        h.pages_current, h.write_only = pages_current, write_only
        h.on_flushed, h.on_changed = self.detect, self.changed
        if not snap:
            f.handles.add(h)
        return h

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

    async def setattr(self, ino: int, changes: dict[str, Any]) -> dict:
        return self.stat(await self.resize(ino, changes))

    async def resize(self, ino: int, changes: dict[str, Any]) -> dict:
        """Change a cluster file's attributes; a new size waits for this mount's writes to it
        and zeroes what lies past it (under the file's model lock: no conversion meanwhile).
        Returns the node's attributes."""
        if "size" not in changes:
            return await self._set(ino, changes)
        async with self.models.locked(ino):
            attr = await self._plain_if_resized(ino, changes)
            if changes["size"] > ((attr.get("tensor") or {}).get("offset") or 0):  # a packed tensor's data is kept
                await self.alone(ino, attr)
            return await self._set(ino, changes)

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

    async def _set(self, ino: int, changes: dict[str, Any]) -> dict:
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
        attr = await self.client.setattr(ino, written=written, **changes)
        if f:
            f.update(attr)  # open files answer getattr: keep them current
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

    # -- what a written file holds -------------------------------------------------------------
    async def detect(self, handle: FileHandle) -> None:
        """What a file just written holds: a tensor (.npy), a model (models.py, unless another
        handle of this mount writes it: the last writer's flush decides) or plain bytes."""
        prefix = await self.detect_tensor(handle.ino, handle.attr, handle.name)
        if prefix is None or (handle.name and not handle.name.endswith(SUFFIX)):
            return
        async with self.models.locked(handle.ino):
            # a handle writing now converts at its own flush (a later write to a model file
            # brings its bytes back first, under this lock)
            if handle.dirty or any(h.dirty for h in self.files.handles(handle.ino)):
                return
            await handle.file.drain()
            attr = await self.client.getattr(handle.ino)  # as it is now (another flush may have converted it)
            if attr["version"] == handle.attr["version"]:
                new = await self.models.convert(attr, handle.name or None, prefix)
                if new is not None:
                    self.changed(handle.ino, new)

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

    # -- directories -----------------------------------------------------------------------------
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
        # a model file's tensor directory moves along; a file named *.safetensors (rsync and
        # safetensors write a temporary name) may become a model, unless open here: then the
        # last writer's flush decides (safetensors renames before it closes)
        if r.get("ino") and (new_parent != parent or new_name.endswith(SUFFIX)):
            await self.models.after_rename(r["ino"], new_parent, new_name, may_convert=not self.files.handles(r["ino"]))
            self.layouts.forget()

    # -- extended attributes ---------------------------------------------------------------------
    async def getxattr(self, ino: int, name: str) -> bytes:
        if not name.startswith("user."):
            # none is ever kept (setxattr refuses them). The kernel asks for security.capability
            # before every write(2) of a file: answered here, not with a metadata call each.
            raise FsError(errno.ENODATA)
        attr = await self.client.getattr(*namespace_ino(ino, errno.ENODATA))
        tensor = attr.get("tensor")
        if name == "user.irdma.version":
            return str(attr["version"]).encode()
        if name == "user.irdma.dtype" and tensor:
            return tensor["dtype"].encode()
        if name == "user.irdma.shape" and tensor:
            return json.dumps(tensor["shape"]).encode()
        if name not in attr["xattrs"]:  # the rest is the mount's
            raise FsError(errno.ENODATA)
        return attr["xattrs"][name].encode("utf-8", "surrogateescape")

    async def listxattr(self, ino: int) -> list[str]:
        if not (is_cluster(ino) or ino & SNAP):
            return []  # the mount's own entries keep none
        return listed_xattrs(await self.client.getattr(*namespace_ino(ino, errno.ENODATA)))

    async def setxattr(self, ino: int, name: str, value: bytes | None) -> None:
        """Set ``name`` (``value`` None: remove it, a policy back to its default); what may be
        set and the check of its value: ``check_xattr``."""
        if ino & SNAP:
            raise FsError(errno.EROFS)
        if not is_cluster(ino):
            raise FsError(errno.EPERM)
        if not name.startswith("user."):
            raise FsError(errno.ENOTSUP, "only user.* attributes are kept")
        if value is not None and len(value) > 65536:
            raise FsError(errno.E2BIG)
        text = None if value is None else value.decode("utf-8", "surrogateescape")
        check_xattr(ino, name, text)
        if name.startswith("user.irdma."):  # a packed tensor's policy is its bucket's (B6)
            await self.alone(ino, await self.client.getattr(ino))
        await self.client.setxattr(ino, name, text)
        if name.startswith("user.irdma."):
            await self._mirror_policy(ino, name, text)
            self.client.training.forget_training()  # a policy may have changed

    async def _mirror_policy(self, ino: int, name: str, text: str | None) -> None:
        """A model file's policy is its tensors': mirrored on their directory."""
        m = models.model_of(await self.client.getattr(ino))
        if m is None:
            return
        try:
            await self.client.setxattr(m["dir"], name, text)
        except RemoteError as exc:
            if exc.code != "ENODATA":
                raise


# -- which user.irdma.* attributes a file shows and takes ------------------------------------------
# Tools copy what listxattr lists and set it on the copy (cp -a, rsync -X, tar --xattrs), and
# rsync -X removes from its copy what the source does not list. So only what may be set back as
# it is is listed: the policies (policy.POLICIES) and a view's metadata, each checked when set
# with the parser that reads it later, and any user.* name outside user.irdma.*. The derived
# attributes (DERIVED_XATTRS) and the mount's own (a rank's batch size) are read by name and never
# listed, as CephFS's virtual ceph.* attributes: listed, every copy out stamped them on every
# file, every copy in was refused them (EPERM) and so never came out the same.
IRDMA_PREFIX = "user.irdma."
KEPT_XATTRS = frozenset(POLICIES) | {META_XATTR}


def listed_xattrs(attr: dict) -> list[str]:
    """The attributes listxattr shows of a namespace inode (none but of files and directories:
    the kernel refuses user.* attributes of the other kinds)."""
    if not (S.S_ISREG(attr["mode"]) or S.S_ISDIR(attr["mode"])):
        return []
    return sorted(k for k in attr["xattrs"] if k.startswith("user.") and (not k.startswith(IRDMA_PREFIX) or k in KEPT_XATTRS))


def check_xattr(ino: int, name: str, text: str | None) -> None:
    """Whether user attribute ``name`` of inode ``ino`` may be set to ``text`` (None: removed):
    FsError EPERM for a derived attribute or the mount's own, EINVAL for a value its parser
    refuses, ENOTSUP for a user.irdma.* name that is none of the mount's (a misspelt policy is
    refused, not ignored for ever). A refusal of a name or value is logged, saying why."""
    if name in DERIVED_XATTRS:
        raise FsError(errno.EPERM, f"{name} is derived from the file")
    if name.startswith(BATCH_XATTR):
        raise FsError(errno.EPERM, f"{name} is the mount's: written through .irdma/workers/<rank>/batch_size")
    if text is None or not name.startswith(IRDMA_PREFIX):
        return  # removed (a policy is back to its default), or a user's own attribute
    if name not in KEPT_XATTRS:
        log.warning("setxattr %s on inode %d refused: no such attribute (the policies: %s)", name, ino, ", ".join(sorted(POLICIES)))
        raise FsError(errno.ENOTSUP, f"{name} is no attribute of the mount's")
    try:
        if name == META_XATTR:
            formats.st_metadata(json.loads(text))
        else:
            check_policy(name, text)
    except (PolicyError, ValueError, RecursionError) as exc:  # (json's and safetensors' errors are ValueErrors)
        log.warning("setxattr %s=%r on inode %d refused: %s", name, text, ino, exc)
        raise FsError(errno.EINVAL, f"{name}: {exc}") from None

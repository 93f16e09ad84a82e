"""The live tree's extended attributes (user.* only; a snapshot's are read-only: EROFS).

Owns what getxattr, listxattr and setxattr answer of a namespace inode: listed are those a copy
may set back as they are (policies, checked when set with the parsers the training path reads
them with; a view's metadata; a user's own); the derived ones of a tensor (dtype, shape,
version) and the mount's own are read by name only (``check_xattr``, ``listed_xattrs``). A
model file's policy is mirrored on its tensors' directory; a packed tensor is unpacked before it
takes a policy of its own (FileContents.alone, contents.py).
"""

from __future__ import annotations

import errno
import json
import logging
import stat as S
from typing import TYPE_CHECKING, Awaitable, Callable

from .. import formats
from ..errors import FsError, PolicyError, RemoteError
from ..policy import POLICIES, check as check_policy
from . import models
from .handles import BATCH_XATTR
from .inodes import DERIVED_XATTRS, SNAP, is_cluster, namespace_ino
from .views import META_XATTR

if TYPE_CHECKING:
    from ..client.client import Client

log = logging.getLogger(__name__)


class LiveXattrs:
    def __init__(self, client: "Client", alone: Callable[[int, dict], Awaitable[dict]]) -> None:
        self.client = client
        self.alone = alone  # a packed tensor's bucket unpacked first (FileContents.alone)

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

"""What the namespace's two sides agree on: the node that keeps it (server/meta.py) and the
client and file system that walk it.

Pure: constants only.
"""

from __future__ import annotations

ROOT = 1  # inode of the root directory
NAME_MAX = 255  # bytes in one name (encoded as the file system encodes it)
PATH_MAX = 4096  # bytes in a path, and so in a symbolic link's target (with its terminating NUL)
# the internal xattr of a safetensors file that is a model (fs/models.py): {"dir": ino, "start": n}
MODEL_XATTR = "irdmafs.model"
MODEL_SUFFIX = ".safetensors"  # a model file's name ends so; X.safetensors's tensors are in X
# Buckets (docs/buckets.md): a model directory's small float tensors packed into one hidden
# regular file, ``.irdmafs-bucket-<n>``, trained, pushed and pulled as one tensor. A packed
# tensor's namespace record points into it: ``tensor["bucket"] = {"fid", "at", "size", "unit"}``
# (with ``"until"``, in ns, while a pack is under way and not yet in force).
BUCKET_NAME = ".irdmafs-bucket-"  # + a random number (client/buckets.py): a name no pack reuses
BUCKET_UNIT = 256 << 10  # a bucket's least stripe unit (client/buckets.py bucket_unit: two stripes a node)
PACK_MAX_BYTES = 256 << 10  # a tensor's data of at most this many bytes may be packed
PACK_MIN_TENSORS = 16  # fewer packable tensors in a directory: not worth a bucket
BUCKET_MAX_BYTES = 64 << 20  # a bucket's data at most (more small tensors: several buckets, as DDP's 25 MB ones)
PACK_LEASE_NS = 30 * 10**9  # a pack under way holds its tensors' pushes at most this long
# The error of a push or a write made against a layout that is no longer the namespace's (a
# tensor packed or unpacked since): the user's ESTALE, under a name of its own because the
# client takes ESTALE for a newer view and asks again
LAYOUT_CHANGED = "EREMCHG"

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

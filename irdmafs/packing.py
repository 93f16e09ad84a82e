"""What a tensor's namespace record says about buckets (docs/buckets.md), read alike by the
namespace (server/buckets.py), the nodes' training and the clients (client/buckets.py).

A packed tensor's record points into its bucket: ``tensor["bucket"] = {"fid", "at", "size",
"unit"}``, with ``"until"`` (ns) while a pack is under way and not in force; a bucket's record is
a headerless 1-D tensor with the list of its ``"members"``.

Pure: no I/O.
"""

from __future__ import annotations

import stat as S

import numpy as np

from .names import PACK_MAX_BYTES


def pointer(node: dict | None) -> dict | None:
    """The bucket pointer of a tensor's inode record (in force or under way), or None."""
    t = (node or {}).get("tensor")
    return t.get("bucket") if isinstance(t, dict) else None


def in_force(node: dict | None) -> dict | None:
    """The pointer of a packed tensor (its data lives in the bucket), or None."""
    p = pointer(node)
    return p if p is not None and "until" not in p else None


def is_bucket(node: dict | None) -> bool:
    t = (node or {}).get("tensor")
    return isinstance(t, dict) and "members" in t


def packable(node: dict) -> bool:
    """A tensor whose data may live in a bucket: a float tensor of one name, a whole .npy of at
    most PACK_MAX_BYTES of data, with no ``user.irdma.*`` attribute of its own (B6)."""
    t = node.get("tensor")
    if not isinstance(t, dict) or in_force(node) or is_bucket(node) or not S.S_ISREG(node["mode"]) or node["nlink"] != 1 or t.get("fortran"):
        return False
    try:
        dtype = np.dtype(t["dtype"])
    except TypeError:
        return False
    nbytes = int(np.prod(t["shape"], dtype=np.int64)) * dtype.itemsize
    own = any(k.startswith("user.irdma.") for k in node["xattrs"])
    return dtype.kind == "f" and 0 < nbytes <= PACK_MAX_BYTES and node["size"] == t["offset"] + nbytes and not own


def nbytes(t: dict) -> int:
    return int(np.prod(t["shape"], dtype=np.int64)) * np.dtype(t["dtype"]).itemsize

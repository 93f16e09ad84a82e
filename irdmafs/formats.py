"""The ``.npy`` format: encode a header for an array, parse one from a file's first bytes.

Pure and I/O-free; used by the client's array API and by the file system, which treats a file
whose content starts with a valid header as a tensor.
"""

from __future__ import annotations

import ast
import io
from typing import NamedTuple

import numpy as np
import numpy.lib.format as npf

MAGIC = b"\x93NUMPY"
PREFIX = 4096  # enough bytes to hold any header this code writes; longer ones are read in full


class NpyError(ValueError):
    """Not a valid .npy header."""


class NpyHeader(NamedTuple):
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool
    data_offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def tensor_info(h: NpyHeader) -> dict:
    """What the namespace records about a tensor file (JSON-friendly)."""
    return {"dtype": h.dtype.str, "shape": list(h.shape), "offset": h.data_offset, "fortran": h.fortran}


def encode_header(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    npf.write_array_header_1_0(buf, npf.header_data_from_array_1_0(np.require(arr, requirements="C")))
    return buf.getvalue()


def header_length(prefix: bytes) -> int:
    """Total header size (magic included) from the first 12 bytes; NpyError if not .npy."""
    if len(prefix) < 10 or prefix[:6] != MAGIC:
        raise NpyError("no .npy magic")
    major = prefix[6]
    if major == 1:
        return 10 + int.from_bytes(prefix[8:10], "little")
    if major in (2, 3) and len(prefix) >= 12:
        return 12 + int.from_bytes(prefix[8:12], "little")
    raise NpyError(f"unsupported .npy version {major}")


def parse_header(data: bytes) -> NpyHeader:
    """Parse the header at the start of ``data`` (which must hold all of it)."""
    total = header_length(data[:12])
    if len(data) < total:
        raise NpyError("truncated .npy header")
    text = data[12 if data[6] > 1 else 10 : total].decode("latin1" if data[6] < 3 else "utf8")
    try:
        d = ast.literal_eval(text)
        dtype = npf.descr_to_dtype(d["descr"])
        shape = tuple(int(x) for x in d["shape"])
        fortran = bool(d["fortran_order"])
    except Exception as exc:
        raise NpyError(f"malformed .npy header: {exc}") from None
    if dtype.hasobject:
        raise NpyError("object arrays are not tensors")
    if any(x < 0 for x in shape):
        raise NpyError("negative dimension")
    return NpyHeader(dtype, shape, fortran, total)

"""File formats, pure and I/O-free: ``.npy`` headers and the safetensors layout.

Used by the client's array API and by the file system, which treats a file whose content starts
with a valid ``.npy`` header as a tensor, and which serves and accepts a whole model as one
safetensors stream.
"""

from __future__ import annotations

import ast
import io
import json
import threading
from typing import NamedTuple

import numpy as np
import numpy.lib.format as npf

from .errors import NpyError, SafetensorsError  # noqa: F401 (the same classes)

MAGIC = b"\x93NUMPY"
PREFIX = 4096  # enough bytes to hold any header this code writes; longer ones are read in full


_AST = threading.Lock()
_LITERAL_EVAL = ast.literal_eval


def literal_eval(text: str):
    """``ast.literal_eval``, one thread at a time. CPython 3.11 counts the AST constructor's
    recursion depth in state shared by the interpreter's threads, so two threads building trees
    at once can fail with SystemError "AST constructor recursion depth mismatch"
    (python/cpython#106905; seen in a soak whose threads ran ``np.load`` side by side)."""
    with _AST:
        return _LITERAL_EVAL(text)


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


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The .npy header of a C-ordered array of ``dtype`` and ``shape`` (no array needed)."""
    buf = io.BytesIO()
    npf.write_array_header_1_0(buf, {"descr": npf.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)})
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
        d = literal_eval(text)
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


# --- safetensors ---------------------------------------------------------------------------------
# <u64 little-endian N><N bytes of JSON header, space-padded to 8><data>. The header maps each
# tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into data) and may
# hold "__metadata__": {str: str}.

ST_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "|i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "|u1", "BOOL": "|b1",
}
NP_TO_ST = {np.dtype(v).str: k for k, v in ST_DTYPES.items()}
MAX_ST_HEADER = 100 << 20


class StEntry(NamedTuple):
    name: str
    dtype: str  # numpy dtype string
    shape: tuple[int, ...]
    begin: int  # offset in the data section
    end: int


def st_dtype(numpy_dtype: str) -> str | None:
    """The safetensors dtype name of a numpy dtype string, or None if it has none."""
    return NP_TO_ST.get(np.dtype(numpy_dtype).str)  # big-endian tensors have none


def st_layout(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> tuple[bytes, list[StEntry]]:
    """(header bytes including the length prefix, entries with their data offsets) for tensors
    given as (name, numpy dtype string, shape), laid out in the given order."""
    doc: dict = {}
    if metadata:
        doc["__metadata__"] = metadata
    entries, pos = [], 0
    for name, dtype, shape in tensors:
        st = st_dtype(dtype)
        if st is None:
            raise SafetensorsError(f"{name}: dtype {dtype} has no safetensors equivalent")
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        entries.append(StEntry(name, dtype, tuple(shape), pos, pos + n))
        doc[name] = {"dtype": st, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, entries


def st_path_problem(name: str) -> str | None:
    """Why tensor ``name`` cannot be a path of ``.npy`` files (a ``/`` is a directory), or None."""
    try:
        if not any(p in ("", ".", "..") or "\0" in p or len((p + ".npy").encode(errors="surrogateescape")) > 255 for p in name.split("/")):
            return None
    except UnicodeEncodeError:  # a lone surrogate from the JSON: no file name holds it
        pass
    return f"tensor name {name!r} cannot be a path"


def _unique(pairs: list) -> dict:
    """A JSON object whose keys are distinct (a tensor named twice is ambiguous: refused)."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise SafetensorsError(f"{twice!r} named twice in the header")
    return doc


def st_metadata(metadata: object) -> dict[str, str]:
    """A header's ``__metadata__`` (also kept in a model directory's xattr, fs/views.py), or
    SafetensorsError: it maps strings to strings."""
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsError("__metadata__ must map strings to strings")
    return metadata


def st_parse(head: bytes, total: int) -> tuple[int, list[StEntry], dict[str, str]]:
    """Validate a safetensors header against a file of ``total`` bytes; returns (offset of the
    data section, entries, metadata). ``head`` must hold at least the whole header."""
    if total < 8 or len(head) < 8:
        raise SafetensorsError("shorter than the 8-byte header length")
    n = int.from_bytes(head[:8], "little")
    if n > MAX_ST_HEADER or 8 + n > total:
        raise SafetensorsError(f"header length {n} does not fit a file of {total} bytes")
    if len(head) < 8 + n:
        raise SafetensorsError("header incomplete")
    try:
        doc = json.loads(head[8 : 8 + n], object_pairs_hook=_unique)
    except SafetensorsError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise SafetensorsError(f"header is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise SafetensorsError("header is not a JSON object")
    metadata = st_metadata(doc.pop("__metadata__", None) or {})
    data_len = total - 8 - n
    entries = []
    for name, t in doc.items():
        try:
            dtype = ST_DTYPES[t["dtype"]]
            shape = tuple(int(x) for x in t["shape"])
            begin, end = (int(x) for x in t["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"tensor {name!r}: needs a known dtype, a shape and data_offsets") from None
        if any(x < 0 for x in shape) or not 0 <= begin <= end <= data_len:
            raise SafetensorsError(f"tensor {name!r}: offsets {begin}..{end} outside {data_len} data bytes")
        if end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
            raise SafetensorsError(f"tensor {name!r}: {end - begin} bytes do not hold {t['dtype']}{list(shape)}")
        entries.append(StEntry(name, dtype, shape, begin, end))
    return 8 + n, entries, metadata

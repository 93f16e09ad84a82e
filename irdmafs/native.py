"""The PS kernels: C (native/kernels.c, built as irdmafs._native) when built, numpy otherwise.

Both give the same bits (tests/unit/test_native.py checks it): the C versions do the numpy
versions' float32 operations in the same order, one pass over memory instead of one per
operation. ``NATIVE`` says which runs; the PS logs it at start and reports it in its status.
Set IRDMAFS_NATIVE=0 to force the numpy versions.
"""

from __future__ import annotations

import os

import numpy as np

try:
    if os.environ.get("IRDMAFS_NATIVE", "1") == "0":
        raise ImportError("IRDMAFS_NATIVE=0")
    from . import _native
except ImportError as exc:  # not built (no C compiler at install time) or turned off
    _native = None
    WHY = str(exc)
else:
    WHY = "built"

NATIVE = _native is not None
F32 = np.dtype(np.float32)
QUIET = 0x00400000  # a float32 NaN's quiet bit


F16C = NATIVE and _native.f16c()  # acc_f16 converts eight halves at a time (chosen at import)


def acc_f16(acc: np.ndarray, src: np.ndarray, native: bool = NATIVE, vector: bool = True) -> None:
    """``acc += float32(src)`` for a float32 ``acc`` and a float16 ``src`` (``vector``: with
    F16C where the CPU has it; False: the C kernel's scalar conversion)."""
    if native and _native is not None and acc.dtype == F32 and acc.flags.c_contiguous and acc.flags.aligned:
        src = np.ascontiguousarray(src, np.float16)
        if not src.flags.aligned:  # a push at an odd offset of its staging slot
            src = src.copy()
        _native.acc_f16(acc, src, vector)
        return
    # Which NaN a sum of two NaNs returns, IEEE leaves open and numpy's loop answers by
    # position (its vector body keeps the first operand's, its tail the second's): both paths
    # keep the sum's own NaN, quieted (kernels.c, add_keep_nan)
    nan = np.isnan(acc)
    kept = acc[nan].view(np.uint32) | np.uint32(QUIET) if nan.any() else None
    acc += src.astype(acc.dtype)
    if kept is not None:
        acc[nan] = kept.view(acc.dtype)


def bias_corrections(beta1: float, beta2: float, t: int) -> tuple[np.float32, np.float32]:
    """Adam's 1 - b1^t and 1 - b2^t, in float32, as both kernels use them."""
    b1, b2 = np.float32(beta1), np.float32(beta2)
    return np.float32(1) - b1**t, np.float32(1) - b2**t


def can_run(param: np.ndarray, grad: np.ndarray, *state: np.ndarray) -> bool:
    """Whether the C kernels take these arrays: float32, contiguous, aligned (a gradient read
    from a staging slot may not be: rounds.py copies it), the parameters writable."""
    return NATIVE and all(a.dtype == F32 and a.flags.c_contiguous and a.flags.aligned for a in (param, grad, *state)) and param.flags.writeable


def sgd(param, grad, buf, lr: float, momentum: float, weight_decay: float, nesterov: bool, first: bool, div: int = 1) -> None:
    """SGD of ``grad / div`` (a round's sum and its count of pushes) in one pass."""
    _native.sgd(param, grad, buf, lr, momentum, weight_decay, nesterov, first, div)


def adam(param, grad, m, v, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, t: int, div: int = 1) -> None:
    """Adam of ``grad / div`` in one pass."""
    c1, c2 = bias_corrections(beta1, beta2, t)
    _native.adam(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, float(c1), float(c2), div)

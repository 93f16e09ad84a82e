"""Gradient compression for pushes (GradientFlow): fp16 on the wire, coarse-grained sparsity.

``user.irdma.compress`` on the model directory: ``none`` (default), ``fp16``, ``chunks=F``, or
``fp16,chunks=F`` (optionally ``chunk=N`` elements, default 256); ``parse`` is irdmafs/policy.py's
``parse_compress``, which the mount also checks a value with when it is set.

- fp16: gradients travel as float16; the PS accumulates them in float32 (float64 tensors too).
- chunks=F: the gradient is cut into fixed chunks of N elements; only the fraction F of chunks
  with the largest L1 norm are sent, and what was not sent stays in a local residual that is added
  to the next gradient (error feedback), so nothing is lost, only delayed.

Pure numpy; the residual lives in the pushing client, one per (tensor, rank).
"""

from __future__ import annotations

import numpy as np

# the form's parser and its types are kept where both sides and the mount read them
from ..policy import COMPRESS_FORMS as FORMS, Compression as Mode, parse_compress as parse  # noqa: F401
from ..errors import CompressError  # noqa: F401


def chunk_norms(g: np.ndarray, chunk: int) -> np.ndarray:
    """L1 norm of each chunk of ``g`` (the last may be short)."""
    n = len(g)
    full = n // chunk * chunk
    norms = np.abs(g[:full]).reshape(-1, chunk).sum(axis=1)
    if full < n:
        norms = np.append(norms, np.abs(g[full:]).sum())
    return norms


class Sparsifier:
    """Top-F chunks by L1 norm, with the rest kept as a residual for the next push."""

    def __init__(self, size: int, dtype: np.dtype):
        self.residual = np.zeros(size, dtype)

    def select(self, grad: np.ndarray, mode: Mode) -> tuple[np.ndarray, np.ndarray]:
        """(selected chunk ids in increasing order, the gradient with the residual added);
        the unsent chunks become the new residual."""
        g = grad.reshape(-1) + self.residual
        norms = chunk_norms(g, mode.chunk)
        k = max(1, int(np.ceil(mode.fraction * len(norms))))
        chosen = np.sort(np.argpartition(norms, len(norms) - k)[len(norms) - k :])
        self.residual = g.copy()
        for c in chosen:
            self.residual[c * mode.chunk : (c + 1) * mode.chunk] = 0
        return chosen, g

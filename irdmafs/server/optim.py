"""Update rules run on the PS, on the primary of each stripe: SGD, momentum, Nesterov, Adam.

Pure numpy, no I/O. ``parse`` reads the xattr form (``"sgd lr=0.1 momentum=0.9 nesterov=1
weight_decay=1e-4"``, ``"adam lr=1e-3 betas=0.9,0.999 eps=1e-8"``; it is irdmafs/policy.py's
``parse_optimizer``, which the mount also checks a value with when it is set); ``step`` updates parameters
and state in place from the averaged gradient of one round. The arithmetic is in float32 for
float32/float16 parameters and float64 for float64 ones, and it is deterministic, so every replica
that applies the same gradients holds the same bits.

State per stripe: ``buf`` (momentum) or ``m``/``v`` (Adam), plus the step count ``t`` for Adam's
bias correction; all of it lives with the stripe and is replicated with it.
"""

from __future__ import annotations

import numpy as np

from .. import native as kernels
# the form's parser and its types are kept where both sides and the mount read them
from ..policy import OPTIMIZER_FORMS as FORMS, Optimizer, parse_optimizer as parse  # noqa: F401
from ..errors import OptimError  # noqa: F401


def work_dtype(param_dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if param_dtype == np.float64 else np.dtype(np.float32)


def step(opt: Optimizer, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], t: int, *, div: int = 1, native: bool = kernels.NATIVE) -> None:
    """One update of ``param`` (in place) with gradient ``grad / div`` (a round's sum and its
    count of pushes: the average is taken in the same pass); ``state`` arrays are updated in
    place; ``t`` is the 1-based count of updates including this one. float32 arrays go to the C
    kernels when built (same bits, one pass; see irdmafs/native.py) unless ``native`` is False.
    ``grad`` is only read."""
    if native and kernels.can_run(param, grad, *state.values()):
        if opt.kind == "sgd":
            kernels.sgd(param, grad, state.get("buf"), opt.lr, opt.momentum, opt.weight_decay, opt.nesterov, t == 1, div)
        else:
            kernels.adam(param, grad, state["m"], state["v"], opt.lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, t, div)
        return
    wd = work_dtype(param.dtype)
    p = param.astype(wd, copy=param.dtype != wd)
    g = grad.astype(wd, copy=True)
    g /= wd.type(div)  # always, as the C kernels do (x / 1 quiets a signalling NaN)
    if opt.weight_decay:
        g += wd.type(opt.weight_decay) * p
    if opt.kind == "sgd":
        if opt.momentum:
            buf = state["buf"]
            if t == 1:
                buf[...] = g
            else:
                buf *= wd.type(opt.momentum)
                buf += g
            g = g + wd.type(opt.momentum) * buf if opt.nesterov else buf
        p -= wd.type(opt.lr) * g
    else:
        m, v = state["m"], state["v"]
        b1, b2 = wd.type(opt.beta1), wd.type(opt.beta2)
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * g * g
        c1, c2 = kernels.bias_corrections(opt.beta1, opt.beta2, t) if wd == np.float32 else (1 - b1**t, 1 - b2**t)
        m_hat = m / c1
        v_hat = v / c2
        p -= wd.type(opt.lr) * m_hat / (np.sqrt(v_hat) + wd.type(opt.eps))
    if p is not param:
        param[...] = p

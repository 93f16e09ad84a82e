"""The C kernels (irdmafs._native) against their numpy fallbacks: the same bits."""

import numpy as np
import pytest

from irdmafs import native
from irdmafs.server import optim

pytestmark = pytest.mark.skipif(not native.NATIVE, reason=f"irdmafs._native not built ({native.WHY})")


def arrays(n=10_001, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)


def test_acc_f16_matches_numpy_bit_for_bit_including_specials():
    rng = np.random.default_rng(1)
    # every float16 bit pattern: normals, subnormals, zeros, infinities, NaNs
    src = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    acc0 = rng.standard_normal(src.size, dtype=np.float32)
    a, b = acc0.copy(), acc0.copy()
    with np.errstate(invalid="ignore"):  # inf + -inf among them
        native.acc_f16(a, src, native=True)
        native.acc_f16(b, src, native=False)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize(
    "text",
    [
        "sgd lr=0.1",
        "sgd lr=0.05 weight_decay=1e-3",
        "sgd lr=0.1 momentum=0.9",
        "sgd lr=0.1 momentum=0.9 nesterov=1 weight_decay=1e-4",
        "adam lr=1e-3",
        "adam lr=1e-2 betas=0.8,0.99 eps=1e-6 weight_decay=1e-2",
    ],
)
def test_optimizers_match_numpy_bit_for_bit_over_several_steps(text):
    opt = optim.parse(text)
    p0, _ = arrays()
    pc, pn = p0.copy(), p0.copy()
    sc = {k: np.zeros_like(p0) for k in opt.state_names}
    sn = {k: np.zeros_like(p0) for k in opt.state_names}
    for t in range(1, 6):
        _, g = arrays(seed=t)
        optim.step(opt, pc, g, sc, t, native=True)
        optim.step(opt, pn, g, sn, t, native=False)
    assert np.array_equal(pc.view(np.uint32), pn.view(np.uint32))
    for k in sc:
        assert np.array_equal(sc[k].view(np.uint32), sn[k].view(np.uint32))


def test_bad_arguments_are_errors_not_crashes():
    p, g = arrays()
    with pytest.raises(ValueError):
        native._native.sgd(p, g[:-1], None, 0.1, 0.0, 0.0, False, True)
    with pytest.raises(TypeError):
        native._native.acc_f16(p, g)  # float32 where float16 belongs
    with pytest.raises(ValueError):
        native._native.sgd(p, g, None, 0.1, 0.9, 0.0, False, True)  # momentum without a buffer

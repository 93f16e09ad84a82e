"""The C kernels (irdmafs._native) against their numpy fallbacks: the same bits."""

import os

import numpy as np
import pytest

from irdmafs import native
from irdmafs.server import optim

_SANITIZED = os.environ.get("IRDMAFS_SANITIZED_KERNELS")  # set by scripts/sanitize
if _SANITIZED and (not native.NATIVE or native._native.__file__ != _SANITIZED):  # that run must test them, never skip
    raise RuntimeError(f"scripts/sanitize asked for {_SANITIZED} but irdmafs._native is {native._native and native._native.__file__} ({native.WHY})")
pytestmark = pytest.mark.skipif(not native.NATIVE, reason=f"irdmafs._native not built ({native.WHY})")


def arrays(n=10_001, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)


def _specials32(n: int, rng) -> np.ndarray:
    """float32 values with NaNs (quiet and signalling, payloads), infinities, zeros and
    subnormals among normals."""
    acc = rng.standard_normal(n, dtype=np.float32)
    bits = acc.view(np.uint32)
    bits[0::7] = 0x7F800001 + (np.arange(bits[0::7].size, dtype=np.uint32) % 0x3FFFFF)  # signalling NaNs
    bits[1::7] = 0xFFC00000 | (np.arange(bits[1::7].size, dtype=np.uint32) % 0x3FFFFF)  # quiet NaNs
    bits[2::11] = 0x7F800000  # +inf
    bits[3::13] = 0x00000001 + np.arange(bits[3::13].size, dtype=np.uint32) % 0x7FFFFF  # subnormals
    bits[4::17] = 0x80000000  # -0
    return acc


@pytest.mark.parametrize("specials", [False, True], ids=["normal-sums", "nan-inf-subnormal-sums"])
@pytest.mark.parametrize("vector", [True, False], ids=["f16c-where-there", "scalar"])
def test_acc_f16_matches_numpy_bit_for_bit_including_specials(vector, specials):
    rng = np.random.default_rng(1)
    # every float16 bit pattern (normals, subnormals, zeros, infinities, quiet and signalling
    # NaNs), each against every kind of float32 sum; an odd length leaves a tail past the
    # vector's eight lanes
    src = np.tile(np.arange(1 << 16, dtype=np.uint16), 3)[:-5].view(np.float16)
    acc0 = _specials32(src.size, rng) if specials else rng.standard_normal(src.size, dtype=np.float32)
    a, b = acc0.copy(), acc0.copy()
    with np.errstate(invalid="ignore"):  # inf + -inf among them
        native.acc_f16(a, src, native=True, vector=vector)
        native.acc_f16(b, src, native=False)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_f16c_path_is_taken_where_the_cpu_has_it():
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    assert native.F16C == ("f16c" in flags and "avx" in flags)


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
@pytest.mark.parametrize("div", [1, 3, 8])
@pytest.mark.parametrize("poisoned", [False, True], ids=["finite", "nan-params-and-state"])
def test_optimizers_match_numpy_bit_for_bit_over_several_steps(text, div, poisoned):
    """``div``: a round's count of pushes, divided as the gradient is read (a lone rank's 1 too:
    x / 1 quiets a signalling NaN in both). The last step's gradient holds NaNs, infinities and
    subnormals; ``poisoned``: so do the parameters and the state from the start."""
    opt = optim.parse(text)
    p0, _ = arrays()
    if poisoned:
        p0 = _specials32(p0.size, np.random.default_rng(5))
    pc, pn = p0.copy(), p0.copy()
    sc = {k: _specials32(p0.size, np.random.default_rng(9)) if poisoned else np.zeros_like(p0) for k in opt.state_names}
    sn = {k: v.copy() for k, v in sc.items()}
    for t in range(1, 6):
        _, g = arrays(seed=t)
        if t == 5:
            g = _specials32(g.size, np.random.default_rng(t))
        with np.errstate(invalid="ignore", over="ignore"):
            optim.step(opt, pc, g, sc, t, div=div, native=True)
            optim.step(opt, pn, g, sn, t, div=div, native=False)
    assert np.array_equal(pc.view(np.uint32), pn.view(np.uint32))
    for k in sc:
        assert np.array_equal(sc[k].view(np.uint32), sn[k].view(np.uint32))


def test_bad_arguments_are_errors_not_crashes():
    p, g = arrays()
    with pytest.raises(ValueError):
        native._native.sgd(p, g[:-1], None, 0.1, 0.0, 0.0, False, True, 1.0)
    with pytest.raises(TypeError):
        native._native.acc_f16(p, g)  # float32 where float16 belongs
    with pytest.raises(ValueError):
        native._native.sgd(p, g, None, 0.1, 0.9, 0.0, False, True, 1.0)  # momentum without a buffer
    for div in (0.0, -2.0, float("nan")):  # a count of pushes is at least 1
        with pytest.raises(ValueError, match="div"):
            native._native.sgd(p, g, None, 0.1, 0.0, 0.0, False, True, div)
        with pytest.raises(ValueError, match="div"):
            native._native.adam(p, g, g.copy(), g.copy(), 0.1, 0.9, 0.99, 1e-8, 0.0, 0.1, 0.01, div)
    with pytest.raises(TypeError):
        native._native.sgd(p, g, None, 0.1, 0.0, 0.0, False, True)  # div missing


def test_misaligned_arrays_are_refused_by_the_kernels_and_taken_by_the_wrappers():
    """A gradient read from a staging slot at an odd offset is misaligned: a load through it is
    undefined in C (UBSan found one), so the kernels refuse it and the wrappers align or fall
    back, with the same bits."""
    raw = np.zeros(4 * 1000 + 2, np.uint8)
    g = np.frombuffer(raw.data[1 : 1 + 4 * 1000], np.float32)  # misaligned by one byte
    h = np.frombuffer(raw.data[1 : 1 + 2 * 1000], np.float16)
    assert not g.flags.aligned and not h.flags.aligned
    p = np.ones(1000, np.float32)
    with pytest.raises(ValueError, match="aligned"):
        native._native.sgd(p, g, None, 0.1, 0.0, 0.0, False, True, 1.0)
    with pytest.raises(ValueError, match="aligned"):
        native._native.acc_f16(p, h)
    assert not native.can_run(p, g)
    a, b = np.ones(1000, np.float32), np.ones(1000, np.float32)
    native.acc_f16(a, h, native=True)
    native.acc_f16(b, h.copy(), native=False)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))

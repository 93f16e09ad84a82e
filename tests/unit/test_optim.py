"""Server-side optimizers against an independent numpy reference (PyTorch's documented rules)."""

import numpy as np
import pytest

from irdmafs.server import optim


def reference(kind, lr, params, grads, momentum=0.0, nesterov=False, wd=0.0, b1=0.9, b2=0.999, eps=1e-8):
    p = params.astype(np.float64).copy()
    buf = m = v = None
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64) + wd * p
        if kind == "sgd":
            if momentum:
                buf = g.copy() if buf is None else momentum * buf + g
                g = g + momentum * buf if nesterov else buf
            p = p - lr * g
        else:
            m = (1 - b1) * g if m is None else b1 * m + (1 - b1) * g
            v = (1 - b2) * g * g if v is None else b2 * v + (1 - b2) * g * g
            p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


CASES = [
    ("sgd lr=0.1", dict(kind="sgd", lr=0.1)),
    ("sgd lr=0.05 weight_decay=1e-4", dict(kind="sgd", lr=0.05, wd=1e-4)),
    ("sgd lr=0.1 momentum=0.9", dict(kind="sgd", lr=0.1, momentum=0.9)),
    ("sgd lr=0.1 momentum=0.9 nesterov=1 weight_decay=1e-4", dict(kind="sgd", lr=0.1, momentum=0.9, nesterov=True, wd=1e-4)),
    ("adam lr=1e-3", dict(kind="adam", lr=1e-3)),
    ("adam lr=1e-2 betas=0.8,0.99 eps=1e-6 weight_decay=1e-3", dict(kind="adam", lr=1e-2, b1=0.8, b2=0.99, eps=1e-6, wd=1e-3)),
]


def run(text, params, grads):
    opt = optim.parse(text)
    p = params.copy()
    state = {name: np.zeros(p.shape, optim.work_dtype(p.dtype)) for name in opt.state_names}
    for t, g in enumerate(grads, 1):
        optim.step(opt, p, g, state, t)
    return p


@pytest.mark.parametrize("text, ref", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_to_1e6(text, ref):
    rng = np.random.default_rng(0)
    params = rng.standard_normal(1000)
    grads = [rng.standard_normal(1000) for _ in range(25)]
    want = reference(params=params, grads=grads, **ref)
    got = run(text, params, grads)  # float64 parameters
    assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-12)) < 1e-6
    got32 = run(text, params.astype(np.float32), [g.astype(np.float32) for g in grads])
    assert np.allclose(got32, want, rtol=1e-4, atol=1e-5)


def test_learning_rate_can_change_while_training():
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(10)
    g1, g2 = rng.standard_normal(10), rng.standard_normal(10)
    p, state = p0.copy(), {"buf": np.zeros(10)}
    optim.step(optim.parse("sgd lr=0.1 momentum=0.9"), p, g1, state, 1)
    optim.step(optim.parse("sgd lr=0.01 momentum=0.9"), p, g2, state, 2)  # new lr, same state
    buf = 0.9 * g1 + g2
    assert np.allclose(state["buf"], buf, rtol=1e-12)
    assert np.allclose(p, p0 - 0.1 * g1 - 0.01 * buf, rtol=1e-12)


@pytest.mark.parametrize(
    "text", ["", "rmsprop lr=1", "sgd lr=x", "sgd lr=0.1 betas=1,2", "sgd lr=-1", "adam lr=1e-3 betas=0.9", "sgd lr=0.1 nesterov=1", "sgd momentum"]
)
def test_bad_optimizer_strings_name_the_accepted_forms(text):
    with pytest.raises(optim.OptimError) as err:
        optim.parse(text)
    assert "accepted" in str(err.value) or "range" in str(err.value) or "nesterov" in str(err.value)

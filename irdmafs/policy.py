"""A model's policies as the mount, the client and the nodes all read them: the accepted forms of
each ``user.irdma.*`` policy attribute and the one parser of each (``POLICIES``), and the stripe
clock a pull waits for (``Policy.required_clock``). The training path parses with these, and a value is
checked with the same parser when it is set (``check``: the mount's setxattr, the node's
``setxattr`` op), so a bad value is refused then, not at the first push. Each sync policy is a
class here saying what its pushes and pulls wait for (``Policy``); the bookkeeping of pushes on
a stripe's primary is server/rounds.py's, the optimizer's arithmetic server/optim.py's, the
compression's client/compress.py's. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar

from .errors import CompressError, OptimError, PolicyError  # noqa: F401 (the same classes)

SYNC_FORMS = "bsp | asp | ssp:S (S >= 0) | r2sp"
OPTIMIZER_FORMS = "sgd lr=F [momentum=F] [nesterov=0|1] [weight_decay=F] | adam lr=F [betas=F,F] [eps=F] [weight_decay=F]"
COMPRESS_FORMS = "none | fp16 | chunks=F (0 < F <= 1) | fp16,chunks=F [,chunk=N]"


# -- user.irdma.sync ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """A sync policy: one class per kind, each saying what its pushes and pulls wait for, so no
    code outside this module and server/rounds.py asks a policy's name. The facts:

    - ``rounds``: pushes of a step are summed into a round applied once every active rank has
      pushed it (bsp); the stripe's clock counts the rounds applied, and a pusher keeps its push
      until it sees its round closed (a round still open lives on the primary alone).
    - ``holds``: a push may be held on the primary until its turn (r2sp), so whether it was
      applied shows in no clock: the pusher asks (``train_wait``).
    - ``paced``: pushes leave in evenly gapped slots the primary names (r2sp).
    - ``required_clock(own_pushes)``: the stripe clock a pull by a rank that pushed that many
      times waits for; ``clock(rounds_applied, slowest)``: a stripe's clock from its primary's
      counts; ``admitted(pushed, active, rank, step)``: whether push ``step`` of ``rank`` may be
      applied now (its turn), given each rank's pushes applied.
    """

    kind: ClassVar[str] = ""
    rounds: ClassVar[bool] = False
    holds: ClassVar[bool] = False
    paced: ClassVar[bool] = False

    def __str__(self) -> str:
        return self.kind

    def required_clock(self, own_pushes: int) -> int:
        return 0

    def clock(self, rounds_applied: int, slowest: int) -> int:
        return slowest

    def admitted(self, pushed: dict[int, int], active: list[int], rank: int, step: int) -> bool:
        return True


@dataclass(frozen=True)
class Bsp(Policy):
    """Bulk synchronous: every active rank's push of step k, averaged, applied once."""

    kind: ClassVar[str] = "bsp"
    rounds: ClassVar[bool] = True

    def required_clock(self, own_pushes: int) -> int:
        return own_pushes

    def clock(self, rounds_applied: int, slowest: int) -> int:
        return rounds_applied


@dataclass(frozen=True)
class Asp(Policy):
    """Asynchronous: every push applied on arrival, scaled by 1/W; a pull waits for nothing."""

    kind: ClassVar[str] = "asp"


@dataclass(frozen=True)
class Ssp(Policy):
    """Stale synchronous: applied as asp; a pull waits until the slowest rank is within
    ``staleness`` steps of its own pushes."""

    kind: ClassVar[str] = "ssp"
    staleness: int = 0

    def __str__(self) -> str:
        return f"ssp:{self.staleness}"

    def required_clock(self, own_pushes: int) -> int:
        return max(0, own_pushes - self.staleness)


@dataclass(frozen=True)
class R2sp(Policy):
    """Round-robin synchronous: applied as asp, in turn order (rank r's push of step k once every
    active rank before r pushed step k and every rank after r step k-1), sent in slots; a pull
    waits for the previous round."""

    kind: ClassVar[str] = "r2sp"
    holds: ClassVar[bool] = True
    paced: ClassVar[bool] = True

    def required_clock(self, own_pushes: int) -> int:
        return max(0, own_pushes - 1)

    def admitted(self, pushed: dict[int, int], active: list[int], rank: int, step: int) -> bool:
        for r in active:
            need = step if r < rank else step - 1 if r > rank else None
            if need is not None and need >= 0 and pushed.get(r, 0) < need + 1:
                return False
        return True


SYNC_POLICIES: dict[str, type[Policy]] = {p.kind: p for p in (Bsp, Asp, R2sp)}  # (ssp takes its S)


def parse_policy(text: str) -> Policy:
    text = text.strip()
    if text in SYNC_POLICIES:
        return SYNC_POLICIES[text]()
    kind, sep, s = text.partition(":")
    if kind == Ssp.kind and sep and s.isdigit():
        return Ssp(int(s))
    raise PolicyError(f"unknown sync policy {text!r}; accepted: {SYNC_FORMS}")


# -- user.irdma.optimizer ----------------------------------------------------------------------
@dataclass(frozen=True)
class Optimizer:
    kind: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    @property
    def state_names(self) -> tuple[str, ...]:
        if self.kind == "adam":
            return ("m", "v")
        return ("buf",) if self.momentum else ()


def parse_optimizer(text: str) -> Optimizer:
    """``"sgd lr=0.1 momentum=0.9 nesterov=1 weight_decay=1e-4"``, ``"adam lr=1e-3 betas=0.9,0.999 eps=1e-8"``."""
    words = text.split()
    if not words or words[0] not in ("sgd", "adam"):
        raise OptimError(f"unknown optimizer {text!r}; accepted: {OPTIMIZER_FORMS}")
    kw: dict = {"kind": words[0]}
    allowed = {"sgd": {"lr", "momentum", "nesterov", "weight_decay"}, "adam": {"lr", "betas", "eps", "weight_decay"}}[words[0]]
    for w in words[1:]:
        key, sep, value = w.partition("=")
        if not sep or key not in allowed:
            raise OptimError(f"{w!r} is not a setting of {words[0]}; accepted: {OPTIMIZER_FORMS}")
        try:
            if key == "betas":
                b1, b2 = (float(x) for x in value.split(","))
                kw["beta1"], kw["beta2"] = b1, b2
            elif key == "nesterov":
                kw["nesterov"] = value not in ("0", "false", "False")
            else:
                kw[key] = float(value)
        except ValueError:
            raise OptimError(f"{w!r}: not a number; accepted: {OPTIMIZER_FORMS}") from None
    opt = Optimizer(**kw)
    if opt.lr <= 0 or opt.momentum < 0 or opt.weight_decay < 0 or not (0 <= opt.beta1 < 1 and 0 <= opt.beta2 < 1) or opt.eps <= 0:
        raise OptimError(f"{text!r}: a setting is out of range")
    if opt.nesterov and not opt.momentum:
        raise OptimError("nesterov needs momentum > 0")
    return opt


# -- user.irdma.compress -----------------------------------------------------------------------
@dataclass(frozen=True)
class Compression:
    fp16: bool = False
    fraction: float | None = None  # chunks=F
    chunk: int = 256

    def __str__(self) -> str:
        parts = (["fp16"] if self.fp16 else []) + ([f"chunks={self.fraction}"] if self.fraction else [])
        return ",".join(parts) or "none"


def parse_compress(text: str) -> Compression:
    fp16, fraction, chunk = False, None, 256
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        try:
            if part == "fp16":
                fp16 = True
            elif part == "none":
                pass
            elif key == "chunks":
                fraction = float(value)
                if not 0 < fraction <= 1:
                    raise ValueError
            elif key == "chunk":
                chunk = int(value)
                if chunk < 1:
                    raise ValueError
            else:
                raise ValueError
        except ValueError:
            raise CompressError(f"{part!r} is not a compression setting; accepted: {COMPRESS_FORMS}") from None
    return Compression(fp16, fraction, chunk)


# -- user.irdma.workers, .timeout, .removed ----------------------------------------------------
def parse_workers(text: str) -> int:
    """The number of worker ranks: a whole number, at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise PolicyError(f"workers {text!r} is not a whole number of ranks") from None
    if n < 1:
        raise PolicyError(f"workers {text!r}: at least 1")
    return n


def parse_timeout(text: str) -> float:
    """Seconds a pull waits for its step: a finite number above 0."""
    try:
        t = float(text)
    except ValueError:
        raise PolicyError(f"timeout {text!r} is not a number of seconds") from None
    if not 0 < t < math.inf:
        raise PolicyError(f"timeout {text!r}: a number of seconds above 0, finite")
    return t


def parse_removed(text: str) -> frozenset[int]:
    """The ranks that left (``rmdir .irdma/workers/<r>``): rank numbers, comma-separated."""
    try:
        ranks = frozenset(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise PolicyError(f"removed {text!r} is not a comma-separated list of ranks") from None
    if any(r < 0 for r in ranks):
        raise PolicyError(f"removed {text!r}: a rank is 0 or more")
    return ranks


# Every policy attribute and its parser: the settable user.irdma.* attributes of the training
# path (inherited from the nearest directory that sets one, server/meta.py inherited_xattrs)
POLICIES: dict[str, Callable[[str], object]] = {
    "user.irdma.sync": parse_policy,
    "user.irdma.workers": parse_workers,
    "user.irdma.optimizer": parse_optimizer,
    "user.irdma.compress": parse_compress,
    "user.irdma.timeout": parse_timeout,
    "user.irdma.removed": parse_removed,
}


def check(name: str, text: str) -> None:
    """PolicyError saying why if ``text`` is no value of policy ``name`` (KeyError: no policy)."""
    POLICIES[name](text)

"""Sync policies as the client and the nodes both read them: the accepted forms of
``user.irdma.sync`` (``parse_policy``) and the stripe clock a pull waits for
(``required_clock``). What each policy does with pushes is server/policies.py's. Pure."""

from __future__ import annotations

from dataclasses import dataclass

FORMS = "bsp | asp | ssp:S (S >= 0) | r2sp"


class PolicyError(ValueError):
    """A sync string that is not one of the accepted forms."""


@dataclass(frozen=True)
class Policy:
    kind: str
    staleness: int = 0

    def __str__(self) -> str:
        return f"ssp:{self.staleness}" if self.kind == "ssp" else self.kind


def parse_policy(text: str) -> Policy:
    text = text.strip()
    if text in ("bsp", "asp", "r2sp"):
        return Policy(text)
    kind, sep, s = text.partition(":")
    if kind == "ssp" and sep and s.isdigit():
        return Policy("ssp", int(s))
    raise PolicyError(f"unknown sync policy {text!r}; accepted: {FORMS}")


def required_clock(policy: Policy, own_pushes: int) -> int:
    """The stripe clock a pull by a rank that has pushed ``own_pushes`` times must wait for."""
    if policy.kind == "bsp":
        return own_pushes
    if policy.kind == "r2sp":
        return max(0, own_pushes - 1)
    if policy.kind == "ssp":
        return max(0, own_pushes - policy.staleness)
    return 0

"""Small helpers shared across layers."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def single_exception() -> Iterator[None]:
    """Re-raise the one exception of an exception group as itself.

    Trio wraps everything leaving a nursery in an ExceptionGroup; at an API edge whose callers
    expect ``except RemoteError`` to work, a group holding exactly one exception is unwrapped.
    Groups of several errors stay groups: those are real concurrent failures."""
    try:
        yield
    except BaseExceptionGroup as group:
        inner = list(leaves(group))
        if len(inner) == 1:
            raise inner[0] from None
        raise


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """Every exception inside ``exc``, groups flattened."""
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from leaves(e)
    else:
        yield exc

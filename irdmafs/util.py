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
        leaves = list(_leaves(group))
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _leaves(e)
    else:
        yield exc

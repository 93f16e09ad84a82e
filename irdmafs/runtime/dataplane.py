"""What serves a process's data plane, said once: the transport, the engine under it (native C,
irdmafs._engine, or the Python transport: transport/engine.py) and the PS kernels (native C,
irdmafs._native, or numpy: native.py).

Both C builds are optional and each falls back on its own, never silently: a node and a mount
log ``line`` once at start, a node reports ``facts`` in its status (every heartbeat: ``irdmafs
status`` prints them per node), a mount in ``.irdma/cluster``, and both in their metrics
(``irdmafs_data_plane_info``, metrics.py). Whatever is not native carries why (the build's
ImportError, ``IRDMAFS_NATIVE=0``, ``IRDMAFS_ENGINE=0``, a transport the engine does not serve).
"""

from __future__ import annotations

import logging
from typing import Any

from .. import native

_ENGINE_MISSING = ""
try:  # the engine's Python side; a process without it runs the Python transport, saying why
    from ..transport import engine as _engine
except ImportError as exc:
    _engine = None
    _absent = "cannot import name 'engine'" in str(exc)  # not in this install, or failed importing
    _ENGINE_MISSING = "irdmafs.transport.engine is not in this install" if _absent else f"irdmafs.transport.engine does not import ({exc})"

__all__ = ["engine", "facts", "kernels", "level", "line", "not_native"]

# why a C build does not run that is a choice, not a failure (an environment variable, a
# transport the engine does not serve): said at INFO; a build that failed or would not load is
# said at WARNING
CHOSEN = ("IRDMAFS_NATIVE=0", "IRDMAFS_ENGINE=0", "chosen")  # "chosen": a transport made with engine="python"
NOT_SERVED = "does not run on the engine"


def kernels() -> dict:
    """``{"native": bool, "why": str}``: whether the C kernels run, and why ("built" if so)."""
    return {"native": bool(native.NATIVE), "why": str(native.WHY)}


def engine(transport: Any) -> dict:
    """``{"name": "native"|"python", "why": str}``: what moves ``transport``'s bytes, and why."""
    name = getattr(transport, "engine", "python")
    name = name if name in ("native", "python") else "python"
    said = getattr(transport, "engine_why", None)  # the transport's own word, where it has one
    if isinstance(said, str) and said:
        why = said
    elif _engine is None:
        why = _ENGINE_MISSING
    elif name == "native" or not getattr(_engine, "AVAILABLE", False):
        why = str(getattr(_engine, "WHY", "unknown"))
    else:  # built and loaded, but this transport does not run on it
        why = f"the {transport.name} transport {NOT_SERVED}"
    return {"name": name, "why": why}


def facts(transport: Any) -> dict:
    """The three facts a node's status and a mount's report carry."""
    return {"transport": transport.name, "engine": engine(transport), "kernels": kernels()}


def not_native(f: dict) -> list[str]:
    """What of ``facts`` is not native, each with why (empty when both C builds run)."""
    out = []
    eng, ker = f.get("engine") or {}, f.get("kernels") or {}
    if eng and eng.get("name") != "native":
        out.append(f"engine python: {eng.get('why')}")
    if ker and not ker.get("native"):
        out.append(f"kernels numpy: {ker.get('why')}")
    return out


def line(f: dict) -> str:
    """``transport tcp, engine native, kernels native C``; why for what is not native."""
    eng, ker = f.get("engine") or {}, f.get("kernels") or {}
    engine_part = "engine native" if eng.get("name") == "native" else f"engine python ({eng.get('why', 'unknown')})"
    kernels_part = "kernels native C" if ker.get("native") else f"kernels numpy ({ker.get('why', 'unknown')})"
    return f"transport {f.get('transport', '?')}, {engine_part}, {kernels_part}"


def level(f: dict) -> int:
    """WARNING when a C build is missing or did not load (slower, and not by choice), else INFO."""
    eng, ker = f.get("engine") or {}, f.get("kernels") or {}
    failed = [why for off, why in ((eng.get("name") != "native", eng.get("why", "")), (not ker.get("native"), ker.get("why", ""))) if off]
    return logging.WARNING if any(why not in CHOSEN and NOT_SERVED not in why for why in failed) else logging.INFO

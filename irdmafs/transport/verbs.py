"""The transport contract over RDMA verbs (pyverbs): placeholder for the probe, filled below."""

from __future__ import annotations


def _import_pyverbs():
    import pyverbs.device  # noqa: F401

    return pyverbs


def first_active_device() -> str | None:
    """Name of the first RDMA device with an active port, or None."""
    import pyverbs.device as d
    import pyverbs.enums as e

    for dev in d.get_device_list():
        name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        try:
            with d.Context(name=name) as ctx:
                for port in range(1, ctx.query_device().phys_port_cnt + 1):
                    if ctx.query_port(port).state == e.IBV_PORT_ACTIVE:
                        return name
        except Exception:  # a device we cannot open is not usable
            continue
    return None


def unusable_reason() -> str | None:
    """Why verbs cannot run here (None when it can)."""
    try:
        import pyverbs.device  # noqa: F401
    except ImportError as exc:
        return f"pyverbs does not import ({exc})"
    try:
        if first_active_device() is None:
            return "no RDMA device with an active port"
    except Exception as exc:
        return f"cannot list RDMA devices ({exc})"
    return None

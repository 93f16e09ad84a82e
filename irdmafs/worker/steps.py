"""A training step's two streams, from the worker's side: numpy arrays in, numpy arrays out.

    push_arrays(mount, model, rank, {"fc.weight": grad, ...})   # one write of every gradient
    pull_arrays(mount, model, rank, {"fc.weight": out, ...})    # every parameter, into ``out``
    step_arrays(mount, model, rank, grads, out)                  # both, overlapped where it can

Two doors, the same semantics. First choice: the mount's shared-memory door (irdmafs/worker/door.py,
fs/door_server.py): the arrays are copied into memory shared with the mount, which moves them to and
from the nodes itself; no FUSE request carries a byte. The fallback, for a mount that offers no
door to this process (another user, another mount namespace, an older mount) or with
``IRDMAFS_DOOR=0``: the stream file ``<mount>/.workers/<rank>/<model>.safetensors``
(fs/streams.py): a push is one ``writev`` of the safetensors header and every array's own
memory (no concatenated copy), and the ``close`` reports the push's result (EINVAL for a stream
that does not fit the model: then nothing was pushed). A pull is one ``readv`` straight into the
caller's arrays. Which door a (mount, model, rank) uses is said in one log line. The stream
files need nothing but files, so any other language can do the same.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .door import Door, DoorGone
from ..formats import ST_DTYPES, st_layout

log = logging.getLogger(__name__)
# (mount, model, rank) -> its door, least recently used first; None: no door, use the files.
# Bounded: a process that trains many models one after the other (a sweep, a soak) would
# otherwise keep a socket, a mapping and the mount's region of every one it ever used.
_doors: OrderedDict[tuple[str, str, int], Door | None] = OrderedDict()
MAX_DOORS = 16
_doors_lock = threading.Lock()
# doors a request is under way through (``through_door``), and how many: one that leaves
# ``_doors`` meanwhile (evicted, opened anew) is closed when its last request ends, never under
# it (another thread's door evicted mid-pull emptied its areas: the pull's copy-out found no
# tensor, chaos --model-gib 1, seed 125172)
_busy: dict[Door, int] = {}
MOUNT_DOWN = (errno.ENOTCONN, errno.ECONNABORTED)  # what a dead or restarting FUSE mount answers

IOV_MAX = 1024  # Linux's limit on buffers per readv/writev


def stream_path(mount: str | os.PathLike, model: str, rank: int) -> Path:
    return Path(mount) / ".workers" / str(rank) / f"{model}.safetensors"


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1)).cast("B") if a.size else memoryview(b"")


def writev_all(fd: int, bufs: list) -> None:
    """Every byte of ``bufs``, in order, however the kernel splits the writes."""
    bufs = [memoryview(b).cast("B") for b in bufs if len(memoryview(b).cast("B"))]
    while bufs:
        n = os.writev(fd, bufs[:IOV_MAX])
        while n and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


def readv_all(fd: int, bufs: list) -> None:
    """Fill every buffer of ``bufs`` in order; EOFError if the file ends first."""
    bufs = [b for b in bufs if len(b)]
    while bufs:
        n = os.readv(fd, bufs[:IOV_MAX])
        if n == 0:
            raise EOFError(f"stream ended with {sum(map(len, bufs))} bytes still wanted")
        while n and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


def door(mount: str | os.PathLike, model: str, rank: int, *, fresh: bool = False) -> Door | None:
    """The shared-memory door of (mount, model, rank), opened once; None where there is none
    (said once in the log: the stream files serve then). Threads of one process may ask for
    doors at once (each rank its own: one door serves one request at a time)."""
    with _doors_lock:
        return _door(os.path.abspath(mount), model, rank, fresh)


def _door(mount: str, model: str, rank: int, fresh: bool) -> Door | None:
    key = (mount, model, rank)
    if fresh:
        _retire(_doors.pop(key, None))
    if key in _doors:
        _doors.move_to_end(key)
    else:
        while len(_doors) >= MAX_DOORS:
            _retire(_doors.popitem(last=False)[1])
        if os.environ.get("IRDMAFS_DOOR", "1") == "0":
            _doors[key] = None
            log.info("step streams of %s rank %d: stream files (IRDMAFS_DOOR=0)", model, rank)
        else:
            try:
                _doors[key] = Door.open(mount, model, rank)
                log.info("step streams of %s rank %d: the shared-memory door of %s", model, rank, mount)
            except (OSError, ValueError, KeyError) as exc:
                # the mount is not there now (dead, or gone from the mountpoint), or no such
                # model: the stream files would fail too; ask again next time
                errno_ = getattr(exc, "errno", None)
                if errno_ in MOUNT_DOWN or (errno_ == errno.ENOENT and not stream_path(mount, model, rank).exists()):
                    raise
                _doors[key] = None  # another user, another network namespace, an older mount
                log.info("step streams of %s rank %d: stream files (no door: %s)", model, rank, exc)
    return _doors[key]


def _retire(d: Door | None) -> None:
    """``d`` has left ``_doors``: closed now, or by the last request under way through it.
    Under ``_doors_lock``."""
    if d is not None and d not in _busy:
        d.close()


def close_doors() -> None:
    """Close every door this process opened (the next step opens them again); one a request
    is under way through closes when that request ends."""
    with _doors_lock:
        for d in _doors.values():
            _retire(d)
        _doors.clear()


def _run(mount, model: str, rank: int, op, fresh: bool) -> bool:
    """``op(door)`` with the door held open for it (``_busy``); False if there is no door."""
    with _doors_lock:
        d = _door(os.path.abspath(mount), model, rank, fresh)
        if d is None:
            return False
        _busy[d] = _busy.get(d, 0) + 1
    try:
        op(d)
    finally:
        with _doors_lock:
            _busy[d] -= 1
            if not _busy[d]:
                del _busy[d]
                if d not in _doors.values():
                    d.close()
    return True


def through_door(mount, model: str, rank: int, op) -> bool:
    """Run ``op(door)``; False if there is no door. A door whose model changed (ESTALE) or that
    its mount closed before the request went (a remount) is opened again once. No other
    thread's door eviction closes it while ``op`` runs."""
    try:
        return _run(mount, model, rank, op, fresh=False)
    except OSError as exc:
        if exc.errno != errno.ESTALE and not isinstance(exc, DoorGone):
            raise
        return _run(mount, model, rank, op, fresh=True)


def push_arrays(mount: str | os.PathLike, model: str, rank: int, grads: dict[str, np.ndarray]) -> None:
    """Push one step's gradients of ``rank`` (arrays of the tensors' dtypes and shapes; others
    than C-contiguous are copied to C order first)."""
    arrays = {n: np.require(a, requirements="C") for n, a in grads.items()}
    if through_door(mount, model, rank, lambda d: d.push(arrays)):
        return
    header, _ = st_layout([(n, a.dtype.str, a.shape) for n, a in arrays.items()])
    fd = os.open(stream_path(mount, model, rank), os.O_WRONLY)
    try:
        writev_all(fd, [header] + [_bytes_of(a) for a in arrays.values()])
    finally:
        os.close(fd)  # the push happens here; its error (EINVAL, EIO...) is raised here


def step_arrays(mount: str | os.PathLike, model: str, rank: int, grads: dict[str, np.ndarray], out: dict[str, np.ndarray]) -> None:
    """``push_arrays`` then ``pull_arrays``: through the door as one request, which the mount
    overlaps (each tensor's pull starts once its own push is taken); through the files, the
    two one after the other."""
    arrays = {n: np.require(a, requirements="C") for n, a in grads.items()}
    if through_door(mount, model, rank, lambda d: d.step(arrays, out)):
        return
    push_arrays(mount, model, rank, arrays)
    pull_arrays(mount, model, rank, out)


def pull_arrays(mount: str | os.PathLike, model: str, rank: int, out: dict[str, np.ndarray]) -> None:
    """Fill ``out`` (writable C-contiguous arrays) with the parameters ``rank`` may see now;
    tensors of the model that ``out`` does not name are read past. KeyError if ``out`` names
    a tensor the model lacks, ValueError if one has another dtype or shape."""
    if through_door(mount, model, rank, lambda d: d.pull(out)):
        return
    fd = os.open(stream_path(mount, model, rank), os.O_RDONLY)
    try:
        head = bytearray(8)
        readv_all(fd, [head])
        doc = bytearray(int.from_bytes(head, "little"))
        readv_all(fd, [doc])
        entries = json.loads(doc)
        entries.pop("__metadata__", None)
        missing = set(out) - set(entries)
        if missing:
            raise KeyError(f"the model has no tensor {sorted(missing)[0]!r}")
        bufs, pos, scratch = [], 0, None
        for name, e in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = e["data_offsets"]
            if begin > pos:
                bufs.append(memoryview(bytearray(begin - pos)))
            a = out.get(name)
            if a is None:
                scratch = scratch if scratch is not None and len(scratch) >= end - begin else bytearray(end - begin)
                bufs.append(memoryview(scratch)[: end - begin])
            else:
                if np.dtype(ST_DTYPES.get(e["dtype"], "V")) != a.dtype or list(a.shape) != e["shape"]:
                    raise ValueError(f"{name}: the model holds {e['dtype']}{e['shape']}, the array is {a.dtype}{list(a.shape)}")
                bufs.append(_bytes_of(a))
            pos = max(pos, end)
        readv_all(fd, bufs)
    finally:
        os.close(fd)

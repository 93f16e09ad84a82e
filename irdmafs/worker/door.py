"""A worker's side of the shared-memory door to the step streams (the mount's side: fs/door_server.py).

    door = Door.open("/mnt/ps", "bert", rank)   # OSError if this mount offers none to us
    door.push({"w": grad_w, ...})               # copied into the push area, pushed by the mount
    door.pull({"w": w, ...})                    # pulled into the pull area, copied into ``w``
    door.step(grads, {"w": w, ...})             # both, overlapped by the mount
    door.params["w"]                            # or use the pull area's arrays themselves

The ticket comes from ``<mount>/.workers/<rank>/<model>.door`` (so the file's permissions say
who may come in); the region is mapped from the descriptor the mount sends. Pushes and pulls
have the stream files' semantics and errors: an ``OSError`` with the errno a stream's ``close``
or ``read`` would raise (EINVAL for a gradient that does not fit, ETIMEDOUT, EIO...). ESTALE
means the model's tensors changed, ``DoorGone`` (ENOTCONN) that the mount closed the door before
the request was sent (it was restarted): ``worker/steps.py`` opens a new door for both. A mount that
dies during a request gives ECONNABORTED, as a FUSE request would.

A pushed array that *is* the push area's array, or a pull target that is the pull area's, is not
copied at all: training code can keep its parameters in the region (``irdmafs.worker.torch`` does).

Blocking, for plain training code; one request at a time (not thread-safe).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import socket
import struct
from pathlib import Path

import numpy as np

from ..formats import st_parse

LENGTH = struct.Struct("<I")
MAX_FRAME = 1 << 20


def door_path(mount: str | os.PathLike, model: str, rank: int) -> Path:
    return Path(mount) / ".workers" / str(rank) / f"{model}.door"


def _send(sock: socket.socket, doc: dict) -> None:
    body = json.dumps(doc, separators=(",", ":")).encode()
    sock.sendall(LENGTH.pack(len(body)) + body)


def _recv(sock: socket.socket) -> tuple[dict, list[int]]:
    fds: list[int] = []

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk, fd_list, _flags, _addr = socket.recv_fds(sock, n - len(data), 4)
            fds.extend(fd_list)
            if not chunk:
                raise OSError(errno.ECONNRESET, "the mount closed the door")
            data += chunk
        return data

    (n,) = LENGTH.unpack(exactly(LENGTH.size))
    if n > MAX_FRAME:
        raise OSError(errno.EPROTO, f"door frame of {n} bytes")
    return json.loads(exactly(n)), fds


def _check(answer: dict) -> dict:
    if answer.get("ok"):
        return answer
    code = int(answer.get("errno", errno.EIO))
    raise OSError(code, f"{os.strerror(code)}: {answer.get('message', '')}".rstrip(": "))


def _arrays(region: mmap.mmap, at: int, size: int) -> dict[str, np.ndarray]:
    """The tensors of the safetensors stream at ``at`` of ``region``, as arrays over it."""
    n = int.from_bytes(region[at : at + 8], "little")
    start, entries, _ = st_parse(region[at : at + 8 + n], size)
    return {e.name: np.frombuffer(region, e.dtype, (e.end - e.begin) // np.dtype(e.dtype).itemsize, at + start + e.begin).reshape(e.shape) for e in entries}


def array_address(a: np.ndarray) -> int:
    """Where an array's data starts (is it an area's own memory?)."""
    return a.__array_interface__["data"][0]


class DoorGone(OSError):
    """The door was closed before a request was sent (nothing happened): open a new one."""


class Door:
    """One rank's door to one model, through one mount."""

    def __init__(self, sock: socket.socket, region: mmap.mmap, info: dict):
        self.sock = sock
        self.region = region
        self.grads = _arrays(region, info["push"], info["size"])  # the push area, by tensor
        self.params = _arrays(region, info["pull"], info["size"])  # the pull area, by tensor
        self._released = True  # may the push area be written? (see fs/door_server.py)

    @classmethod
    def open(cls, mount: str | os.PathLike, model: str, rank: int) -> "Door":
        with open(door_path(mount, model, rank), "rb") as f:
            ticket = json.loads(f.read())
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect("\0" + ticket["socket"])
            _send(sock, {"ticket": ticket["ticket"]})
            answer, fds = _recv(sock)
            try:
                _check(answer)
                if len(fds) != 1:
                    raise OSError(errno.EPROTO, "the door came without its region")
                region = mmap.mmap(fds[0], answer["region"])
            finally:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            sock.close()
            raise
        return cls(sock, region, answer)

    def _ask(self, doc: dict) -> None:
        # A mount killed (or remounted) since the last request closed this door: say so before
        # sending anything, so the caller may open a new door and send the request there.
        # (a peek, not select(): a process with a thousand files open has descriptors past
        # FD_SETSIZE, which select() refuses)
        try:
            early = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            early = None  # nothing waiting: the door is open
        except OSError:
            early = b""
        if early is not None:  # EOF, a reset, or bytes nobody asked for: out of step
            raise DoorGone(errno.ENOTCONN, "the mount closed this door (it was unmounted or restarted)")
        try:
            _send(self.sock, doc)
            answer, fds = _recv(self.sock)
        except OSError as exc:
            # as a FUSE request the mount dies during: whether it took effect is unknown
            raise OSError(errno.ECONNABORTED, f"the mount went away during a door request: {exc.strerror or exc}") from None
        for fd in fds:
            os.close(fd)
        _check(answer)

    def push(self, grads: dict[str, np.ndarray]) -> None:
        """Push these gradients (a subset of the model's tensors is a partial step, as with the
        stream file). EINVAL, naming the tensor, for one the model lacks or that does not fit."""
        self._fill(grads)
        self._ask({"op": "push", "only": self._only(grads)})

    def step(self, grads: dict[str, np.ndarray], out: dict[str, np.ndarray] | None = None) -> None:
        """``push(grads)`` then ``pull(out)`` as one request: the mount overlaps them (each
        tensor's pull starts once its own push is taken). Afterwards the push area is released,
        so the gradients may live there (``grads``'s arrays are the area's own)."""
        out = out or {}
        self._check_out(out)
        self._fill(grads)
        self._ask({"op": "step", "only": self._only(grads)})
        self._released = True
        self._copy_out(out)

    def _only(self, grads: dict) -> list[str] | None:
        return None if len(grads) == len(self.grads) else sorted(grads)

    def _fill(self, grads: dict[str, np.ndarray]) -> None:
        """Check the gradients, then copy them into the push area (released first if a push
        since the last pull may still be kept by the mount)."""
        for name, g in grads.items():
            area = self.grads.get(name)
            if g is area:
                continue  # the area itself (a gradient adopted by irdmafs.worker.torch): fits
            if area is None:
                self._misfit(OSError(errno.EINVAL, f"tensor {name!r} is not in this model"))
            if g.dtype != area.dtype or g.shape != area.shape:
                self._misfit(OSError(errno.EINVAL, f"tensor {name!r}: pushed {g.dtype}{list(g.shape)}, the model holds {area.dtype}{list(area.shape)}"))
        if not self._released:
            self._ask({"op": "release"})
        for name, g in grads.items():
            area = self.grads[name]
            if g is not area and array_address(g) != array_address(area):  # not the area itself: copy it in
                np.copyto(area, g)
        self._released = False

    def pull(self, out: dict[str, np.ndarray] | None = None) -> None:
        """Pull every parameter into the pull area, then into ``out``'s arrays (not copied where
        an array is the area's own). KeyError for a tensor the model lacks, ValueError for one
        of another dtype or shape."""
        out = out or {}
        self._check_out(out)
        self._ask({"op": "pull"})
        self._released = True
        self._copy_out(out)

    def _check_out(self, out: dict[str, np.ndarray]) -> None:
        self.expect({name: (a.dtype, a.shape) for name, a in out.items()})

    def expect(self, tensors: dict[str, tuple[np.dtype | None, tuple[int, ...]]]) -> None:
        """Each named tensor is in the pull area with this dtype (None: any) and shape: KeyError
        for one the model lacks, ValueError for another dtype or shape, ESTALE if the model
        changed since the door opened (``_misfit``)."""
        for name, (dtype, shape) in tensors.items():
            area = self.params.get(name)
            if area is None:
                self._misfit(KeyError(f"the model has no tensor {name!r}"))
            if (dtype is not None and dtype != area.dtype) or tuple(shape) != area.shape:
                self._misfit(ValueError(f"{name}: the model holds {area.dtype}{list(area.shape)}, the array is {dtype or ''}{list(shape)}"))

    def _misfit(self, error: Exception) -> None:
        """An array this door's layout has no room for: ESTALE if the model's tensors changed
        since the door opened (published again with other shapes, through any mount: the mount
        reads the layout anew; worker/steps.py then opens a new door), else ``error``."""
        self._ask({"op": "check"})
        raise error

    def _copy_out(self, out: dict[str, np.ndarray]) -> None:
        for name, a in out.items():
            area = self.params[name]
            if array_address(a) != array_address(area):
                np.copyto(a, area)

    def fsync(self) -> None:
        """Until every push of this rank is applied."""
        self._ask({"op": "fsync"})

    def close(self) -> None:
        """Leave the door: the mount ends its session (and frees its region). The mapping
        goes once no array of it is left (parameters a torch module adopted keep it)."""
        self.sock.close()
        self.grads = self.params = {}
        try:
            self.region.close()
        except BufferError:  # arrays of it still live: freed with the last of them
            pass

"""PyTorch on top of the mount: publish a module, pull its parameters, push its gradients.

    ps = ParameterServer("/mnt/ps", "mlp", rank)
    ps.publish(model)          # once (rank 0): every parameter becomes /mnt/ps/mlp/<name>.npy
    ps.pull(model)             # parameters as the model's sync policy lets this rank see them
    loss.backward()
    ps.push(model)             # every .grad, pushed as one stream
    ps.step(model)             # or both at once: push, then pull, overlapped by the mount

Only files are used, so this works with any mount of the cluster; the policy, optimizer and
compression are the model directory's xattrs (``configure``). A step is one stream per
direction (``/mnt/ps/.workers/<rank>/mlp.safetensors``, see irdmafs/steps.py): the gradients
are written straight from the ``.grad`` tensors' memory and the parameters read straight into
the parameters' memory (CPU float tensors; others go through a temporary and ``copy_``).
Through the mount's shared-memory door (steps.py), the parameters are made views of the door's
pull area at the first pull, so a pull copies nothing here and a push copies each gradient once.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .door import array_address
from .steps import door, pull_arrays, push_arrays, through_door

_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64, np.dtype(np.float16): torch.float16}


def _fits(t: torch.Tensor, area: np.ndarray) -> bool:
    """May ``t`` become (or already is) a view of the door's ``area``?"""
    return t.device.type == "cpu" and t.dtype == _TORCH.get(area.dtype) and tuple(t.shape) == area.shape


class ParameterServer:
    def __init__(self, mount: str | os.PathLike, model: str, rank: int):
        self.mount = Path(mount)
        self.model = model
        self.rank = rank
        self.root = self.mount / model

    @staticmethod
    def _file(name: str) -> str:
        return name + ".npy"  # tensor "fc.bias" is <model>/fc.bias.npy, as in the safetensors view

    def configure(self, **policy: str) -> None:
        """Set model xattrs, e.g. sync="bsp", workers="2", optimizer="sgd lr=0.1"."""
        self.root.mkdir(parents=True, exist_ok=True)
        for key, value in policy.items():
            os.setxattr(self.root, f"user.irdma.{key}", str(value).encode())

    def publish(self, module: torch.nn.Module) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for name, p in module.named_parameters():
            np.save(self.root / self._file(name), p.detach().cpu().numpy())

    def pull(self, module: torch.nn.Module) -> None:
        params = dict(module.named_parameters())
        if through_door(self.mount, self.model, self.rank, lambda d: self._pull_in_place(d, params)):
            return
        direct = {n: p for n, p in params.items() if p.device.type == "cpu" and p.is_contiguous() and p.dtype in (torch.float32, torch.float64, torch.float16)}
        out = {n: p.data.numpy() for n, p in direct.items()}
        staged = {n: np.empty_like(p.detach().cpu().contiguous().numpy()) for n, p in params.items() if n not in direct}
        pull_arrays(self.mount, self.model, self.rank, out | staged)
        with torch.no_grad():
            for n, arr in staged.items():
                params[n].copy_(torch.from_numpy(arr))

    def step(self, module: torch.nn.Module) -> None:
        """``push(module)`` then ``pull(module)`` in one request the mount overlaps. Through the
        door, each ``.grad`` then lives in the door's push area too (made a view of it once):
        ``zero_grad(set_to_none=False)`` and the next backward write it there, and the next
        step copies nothing in this process."""
        params = dict(module.named_parameters())
        grads = {n: p.grad.detach().cpu().numpy() for n, p in params.items() if p.grad is not None}

        def through(door) -> None:
            try:
                door.step(grads)
            except BaseException:
                # the mount may still keep this push in the area (for a replay): a gradient
                # living there must move out before the next backward writes it
                self._move_grads_out(door, params)
                raise
            self._adopt(door, params)
            for name, p in params.items():
                area = door.grads.get(name)
                if p.grad is not None and area is not None and _fits(p.grad, area):
                    p.grad = torch.from_numpy(area)  # holds this step's gradient already

        if not through_door(self.mount, self.model, self.rank, through):
            self.push(module)
            self.pull(module)

    def _pull_in_place(self, door, params: dict) -> None:
        """Pull through the door; the parameters then live in its pull area."""
        door.pull()
        self._adopt(door, params)

    @staticmethod
    def _adopt(door, params: dict) -> None:
        """Make each parameter a view of the door's pull area (once), so this and every later
        pull copies nothing in this process; a parameter that cannot be one is copied."""
        with torch.no_grad():
            for name, p in params.items():
                area = door.params.get(name)
                if area is None:
                    raise KeyError(f"the model has no tensor {name!r}")
                if _fits(p, area):
                    p.data = torch.from_numpy(area)
                else:
                    p.copy_(torch.from_numpy(area))

    def push(self, module: torch.nn.Module) -> None:
        params = dict(module.named_parameters())
        grads = {n: p.grad.detach().cpu().numpy() for n, p in params.items() if p.grad is not None}
        try:
            push_arrays(self.mount, self.model, self.rank, grads)
        finally:
            # A gradient living in the door's push area (adopted by step()) must move out: the
            # mount may keep the push there until a pull, and the next backward would write it.
            d = door(self.mount, self.model, self.rank)
            if d is not None:
                self._move_grads_out(d, params)

    @staticmethod
    def _move_grads_out(door, params: dict) -> None:
        areas = {array_address(a) for a in door.grads.values()}
        for p in params.values():
            if p.grad is not None and p.grad.data_ptr() in areas:
                p.grad = p.grad.clone()

    def close(self) -> None:
        pass

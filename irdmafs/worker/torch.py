"""PyTorch on top of the mount: publish a module, pull its parameters, push its gradients.

    ps = ParameterServer("/mnt/ps", "mlp", rank)
    ps.publish(model)          # once (rank 0): every parameter becomes /mnt/ps/mlp/<name>.npy
    ps.pull(model)             # parameters as the model's sync policy lets this rank see them
    loss.backward()
    ps.push(model)             # every .grad, pushed as one stream
    ps.step(model)             # or both at once: push, then pull, overlapped by the mount

Only files are used, so this works with any mount of the cluster; the policy, optimizer and
compression are the model directory's xattrs (``configure``). A step is one stream per
direction (``/mnt/ps/.workers/<rank>/mlp.safetensors``, see irdmafs/worker/steps.py): the gradients
are written straight from the ``.grad`` tensors' memory and the parameters read straight into
the parameters' memory (CPU float tensors; others go through a temporary and ``copy_``).
Through the mount's shared-memory door (worker/steps.py), the parameters are made views of the door's
pull area at the first pull, so a pull copies nothing here and a push copies each gradient once.

A model may also be a safetensors checkpoint where it lies (fs/models.py): ``"bert/model"``
names ``bert/model.safetensors``, or, for a sharded checkpoint, the shards listed by
``bert/model.safetensors.index.json``, each a model of its own: every call then goes to each
shard with the parameters it holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from .door import array_address
from .steps import door, pull_arrays, push_arrays, through_door

VIRT = 1 << 56  # inode numbers from here on are the mount's own (fs/inodes.py): views, status files
_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64, np.dtype(np.float16): torch.float16}


def _fits(t: torch.Tensor, area: np.ndarray) -> bool:
    """May ``t`` become (or already is) a view of the door's ``area``?"""
    return t.device.type == "cpu" and t.dtype == _TORCH.get(area.dtype) and tuple(t.shape) == area.shape


def _grads(params: dict, areas: dict | None = None) -> dict[str, np.ndarray]:
    """Every gradient as an array: the door's push area itself where the gradient lives there
    already (``step`` made it a view of it), else a view of the gradient's own memory."""
    out = {}
    for n, p in params.items():
        g = p.grad
        if g is None:
            continue
        area = areas.get(n) if areas else None
        out[n] = area if area is not None and g.data_ptr() == array_address(area) else g.detach().cpu().numpy()
    return out


def shards(mount: Path, model: str) -> list[tuple[str, set[str] | None]]:
    """(model name, the tensor names it holds, None for all) of each part of ``model``: itself,
    or the shards of a sharded safetensors checkpoint (``<model>.safetensors.index.json``).
    ValueError for a safetensors file that is not a model (the mount's log says why)."""
    index = mount / f"{model}.safetensors.index.json"
    if (mount / model).exists() or not index.exists():
        _check_model_file(mount, model)
        return [(model, None)]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        parts: dict[str, set[str]] = {}
        for name, shard in weight_map.items():
            if not shard.endswith(".safetensors") or "/" in shard:
                raise ValueError(f"shard {shard!r} is not a .safetensors file beside the index")
            parts.setdefault(shard[: -len(".safetensors")], set()).add(name)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index}: not a safetensors index: {exc}") from None
    folder = str(Path(model).parent)
    out = [(f"{folder}/{stem}" if folder != "." else stem, names) for stem, names in sorted(parts.items())]
    for m, _ in out:
        _check_model_file(mount, m)
    return out


def _model_file(mount: Path, model: str) -> Path | None:
    """``<model>.safetensors`` if it is a real file (not the view of a directory ``<model>``)."""
    f = mount / f"{model}.safetensors"
    return f if f.is_file() and f.stat().st_ino < VIRT else None


def _check_model_file(mount: Path, model: str) -> None:
    """A ``<model>.safetensors`` that the mount kept as plain bytes has no tensors to train."""
    f = _model_file(mount, model)
    if f is not None and not (mount / model).is_dir():
        raise ValueError(f"{f} is not a model: the mount kept it as plain bytes (its log says why; bf16 and other dtypes numpy lacks are not trainable)")


def _policy_target(mount: Path, model: str) -> Path:
    """Where a model's policy xattrs go: its safetensors file if it is one (the mount mirrors
    them on its tensors), else its directory (made if missing)."""
    f = _model_file(mount, model)
    if f is not None:
        return f
    (mount / model).mkdir(parents=True, exist_ok=True)
    return mount / model


class ParameterServer:
    def __init__(self, mount: str | os.PathLike, model: str, rank: int):
        self.mount = Path(mount)
        self.model = model
        self.rank = rank
        self.root = self.mount / model
        self.parts = shards(self.mount, model)

    def _each(self, params: dict) -> list[tuple[str, dict]]:
        """(model name, its share of ``params``) per part of the model; KeyError for a
        parameter no shard holds."""
        covered = set().union(*(names for _, names in self.parts if names is not None)) if self.parts[0][1] is not None else set(params)
        missing = sorted(set(params) - covered)
        if missing:
            raise KeyError(f"the model has no tensor {missing[0]!r} (no shard of {self.model} holds it)")
        return [(m, params if names is None else {n: p for n, p in params.items() if n in names}) for m, names in self.parts]

    @staticmethod
    def _file(name: str) -> str:
        return name + ".npy"  # tensor "fc.bias" is <model>/fc.bias.npy, as in the safetensors view

    def configure(self, **policy: str) -> None:
        """Set model xattrs, e.g. sync="bsp", workers="2", optimizer="sgd lr=0.1"."""
        for model, _ in self.parts:
            target = _policy_target(self.mount, model)
            for key, value in policy.items():
                os.setxattr(target, f"user.irdma.{key}", str(value).encode())

    def publish(self, module: torch.nn.Module) -> None:
        """Every parameter as ``<model>/<name>.npy``; into a safetensors model file's tensors,
        in the dtype the file holds (a float32 module loaded from a float16 checkpoint)."""
        for model, params in self._each(dict(module.named_parameters())):
            root = self.mount / model
            root.mkdir(parents=True, exist_ok=True)
            in_file = _model_file(self.mount, model) is not None
            for name, p in params.items():
                path = root / self._file(name)
                arr = p.detach().cpu().numpy()
                if in_file:
                    arr = arr.astype(np.dtype(os.getxattr(path, "user.irdma.dtype").decode()), copy=False)
                np.save(path, arr)

    def pull(self, module: torch.nn.Module) -> None:
        for model, params in self._each(dict(module.named_parameters())):
            self._pull(model, params)

    def _pull(self, model: str, params: dict) -> None:
        if through_door(self.mount, model, self.rank, lambda d: self._pull_in_place(d, params)):
            return
        direct = {n: p for n, p in params.items() if p.device.type == "cpu" and p.is_contiguous() and p.dtype in (torch.float32, torch.float64, torch.float16)}
        out = {n: p.data.numpy() for n, p in direct.items()}
        staged = {n: np.empty_like(p.detach().cpu().contiguous().numpy()) for n, p in params.items() if n not in direct}
        pull_arrays(self.mount, model, self.rank, out | staged)
        with torch.no_grad():
            for n, arr in staged.items():
                params[n].copy_(torch.from_numpy(arr))

    def step(self, module: torch.nn.Module) -> None:
        """``push(module)`` then ``pull(module)`` in one request the mount overlaps. Through the
        door, each ``.grad`` then lives in the door's push area too (made a view of it once):
        ``zero_grad(set_to_none=False)`` and the next backward write it there, and the next
        step copies nothing in this process."""
        for model, params in self._each(dict(module.named_parameters())):
            self._step(model, params)

    def _step(self, model: str, params: dict) -> None:
        def through(door) -> None:
            grads = _grads(params, door.grads)
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
                if p.grad is None or area is None or p.grad.data_ptr() == array_address(area):
                    continue  # (a view of it since an earlier step: a model's thousand tensors cost nothing)
                if _fits(p.grad, area):
                    p.grad = torch.from_numpy(area)  # holds this step's gradient already

        if not through_door(self.mount, model, self.rank, through):
            self._push(model, params)
            self._pull(model, params)

    def _pull_in_place(self, door, params: dict) -> None:
        """Pull through the door; the parameters then live in its pull area. Their shapes are
        checked first: a door opened before the model was published again with other shapes
        answers ESTALE, and ``through_door`` opens a new one."""
        door.expect({name: (None, tuple(p.shape)) for name, p in params.items()})
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
                if p.data_ptr() == array_address(area):
                    continue  # a view of it already (an earlier pull)
                if _fits(p, area):
                    p.data = torch.from_numpy(area)
                else:
                    p.copy_(torch.from_numpy(area))

    def push(self, module: torch.nn.Module) -> None:
        for model, params in self._each(dict(module.named_parameters())):
            self._push(model, params)

    def _push(self, model: str, params: dict) -> None:
        grads = _grads(params)
        try:
            push_arrays(self.mount, model, self.rank, grads)
        finally:
            # A gradient living in the door's push area (adopted by step()) must move out: the
            # mount may keep the push there until a pull, and the next backward would write it.
            d = door(self.mount, model, self.rank)
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

"""PyTorch on top of the mount: publish a module, pull its parameters, push its gradients.

    ps = ParameterServer("/mnt/ps", "mlp", rank)
    ps.publish(model)          # once (rank 0): every parameter becomes /mnt/ps/mlp/<name>.npy
    ps.pull(model)             # parameters as the model's sync policy lets this rank see them
    loss.backward()
    ps.push(model)             # every .grad, pushed through /mnt/ps/.workers/<rank>/mlp/

Only files are used, so this works with any mount of the cluster; the policy, optimizer and
compression are the model directory's xattrs (``configure``). Pulls and pushes of the tensors of
one step run concurrently (a thread each), so many small tensors cost about one round trip.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


class ParameterServer:
    def __init__(self, mount: str | os.PathLike, model: str, rank: int, threads: int = 16):
        self.root = Path(mount) / model
        self.worker = Path(mount) / ".workers" / str(rank) / model
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="irdmafs-torch")

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
        arrays = self.pool.map(lambda n: np.load(self.worker / self._file(n)), list(params))
        with torch.no_grad():
            for (name, p), arr in zip(params.items(), arrays):
                p.copy_(torch.from_numpy(arr))

    def push(self, module: torch.nn.Module) -> None:
        grads = [(n, p.grad.detach().cpu().numpy()) for n, p in module.named_parameters() if p.grad is not None]
        list(self.pool.map(lambda item: np.save(self.worker / self._file(item[0]), item[1]), grads))

    def close(self) -> None:
        self.pool.shutdown()

"""``irdmafs.torch``: the name users import; the module is ``irdmafs.worker.torch`` (the worker's side)."""

import sys

from .worker import torch as _module

sys.modules[__name__] = _module

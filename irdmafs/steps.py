"""``irdmafs.steps``: the name users import; the module is ``irdmafs.worker.steps`` (the worker's side)."""

import sys

from .worker import steps as _module

sys.modules[__name__] = _module

"""The worker's side: what a training process imports to talk to a mount, and nothing of the
cluster. ``steps`` (numpy arrays in and out of a model's step streams), ``torch`` (a PyTorch
module published, pulled and pushed through the mount) and ``door`` (the shared-memory door to the
step streams; the mount's side is ``fs/door_server.py``). ``irdmafs.steps`` and ``irdmafs.torch``
are the same modules under the names users import.
"""

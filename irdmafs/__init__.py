"""irdmafs: a parameter server whose interface is a FUSE file system.

Layers, top to bottom: ``fs`` (the mount), ``client`` (striping, replicas), ``server`` (PS nodes),
``transport`` (remote memory as a device: memory, tcp, verbs). See README.md for the picture.
"""

__version__ = "0.1.0"

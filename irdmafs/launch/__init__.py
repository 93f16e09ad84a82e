"""The launchers: the processes a user starts and what starts them. ``cli`` (the ``irdmafs``
command), ``mount`` (a mount's process wiring), ``mount_helper`` (``mount.irdmafs`` for mount(8)),
``local`` (a whole cluster on one machine, the embedded default), ``etcd_process`` (a local etcd
for it) and ``rebalance`` (moving a running cluster to a new membership). The top floor: nothing
below imports it. A node's process is ``python -m irdmafs.server.node`` (server/node.py).
"""

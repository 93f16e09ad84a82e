"""The cluster runtime: one process's view of the cluster, shared by a node and a mount alike.

It owns the connections to the nodes and the calls on them (``peers``), what this process hears of
each node (``heartbeats``, ``liveness``), who serves what (``roles``, ``routing``, ``placement``),
the write-staging slots in peers' memory (``slots``), and the ``Cluster`` that puts them together
(``cluster``); and the process's loop itself: batches to one destination (``batching``), bounds on
silence (``silence``), work sent off the loop (``offload``), the loop's lag (``looplag``) and
systemd's readiness (``notify``). It sits above ``transport`` and ``coord``, below ``client`` and
``server``, and imports neither of those.
"""

"""The config of a cluster of one node "a" on the in-memory transport, for tests that serve that
node themselves (a handler answering calls) and watch what a ``Cluster`` or ``Client`` does."""

from irdmafs.config import from_dict


def one_node_config(port: int, **timing: float):
    return from_dict(
        {
            "nodes": [{"name": "a", "host": "mem", "port": port}],
            "token": "test-token-123",
            "replicas": 1,
            "transport": ["memory"],
            "coordinator": ["http://127.0.0.1:2379"],  # never reached
            "heartbeat": 0.05,
            **timing,
        }
    )

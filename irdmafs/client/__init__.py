"""The client: the tensor- and file-level API (client), striping and failover (stripe)."""

from .client import Client, SyncClient

__all__ = ["Client", "SyncClient"]

"""SyncClient: the Client for code without trio, against real node processes."""

import numpy as np
import pytest
import trio

from irdmafs.client import SyncClient
from irdmafs.launch.local import LocalCluster, wait_settled, write_config
from irdmafs.errors import RemoteError

pytestmark = pytest.mark.cluster


def test_sync_client_round_trip(tmp_path, etcd_endpoints):
    lc = LocalCluster(write_config(tmp_path, 2, 2, transport=["tcp"], coordinator=etcd_endpoints))
    lc.start_all()
    try:
        trio.run(wait_settled, lc.cfg)
        with SyncClient(lc.cfg) as c:
            c.makedirs("/m")
            arr = np.linspace(0, 1, 100_001, dtype=np.float64)
            c.save("/m/a.npy", arr)
            assert np.array_equal(c.load("/m/a.npy"), arr)
            assert c.listdir("/m") == ["a.npy"]
            with pytest.raises(RemoteError) as err:
                c.load("/m/missing.npy")
            assert err.value.code == "ENOENT"
    finally:
        lc.stop_all()

"""When a primary expels a backup it could not replicate to (server/replicator.py, views V6)."""

import trio

from irdmafs.cluster import DOWN, READY
from irdmafs.server.replicator import Replicator
from irdmafs.transport.base import TimeoutError


class Heartbeats:
    """What a node's heartbeat probes say of its peers, as the next ``refresh`` will find them."""

    def __init__(self, after_refresh: dict[str, str]):
        self.state = {p: DOWN for p in after_refresh}  # the failed sends counted them down
        self.after_refresh = after_refresh
        self.view = object()  # a coordinator is there

    async def refresh(self):
        self.state = dict(self.after_refresh)

    def heard_majority(self):
        return sum(s != DOWN for s in self.state.values()) + 1 >= 2


class Lease:
    def __init__(self):
        self.expelled = []

    async def expel(self, peer):
        self.expelled.append(peer)
        return True

    async def refresh(self):
        pass


class Serving:
    def __init__(self):
        self.lease = Lease()


async def test_a_backup_the_heartbeats_reach_again_is_sent_to_again_not_expelled(autojump_clock):
    """A send to n2 failed while this node's own link was down; by the time it decides, its
    heartbeats reach n2 again: it must not expel a healthy peer (which then has to resync, with
    its stripes down to one copy meanwhile: chaos --views seed 7). A peer still silent is
    expelled as before."""
    cluster = Heartbeats({"n2": READY, "n3": DOWN})
    serving = Serving()
    rep = Replicator("n1", cluster, slots=None, snapshot=dict, serving=serving)
    for peer in ("n2", "n3"):
        rep.lost(peer, TimeoutError(f"{peer}: no answer"))
    await rep._out_of_view(["n2", "n3"])
    assert serving.lease.expelled == ["n3"]
    assert not rep.unreached

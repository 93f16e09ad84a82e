"""A node's memory budget (server/budget.py): stripes and staging count against one capacity,
full is ENOSPC with a message saying what holds the memory, and ``irdmafs up`` sizes its nodes
to the machine. The loop-lag monitor (runtime/looplag.py) records a loop held without yielding."""

import time

import pytest
import trio

from irdmafs.launch.cli import memory_line
from irdmafs.runtime.looplag import LoopLag
from irdmafs.server.budget import MIN_CAPACITY, Budget, NoSpace, machine_capacity
from irdmafs.server.staging import StagingRegions
from irdmafs.server.store import Store
from irdmafs.server.updates import StripeKey
from irdmafs.errors import RemoteError
from irdmafs.transport.memory import MemoryTransport

UNIT = 64 << 10


async def test_stripes_and_staging_share_one_capacity():
    transport = MemoryTransport("test-token-123")
    budget = Budget(4 * UNIT)
    store, staging = Store(transport, budget), StagingRegions(transport, budget)
    staging.alloc("mount-1", 2 * UNIT)
    store.install(StripeKey(1, 0), 0, memoryview(b"a" * UNIT), UNIT)
    store.install(StripeKey(1, 1), 0, memoryview(b"b" * UNIT), UNIT)
    assert budget.used == 4 * UNIT
    with pytest.raises(NoSpace, match="bytes of stripes do not fit .staging 131072, stripes 131072 held"):
        store.install(StripeKey(1, 2), 0, memoryview(b"c"), UNIT)
    with pytest.raises(RemoteError) as exc:
        staging.alloc("mount-2", UNIT)
    assert exc.value.code == "ENOSPC" and "staging for mount-2" in str(exc.value)
    assert store.get(1, 2) is None and budget.used == 4 * UNIT  # nothing half-taken
    staging.release("mount-1")
    store.install(StripeKey(1, 2), 0, memoryview(b"c"), UNIT)  # room again
    assert budget.held["staging"] == 0 and budget.held["stripes"] == 3 * UNIT


def test_machine_capacity_leaves_the_host_room(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemAvailable:   20971520 kB\n")
    per_node = machine_capacity(3, str(meminfo))
    assert per_node == int(20 * 2**30 * 0.6) // 3 >> 20 << 20
    assert 3 * per_node <= 0.6 * 20 * 2**30
    assert machine_capacity(1, str(meminfo)) == 8 << 30  # never above the config's default
    meminfo.write_text("MemAvailable:   102400 kB\n")
    assert machine_capacity(3, str(meminfo)) == MIN_CAPACITY


def test_status_names_what_holds_a_full_node():
    line = memory_line({"name": "n1", "capacity": 100 << 20, "held": {"stripes": 57 << 20, "staging": 0, "snapshots": 40 << 20}, "loop_lag": 0.012})
    assert "97 of 100 MiB" in line and "snapshots 40" in line and "FULL" in line and "0.012 s" in line
    assert "FULL" not in memory_line({"name": "n1", "capacity": 100 << 20, "held": {"stripes": 10 << 20}})


async def test_loop_lag_sees_a_loop_held_without_yielding():
    lag = LoopLag()
    async with trio.open_nursery() as n:
        n.start_soon(lag.run)
        await trio.sleep(0.05)
        time.sleep(0.3)  # work that does not yield: the monitor's next wake-up is late by about this
        await trio.sleep(0.05)
        n.cancel_scope.cancel()
    assert lag.worst >= 0.25 and lag.recent >= 0.25


async def test_loop_lag_tells_its_own_work_from_a_host_that_did_not_run_it():
    lag = LoopLag()
    lag.observe(0.9, time.monotonic(), busy=0.01)  # not run: the host starved every process
    assert lag.worst == 0.9 and lag.worst_busy == 0.01
    async with trio.open_nursery() as n:
        n.start_soon(lag.run)
        await trio.sleep(0.05)
        end = time.thread_time() + 0.3
        while time.thread_time() < end:  # the loop's own work, on the CPU
            pass
        await trio.sleep(0.05)
        n.cancel_scope.cancel()
    assert lag.worst_busy >= 0.25

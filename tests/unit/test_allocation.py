"""A new file's number chosen to place its first stripe on the node leading the fewest bytes of
its directory (server/allocation.py): pure properties, and the namespace choosing it for real
over an in-process cluster."""

import numpy as np
from hypothesis import given, settings, strategies as st

from irdmafs.client.client import Client
from irdmafs.runtime.placement import rank, stripe_key
from irdmafs.server.allocation import TRIES, balanced_ino, led_bytes
from irdmafs.transport.memory import MemoryTransport

from .test_cluster_inprocess import config, start_cluster

UNIT = 4 << 20
MB = 1 << 20
# a ResNet-50-like mix: a few tensors of two or three stripes, many of one, many of a few KB
SIZES = [9 * MB + 128] * 3 + [int(4.5 * MB)] * 6 + [int(2.3 * MB)] * 16 + [MB + 128] * 24 + [600 << 10] * 20 + [8 << 10] * 100


def _created(sizes: list[int], nodes: list[str], pick: bool) -> dict[str, int]:
    """The bytes each node leads after files of ``sizes`` are made one after another in one
    directory, numbered by ``balanced_ino`` (``pick``) or one after another."""
    files, ino = [], 100
    for size in sizes:
        ino = balanced_ino(ino, files, nodes) if pick else ino
        files.append((ino, size, UNIT))
        ino += 1
    return led_bytes(files, nodes)


def _worst(led: dict[str, int]) -> float:
    return max(led.values()) / (sum(led.values()) / len(led))


def test_a_directory_of_uneven_tensors_spreads_its_bytes_over_the_nodes():
    for n in (3, 4, 5):
        nodes = [f"n{i}" for i in range(n)]
        hashed, chosen = _worst(_created(SIZES, nodes, False)), _worst(_created(SIZES, nodes, True))
        assert chosen <= 1.2, (n, chosen)
        assert chosen < hashed, (n, chosen, hashed)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 10**9), st.lists(st.tuples(st.integers(1, 10**6), st.integers(0, 3 * UNIT)), max_size=20), st.integers(1, 6))
def test_a_number_only_moves_forward_by_at_most_tries(first, siblings, n):
    nodes = [f"n{i}" for i in range(n)]
    ino = balanced_ino(first, [(f, s, UNIT) for f, s in siblings], nodes)
    assert first <= ino < first + TRIES
    if n == 1:
        assert ino == first


async def test_the_namespace_numbers_new_files_to_balance_their_directory(nursery):
    cfg = config(n=3, r=2, unit=256 << 10)
    nodes = await start_cluster(nursery, cfg)
    sizes = [(700 << 10)] * 4 + [(300 << 10)] * 10 + [(100 << 10)] * 20 + [4096] * 20
    async with Client.connect(cfg, MemoryTransport(cfg.token)) as c:
        await c.paths.makedirs("/m")
        inos = []
        for i, size in enumerate(sizes):
            inos.append((await c.paths.write_file(f"/m/t{i}", np.full(size, i % 251, np.uint8).tobytes()))["ino"])
        assert inos == sorted(inos) and len(set(inos)) == len(inos)  # never reused, only forward
        for i, size in enumerate(sizes):  # every byte where its placement says
            assert await c.read(inos[i], 0, size) == np.full(size, i % 251, np.uint8).tobytes()
        for node in nodes:  # every replica applied the primary's numbers
            assert [node.meta.lookup(node.meta.lookup(1, "m")["ino"], f"t{i}")["ino"] for i in range(len(sizes))] == inos
        files = [(ino, size, cfg.stripe_unit) for ino, size in zip(inos, sizes)]
        for i in range(1, len(files)):  # the rule itself: each file's first stripe on the least-leading node
            before = led_bytes(files[:i], cfg.names)
            tied_as_hashing = rank(stripe_key(inos[i - 1] + 1, 0), cfg.names)  # the next free number's ranking
            assert rank(stripe_key(inos[i], 0), cfg.names)[0] == min(tied_as_hashing, key=lambda n: before[n]), i
        led = led_bytes(files, cfg.names)
        hashed = led_bytes([(100 + i, size, cfg.stripe_unit) for i, size in enumerate(sizes)], cfg.names)
        assert _worst(led) <= 1.2 and _worst(led) < _worst(hashed), (led, hashed)

"""``free_ports`` (launch/local.py): distinct ports, free when handed out, never twice in one process,
and below the kernel's ephemeral range, where no outgoing connection can take one before the
server that was given it binds it (CI's prometheus test once lost a port that way)."""

from __future__ import annotations

import socket

from irdmafs.launch.local import _ephemeral_low, free_ports


def test_ports_are_distinct_free_below_the_ephemeral_range_and_never_handed_out_twice():
    first = free_ports(50)
    second = free_ports(50)
    assert len(set(first) | set(second)) == 100
    assert all(1024 <= p < _ephemeral_low() for p in first + second)
    for p in first[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: a server given it can bind it


def test_an_outgoing_connection_takes_its_local_port_from_the_ephemeral_range():
    """What the choice rests on: connect() picks a local port at or above the range's low end."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        with socket.create_connection(srv.getsockname()) as c:
            assert c.getsockname()[1] >= _ephemeral_low()

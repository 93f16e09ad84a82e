"""What a user would pick instead of irdmafs, measured for scripts/bench.py.

- torch.distributed with the gloo backend: ``broadcast`` and ``all_reduce`` of a float32 tensor
  between 2 processes on loopback (the collective a data-parallel job uses to share a model);
- a gRPC parameter server (grpcio, no generated code: raw-bytes unary methods ``/ps/Get`` and
  ``/ps/Put``, message limits raised), in its own process, fetched and stored from another.

Each returns median seconds per operation over ``reps`` runs, after a warm-up run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- gloo -------------------------------------------------------------------------------------------
def _gloo_rank(rank: int, port: int, sizes: list[int], reps: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        for op in ("broadcast", "all_reduce"):
            times = []
            for i in range(reps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if op == "broadcast":
                    dist.broadcast(t, src=0)
                else:
                    dist.all_reduce(t)
                if i:  # the first is a warm-up
                    times.append(time.perf_counter() - t0)
            res[f"{op}_{nbytes // MiB}"] = statistics.median(times)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 1:  # the receiving side: broadcast is done when rank 1 has the data
        out.put(res)


def gloo(sizes: list[int], reps: int) -> dict[str, float]:
    """{"broadcast_256": seconds, "all_reduce_256": seconds, ...}"""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, sizes, reps, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


# -- gRPC -------------------------------------------------------------------------------------------
GRPC_LIMITS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


def _grpc_server(port: int, ready: mp.Event, stop: mp.Event) -> None:
    from concurrent import futures

    import grpc

    store: dict[bytes, bytes] = {}

    def put(request: bytes, context) -> bytes:
        key, _, value = request.partition(b"\0")
        store[key] = value
        return b""

    def get(request: bytes, context) -> bytes:
        return store.get(request, b"")

    handler = grpc.method_handlers_generic_handler(
        "ps",
        {
            "Put": grpc.unary_unary_rpc_method_handler(put),  # no (de)serializers: raw bytes
            "Get": grpc.unary_unary_rpc_method_handler(get),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_LIMITS)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    stop.wait()
    server.stop(0)


def grpc_ps(sizes: list[int], reps: int) -> dict[str, float]:
    """{"get_256": seconds, "put_256": seconds, ...}: unary calls moving the tensor's bytes."""
    import grpc

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    port = _free_port()
    proc = ctx.Process(target=_grpc_server, args=(port, ready, stop))
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("gRPC server did not start")
        res = {}
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_LIMITS) as ch:
            put, get = ch.unary_unary("/ps/Put"), ch.unary_unary("/ps/Get")
            for nbytes in sizes:
                value = os.urandom(MiB) * (nbytes // MiB)
                key = f"t{nbytes}".encode()
                request = key + b"\0" + value
                times = {"put": [], "get": []}
                for i in range(reps + 1):
                    t0 = time.perf_counter()
                    put(request)
                    t1 = time.perf_counter()
                    got = get(key)
                    t2 = time.perf_counter()
                    if len(got) != nbytes:
                        raise RuntimeError(f"gRPC get returned {len(got)} of {nbytes} bytes")
                    if i:
                        times["put"].append(t1 - t0)
                        times["get"].append(t2 - t1)
                for op, ts in times.items():
                    res[f"{op}_{nbytes // MiB}"] = statistics.median(ts)
        return res
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()

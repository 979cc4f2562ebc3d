"""Store server under many idle connections: threads, memory and latency with N clients.

    python scripts/bench_store.py [--connections 2000]

The server runs in a child process (so its threads and RSS are its own); this process opens the
authenticated clients, then times set/get round trips while all of them are connected.
Writes out/bench_store.csv.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import format_table, write_csv  # noqa: E402


def _serve(conn) -> None:
    from nccl_ddp.store.server import StoreServer

    with StoreServer("127.0.0.1", 0, "bench") as s:
        conn.send(s.port)
        conn.recv()  # until the parent is done


def _proc_status(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {"threads": int(fields["Threads"]), "rss_mib": int(fields["VmRSS"].split()[0]) / 1024}


def _round_trips(client, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        client.set("k", str(i))
        client.get("k")
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--connections", type=int, default=2000)
    p.add_argument("--round-trips", type=int, default=2000)
    a = p.parse_args()
    from nccl_ddp.store.client import TCPStore

    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    port = parent.recv()
    rows, clients = [], []
    try:
        first = TCPStore("127.0.0.1", port, "bench", timeout=30)
        clients.append(first)
        rows.append(
            dict(
                connections=1,
                connect_s=0.0,
                us_per_set_get=_round_trips(first, a.round_trips),
                **_proc_status(proc.pid),
            )
        )
        t0 = time.perf_counter()
        while len(clients) < a.connections:
            clients.append(TCPStore("127.0.0.1", port, "bench", timeout=30))
        connect = time.perf_counter() - t0
        rows.append(
            dict(
                connections=len(clients),
                connect_s=connect,
                us_per_set_get=_round_trips(first, a.round_trips),
                **_proc_status(proc.pid),
            )
        )
    finally:
        for c in clients:
            c.close()
        parent.send("done")
        proc.join(10)
    print(
        format_table(
            rows,
            ["connections", "connect_s", "us_per_set_get", "threads", "rss_mib"],
            {"connect_s": ".2f", "us_per_set_get": ".0f", "rss_mib": ".1f"},
        )
    )
    os.makedirs("out", exist_ok=True)
    write_csv(rows, "out/bench_store.csv")


if __name__ == "__main__":
    main()

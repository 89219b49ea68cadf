"""What this machine's kernel charges for one chunk written to a client (issue #32).

A proxy that reads one upstream event and writes one chunk per token pays at least one
`send` and one `recv` per token before any of its Python runs. On loopback TCP the
receiver's side of the network stack runs inside the sender's system call, so the
proxy's `send` also pays for its client's receive. This measures, with nothing of
tokentrail in it:

- a `send` of `--size` bytes (about one streamed chunk with top-5 alternatives) on a
  loopback TCP socket with Nagle off, while another thread drains the other end: the
  sending thread's CPU time per call;
- a `send` and `recv` of the same bytes on a Unix socketpair, for comparison;
- `os.getpid()`, a bare system call.

    python benchmarks/bench_send.py [--size 900] [--calls 20000] [--rounds 3]

Each figure is the median over the rounds, in CPU microseconds per call.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import threading
import time


def tcp_send(size: int, calls: int) -> float:
    """CPU µs per `send` of `size` bytes on loopback TCP, drained by another thread."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        client = socket.create_connection(srv.getsockname())
        server, _ = srv.accept()
        with client, server:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = b"x" * size

            def drain() -> None:
                left = size * calls
                while left > 0:
                    got = server.recv(1 << 20)
                    if not got:
                        return
                    left -= len(got)

            reader = threading.Thread(target=drain)
            reader.start()
            start = time.thread_time()
            for _ in range(calls):
                client.sendall(msg)
            spent = time.thread_time() - start
            reader.join()
    return spent / calls * 1e6


def pair_round_trip(size: int, calls: int) -> float:
    """CPU µs per `send` + `recv` of `size` bytes on a Unix socketpair."""
    a, b = socket.socketpair()
    with a, b:
        msg = b"x" * size
        start = time.thread_time()
        for _ in range(calls):
            a.sendall(msg)
            b.recv(1 << 16)
        return (time.thread_time() - start) / calls * 1e6


def bare(calls: int) -> float:
    """CPU µs per `os.getpid()`."""
    start = time.thread_time()
    for _ in range(calls):
        os.getpid()
    return (time.thread_time() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=900, help="bytes per send (default 900)")
    ap.add_argument("--calls", type=int, default=20000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = {"send, loopback TCP": [], "send + recv, Unix socketpair": [], "os.getpid()": []}
    for _ in range(args.rounds):
        rows["send, loopback TCP"].append(tcp_send(args.size, args.calls))
        rows["send + recv, Unix socketpair"].append(pair_round_trip(args.size, args.calls))
        rows["os.getpid()"].append(bare(args.calls))
    print(f"{platform.platform()}, {os.cpu_count()} CPUs; {args.size} bytes, "
          f"{args.calls} calls x {args.rounds} rounds")
    print("| call | CPU µs per call, median | per round |")
    print("|---|---:|---|")
    for name, got in rows.items():
        each = ", ".join(f"{v:.2f}" for v in got)
        print(f"| {name} | {statistics.median(got):.2f} | {each} |")


if __name__ == "__main__":
    main()

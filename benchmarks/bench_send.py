"""What this machine's kernel charges for one chunk written to a client (issue #32).

A proxy that reads one upstream event and writes one chunk per token pays at least one
`send` and one `recv` per token before any of its Python runs. On loopback TCP the
receiver's side of the network stack runs inside the sender's system call, so the
proxy's `send` also pays for its client's receive. This measures, with nothing of
tokentrail in it:

- a `send` of `--size` bytes (about one streamed chunk with top-5 alternatives) on a
  loopback TCP socket with Nagle off, while another thread drains the other end as
  fast as it can: the sending thread's CPU time per call;
- the same to a reader in another process that sleeps between chunks, as a streaming
  client does (the sender waits `--gap` microseconds between sends, spinning so that
  it keeps its core): each send then wakes the reader, and on a virtual machine waking
  a process on another vCPU is dear;
- a `send` and `recv` of the same bytes on a Unix socketpair, for comparison;
- `os.getpid()`, a bare system call.

    python benchmarks/bench_send.py [--size 900] [--calls 20000] [--gap 1000] [--rounds 3]

Each figure is the median over the rounds, in CPU microseconds per call.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time


def _drain(sock: socket.socket, total: int) -> None:
    """Read `total` bytes from `sock` (or until it closes)."""
    while total > 0:
        got = sock.recv(1 << 20)
        if not got:
            return
        total -= len(got)


def tcp_send(size: int, calls: int) -> float:
    """CPU µs per `send` of `size` bytes on loopback TCP, drained by another thread."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        client = socket.create_connection(srv.getsockname())
        server, _ = srv.accept()
        with client, server:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = b"x" * size
            reader = threading.Thread(target=_drain, args=(server, size * calls))
            reader.start()
            start = time.thread_time()
            for _ in range(calls):
                client.sendall(msg)
            spent = time.thread_time() - start
            reader.join()
    return spent / calls * 1e6


def _read_all(port: int, total: int) -> None:
    """The reader process: connect to `port` and drain `total` bytes."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        _drain(s, total)


def tcp_send_waking(size: int, calls: int, gap_us: float) -> float:
    """CPU µs per `send` of `size` bytes on loopback TCP to a reader process that sleeps
    between chunks (`gap_us` between sends)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        reader = mp.Process(target=_read_all, args=(srv.getsockname()[1], size * calls))
        reader.start()
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = b"x" * size
            spent = 0.0
            for _ in range(calls):
                start = time.thread_time()
                conn.sendall(msg)
                spent += time.thread_time() - start
                until = time.perf_counter() + gap_us / 1e6
                while time.perf_counter() < until:  # spin: keep this core
                    pass
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
    ap.add_argument("--gap", type=float, default=1000.0,
                    help="µs between sends to the sleeping reader (default 1000)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    waking = f"send, loopback TCP, to a reader process asleep between chunks ({args.gap:g} µs)"
    rows: dict[str, list[float]] = {
        "send, loopback TCP, drained as fast as it can": [], waking: [],
        "send + recv, Unix socketpair": [], "os.getpid()": [],
    }  # fmt: skip
    for _ in range(args.rounds):
        rows["send, loopback TCP, drained as fast as it can"].append(
            tcp_send(args.size, args.calls))
        rows[waking].append(tcp_send_waking(args.size, max(args.calls // 10, 100), args.gap))
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

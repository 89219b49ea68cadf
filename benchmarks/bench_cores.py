"""How far this machine itself lets two processes of the proxy's work scale (issue #32).

`serve --workers 2` is asked to serve at least 1.7x the tokens of one worker where the
proxy is the limit. That cannot exceed what the machine gives two busy Python processes
at once: on a virtual machine two vCPUs may share a physical core, a cache or memory
bandwidth. This runs the proxy's own per-token work in process (`bench_reader.py`'s
workload: llama-server recordings of the demo model through `StepReader`: the SSE split,
the JSON decode, the realigner) in one process, then in `--procs` processes at once,
alternating, and reports tokens per second of all of them together, their ratio, and
each process's CPU time per token. No sockets, no server: nothing but the machine's
own scaling.

    python benchmarks/bench_cores.py [--procs 2] [--rounds 5] [--seconds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time

from bench_reader import _read, workload


def _work(start: float, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    engine, streams = workload("completion")
    for s in streams:  # a warm-up pass
        _read(engine, s)
    while time.time() < start:
        time.sleep(0.001)
    tokens, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < seconds:
        for s in streams:
            tokens += _read(engine, s)
    out.put((tokens, time.perf_counter() - wall0, time.process_time() - cpu0))


def run(procs: int, seconds: float) -> tuple[float, float]:
    """(tokens per second of all `procs` processes together, median CPU µs per token)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = time.time() + 3.0  # after every process has loaded the vocabulary and warmed up
    ps = [ctx.Process(target=_work, args=(start, seconds, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    got = [out.get() for _ in ps]
    for p in ps:
        p.join()
    rate = sum(t / w for t, w, _ in got)
    return rate, statistics.median(c / t * 1e6 for t, _, c in got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0, help="each process's busy time per run")
    args = ap.parse_args()
    one, many = [], []
    for _ in range(args.rounds):
        one.append(run(1, args.seconds))
        many.append(run(args.procs, args.seconds))
    r1 = statistics.median(r for r, _ in one)
    rn = statistics.median(r for r, _ in many)
    ratios = [m[0] / o[0] for o, m in zip(one, many, strict=True)]
    print(f"{platform.platform()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; medians of {args.rounds} alternating rounds")
    print("| processes | tokens/s, all together | CPU µs/token per process |")
    print("|---:|---:|---:|")
    print(f"| 1 | {r1:,.0f} | {statistics.median(c for _, c in one):.1f} |")
    print(f"| {args.procs} | {rn:,.0f} | {statistics.median(c for _, c in many):.1f} |")
    print(f"\nRatio {args.procs} / 1: **{rn / r1:.2f}x** (per round: "
          f"{', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()

"""How much a cross-process wake-up costs here: a socket ping-pong with and without polling.

Not a test. Run from the repository with the main venv:

    .venv/bin/python bench/bench_wakeups.py [--round-trips N]

Two processes (this one and a forked child) bounce 60 bytes over a socketpair, N times for
each arrangement, and the median round trip is printed:

* both sleep in ``select`` between messages (what a binding round trip did before the
  worker polled for replies);
* the caller polls (non-blocking reads) for up to 100 us before it sleeps, as the worker's
  wait in place does (``_POLL_S`` in ``dsh_core/coderuntime/worker/runner.py``);
* both sleep, both pinned to one CPU (``sched_setaffinity``), where no CPU idles between them.

On the project's 2-vCPU VM (twelfth session) the three took 64-67, 19 and 5 us: waking a
process on an idle CPU costs far more there than the work of either side.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import time


def _wait(fd: int, poll_s: float) -> bytes:
    if poll_s:
        deadline = time.perf_counter() + poll_s
        while time.perf_counter() < deadline:
            try:
                return os.read(fd, 1 << 16)
            except BlockingIOError:
                pass
    select.select([fd], [], [])
    return os.read(fd, 1 << 16)


def ping_pong(round_trips: int, *, caller_poll_s: float = 0.0, one_cpu: bool = False) -> float:
    """Median microseconds of one 60-byte round trip between this process and a forked child."""
    caller, answerer = socket.socketpair()
    caller.setblocking(False)
    answerer.setblocking(False)
    affinity = os.sched_getaffinity(0)
    if one_cpu:
        os.sched_setaffinity(0, {min(affinity)})
    pid = os.fork()
    if pid == 0:  # the answerer: echo until the caller closes its end
        caller.close()
        fd = answerer.fileno()
        while True:
            data = _wait(fd, 0.0)
            if not data:
                os._exit(0)
            os.write(fd, data)
    answerer.close()
    fd = caller.fileno()
    times = []
    try:
        for _ in range(round_trips):
            started = time.perf_counter()
            os.write(fd, b"x" * 60)
            _wait(fd, caller_poll_s)
            times.append(time.perf_counter() - started)
    finally:
        caller.close()
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, affinity)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--round-trips", type=int, default=20_000)
    n = parser.parse_args().round_trips
    print(f"both sleep, two CPUs: {ping_pong(n):.1f} us")
    print(f"the caller polls up to 100 us: {ping_pong(n, caller_poll_s=100e-6):.1f} us")
    print(f"both sleep, one CPU: {ping_pong(n, one_cpu=True):.1f} us")


if __name__ == "__main__":
    main()

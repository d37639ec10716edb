"""Peer side of bench_coderuntime.py: run inside the *bench* venv (smolagents, pydantic-monty).

Prints one JSON object. Not imported by dsh; driven as a subprocess:
    .bench-venv/bin/python bench/peers_coderuntime.py   (the venv bench/peers_env.py makes)
"""

import asyncio
import json
import os
import statistics
import sys
import time

N_COMPUTE = 1_000_000
COMPUTE = f"s = 0\nfor i in range({N_COMPUTE}):\n    s += i * i\n"
EXPECTED = sum(i * i for i in range(N_COMPUTE))


def median_ms(fn, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def smolagents_part():
    import smolagents
    from smolagents import LocalPythonExecutor
    from smolagents.default_tools import FinalAnswerTool

    ex = LocalPythonExecutor(additional_authorized_imports=[], timeout_seconds=None)
    ex.send_tools({"final_answer": FinalAnswerTool()})
    out = ex("final_answer(1)")
    assert out.output == 1
    res = {"version": smolagents.__version__}
    res["trivial_ms"] = median_ms(lambda: ex("final_answer(1)"), 50)

    def compute():
        out = ex(COMPUTE + "final_answer(s)")
        assert out.output == EXPECTED, out

    res["compute_ms"] = median_ms(compute, 2)
    return res


def monty_part():
    import pydantic_monty
    from pydantic_monty import AsyncMonty, Monty

    limits = {"max_suspensions": 10_000_000, "max_feed_duration_secs": 600}
    res = {"version": pydantic_monty.__version__}

    def fresh_trivial():
        with Monty(min_processes=1) as pool, pool.checkout(limits=limits) as session:
            assert session.feed_run("1") == 1

    res["trivial_fresh_worker_ms"] = median_ms(fresh_trivial, 10)
    with Monty(min_processes=1, max_processes=1) as pool, pool.checkout(limits=limits) as session:
        assert session.feed_run(COMPUTE + "s") == EXPECTED
        res["compute_ms"] = median_ms(lambda: session.feed_run(COMPUTE + "s"), 3)

    async def add_one(x):
        return x + 1

    loop_src = "s = 0\nfor i in range(1000):\n    s = s + await add_one(x=i)\ns"
    gather_src = "import asyncio\nrs = await asyncio.gather(*[add_one(x=i) for i in range(1000)])\nsum(rs)"

    async def amain():
        async with AsyncMonty(min_processes=1, max_processes=1) as apool, apool.checkout(limits=limits) as s:
            assert await s.feed_run(loop_src, external_lookup={"add_one": add_one}) == 500500
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                await s.feed_run(loop_src, external_lookup={"add_one": add_one})
                times.append(time.perf_counter() - t0)
            res["async_call_us"] = statistics.median(times) * 1e3  # ms per 1000 calls == us per call
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                await s.feed_run(gather_src, external_lookup={"add_one": add_one})
                times.append(time.perf_counter() - t0)
            res["gather1000_ms"] = statistics.median(times) * 1e3
            res["gather_calls_per_s"] = 1000 / (res["gather1000_ms"] / 1e3)

    asyncio.run(amain())
    return res


if __name__ == "__main__":
    out = {"python": sys.version.split()[0]}
    for name, part in (("smolagents", smolagents_part), ("monty", monty_part)):
        try:
            out[name] = part()
        except Exception as error:  # report, do not hide
            out[name] = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(out), flush=True)
    # pydantic-monty 1.4.0's native threads abort the interpreter as it finalizes (SIGABRT, no
    # message: seen in about half the twelfth session's runs), after every figure is printed.
    # Leaving without finalization keeps that out of the bench's report; a failure before this
    # line still shows as the exit status the bench reports.
    os._exit(0)

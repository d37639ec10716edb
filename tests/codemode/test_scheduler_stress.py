"""Randomized stress of the scheduler's ordered lane (in-process code runtime).

Random mixes of concurrency-safe, exclusive and flip-flopping tools, denials, slow
policies, staggered submissions and outer aborts; each run checks the invariants:
the cap, exclusive bodies alone, one start and one settle event per started call,
both in submission order, and no dsh task left running once run_code returns.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from codemode_kit import Env, tool

from dsh_core import PreDecision, hookimpl
from dsh_core.abort import AbortController


def _number(sub_call_id: str) -> int:
    return int(sub_call_id.rsplit(":", 1)[1])


@pytest.mark.parametrize("seed", range(60))
async def test_random_mix_completes_in_order(seed: int) -> None:
    rng = random.Random(seed)
    cap = rng.choice([1, 2, 3, 5])
    env = Env(cap=cap)
    state = {"active": 0, "excl": 0, "peak": 0}
    trace: list[str] = []

    def flaky(args: Any) -> bool:
        # non-deterministic classification: a registry that changes between looks
        return rng.random() < 0.7

    async def body(args: Any, ctx: Any) -> Any:
        excl = args["kind"] == "x"
        assert state["excl"] == 0, "something overlapped an exclusive body"
        if excl:
            assert state["active"] == 0, "exclusive started while bodies in flight"
            state["excl"] += 1
        state["active"] += 1
        state["peak"] = max(state["peak"], state["active"])
        d = args["d"]
        if d:
            await asyncio.sleep(d)
        elif args["y"]:
            await asyncio.sleep(0)
        state["active"] -= 1
        if excl:
            state["excl"] -= 1
        return args["i"]

    class Policy:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            if not execution.nested:
                return None
            trace.append(execution.call_id)
            if execution.arguments["deny"]:
                return PreDecision.block("no")
            if execution.arguments["slow"]:

                async def slow() -> None:
                    await asyncio.sleep(0.002)

                return slow()
            return None

    env.add(tool("s", body, safe=True), tool("x", body), tool("f", body, safe=flaky))
    env.plug(Policy())
    n = rng.randint(1, 25)
    calls = []
    for i in range(n):
        kind = rng.choice("ssssxf")
        a = {
            "i": i,
            "kind": kind,
            "d": rng.choice([0, 0, 0.001, 0.003]),
            "y": rng.random() < 0.5,
            "deny": rng.random() < 0.1,
            "slow": rng.random() < 0.2,
        }
        wait = rng.choice(["", "", "await asyncio.sleep(0)\n    ", f"await asyncio.sleep({rng.random() / 500})\n    "])
        calls.append((kind, a, wait))
    lines = [
        "import asyncio",
        "async def one(name, a, pre):",
        "    if pre:",
        "        await asyncio.sleep(pre)",
        "    try:",
        "        return await tools[name](a)",
        "    except ToolCallError as error:",
        "        return 'E'",
        "ts = []",
    ]
    for kind, a, _ in calls:
        pre = rng.choice([0, 0, 0.0005, 0.002])
        lines.append(f"ts.append(asyncio.ensure_future(one({kind!r}, {a!r}, {pre})))")
        if rng.random() < 0.3:
            lines.append("await asyncio.sleep(0)")
    lines.append("return await asyncio.gather(*ts)")
    result = await asyncio.wait_for(env.run("\n".join(lines)), 10)
    assert not result.is_error, result.text
    values = result.value["result"]
    assert len(values) == n
    assert state["peak"] <= cap
    kinds = env.sink.kinds()
    starts = [s for k, s in kinds if k == "tool/code-dispatch-start"]
    settles = [s for k, s in kinds if k == "tool/code-dispatch"]
    assert len(starts) == n
    assert starts == settles == sorted(starts, key=_number)
    # Pre-execute runs on the lane in submission order (the order the program called in).
    assert trace == sorted(trace, key=_number) and len(trace) == n


@pytest.mark.parametrize("seed", range(80))
async def test_random_abort_reaches_quiescence(seed: int) -> None:
    rng = random.Random(1000 + seed)
    cap = rng.choice([1, 2, 3])
    env = Env(cap=cap)
    running = {"n": 0}

    async def body(args: Any, ctx: Any) -> Any:
        running["n"] += 1
        try:
            await asyncio.sleep(args["d"])
        finally:
            running["n"] -= 1
        return args["i"]

    env.add(tool("s", body, safe=True), tool("x", body))
    n = rng.randint(1, 15)
    parts = [f"tools.{rng.choice('ssx')}({{'i': {i}, 'd': {rng.choice([0, 0.001, 0.004])}}})" for i in range(n)]
    program = (
        "import asyncio\nts = [asyncio.ensure_future(c) for c in [" + ", ".join(parts) + "]]\n"
        "return await asyncio.gather(*ts, return_exceptions=True)"
    )
    controller = AbortController()
    loop = asyncio.get_running_loop()
    loop.call_later(rng.random() * 0.01, controller.abort, "stop")
    before = {t for t in asyncio.all_tasks()}
    await asyncio.wait_for(env.run(program, signal=controller.signal), 10)
    assert running["n"] == 0
    left = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]
    assert [t.get_name() for t in left if t.get_name().startswith("dsh-")] == []
    kinds = env.sink.kinds()
    starts = [s for k, s in kinds if k == "tool/code-dispatch-start"]
    settles = [s for k, s in kinds if k == "tool/code-dispatch"]
    assert starts == sorted(starts, key=_number)
    assert settles == sorted(starts, key=_number)

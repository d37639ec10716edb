"""Benchmark sessions and the agent loop (issue 6). Not a test: run it and copy the figures.

    .venv/bin/python bench/bench_sessions.py            # prints JSON on stdout, progress on stderr

1. SQLite store append throughput (events/s), batches of 1 and of 100 events,
   each batch one committed transaction (WAL, synchronous=NORMAL), payloads
   shaped like real tool results (~300 bytes of JSON);
2. the time to load a 10,000-event session (``store.load``: query + JSON decode);
3. the agent loop's own overhead per step with the scripted provider: a run
   of N steps, each one tool call of a trivial tool, with the session
   recorded, minus nothing — i.e. everything dsh does per step (prompt
   assembly, wire schemas, scheduling, the pipeline, the session writes)
   except a real model; also without recording, to split out the store.

Medians of several repetitions, wall clock, this machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dsh_core import define_tool, hookimpl
from dsh_core.agent.loop import run_agent
from dsh_core.config import compose
from dsh_core.harness import Harness
from dsh_core.plugins import PluginCatalog
from dsh_core.sessions import NewEvent
from dsh_core.sessions.sqlite import SqliteSessionStore

PAYLOAD = {
    "name": "read",
    "tool_call_id": "call_1",
    "ok": True,
    "error": None,
    "content": "x" * 200,
    "concludes_turn": False,
    "duration_ms": 1.234,
}


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def append_throughput(home: Path, batch: int, total: int) -> float:
    store = SqliteSessionStore.open(home)
    try:
        info = await store.create()
        events = [NewEvent("tool/result", PAYLOAD, root_call_id="1.1") for _ in range(batch)]
        started = time.perf_counter()
        for _ in range(total // batch):
            await store.append(info.id, events)
        return total / (time.perf_counter() - started)
    finally:
        await store.close()


async def load_time(home: Path, count: int, repeats: int) -> float:
    store = SqliteSessionStore.open(home)
    try:
        info = await store.create()
        events = [NewEvent("tool/result", PAYLOAD, root_call_id=f"{i}.1") for i in range(100)]
        for _ in range(count // 100):
            await store.append(info.id, events)
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            loaded = await store.load(info.id)
            samples.append(time.perf_counter() - started)
            assert len(loaded) == count
        return statistics.median(samples)
    finally:
        await store.close()


class Tools:
    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        async def noop(args: Any, ctx: Any) -> Any:
            return "ok"

        register(define_tool(name="noop", description="Do nothing.", parameters={"type": "object"}, execute=noop))


async def loop_overhead(base: Path, steps: int, record: bool) -> float:
    base.mkdir(parents=True, exist_ok=True)
    script = base / f"script-{steps}.jsonl"
    turns = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": "noop", "arguments": "{}"}}],
        }
        for i in range(steps)
    ]
    turns.append({"role": "assistant", "content": "done"})
    script.write_text("".join(json.dumps(t) + "\n" for t in turns))
    deployment = compose(
        [
            (
                "bench",
                {
                    "sessions": {"home": str(base / "home")},
                    "agents": [{"id": "main", "provider": "scripted", "max_turns": steps + 1}],
                    "plugins": [
                        {"id": "tools", "use": "tools"},
                        {"id": "scripted", "use": "scripted", "config": {"script": str(script)}},
                        {"id": "sessions", "use": "sqlite-sessions"},
                    ],
                },
            )
        ],
        env={},
    )
    harness = await Harness.start(deployment, catalog=PluginCatalog(extra={"tools": lambda s, c: Tools()}, strict=True))
    try:
        started = time.perf_counter()
        result = await run_agent(harness, "go", record=record)
        elapsed = time.perf_counter() - started
        assert result.ok and result.turns == steps + 1, result
        return elapsed / (steps + 1)
    finally:
        await harness.aclose()


async def main() -> dict[str, Any]:
    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for batch, total in ((1, 2000), (100, 50_000)):
            progress(f"append throughput, batches of {batch}…")
            rates = [await append_throughput(base / f"a{batch}-{i}", batch, total) for i in range(3)]
            figures[f"append_events_per_s_batch_{batch}"] = round(statistics.median(rates))
        progress("load a 10,000-event session…")
        figures["load_10000_events_ms"] = round(await load_time(base / "load", 10_000, 5) * 1000, 1)
        # Each step's history grows, so the per-step cost is reported for a short and a longer run.
        for steps in (20, 100):
            for record in (True, False):
                progress(f"agent loop, {steps} steps, record={record}…")
                samples = [await loop_overhead(base / f"l{steps}{record}{i}", steps, record) for i in range(3)]
                key = f"loop_ms_per_step_{steps}_steps_{'recorded' if record else 'unrecorded'}"
                figures[key] = round(statistics.median(samples) * 1000, 3)
    return figures


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main()), indent=2))

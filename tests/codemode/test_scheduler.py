"""The per-program scheduler (issue 4 item 4) and CODEMODE-TEST-SCHEDULER."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from codemode_kit import Env, Recorder, tool

from dsh_core import ContextMessage, PostDecision, TextBlock, hookimpl
from dsh_core.abort import AbortSignal
from dsh_core.codemode import scheduler as scheduler_module
from dsh_core.codemode.history import DispatchHistory
from dsh_core.codemode.scheduler import ProgramScheduler, check_max_parallel
from dsh_core.codemode.transport import RunCodeTransport
from dsh_core.hooks import Hooks
from dsh_core.sessions.recorder import SessionRecorder
from dsh_core.sessions.sqlite import DB_FILENAME, SqliteSessionStore


class Probe:
    """Tool bodies that record their overlap and the order of pipeline events."""

    def __init__(self) -> None:
        self.active = 0
        self.peak = 0
        self.log: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    def gate(self, key: str) -> asyncio.Event:
        return self.gates.setdefault(key, asyncio.Event())

    def body(self, label: str, *, wait: bool = False, delay: float = 0.0) -> Any:
        async def run(args: Any, ctx: Any) -> Any:
            key = f"{label}{args.get('i', '')}"
            self.active += 1
            self.peak = max(self.peak, self.active)
            self.log.append(f"start {key}")
            try:
                if wait:
                    await self.gate(key).wait()
                elif delay or args.get("delay"):
                    await asyncio.sleep(args.get("delay", delay))
                else:
                    await asyncio.sleep(0)
            finally:
                self.active -= 1
            self.log.append(f"end {key}")
            return key

        return run


def gather(calls: str) -> str:
    return f"import asyncio\nreturn await asyncio.gather({calls})"


async def test_concurrency_safe_calls_overlap_with_ordered_starts(env: Env) -> None:
    probe = Probe()
    env.add(tool("safe", probe.body("s", delay=0.02), safe=True))
    result = await env.run(gather("*(tools.safe({'i': i}) for i in range(3))"))
    assert result.value["result"] == ["s0", "s1", "s2"]
    assert probe.peak == 3
    starts = [e["sub_call_id"] for e in env.sink.events if e["kind"] == "tool/code-dispatch-start"]
    assert starts == ["call-1:code:1", "call-1:code:2", "call-1:code:3"]
    assert len([e for e in env.sink.events if e["kind"] == "tool/code-dispatch"]) == 3


@pytest.mark.parametrize("cap", [1, 3, 10])
async def test_the_cap_bounds_the_overlap_window_and_the_peak_reaches_it(cap: int) -> None:
    env = Env(cap=cap)
    probe = Probe()
    env.add(tool("safe", probe.body("s", delay=0.01), safe=True))
    result = await env.run(gather("*(tools.safe({'i': i}) for i in range(12))"))
    assert result.value["result"] == [f"s{i}" for i in range(12)]
    assert probe.peak == cap


async def test_an_exclusive_call_is_a_barrier(env: Env) -> None:
    probe = Probe()
    env.add(tool("safe", probe.body("s", delay=0.01), safe=True), tool("excl", probe.body("x", delay=0.01)))
    await env.run(
        gather("tools.safe({'i': 0}), tools.safe({'i': 1}), tools.excl({}), tools.safe({'i': 2}), tools.safe({'i': 3})")
    )
    log = probe.log
    # Safe calls before it drain first; it runs alone; later calls wait for it.
    assert log.index("start x") > max(log.index("end s0"), log.index("end s1"))
    assert log.index("end x") < min(log.index("start s2"), log.index("start s3"))
    assert probe.peak == 2


async def test_gather_over_exclusive_tools_runs_them_serially_in_submission_order(env: Env) -> None:
    probe = Probe()
    env.add(tool("excl", probe.body("x")))
    await env.run(gather("*(tools.excl({'i': i, 'delay': 0.01 * (4 - i)}) for i in range(4))"))
    assert probe.log == [f"{kind} x{i}" for i in range(4) for kind in ("start", "end")]
    assert probe.peak == 1


async def test_out_of_order_bodies_commit_post_execute_and_contexts_in_submission_order(env: Env) -> None:
    probe = Probe()
    commits: list[str] = []

    class Post:
        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            if execution.nested:
                commits.append(f"post {execution.arguments['i']}")
                return PostDecision.accept([ContextMessage(f"ctx {execution.arguments['i']}")])
            return None

    env.add(tool("safe", probe.body("s"), safe=True))
    env.plug(Post())
    # Bodies finish in reverse order (larger delays first).
    result = await env.run(gather("*(tools.safe({'i': i, 'delay': 0.03 - 0.01 * i}) for i in range(3))"))
    assert [line for line in probe.log if line.startswith("end")] == ["end s2", "end s1", "end s0"]
    assert commits == ["post 0", "post 1", "post 2"]
    assert [c.text for c in result.additional_contexts] == ["ctx 0", "ctx 1", "ctx 2"]
    ends = [e["sub_call_id"] for e in env.sink.events if e["kind"] == "tool/code-dispatch"]
    assert ends == ["call-1:code:1", "call-1:code:2", "call-1:code:3"]


async def test_ordered_pre_execute_never_overlaps_and_a_slow_policy_delays_the_next_start(env: Env) -> None:
    probe = Probe()
    trace: list[str] = []

    class SlowPolicy:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            if not execution.nested:
                return None

            async def decide() -> None:
                trace.append(f"policy in {execution.arguments['i']}")
                await asyncio.sleep(0.03 if execution.arguments["i"] == 0 else 0)
                trace.append(f"policy out {execution.arguments['i']}")

            return decide()

    env.add(tool("safe", probe.body("s"), safe=True))
    env.plug(SlowPolicy())
    await env.run(gather("*(tools.safe({'i': i}) for i in range(3))"))
    assert trace == ["policy in 0", "policy out 0", "policy in 1", "policy out 1", "policy in 2", "policy out 2"]


@pytest.mark.parametrize("safe", [True, None], ids=["parallel", "exclusive"])
@pytest.mark.parametrize("stage", ["start-log", "pre-execute", "body", "post-execute", "settle-log"])
async def test_a_scheduler_task_cancelled_from_outside_aborts_only_its_call(
    env: Env, stage: str, safe: bool | None
) -> None:
    # Nothing in dsh cancels the scheduler's tasks, but loop teardown or a foreign
    # task-killer may: the call commits as aborted (one settle event), an exclusive
    # call's barrier is released, and the queue goes on.
    blocked: list[asyncio.Task[Any]] = []
    entered = asyncio.Event()

    async def block() -> None:
        task = asyncio.current_task()
        assert task is not None
        blocked.append(task)
        entered.set()
        await asyncio.sleep(30)

    def first(execution: Any) -> bool:
        return bool(execution.nested and execution.arguments["i"] == 0)

    class Blocking:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            return block() if stage == "pre-execute" and first(execution) else None

        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            return block() if stage == "post-execute" and first(execution) else None

    async def body(args: Any, ctx: Any) -> Any:
        if stage == "body" and args["i"] == 0:
            await block()
        return args

    sink = env.sink
    assert sink is not None
    append = sink.append

    slowed = {"start-log": "tool/code-dispatch-start", "settle-log": "tool/code-dispatch"}.get(stage)

    async def slow_first_write(kind: str, payload: Any, **ids: Any) -> None:
        if kind == slowed and ids["sub_call_id"] == "call-1:code:1" and not blocked:
            await block()  # the first attempt only: cancelled, it wrote nothing
        await append(kind, payload, **ids)

    sink.append = slow_first_write  # type: ignore[method-assign]
    env.add(tool("t", body, safe=safe))
    env.plug(Blocking())
    recorder = Recorder()
    env.plug(recorder)
    program = (
        "import asyncio\nasync def one(i):\n    try:\n        return await tools.t({'i': i})\n"
        "    except ToolCallError as error:\n        return str(error)\n"
        "return await asyncio.gather(one(0), one(1))"
    )
    run = asyncio.ensure_future(env.run(program))
    await asyncio.wait_for(entered.wait(), 5)
    blocked[0].cancel()
    result = await asyncio.wait_for(run, 5)
    # Cancelled while logging, the call had already been answered.
    # Cut in its policy, it never dispatched: aborted before dispatch, as its result event says.
    first_answer = (
        {"i": 0}
        if stage == "settle-log"
        else ("tool call aborted before dispatch" if stage == "pre-execute" else "tool call aborted")
    )
    assert result.value["result"] == [first_answer, {"i": 1}]
    kinds = sink.kinds()
    start, settle = "tool/code-dispatch-start", "tool/code-dispatch"
    first_call, second_call = "call-1:code:1", "call-1:code:2"
    # A cancelled append wrote nothing (the sink's contract), so an interrupted start or settle write
    # is redone: each call's pair, its start first.
    assert sorted(kinds) == sorted(
        [(start, first_call), (settle, first_call), (start, second_call), (settle, second_call)]
    )
    assert kinds.index((start, first_call)) < kinds.index((settle, first_call))
    # Each call the pipeline saw (its pre-execute ran) emits its one result event, cancelled or not.
    results = [(execution.call_id, result.code) for execution, result in recorder.results if execution.nested]
    cut = {"pre-execute": "ABORTED_BEFORE_DISPATCH", "body": "ABORTED", "post-execute": "ABORTED"}
    expected = [(second_call, None)] + (
        [(first_call, cut[stage])] if stage in cut else [(first_call, None)] if stage == "settle-log" else []
    )
    assert sorted(results, key=str) == sorted(expected, key=str)


async def test_a_settle_write_cancelled_behind_a_busy_store_is_written_once(tmp_path: Path) -> None:
    # The real store: the settle append waits out another process's write lock when the lane's
    # task is cancelled, twice. Each cancelled append committed nothing, so the write is redone
    # until it lands: the session shows the call settled, once.
    store = SqliteSessionStore.open(tmp_path)
    other = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
    try:
        info = await store.create()
        recorder = SessionRecorder(store, info.id)
        env = Env(sink=recorder)  # type: ignore[arg-type]
        lane: list[asyncio.Task[Any]] = []
        settling: list[asyncio.Event] = []
        append = recorder.append

        async def watched(kind: str, payload: Any = None, **ids: Any) -> Any:
            if kind == "tool/code-dispatch":
                settling.append(asyncio.Event())
                settling[-1].set()
            return await append(kind, payload, **ids)

        async def body(args: Any, ctx: Any) -> Any:
            task = asyncio.current_task()
            assert task is not None
            lane.append(task)  # the task that commits the call next
            other.execute("BEGIN IMMEDIATE")  # another process takes the write lock
            return args

        recorder.append = watched  # type: ignore[method-assign]
        env.add(tool("t", body, safe=True))
        run = asyncio.ensure_future(env.run("return await tools.t({'i': 0})"))

        async def attempts(n: int) -> None:
            while len(settling) < n:
                await asyncio.sleep(0.005)

        for attempt in (1, 2):
            await asyncio.wait_for(attempts(attempt), 2)
            await asyncio.sleep(0.02)  # the append is waiting on the lock
            lane[0].cancel()
        await asyncio.wait_for(attempts(3), 2)
        other.execute("ROLLBACK")
        result = await asyncio.wait_for(run, 3)
        assert result.value["result"] == {"i": 0}
        kinds = [(e.kind, e.sub_call_id) for e in await store.load(info.id)]
        assert kinds == [("tool/code-dispatch-start", "call-1:code:1"), ("tool/code-dispatch", "call-1:code:1")]
    finally:
        other.close()
        await store.close()


async def test_a_redone_settle_write_runs_the_log_hook_once(env: Env) -> None:
    # The durable record is computed once per call: redoing an interrupted settle write only
    # appends it again (a hook that spills the content elsewhere must not spill it twice).
    seen: list[str] = []
    lane: list[asyncio.Task[Any]] = []
    entered = asyncio.Event()

    class Spill:
        @hookimpl
        def dsh_code_dispatch_log(self, dispatch: Any) -> Any:
            seen.append(dispatch.sub_call_id)
            return [TextBlock(f"[spilled {len(seen)}]")]

    sink = env.sink
    assert sink is not None
    append = sink.append

    async def slow_first_settle(kind: str, payload: Any, **ids: Any) -> None:
        if kind == "tool/code-dispatch" and not lane:
            task = asyncio.current_task()
            assert task is not None
            lane.append(task)
            entered.set()
            await asyncio.sleep(30)  # the first attempt only: cancelled, it wrote nothing
        await append(kind, payload, **ids)

    async def body(args: Any, ctx: Any) -> Any:
        return args

    sink.append = slow_first_settle  # type: ignore[method-assign]
    env.add(tool("t", body, safe=True))
    env.plug(Spill())
    run = asyncio.ensure_future(env.run("return await tools.t({'i': 0})"))
    await asyncio.wait_for(entered.wait(), 5)
    lane[0].cancel()
    result = await asyncio.wait_for(run, 5)
    assert result.value["result"] == {"i": 0}
    assert seen == ["call-1:code:1"]
    assert [e["payload"]["content"] for e in sink.events if e["kind"] == "tool/code-dispatch"] == [
        [{"type": "text", "text": "[spilled 1]"}]
    ]


async def test_a_settle_write_after_a_cancellation_gives_up_on_a_stuck_sink(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # Redoing the write must not hold a cancelled run on a store that never answers.
    monkeypatch.setattr(scheduler_module, "WRITE_AFTER_CANCEL_TIMEOUT_S", 0.05)
    lane: list[asyncio.Task[Any]] = []
    attempts: list[str] = []
    sink = env.sink
    assert sink is not None
    append = sink.append

    async def stuck_settle(kind: str, payload: Any, **ids: Any) -> None:
        if kind == "tool/code-dispatch":
            attempts.append(ids["sub_call_id"])
            await asyncio.sleep(30)
        await append(kind, payload, **ids)

    async def body(args: Any, ctx: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        lane.append(task)
        return args

    sink.append = stuck_settle  # type: ignore[method-assign]
    env.add(tool("t", body, safe=True))
    run = asyncio.ensure_future(env.run("return await tools.t({'i': 0})"))
    while not attempts:
        await asyncio.sleep(0.005)
    with caplog.at_level("WARNING", logger="dsh"):
        lane[0].cancel()
        result = await asyncio.wait_for(run, 10)  # a hang guard: the stuck write sleeps 30 s
    assert result.value["result"] == {"i": 0}
    assert attempts == ["call-1:code:1", "call-1:code:1"]  # redone once, then given up on
    assert sink.kinds() == [("tool/code-dispatch-start", "call-1:code:1")]
    assert "settle event of nested call call-1:code:1 was not written" in caplog.text
    assert "took over 0.05 s" in caplog.text


async def test_a_start_write_given_up_on_after_a_cancellation_logs_no_settle_either(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # A start event that could not be written after all leaves the call out of the session: a
    # settle event without its start would break the pair (and render with no arguments).
    monkeypatch.setattr(scheduler_module, "WRITE_AFTER_CANCEL_TIMEOUT_S", 0.05)
    lane: list[asyncio.Task[Any]] = []
    sink = env.sink
    assert sink is not None
    append = sink.append

    async def stuck_start(kind: str, payload: Any, **ids: Any) -> None:
        if kind == "tool/code-dispatch-start" and ids["sub_call_id"] == "call-1:code:1":
            task = asyncio.current_task()
            assert task is not None
            lane.append(task)
            await asyncio.sleep(30)
        await append(kind, payload, **ids)

    async def body(args: Any, ctx: Any) -> Any:
        return args

    sink.append = stuck_start  # type: ignore[method-assign]
    env.add(tool("t", body, safe=True))
    program = (
        "try:\n    await tools.t({'i': 0})\nexcept ToolCallError as error:\n    first = str(error)\n"
        "return [first, await tools.t({'i': 1})]"
    )
    run = asyncio.ensure_future(env.run(program))
    while not lane:
        await asyncio.sleep(0.005)
    with caplog.at_level("WARNING", logger="dsh"):
        lane[0].cancel()
        result = await asyncio.wait_for(run, 10)  # a hang guard: the stuck write sleeps 30 s
    assert result.value["result"] == ["tool call aborted", {"i": 1}]
    assert sink.kinds() == [("tool/code-dispatch-start", "call-1:code:2"), ("tool/code-dispatch", "call-1:code:2")]
    assert "start event of nested call call-1:code:1 was not written" in caplog.text


@pytest.mark.parametrize("target", ["ProgramScheduler._hold_lane", "ProgramScheduler._body"])
async def test_a_scheduler_task_cancelled_before_its_first_step_loses_nothing(env: Env, target: str) -> None:
    loop = asyncio.get_running_loop()
    cancelled: list[str] = []

    def factory(loop: Any, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        if not cancelled and getattr(coro, "__qualname__", "") == target:
            cancelled.append(target)
            task.cancel()  # a foreign task-killer (or loop shutdown) before the task ever ran
        return task

    async def body(args: Any, ctx: Any) -> Any:
        await asyncio.sleep(0.001 if args["i"] == 0 else 0)
        return args["i"]

    env.add(tool("safe", body, safe=True))
    program = (
        "import asyncio\nasync def one(i):\n    try:\n        return await tools.safe({'i': i})\n"
        "    except ToolCallError as error:\n        return str(error)\n"
        "return await asyncio.gather(one(0), one(1), one(2))"
    )
    loop.set_task_factory(factory)
    try:
        result = await asyncio.wait_for(env.run(program), 3)
    finally:
        loop.set_task_factory(None)
    assert cancelled == [target]
    values = result.value["result"]
    # A body task cut before its first step never invoked the body: that call was aborted before dispatch.
    aborted = ("tool call aborted", "tool call aborted before dispatch")
    assert len(values) == 3 and sum(v in aborted for v in values) <= 1
    assert [v for v in values if v not in aborted] == [i for i in range(3) if values[i] not in aborted]


async def test_a_cancelled_drain_still_waits_for_every_started_body(env: Env) -> None:
    # Quiescence holds even if a foreign task-killer cancels the task that drains the scheduler.
    loop = asyncio.get_running_loop()
    running = {"n": 0}
    drains: list[asyncio.Task[Any]] = []

    def factory(loop: Any, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        if getattr(coro, "__qualname__", "") == "ProgramScheduler.drain":
            drains.append(task)
            loop.call_soon(task.cancel)
        return task

    async def body(args: Any, ctx: Any) -> Any:
        running["n"] += 1
        try:
            await asyncio.sleep(0.05)
        finally:
            running["n"] -= 1
        return 1

    env.add(tool("s", body, safe=True))
    loop.set_task_factory(factory)
    try:
        await asyncio.wait_for(
            env.run("import asyncio\nasyncio.ensure_future(tools.s({}))\nawait asyncio.sleep(0.01)\nreturn 1"), 3
        )
    finally:
        loop.set_task_factory(None)
    assert drains
    assert running["n"] == 0, "run_code returned while a nested body was still running"
    assert [kind for kind, _ in env.sink.kinds()] == ["tool/code-dispatch-start", "tool/code-dispatch"]


async def test_an_exclusive_call_holds_its_barrier_through_post_execute(env: Env) -> None:
    probe = Probe()
    trace: list[str] = []

    class SlowPost:
        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            if execution.name != "excl":
                return None

            async def decide() -> None:
                trace.append("post excl in")
                await asyncio.sleep(0.03)
                trace.append("post excl out")

            return decide()

        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            if execution.name == "safe":
                trace.append("pre safe")
            return None

    env.add(tool("excl", probe.body("x")), tool("safe", probe.body("s"), safe=True))
    env.plug(SlowPost())
    await env.run(gather("tools.excl({}), tools.safe({'i': 0})"))
    assert trace == ["post excl in", "post excl out", "pre safe"]


async def test_a_tool_replaced_while_queued_is_reclassified_at_the_head(env: Env) -> None:
    probe = Probe()
    env.add(tool("blocker", probe.body("b", wait=True)))
    unregister = env.registry.register(tool("flip", probe.body("f", delay=0.02), safe=True))
    env.add(tool("safe", probe.body("s", delay=0.01), safe=True))
    run = asyncio.ensure_future(env.run(gather("tools.blocker({}), tools.flip({}), tools.safe({'i': 0})")))
    while "start b" not in probe.log:
        await asyncio.sleep(0.001)
    # While flip is queued behind the blocker, it is replaced by an exclusive version.
    unregister()
    env.add(tool("flip", probe.body("f", delay=0.02)))
    probe.gate("b").set()
    await run
    log = probe.log
    assert log.index("end f") < log.index("start s0"), log  # ran alone: it was reclassified exclusive
    assert probe.peak == 1


async def test_a_queued_call_abandoned_by_settlement_logs_no_start_event(env: Env) -> None:
    probe = Probe()
    env.add(tool("blocker", probe.body("b", wait=True)), tool("queued", probe.body("q")))
    program = """
import asyncio
first = asyncio.ensure_future(tools.blocker({}))
second = asyncio.ensure_future(tools.queued({}))
await asyncio.sleep(0.01)
return "settled early"
"""
    run = asyncio.ensure_future(env.run(program))
    while "start b" not in probe.log:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.03)
    assert not run.done()  # run_code waits for the started body (quiescence)
    probe.gate("b").set()
    result = await run
    assert result.value["result"] == "settled early"
    assert "start q" not in probe.log
    kinds = env.sink.kinds()
    assert kinds == [("tool/code-dispatch-start", "call-1:code:1"), ("tool/code-dispatch", "call-1:code:1")]
    # The started body committed after settlement: aborted, but logged exactly once.
    assert env.sink.events[1]["payload"]["error_code"] == "ABORTED"


async def test_run_settlement_drains_a_commit_in_progress_and_logs_inside_the_turn() -> None:
    env = Env()
    assert env.sink is not None
    env.sink.settle_delay = 0.02  # a slow session store
    trace: list[str] = []

    class SlowPost:
        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            if not execution.nested:
                return None

            async def decide() -> None:
                trace.append("post in")
                await asyncio.sleep(0.03)
                trace.append("post out")

            return decide()

    env.add(tool("echo"))
    env.plug(SlowPost())
    program = (
        "import asyncio\nasync def forget():\n    try:\n        await tools.echo({})\n"
        "    except ToolCallError:\n        pass\n"
        "asyncio.ensure_future(forget())\nawait asyncio.sleep(0.005)\nreturn 1"
    )
    result = await env.run(program)
    # When run_code returns, the commit that was in progress finished and its event is appended.
    assert trace == ["post in", "post out"]
    assert env.sink.kinds() == [("tool/code-dispatch-start", "call-1:code:1"), ("tool/code-dispatch", "call-1:code:1")]
    assert result.value == {"logs": [], "result": 1}


async def test_a_slow_store_gets_every_settle_event_in_commit_order_before_run_code_returns() -> None:
    env = Env(cap=2)
    assert env.sink is not None
    env.sink.settle_delay = 0.005
    env.add(tool("safe", safe=True))
    result = await env.run(gather("*(tools.safe({'i': i}) for i in range(8))"))
    assert len(result.value["result"]) == 8
    settles = [sub for kind, sub in env.sink.kinds() if kind == "tool/code-dispatch"]
    assert settles == [f"call-1:code:{n}" for n in range(1, 9)]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "10", None])
def test_max_parallel_sub_calls_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_parallel_sub_calls"):
        check_max_parallel(bad)
    with pytest.raises(ValueError, match="max_parallel_sub_calls"):
        RunCodeTransport(lambda: None, None, max_parallel_sub_calls=bad)  # type: ignore[arg-type]


async def test_the_default_cap_is_ten() -> None:
    transport = RunCodeTransport(lambda: None, None)  # type: ignore[arg-type,return-value]
    assert transport.max_parallel_sub_calls == 10
    env = Env()
    scheduler = ProgramScheduler(
        env.runtime,
        signal=AbortSignal.never(),
        context=None,
        history=DispatchHistory(Hooks(), None, root_call_id="r", parent_call_id="p"),
    )
    assert scheduler._cap == 10
    await scheduler.drain()


async def test_a_call_prepared_then_aborted_before_its_body_task_runs_skips_post_execute() -> None:
    # The lane prepares a parallel call and gives its body a task; the run is aborted before
    # that task runs. The call was aborted before dispatch: no middleware, body or post-execute.
    from dsh_core.abort import AbortController
    from dsh_core.model import ToolResult

    env = Env()
    controller = AbortController()
    ran: list[str] = []
    wrapped: list[str] = []
    posted: list[str] = []
    results: dict[str, ToolResult] = {}

    async def body(args: Any, ctx: Any) -> Any:
        ran.append(args["i"])
        return args

    class Plugin:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> None:
            if execution.nested and execution.arguments["i"] == "b":
                controller.abort("user pressed stop")  # while call "a" waits for its body task

        @hookimpl
        def dsh_around_dispatch(self, execution: Any) -> Any:
            async def middleware(call: Any, proceed: Any) -> Any:
                wrapped.append(call.arguments.get("i", "run"))
                return await proceed(call)

            return middleware

        @hookimpl
        def dsh_post_execute(self, execution: Any, result: Any) -> Any:
            if execution.nested:
                posted.append(execution.arguments["i"])
                return PostDecision.replace_content("all good, file written")
            return None

        @hookimpl
        def dsh_tool_result(self, execution: Any, result: Any) -> None:
            if execution.nested:
                results[execution.arguments["i"]] = result

    env.add(tool("safe", body, safe=True))
    env.plug(Plugin())
    await env.run(gather("tools.safe({'i': 'a'}), tools.safe({'i': 'b'})"), signal=controller.signal)
    assert ran == [] and posted == [] and wrapped == ["run"]
    assert {i: (r.code, r.text) for i, r in results.items()} == {
        i: ("ABORTED_BEFORE_DISPATCH", "Error: tool call aborted before dispatch") for i in ("a", "b")
    }


async def test_one_listener_on_the_run_signal_reaches_every_call_not_yet_committed() -> None:
    """Not one listener per call (each removal scanned them all: quadratic in a gather's queue)."""
    from dsh_core.abort import AbortController
    from dsh_core.model import ToolExecutionInput

    env = Env(mode="native")  # the requests name no parent: the tool must be callable model-direct
    started = asyncio.Event()

    async def wait(args: Any, ctx: Any) -> Any:
        started.set()
        await ctx.signal.wait()
        return None

    env.add(tool("wait", wait, safe=True))
    run = AbortController()
    scheduler = ProgramScheduler(
        env.runtime,
        signal=run.signal,
        context=None,
        max_parallel_sub_calls=3,
        history=DispatchHistory(Hooks(), None, root_call_id="r", parent_call_id="p"),
    )
    controllers = [AbortController() for _ in range(50)]
    futures = [
        scheduler.submit(
            ToolExecutionInput(call_id=f"c:code:{i}", name="wait", arguments={}, signal=controller.signal),
            {},
            controller,
        )
        for i, controller in enumerate(controllers)
    ]
    await started.wait()
    assert len(run.signal._listeners or []) == 1  # the scheduler's own, whatever the number of calls
    run.abort("run over")
    await scheduler.drain()
    assert all(c.signal.aborted and c.signal.reason == "run over" for c in controllers)
    assert all(f.done() for f in futures)
    late = AbortController()  # a call submitted once the run is over starts aborted
    scheduler.submit(ToolExecutionInput(call_id="c:code:late", name="wait", arguments={}, signal=late.signal), {}, late)
    assert late.signal.aborted and late.signal.reason == "run over"
    await scheduler.drain()

"""End to end with the real worker runtime: start_harness wiring and the CLI (few: each run forks a worker)."""

from __future__ import annotations

import asyncio
import gc
import json
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from codemode_kit import Env, tool

import dsh_core.harness as harness_module
from dsh_core import PreDecision, ToolError, define_tool, hookimpl
from dsh_core.boot import LazyCodeRuntime, start_harness
from dsh_core.cli import main
from dsh_core.codemode.prompt import SDK_SECTION
from dsh_core.codemode.scheduler import ProgramScheduler
from dsh_core.codemode.transport import RunCodeTransport
from dsh_core.coderuntime import CodeRuntimeConfig, PythonCodeRuntime
from dsh_core.config import load_deployment
from dsh_core.errors import ErrorCode
from dsh_core.model import ApprovalOutcome
from dsh_core.plugins import PluginCatalog
from dsh_core.prompt import PromptAssembler
from dsh_plugins.code_mode import plugin as code_mode_plugin


class Tools:
    """A test plugin: ``add_one`` (concurrency-safe), ``fail`` and an approval-gated ``danger``."""

    def __init__(self) -> None:
        self.approvals: list[str] = []

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        async def add_one(args: Any, ctx: Any) -> Any:
            return args["x"] + 1

        async def fail(args: Any, ctx: Any) -> Any:
            raise ToolError("this tool always fails")

        async def danger(args: Any, ctx: Any) -> Any:
            return "did the dangerous thing"

        async def listing(args: Any, ctx: Any) -> Any:
            return {"entries": [{"name": "a.py", "size": 3}], "truncated": False}

        schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
        register(
            define_tool(
                name="add_one",
                description="Add one.",
                parameters=schema,
                execute=add_one,
                output_schema={"type": "integer"},
                is_concurrency_safe=True,
            )
        )
        register(define_tool(name="fail", description="Fail.", parameters={"type": "object"}, execute=fail))
        register(
            define_tool(name="danger", description="Needs approval.", parameters={"type": "object"}, execute=danger)
        )
        register(
            define_tool(
                name="listing",
                description="Structured output.",
                parameters={"type": "object"},
                execute=listing,
                is_concurrency_safe=True,
            )
        )

    @hookimpl
    def dsh_pre_execute(self, execution: Any) -> Any:
        return PreDecision.ask("dangerous") if execution.name == "danger" else None

    @hookimpl
    def dsh_approve(self, request: Any) -> Any:
        async def decide() -> ApprovalOutcome:
            await asyncio.sleep(1.5)  # a person thinking, longer than the run's wall-clock budget
            self.approvals.append(request.execution.call_id)
            return ApprovalOutcome.ALLOWED

        return decide()


TOOLS = Tools()


def tools_plugin(scope: Any, config: Any) -> Tools:
    return TOOLS


@pytest.fixture
def catalog(monkeypatch: pytest.MonkeyPatch) -> PluginCatalog:
    made = PluginCatalog(entry_points=[], extra={"code-mode": code_mode_plugin, "test-tools": tools_plugin})
    monkeypatch.setattr(harness_module, "PluginCatalog", lambda: made)
    return made


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "dsh.toml"
    path.write_text(
        textwrap.dedent("""
        [tools]
        mode = "code"
        [code_runtime]
        timeout_s = 1.0
        [[agents]]
        id = "main"
        [[plugins]]
        id = "tools"
        use = "test-tools"
        [[plugins]]
        id = "code-mode"
        use = "code-mode"
    """),
        encoding="utf-8",
    )
    return path


PROGRAM = """
import asyncio
print("start")
values = await asyncio.gather(*(tools.add_one({"x": i}) for i in range(5)))
try:
    await tools.fail({})
except ToolCallError as error:
    print("caught", error.tool_name, str(error))
approved = await tools.danger({})
listing = await tools.listing({})
listing["entries"].append("programs get plain, mutable JSON")
return {"values": values, "approved": approved, "kw": await tools.add_one(x=41), "listing": listing}
"""


async def test_start_harness_runs_programs_on_the_real_worker(catalog: PluginCatalog, config: Path) -> None:
    deployment = load_deployment([config])
    harness = await start_harness(deployment, catalog=catalog)
    try:
        runtime = harness.root.lookup("code_runtime")
        assert isinstance(runtime, LazyCodeRuntime) and not runtime.built
        assert isinstance(harness.root.lookup("run_code"), RunCodeTransport)
        assembler = harness.root.lookup("prompt")
        assert isinstance(assembler, PromptAssembler)
        sections = {s.name: s.text for s in assembler.sections(harness.agent())}
        assert "async def add_one(self, args: AddOneArgs) -> int:" in sections[SDK_SECTION]
        assert not runtime.built  # presenting the SDK does not start a worker
        # The approval wait (1.5 s) is longer than the 1 s wall-clock budget: it does not count.
        result = await harness.call("run_code", {"code": PROGRAM, "description": "Exercise the tools"})
        assert not result.is_error, result.text
        assert result.value == {
            "logs": ["start", "caught fail this tool always fails"],
            "result": {
                "values": [1, 2, 3, 4, 5],
                "approved": "did the dangerous thing",
                "kw": 42,
                "listing": {
                    "entries": [{"name": "a.py", "size": 3}, "programs get plain, mutable JSON"],
                    "truncated": False,
                },
            },
        }
        assert TOOLS.approvals[-1].endswith(":code:7")
        assert runtime.built
        failed = await harness.call("run_code", {"code": "print('x')\n1/0", "description": "Divide by zero"})
        assert failed.code == ErrorCode.CODE_RUN_FAILED
        assert failed.error is not None and "(exception)" in failed.error.message
        assert "ZeroDivisionError" in failed.error.message and failed.error.message.endswith("Captured output:\nx")
        timeout = await harness.call("run_code", {"code": "while True:\n    pass", "description": "Spin"})
        assert timeout.error is not None and "code run failed (timeout)" in timeout.error.message
        direct = await harness.call("add_one", {"x": 1})
        assert direct.code == ErrorCode.UNKNOWN_TOOL
    finally:
        await harness.aclose()
    assert not runtime.built  # closed with the root scope
    with pytest.raises(RuntimeError, match="closed"):
        await runtime.run("pass", [])


def test_cli_run_code_json_lists_calls_and_exits_by_outcome(
    catalog: PluginCatalog, config: Path, tmp_path: Path
) -> None:
    program = tmp_path / "prog.py"
    program.write_text(
        "print('hi')\nr = await tools.add_one({'x': 1})\n"
        "try:\n    await tools.fail({})\nexcept ToolCallError:\n    pass\nreturn r\n"
    )
    runner = CliRunner()
    out = runner.invoke(main, ["run-code", str(program), "--json", "--config", str(config)])
    assert out.exit_code == 0, out.output
    document = json.loads(out.stdout)
    assert document == {
        "outcome": "completed",
        "logs": ["hi"],
        "result": 2,
        "error": None,
        "calls": [
            {"sub_call_id": "call-1:code:1", "name": "add_one", "args": {"x": 1}, "ok": True, "error_code": None},
            {"sub_call_id": "call-1:code:2", "name": "fail", "args": {}, "ok": False, "error_code": "TOOL_FAILED"},
        ],
    }
    program.write_text("print('before')\nraise ValueError('nope')\n")
    out = runner.invoke(main, ["run-code", str(program), "--json", "--config", str(config)])
    assert out.exit_code == 1
    document = json.loads(out.stdout)
    assert document["outcome"] == "exception" and document["logs"] == ["before"] and document["result"] is None
    assert document["error"]["code"] == "CODE_RUN_FAILED" and "ValueError: nope" in document["error"]["message"]
    program.write_text("def broken(:\n")
    out = runner.invoke(main, ["run-code", str(program), "--json", "--config", str(config)])
    assert out.exit_code == 1 and json.loads(out.stdout)["outcome"] == "exception"
    out = runner.invoke(main, ["run-code", str(program), "--config", str(config)])
    assert out.exit_code == 1 and "SyntaxError" in out.stderr


def test_cli_run_code_reads_a_utf8_byte_order_mark_as_the_encoding_not_as_code(
    catalog: PluginCatalog, config: Path, tmp_path: Path
) -> None:
    # Editors on Windows save UTF-8 with a BOM; `python prog.py` skips it, run-code passed U+FEFF on as the
    # program's first character: "SyntaxError: invalid non-printable character U+FEFF", exit 1.
    program = tmp_path / "bom.py"
    program.write_bytes("\ufeffreturn await tools.add_one(x=1)\n".encode())
    runner = CliRunner()
    out = runner.invoke(main, ["run-code", str(program), "--config", str(config)])
    assert (out.exit_code, out.stdout) == (0, "2\n"), out.output
    out = runner.invoke(main, ["run-code", "-", "--config", str(config)], input=program.read_bytes())
    assert (out.exit_code, out.stdout) == (0, "2\n"), out.output


def test_cli_run_code_under_a_native_deployment_presents_both_for_the_call(
    catalog: PluginCatalog, tmp_path: Path
) -> None:
    config = tmp_path / "native.toml"
    config.write_text('[[agents]]\nid = "main"\n[[plugins]]\nid = "tools"\nuse = "test-tools"\n')
    program = tmp_path / "p.py"
    program.write_text("return await tools.add_one(x=1)\n")
    out = CliRunner().invoke(main, ["run-code", str(program), "--config", str(config)])
    assert out.exit_code == 0, out.output
    assert out.stdout.strip() == "2"
    assert "agent 'main' is in native mode" in out.stderr


def test_cli_sdk_prints_the_sdk_in_either_language(catalog: PluginCatalog, config: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["sdk", "--config", str(config)])
    assert out.exit_code == 0, out.output
    assert "```python" in out.stdout and "async def add_one(self, args: AddOneArgs) -> int:" in out.stdout
    out = runner.invoke(main, ["sdk", "--lang", "typescript", "--config", str(config)])
    assert out.exit_code == 0 and "add_one: { x: number } & Record<string, JsonValue>;" in out.stdout
    out = runner.invoke(main, ["sdk", "--lang", "cobol", "--config", str(config)])
    assert out.exit_code == 2


async def _fire_and_forget_on_worker(calls: int, wait: Callable[[Any], Awaitable[None]]) -> tuple[Env, list[Any]]:
    """On the real worker runtime, run a program that fires ``calls`` exclusive calls and returns at once.

    Each body records its arguments, then awaits ``wait(args)``. Returns the
    environment (its sink holds the events) and the arguments of the bodies that started.
    """
    started: list[Any] = []

    async def body(args: Any, ctx: Any) -> Any:
        started.append(args)
        await wait(args)
        return args

    runtime = PythonCodeRuntime()
    try:
        env = Env(code_runtime=runtime)
        env.add(tool("excl", body))  # exclusive: every later call stays queued behind the first
        program = (
            f"import asyncio\nfor i in range({calls}):\n    asyncio.ensure_future(tools.excl({{'i': i}}))\n"
            "await asyncio.sleep(0.05)\nreturn 'done'"
        )
        result = await env.run(program)
        assert result.value == {"logs": [], "result": "done"}, result.text
        await asyncio.sleep(0.3)  # the started body ends; nothing else may start meanwhile
        return env, started
    finally:
        await runtime.aclose()


async def test_calls_still_queued_when_the_program_settles_never_start_nor_raise() -> None:
    # The worker host cancels the futures of calls still pending when the run settles; the
    # scheduler then abandons those queued calls without an error of its own.
    errors: list[BaseException] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda _l, ctx: errors.append(ctx.get("exception") or ctx["message"])
    )

    async def slow(args: Any) -> None:
        await asyncio.sleep(0.2)

    env, started = await _fire_and_forget_on_worker(3, slow)
    gc.collect()
    await asyncio.sleep(0)
    kinds = env.sink.kinds()
    assert kinds == [("tool/code-dispatch-start", "call-1:code:1"), ("tool/code-dispatch", "call-1:code:1")]
    assert started == [{"i": 0}]
    assert errors == []


def _signal_teardown(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """An event set when the host starts tearing down a program's run (not a pre-spawned worker)."""
    from dsh_core.coderuntime import host

    tearing = asyncio.Event()
    original = host._Run._teardown

    async def teardown(self: Any, zygote: Any) -> None:
        if self.tasks:  # the program's run, not a pre-spawned worker
            tearing.set()
        await original(self, zygote)

    monkeypatch.setattr(host._Run, "_teardown", teardown)
    return tearing


async def test_a_queued_call_does_not_start_once_the_host_cancelled_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # A body that ends between the host's cancellation and run_code's own abort must not
    # let the next queued call start for a program that is gone.
    tearing = _signal_teardown(monkeypatch)
    asyncio.get_running_loop().set_exception_handler(lambda _l, _c: None)

    async def first_waits_for_teardown(args: Any) -> None:
        if args["i"] == 0:
            await tearing.wait()  # the first call ends while the host tears the run down

    env, started = await _fire_and_forget_on_worker(2, first_waits_for_teardown)
    # the program is gone; call 2 was queued at settlement: it must not start
    assert started == [{"i": 0}]
    assert ("tool/code-dispatch-start", "call-1:code:2") not in env.sink.kinds()


def _settles(env: Env) -> list[tuple[str, str, bool, str | None]]:
    return [
        (e["sub_call_id"], e["payload"]["name"], e["payload"]["is_error"], e["payload"]["error_code"])
        for e in env.sink.events
        if e["kind"] == "tool/code-dispatch"
    ]  # type: ignore[union-attr]


async def test_a_call_still_in_policy_when_the_program_settles_never_runs_its_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its policy answers while the host tears the run down, before run_code's own abort: the
    # program is gone, so its body must not start (it ran, unaborted, and committed as a success).
    tearing = _signal_teardown(monkeypatch)
    ran: list[Any] = []

    class Policy:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            async def allow_once_tearing() -> None:
                await tearing.wait()

            return allow_once_tearing() if execution.nested else None

    async def write(args: Any, ctx: Any) -> Any:
        ran.append(ctx.signal.aborted)
        return "wrote"

    runtime = PythonCodeRuntime()
    try:
        env = Env(code_runtime=runtime)
        env.plug(Policy())
        env.add(tool("write", write))
        result = await env.run(
            "import asyncio\nasyncio.ensure_future(tools.write({}))\nawait asyncio.sleep(0.05)\nreturn 'done'"
        )
    finally:
        await runtime.aclose()
    assert result.value == {"logs": [], "result": "done"}, result.text
    assert ran == []
    assert _settles(env) == [("call-1:code:1", "write", True, "ABORTED_BEFORE_DISPATCH")]


async def test_a_retry_loop_after_timeouts_runs_one_body_at_a_time_on_the_worker() -> None:
    # asyncio.wait_for gives up on an exclusive call whose body ignores its signal: the worker
    # tells the host, which aborts and cuts it (ABORTED). The next attempt starts only then, and
    # a later call is not held up by the barrier (without this, each body ran its 30 s, and the
    # status call waited for one: 5 s is far below that, far above a slow machine's round trip).
    events: list[str] = []

    async def deploy(args: Any, ctx: Any) -> Any:
        events.append(f"start {args['attempt']}")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append(f"cut {args['attempt']}: {ctx.signal.reason}")
            raise
        return "deployed"

    async def status(args: Any, ctx: Any) -> Any:
        return "ok"

    program = (
        "import asyncio, time\nfor attempt in range(3):\n    try:\n"
        "        await asyncio.wait_for(tools.deploy({'attempt': attempt}), 0.2)\n    except TimeoutError:\n"
        "        print('attempt', attempt, 'timed out')\n"
        "began = time.monotonic()\nstatus = await tools.status({})\nreturn [status, time.monotonic() - began < 5]"
    )
    runtime = PythonCodeRuntime(CodeRuntimeConfig(timeout_s=10.0))
    try:
        env = Env(code_runtime=runtime)
        env.add(tool("deploy", deploy), tool("status", status))
        result = await env.run(program)
    finally:
        await runtime.aclose()
    assert result.value == {"logs": [f"attempt {n} timed out" for n in range(3)], "result": ["ok", True]}, result.text
    assert events == [
        f"{what} {n}" + (": cancelled by the program" if what == "cut" else "")
        for n in range(3)
        for what in ("start", "cut")
    ]
    assert _settles(env) == [
        *((f"call-1:code:{n}", "deploy", True, "ABORTED") for n in (1, 2, 3)),
        ("call-1:code:4", "status", False, None),
    ]


async def test_a_queued_call_and_an_approval_the_program_gives_up_on_never_run_on_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The order is forced, not timed: the first (exclusive) call's body holds the barrier until the host
    # has seen the program cancel the call queued behind it, so the queued call is still queued then.
    asked: list[str] = []
    ran: list[str] = []
    queued_cancelled = asyncio.Event()
    submit = ProgramScheduler.submit

    def watched_submit(self: ProgramScheduler, request: Any, *args: Any) -> asyncio.Future[Any]:
        future = submit(self, request, *args)
        if request.call_id == "call-1:code:2":  # the queued call
            future.add_done_callback(lambda done: queued_cancelled.set() if done.cancelled() else None)
        return future

    monkeypatch.setattr(ProgramScheduler, "submit", watched_submit)

    class Person:
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> Any:
            return PreDecision.ask("dangerous") if execution.name == "danger" else None

        @hookimpl
        def dsh_approve(self, request: Any) -> Any:
            async def think() -> ApprovalOutcome:
                asked.append("asked")
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    asked.append("withdrawn")
                    raise
                return ApprovalOutcome.ALLOWED

            return think()

    async def body(args: Any, ctx: Any) -> Any:
        ran.append(args["n"])
        if args["n"] == "first":  # a guard, not a pause: the cancel arrives within milliseconds
            await asyncio.wait_for(queued_cancelled.wait(), 5)
        return args["n"]

    # sleep(0) lets both calls' tasks take their first step, which sends each call's frame, in order;
    # the cancel follows them on the same channel. The program gives up on the approval after 2 s: the
    # host asks for it as soon as the call arrives (the program cannot see that it was asked).
    program = (
        "import asyncio\nfirst = asyncio.ensure_future(tools.work({'n': 'first'}))\n"
        "queued = asyncio.ensure_future(tools.work({'n': 'queued'}))\n"
        "await asyncio.sleep(0)\nqueued.cancel()\nout = [await first]\n"
        "try:\n    await asyncio.wait_for(tools.danger({'n': 'danger'}), 2)\nexcept TimeoutError:\n"
        "    out.append('gave up')\nreturn out"
    )
    runtime = PythonCodeRuntime(CodeRuntimeConfig(timeout_s=10.0))
    try:
        env = Env(code_runtime=runtime)
        env.plug(Person())
        env.add(tool("work", body), tool("danger", body))
        result = await env.run(program)
    finally:
        await runtime.aclose()
    assert result.value == {"logs": [], "result": ["first", "gave up"]}, result.text
    assert queued_cancelled.is_set()  # it reached the host, queued, before the program cancelled it
    assert ran == ["first"] and asked == ["asked", "withdrawn"]
    assert [e["sub_call_id"] for e in env.sink.events if e["kind"] == "tool/code-dispatch-start"] == [
        "call-1:code:1",
        "call-1:code:3",
    ]  # nothing of the queued call 2
    assert _settles(env) == [
        ("call-1:code:1", "work", False, None),
        ("call-1:code:3", "danger", True, "ABORTED_BEFORE_DISPATCH"),
    ]


async def test_a_call_running_when_the_program_returns_is_not_taken_for_cancelled() -> None:
    # The host cancels the futures of calls still pending when the run settles (aborting the
    # run's control signal first): that is the run's end, not the program's cancel. The body is
    # not cut; it hears the run's own abort and is awaited, as before.
    seen: list[Any] = []

    async def slow(args: Any, ctx: Any) -> Any:
        await asyncio.sleep(0.2)
        seen.append(["finished", ctx.signal.reason])
        return "late"

    runtime = PythonCodeRuntime()
    try:
        env = Env(code_runtime=runtime)
        env.add(tool("slow", slow))
        result = await env.run(
            "import asyncio\nasyncio.ensure_future(tools.slow({}))\nawait asyncio.sleep(0.05)\nreturn 'done'"
        )
    finally:
        await runtime.aclose()
    assert result.value == {"logs": [], "result": "done"}, result.text
    assert seen == [["finished", "run_code settled"]]
    assert _settles(env) == [("call-1:code:1", "slow", True, "ABORTED")]

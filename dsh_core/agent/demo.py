"""``dsh demo``: an offline, end-to-end Code Mode run in a temporary workspace.

The shipped deployment (``demo.toml``: workspace tools, the approval preset,
Code Mode, the scripted provider, the SQLite session store) is run against
a small generated project. The script (``demo.jsonl``) makes the model write
one ``run_code`` program that reads three files and searches for TODO
markers in parallel, then a second one that writes ``REPORT.md``, then
answer. Afterwards the demo prints the answer, the recorded trajectory
(``dsh sessions show``'s tree) and the prompt-size saving: the same task is
run again natively (``demo-native.jsonl``: every tool schema on the wire,
every file's content through the conversation) and the characters sent to
the model are compared, measured, not estimated.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Final

import attrs
import click

from dsh_core.agent.loop import (
    AgentLoop,
    LoopObserver,
    RunResult,
    core_sections_of,
    open_session_store,
    run_agent,
)
from dsh_core.boot import start_harness
from dsh_core.clirun import fail, run_async
from dsh_core.config import Deployment, load_deployment
from dsh_core.errors import DshError
from dsh_core.harness import Harness
from dsh_core.registry import TRANSPORT_NAME
from dsh_core.scope import Scope
from dsh_core.sessions.cli import render_session
from dsh_core.sessions.events import EventKind, SessionEvent, SessionInfo

__all__ = [
    "demo_main",
    "prepare_demo",
    "run_demo",
    "run_demo_once",
    "DemoRun",
    "PromptSize",
    "prompt_sizes",
    "render_comparison",
    "DEMO_TASK",
    "DEMO_FILES",
]

#: The task the demo agent is given.
DEMO_TASK: Final = "Survey the source files and notes for TODO markers and write a REPORT.md summarizing them."


def _module(name: str, todo: str) -> str:
    # Realistically sized sources: in a native run every byte read flows through the model's context.
    body = [f'"""The {name} module of the demo inventory service."""', "", "from __future__ import annotations", ""]
    for index in range(12):
        body += [
            "",
            f"def {name}_step_{index}(items: dict[str, int], key: str, count: int) -> int:",
            f'    """Step {index}: adjust ``key`` by ``count`` and return the new level."""',
            "    level = items.get(key, 0) + count",
            "    items[key] = level",
            "    return level",
        ]
        if index == 5:
            body.append(f"    # TODO: {todo}")
    return "\n".join(body) + "\n"


#: The generated project the demo works on.
DEMO_FILES: Final = {
    "README.md": "# inventory\n\nA tiny inventory service used by `dsh demo`.\n",
    "src/inventory.py": _module("inventory", "refuse negative counts"),
    "src/report.py": _module("report", "paginate long reports"),
    "notes/plan.md": "# Plan\n\n- TODO: write tests for add()\n- ship v1\n",
}


def _toml_string(value: str) -> str:
    # A JSON string literal is a valid TOML basic string (same escapes for what paths contain).
    return json.dumps(value, ensure_ascii=False)


def prepare_demo(base: Path, *, mode: str = "code") -> tuple[Deployment, Path]:
    """Write the project, the script and the config under ``base``; return the deployment and workspace.

    ``mode="code"`` is the demo proper (``demo.jsonl``); ``mode="native"`` runs the same task with every
    tool on the wire (``demo-native.jsonl``), for the comparison.
    """
    if mode not in ("code", "native"):
        raise ValueError(f"demo mode must be 'code' or 'native', got {mode!r}")
    workspace = base / "workspace"
    for name, text in DEMO_FILES.items():
        path = workspace / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    package = resources.files("dsh_core.agent")
    script_name = "demo.jsonl" if mode == "code" else "demo-native.jsonl"
    script = base / script_name
    script.write_text(package.joinpath(script_name).read_text(encoding="utf-8"), encoding="utf-8")
    config = (
        package.joinpath("demo.toml")
        .read_text(encoding="utf-8")
        .replace("@MODE@", _toml_string(mode))
        .replace("@ROOT@", _toml_string(str(workspace)))
        .replace("@SCRIPT@", _toml_string(str(script)))
        .replace("@HOME@", _toml_string(str(base / "dsh-home")))
    )
    config_path = base / "demo.toml"
    config_path.write_text(config, encoding="utf-8")
    # The demo is self-contained: the environment must not switch its mode or move its home.
    return load_deployment([config_path], env={}), workspace


@attrs.frozen
class PromptSize:
    """What one model request carries besides the conversation: system prompt and tool schemas."""

    mode: str
    system_chars: int
    tools_chars: int
    tool_names: tuple[str, ...]

    @property
    def total(self) -> int:
        """Characters of system prompt plus tool schemas (JSON)."""
        return self.system_chars + self.tools_chars

    @property
    def approx_tokens(self) -> int:
        """A rough token count (4 characters a token)."""
        return (self.total + 3) // 4


async def prompt_sizes(harness: Harness, agent: Scope) -> tuple[PromptSize, PromptSize]:
    """The per-request prompt size of ``agent`` as configured, and with every tool presented natively."""
    registry = harness.registry
    row = harness.deployment.agent(next(i for i, s in harness.agents.items() if s is agent))
    extra = core_sections_of(harness)

    def measure(scope: Scope) -> PromptSize:
        loop = AgentLoop(
            agent_id="probe",
            scope=scope,
            registry=registry,
            runtime=harness.runtime,
            hooks=harness.hooks,
            provider=_NoProvider(),
            system_prompt=row.system_prompt if row is not None else None,
            core_sections=extra,
        )
        system = loop.assembler.assemble(scope)
        tools = [schema.to_json() for schema in registry.wire_schemas(scope)]
        return PromptSize(
            registry.mode_for(scope),
            len(system),
            len(json.dumps(tools, ensure_ascii=False)),
            tuple(t["name"] for t in tools),
        )

    configured = measure(agent)
    # A layered child that declares `native`: same tools, same hooks, only the presentation differs.
    probe = agent.child("prompt-size-probe", layered=True)
    try:
        registry.present_as("native", probe)
        native = measure(probe)
    finally:
        await probe.dispose()
    return configured, native


class _NoProvider:
    async def complete(self, *args: object, **kwargs: object) -> dict[str, object]:
        raise RuntimeError("the prompt-size probe never calls a provider")


@attrs.frozen
class DemoRun:
    """One run of the demo task: its result, its recorded events and its per-request prompt size."""

    result: RunResult
    info: SessionInfo
    events: tuple[SessionEvent, ...]
    size: PromptSize
    workspace: Path


async def run_demo_once(base: Path, *, mode: str, observer: LoopObserver | None = None) -> DemoRun:
    """Run the demo task once in ``mode`` under ``base``."""
    deployment, workspace = prepare_demo(base, mode=mode)
    harness = await start_harness(deployment)
    try:
        agent = harness.agent("demo")
        if harness.registry.mode_for(agent) != "native" and harness.registry.transport is None:
            raise DshError("dsh demo needs Code Mode, but this build has no run_code transport")
        store = open_session_store(harness)
        try:
            result = await run_agent(harness, DEMO_TASK, agent_id="demo", observer=observer, store=store)
            assert result.session_id is not None
            info = await store.get(result.session_id)
            events = await store.load(result.session_id)
        finally:
            await store.close()
        size, _ = await prompt_sizes(harness, agent)
    finally:
        await harness.aclose()
    if not result.ok:
        raise DshError(f"the demo run ({mode} mode) stopped: {result.reason}: {result.error}")
    # The scripted model answers as if every call worked: a failed one (Code Mode unable to run here,
    # say) must fail the demo, not be reported under a canned success and exit 0.
    for event in events:
        if event.kind == EventKind.TOOL_RESULT and not event.payload.get("ok"):
            error = event.payload.get("error") or {}
            raise DshError(
                f"the demo run ({mode} mode): tool call {event.payload.get('name')} "
                f"[{event.root_call_id}] failed (run with --keep to inspect its session): "
                f"{error.get('code')}: {error.get('message')}"
            )
    return DemoRun(result, info, tuple(events), size, workspace)


def render_comparison(code: DemoRun, native: DemoRun) -> str:
    """Per-request overhead and total characters sent to the model, Code Mode against native."""
    lines = [
        "Prompt size, the same task in both modes (characters sent to the model):",
        f"  {'mode':<7}{'requests':>9}{'per-request overhead':>23}{'total sent':>13}  tools on the wire",
    ]
    for run in (native, code):
        size = run.size
        lines.append(
            f"  {size.mode:<7}{len(run.result.request_chars):>9}{size.total:>23,}"
            f"{sum(run.result.request_chars):>13,}  {', '.join(size.tool_names)}"
        )
    before, after = sum(native.result.request_chars), sum(code.result.request_chars)
    if before:
        change = 100 * (before - after) / before
        verdict = f"Code Mode sent {change:.0f}% less" if change >= 0 else f"Code Mode sent {-change:.0f}% more"
        lines.append(
            f"  {verdict} ({abs(before - after):,} characters, ~{abs(before - after) // 4:,} tokens): "
            "file contents stayed in the program instead of flowing through the conversation."
        )
    lines.append("  (per-request overhead = system prompt + tool schemas; Code Mode's includes the generated SDK)")
    return "\n".join(lines)


def _count_nested(events: Sequence[SessionEvent]) -> tuple[int, int]:
    programs = sum(1 for e in events if e.kind == EventKind.TOOL_CALL and e.payload.get("name") == TRANSPORT_NAME)
    nested = sum(1 for e in events if e.kind == EventKind.CODE_DISPATCH_START)
    return programs, nested


async def run_demo(base: Path, *, observer: LoopObserver | None = None) -> str:
    """Run the demo (Code Mode, then the native comparison) under ``base``; return the report."""
    code = await run_demo_once(base / "code", mode="code", observer=observer)
    native = await run_demo_once(base / "native", mode="native")
    programs, nested = _count_nested(code.events)
    report = code.workspace / "REPORT.md"
    return "\n".join(
        [
            f"Task: {DEMO_TASK}",
            f"Answer: {code.result.answer}",
            "",
            "Trajectory (as dsh sessions show renders it; run with --keep to open it later):",
            render_session(code.info, list(code.events)),
            "",
            f"{nested} tool calls ran inside {programs} run_code program(s); "
            f"the model was asked {code.result.turns} times.",
            f"REPORT.md: {'written' if report.exists() else 'not written'}",
            "",
            render_comparison(code, native),
        ]
    )


def demo_main(*, keep: bool) -> None:
    """``dsh demo [--keep]``: run the demo in a temporary directory, print the report, exit 1 on an error."""
    from dsh_core.agent.cli import ConsoleObserver, stderr_console

    base = Path(tempfile.mkdtemp(prefix="dsh-demo-"))
    observer = ConsoleObserver(stderr_console()) if sys.stderr.isatty() else None
    try:
        # run_async: SIGINT/SIGTERM cancel the demo (exit 130), and the directory is still removed.
        # What a plugin or a tool body prints goes to stderr, as in every other command: stdout is the report.
        report = run_async(lambda: run_demo(base, observer=observer), stdout_to_stderr=True)
    except DshError as error:
        fail(error.message, 1)  # escaped: it may quote what a tool or the model wrote
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    click.echo(report)
    if keep:
        # DSH_HOME overrides the kept config's [sessions] home: where it is set, the command
        # must set it too, or it would list the sessions of the user's own home instead.
        home = f"DSH_HOME={shlex.quote(str(base / 'code' / 'dsh-home'))} " if "DSH_HOME" in os.environ else ""
        click.echo(
            f"\nKept {base} (code/ and native/: workspace, script, config, dsh-home/sessions.db).\n"
            f"Its sessions: {home}dsh sessions list --config {shlex.quote(str(base / 'code' / 'demo.toml'))} "
            "(then sessions show ID"
            f" with the same {'DSH_HOME and ' if home else ''}--config)."
        )

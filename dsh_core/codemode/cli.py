"""The Code Mode commands of ``dsh``: ``run-code`` and ``sdk`` (loaded by name by :mod:`dsh_core.cli`).

``dsh run-code FILE [--json]`` makes one model-direct ``run_code`` call with
the program in FILE (``-`` reads stdin) through the whole pipeline, as the
chosen agent. If that agent's effective mode is ``native`` (where the model
could not call ``run_code``), the call is made from a short-lived child scope
of the agent presenting ``both``: same tools, restrictions, hooks and session
as the agent, so the program is governed exactly as the agent's own calls.

``--json`` prints ``{"outcome", "logs", "result", "error", "calls"}``:
``outcome`` is ``completed`` or the run's error kind (``exception``,
``timeout``, ``abort``, ``worker-exit``, ``memory-limit``, ``invalid-output``,
``output-limit``); when the call failed before or around the run (denied by
policy, no runtime, invalid arguments, blocked by a post-execute hook) it is
that result's error code (e.g. ``DENIED``). ``logs``/``result`` are what the
pipeline returned (after the post-execute hooks, or an around-dispatch
middleware's answer), as the model got them; a failed run's logs only while
its failure is reported unchanged. ``error`` is ``null`` or ``{"code", "kind", "message"}``;
``calls`` lists the nested calls in submission order. The exit code is 0 only
for ``completed``.

``dsh sdk [--lang python|typescript]`` prints the SDK the model sees for the
agent's visible tools (default language: the code runtime's).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, Final

import click

from dsh_core.cli import _boot_and_run, _configs, config_option, emit_json, fail, load_config
from dsh_core.clirun import echo_outside_text
from dsh_core.lossless import thaw

# `dsh --help` imports this module: Code Mode itself is imported in the command bodies.
if TYPE_CHECKING:
    from dsh_core.codemode.transport import RunRecord
    from dsh_core.coderuntime.seam import CodeRunResult
    from dsh_core.model import ToolResult

__all__ = ["SDK_LANGUAGES", "run_code_command", "sdk_command", "run_code_json"]

#: The choices of ``dsh sdk --lang``: the keys of :data:`dsh_core.codemode.sdk.SDK_RENDERERS`, sorted
#: (a test checks), named here so that the help does not import the renderers.
SDK_LANGUAGES: Final = ("python", "typescript")


def run_code_json(result: ToolResult, record: RunRecord) -> dict[str, Any]:
    """The ``--json`` document of one ``run_code`` call: what the pipeline produced, as the model got it.

    ``logs``/``result`` of a success come from the call's result value, after
    the post-execute hooks (a redacting hook's work stays done), not from the
    raw run. The run itself gives only the outcome and the error's ``kind``,
    and its logs and message only while the failure is the run's own as the
    transport reported it; a failure the pipeline made or rewrote (a block, a
    replaced message or content) shows its code and model-facing text, no logs.
    """
    run = record.run
    calls = [
        {"sub_call_id": c.sub_call_id, "name": c.name, "args": c.args, "ok": c.ok, "error_code": c.error_code}
        for c in record.calls
    ]
    if result.error is None:
        # The value passed run_code's output schema: {logs, result?} (also when an around-dispatch
        # middleware answered without running the program, e.g. a cache).
        value = thaw(result.value)
        answered = value if isinstance(value, dict) else {}
        logs = answered.get("logs")
        return {
            "outcome": "completed",
            "logs": list(logs) if isinstance(logs, list) else [],
            "result": answered.get("result"),
            "error": None,
            "calls": calls,
        }
    failed = run.error if run is not None else None
    if run is not None and failed is not None and _is_the_runs_own_failure(result, run):
        return {
            "outcome": failed.kind,
            "logs": list(run.logs),
            "result": None,
            "error": {"code": result.error.code, "kind": failed.kind, "message": failed.message},
            "calls": calls,
        }
    # The pipeline failed the call itself or rewrote the run's failure: what it says, not the raw run.
    error: dict[str, str | None] = {
        "code": result.error.code,
        "kind": failed.kind if failed is not None else None,
        "message": result.text.removeprefix("Error: ") or result.error.message,
    }
    return {
        "outcome": failed.kind if failed is not None else result.error.code,
        "logs": [],
        "result": None,
        "error": error,
        "calls": calls,
    }


def _is_the_runs_own_failure(result: ToolResult, run: CodeRunResult) -> bool:
    """Whether ``result`` is the transport's report of the run's failure, as the pipeline left it."""
    from dsh_core.errors import CodeRunFailedError, ErrorCode

    assert result.error is not None and run.error is not None
    reported = CodeRunFailedError(run.error.kind, run.error.message, run.logs).message
    return (
        result.error.code == ErrorCode.CODE_RUN_FAILED
        and result.error.message == reported
        and result.text == f"Error: {reported}"
    )


@click.command("run-code")
# utf-8-sig: a byte order mark (editors on Windows write one) is the encoding's, not the program's,
# as `python FILE` takes it.
@click.argument("file", type=click.File("r", encoding="utf-8-sig"))
@click.option("--agent", "agent_id", help="The calling agent (default: the first one).")
@click.option("--description", default=None, help="The run's title (default: derived from FILE).")
@click.option("--json", "as_json", is_flag=True, help='Print {"outcome", "logs", "result", "error", "calls"}.')
@config_option
@click.pass_context
def run_code_command(
    ctx: click.Context,
    file: IO[str],
    agent_id: str | None,
    description: str | None,
    as_json: bool,
    configs: tuple[str, ...],
) -> None:
    """One model-direct run_code call with the program in FILE (- for stdin).

    The exit status is 0 only if the program completed; 1 if it failed (an exception, a timeout, a
    denial: --json's outcome says which), 2 for bad usage or config. An agent in native mode runs
    the program as if its mode were "both" (same tools, restrictions and hooks).
    """
    from dsh_core.codemode.transport import RunCodeTransport
    from dsh_core.registry import TRANSPORT_NAME

    name = getattr(file, "name", "program")
    try:
        code = file.read()
    except UnicodeDecodeError as error:
        fail(f"{name}: the program is not UTF-8 text ({error.reason})", 2)
    title = description or f"Run {name}"

    async def work(harness: Any) -> tuple[ToolResult, RunRecord]:
        scope = harness.agent(agent_id)
        registry = harness.registry
        transport = harness.root.lookup("run_code")
        if not isinstance(transport, RunCodeTransport):
            fail("this harness has no run_code transport", 2)
        caller = scope
        if registry.mode_for(scope) == "native":
            # A native agent has no run_code; this developer command lends it one, and says so.
            click.echo(
                f"dsh: note: agent {scope.name.removeprefix('agent:')!r} is in native mode; "
                'running the program as if its mode were "both"',
                err=True,
            )
            caller = scope.child("cli:run-code", layered=True)
            registry.present_as("both", caller)
        call_id = harness.next_call_id()
        try:
            with transport.watch(call_id) as record:
                result: ToolResult = await harness.call(
                    TRANSPORT_NAME, {"code": code, "description": title}, agent=caller, call_id=call_id
                )
        finally:
            if caller is not scope:
                await caller.dispose()
        return result, record

    result, record = _boot_and_run(load_config(_configs(ctx, configs)), work)
    document = run_code_json(result, record)
    if as_json:
        emit_json(document)
    else:
        echo_outside_text(result.text, err=result.is_error)
    sys.exit(0 if document["outcome"] == "completed" else 1)


@click.command("sdk")
@click.option(
    "--lang",
    "language",
    type=click.Choice(SDK_LANGUAGES),
    default=None,
    help="The SDK language (default: the code runtime's).",
)
@click.option("--agent", "agent_id", help="The agent whose visible tools to render (default: the first one).")
@config_option
@click.pass_context
def sdk_command(ctx: click.Context, language: str | None, agent_id: str | None, configs: tuple[str, ...]) -> None:
    """The generated SDK a run_code program is written against."""
    from dsh_core.codemode.sdk import render_sdk, sdk_tools

    async def work(harness: Any) -> str:
        scope = harness.agent(agent_id)
        lang = language or _runtime_language(harness.root.lookup)
        return render_sdk(lang, sdk_tools(harness.registry.definitions(scope)))

    click.echo(_boot_and_run(load_config(_configs(ctx, configs)), work))


def _runtime_language(lookup: Callable[[str], Any]) -> str:
    runtime = lookup("code_runtime")
    language = getattr(runtime, "language", None)
    return language if isinstance(language, str) else "python"

"""``dsh -p TASK`` and ``dsh demo``: headless agent runs from the command line.

Only the final answer goes to stdout. Progress and tool activity go to
stderr through ``rich`` — and only when stderr is a terminal, so pipelines
and CI logs stay clean. The first SIGINT (or SIGTERM) aborts the run (tool
bodies see the abort signal; the session records ``aborted``), a second one
cancels it, a third exits at once.

Exit codes: 0 for an answer (final message or a concluding tool), 1 for a
run that stopped without one (turn limit, provider or other error), 2 for
bad usage or config, 130 for an interrupted run. An answer whose reply the
model did not finish (``finish_reason`` ``length`` or ``content_filter``),
or that is the model's refusal, still exits 0, with a warning on stderr.
"""

from __future__ import annotations

import sys
from typing import Final, NoReturn, TypeVar

import click
from rich.console import Console
from rich.markup import escape as escape_markup

from dsh_core.abort import AbortController
from dsh_core.agent.loop import LoopObserver, RunResult, StopReason, ToolCallRecord, run_agent
from dsh_core.agent.provider import Message
from dsh_core.clirun import USAGE_ERROR_CODES, echo_outside_text, fail, run_async
from dsh_core.config import Deployment
from dsh_core.errors import DshError
from dsh_core.terminal import visible

__all__ = ["run_prompt", "ConsoleObserver", "exit_code", "stderr_console"]

T = TypeVar("T")


def stderr_console() -> Console:
    """The console for progress: stderr, highlighting off (values are shown as given)."""
    return Console(stderr=True, highlight=False)


def escape(text: str) -> str:
    """``text`` for the progress console: no rich markup, nothing that would drive the terminal."""
    return escape_markup(visible(text))


def _short(text: str, limit: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ConsoleObserver(LoopObserver):
    """Renders steps and tool activity on a (stderr) console."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def on_step(self, step: int) -> None:
        """Announce a model request."""
        self.console.print(f"[dim]· step {step}: asking the model…[/]")

    def on_assistant(self, message: Message) -> None:
        """Show the assistant's interim text (the final answer goes to stdout instead)."""
        if message.get("tool_calls") and message.get("content"):
            self.console.print(f"[dim]  {escape(_short(str(message['content'])))}[/]")

    def on_tool_start(self, call: ToolCallRecord) -> None:
        """Show a starting call with its arguments."""
        arguments = _short(call.raw_arguments, 80)
        lane = " [dim](parallel)[/]" if call.mode == "parallel" else ""
        self.console.print(f"  [cyan]→ {escape(_short(call.name, 80))}[/] {escape(arguments)}{lane}")

    def on_tool_end(self, call: ToolCallRecord) -> None:
        """Show a settled call: outcome and duration."""
        result = call.result
        assert result is not None
        took = f"{call.duration_ms:.0f} ms"
        if result.error is None:
            self.console.print(f"  [green]✓ {escape(_short(call.name, 80))}[/] [dim]{took}[/]")
        else:
            # The code is a plugin's (any string), the name the model's (any length): both are escaped and cut.
            message = escape(_short(result.error.message, 120))
            label = escape(f"{_short(call.name, 80)} {_short(result.error.code, 40)}")
            self.console.print(f"  [red]✗ {label}[/] [dim]{took}[/] {message}")

    def on_end(self, result: RunResult) -> None:
        """Say why the run stopped and how to continue it."""
        where = f" · session {result.session_id}" if result.session_id else ""
        self.console.print(f"[dim]· {result.reason} after {result.turns} turn(s){where}[/]")


#: What a last reply's ``finish_reason`` says about an answer the model did not finish (warned about on stderr).
_UNFINISHED: Final = {
    "length": "the model stopped at its output limit",
    "content_filter": "the provider's content filter stopped the model",
}


def exit_code(result: RunResult) -> int:
    """The process exit code of a run (see the module docstring)."""
    if result.ok:
        return 0
    if result.reason is StopReason.ABORTED:
        return 130
    return 1


def run_prompt(
    deployment: Deployment, task: str, *, session_id: str | None = None, agent_id: str | None = None
) -> NoReturn:
    """``dsh -p TASK``: one headless agent run; print the answer on stdout and exit with :func:`exit_code`."""
    console = stderr_console()
    interactive = sys.stderr.isatty()
    observer: LoopObserver = ConsoleObserver(console) if interactive else LoopObserver()
    # Approvals are asked by the deployment's approval plugin (its terminal channel honours its
    # config and the call's abort signal); the run records every outcome in the session.

    controller = AbortController()

    async def main() -> RunResult:
        from dsh_core.boot import start_harness

        harness = await start_harness(deployment)
        try:
            return await run_agent(
                harness, task, agent_id=agent_id, session_id=session_id, signal=controller.signal, observer=observer
            )
        finally:
            await harness.aclose()

    try:
        # The first signal aborts the run: the loop stops at its next safe point and records why.
        # stdout is the answer alone, printed after the run.
        result = run_async(main, on_signal=lambda: controller.abort("interrupted"), stdout_to_stderr=True)
    except DshError as error:
        fail(error.message, 2 if error.code in USAGE_ERROR_CODES else 1)
    if result.answer is not None:
        echo_outside_text(result.answer)
    unfinished = _UNFINISHED.get(result.finish_reason or "")
    if result.ok and unfinished is not None:
        click.echo(
            f"dsh: warning: the answer may be incomplete: {unfinished} (finish_reason {result.finish_reason!r})",
            err=True,
        )
    if result.ok and result.refusal:
        # The answer on stdout is the refusal's text: a script reading it should not take it for the result.
        click.echo("dsh: warning: the model refused; the answer is its refusal", err=True)
    if not result.ok:
        detail = result.error or str(result.reason)
        resume = f" (session {result.session_id})" if result.session_id else ""
        # The detail may quote a provider's error body or a tool's message.
        click.echo(f"dsh: run stopped: {result.reason}: {visible(detail, lines=True)}{resume}", err=True)
    sys.exit(exit_code(result))

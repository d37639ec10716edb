"""The ``dsh`` command.

Only the requested output goes to stdout; errors go to stderr with a
non-zero exit code (1 for a failed operation, 2 for bad usage or config).
Output whose reader goes away (``dsh ... | head -1``) ends the command
silently with 141, the status of a process SIGPIPE killed. Ctrl-C ends it
with 130 and ``dsh: error: interrupted``.
Every command takes ``--config FILE`` (repeatable: later files overlay
earlier ones); without it the built-in default deployment is used.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import select
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from dsh_core.clirun import echo_json, echo_outside_text, fail, run_async
from dsh_core.errors import DshError
from dsh_core.lossless import dumps, thaw

# What the commands drive is imported in their bodies: `dsh --help` must not load it (a test checks).
if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from dsh_core.config import Deployment
    from dsh_core.model import ToolResult

__all__ = ["main", "load_config", "run_async", "result_json", "fail"]

T = TypeVar("T")


def _escape_lone_surrogates() -> None:
    """Write a lone surrogate on stdout and stderr as its ``\\uXXXX`` escape.

    A file name that is not UTF-8 reaches results and sessions as lone surrogates
    (``os.listdir`` decodes with ``surrogateescape``). Printed strictly they raise,
    and printed as raw bytes they are invalid UTF-8; the escape is readable text.
    (``--json`` output goes through :func:`dsh_core.clirun.echo_json`, which writes
    JSON escapes for whatever stdout cannot encode.)
    """
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


class _WholeFileIO(io.FileIO):
    """A raw file whose write takes everything it is given, as a buffered one does.

    A raw write may take only part (a signal mid-write, a full non-blocking pipe, a terminal), and
    the text layer above it ignores the count: the rest would be lost without a word.
    """

    def write(self, data: ReadableBuffer, /) -> int:
        with memoryview(data) as view, view.cast("B") as octets:
            done = 0
            while done < len(octets):
                written = super().write(octets[done:])
                if written is None:
                    # Non-blocking and full: wait until the reader takes some (a closed read end
                    # polls ready, and the next write raises BrokenPipeError).
                    poller = select.poll()
                    poller.register(self.fileno(), select.POLLOUT)
                    poller.poll()
                else:
                    done += written
            return done


def _write_output_whole() -> None:
    """Under ``python -u`` (or ``PYTHONUNBUFFERED``), print to stdout and stderr through a :class:`_WholeFileIO`.

    There each stream's binary layer is the raw file, so a large result, or a large message on
    stderr (what a plugin prints while a command runs goes there), could reach its reader cut
    short. Each new text layer writes through at once like the one it replaces, with the same
    encoding and error handler (lone surrogates stay escaped); the replaced ones stay as they
    are (``sys.__stdout__``, ``sys.__stderr__``, on the same file descriptors).
    """
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        # Buffered, it writes whole already. Not the interpreter's own (pytest's capture is a subclass
        # over a raw file too), it is left alone: a test calling main would find its capture replaced.
        if not (type(stream) is io.TextIOWrapper and type(stream.buffer) is io.FileIO):
            continue
        stream.flush()
        raw = _WholeFileIO(stream.fileno(), "w", closefd=False)
        raw.name = stream.buffer.name  # "<stdout>" or "<stderr>", not the bare descriptor
        # newline="\n": no translation, as the interpreter's own streams on POSIX.
        whole = io.TextIOWrapper(
            raw,
            encoding=stream.encoding,
            errors=stream.errors,
            newline="\n",
            line_buffering=stream.line_buffering,
            write_through=True,
        )
        setattr(sys, name, whole)


def load_config(paths: Sequence[str]) -> Deployment:
    """The effective deployment: the files given, or the default one for the current directory."""
    from dsh_core.config import default_deployment, load_deployment

    try:
        if paths:
            return load_deployment(list(paths))
        try:
            workspace = Path.cwd()
        except OSError as error:  # the directory dsh was started in has been deleted
            fail(
                f"cannot use the current directory as the default workspace: {error.strerror or error} "
                "(cd to an existing directory, or pass --config)",
                2,
            )
        return default_deployment(workspace)
    except DshError as error:
        fail(error.message, 2)


def result_json(result: ToolResult) -> dict[str, Any]:
    """The ``--json`` shape of a call: ``{"ok", "error", "content", "value"}``."""
    from dsh_core.model import converter

    return {
        "ok": not result.is_error,
        "error": None if result.error is None else {"code": result.error.code, "message": result.error.message},
        "content": converter.unstructure(list(result.content)),
        "value": None if result.is_error else thaw(result.value),
    }


def emit_json(value: object) -> None:
    """Write one JSON document to stdout."""
    echo_json(dumps(value, indent=2))


config_option = click.option(
    "--config",
    "configs",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Deployment TOML file; repeat to overlay (later files patch earlier ones).",
)


def _configs(ctx: click.Context, local: Sequence[str]) -> list[str]:
    inherited: Sequence[str] = ctx.find_root().params.get("configs") or ()
    return [*inherited, *local]


def _readers_gone() -> list[int]:
    """The standard output streams (fd 1, 2) whose reader is gone: pipes whose read end is closed."""
    gone = []
    for fd in (1, 2):
        poller = select.poll()
        try:
            poller.register(fd, select.POLLOUT)
            # The write end of a pipe whose read end is closed polls as POLLERR.
            if any(events & select.POLLERR for _, events in poller.poll(0)):
                gone.append(fd)
        except (OSError, ValueError):
            pass
    return gone


def _exit_as_sigpipe(streams: Sequence[int]) -> NoReturn:
    """Exit silently with 141, as a process SIGPIPE killed: ``streams``' reader is gone (``dsh ... | head -1``)."""
    # Python flushes the standard streams once more on exit: into /dev/null that cannot fail.
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in streams:
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.exit(128 + signal.SIGPIPE)


@contextlib.contextmanager
def _reader_gone_is_sigpipe() -> Iterator[None]:
    """Exit as :func:`_exit_as_sigpipe` does when the block's output finds the reader of stdout or stderr gone.

    click would exit 1, a failed operation's status, for ``dsh ... | head -1``. A broken pipe
    to anything but stdout or stderr is an error like any other.
    """
    try:
        yield
    except BrokenPipeError:
        gone = _readers_gone()
        if not gone:
            raise
        _exit_as_sigpipe(gone)


@contextlib.contextmanager
def _interrupt_exits_130() -> Iterator[None]:
    """Exit with 130 and ``dsh: error: interrupted`` on a Ctrl-C in the block, as an interrupted run does.

    click would print "Aborted!" and exit 1, a failed operation's status.
    """
    try:
        yield
    except KeyboardInterrupt:
        fail("interrupted", 130)


@contextlib.contextmanager
def _error_shown_interruptibly() -> Iterator[None]:
    """Make a Ctrl-C while click shows a :class:`click.ClickException` raised in the block exit as
    :func:`_interrupt_exits_130` does.

    click shows such an error (a usage error's usage and message, on stderr) in its ``main``, once the
    block has been left, and there turns a Ctrl-C into the error's own status (2 for a usage error).
    The error is passed on as it is (a caller with ``standalone_mode=False`` gets it); only its
    ``show`` is wrapped.
    """
    try:
        yield
    except click.ClickException as error:
        show = error.show

        def show_or_exit_130(file: IO[Any] | None = None) -> None:
            with _interrupt_exits_130():
                show(file)

        error.show = show_or_exit_130  # type: ignore[method-assign]
        raise


class LazyGroup(click.Group):
    """A group some of whose commands live in other modules, imported when first looked up.

    ``lazy_commands`` maps a command's name to ``"module:attribute"``. Listing the commands does not
    import them, but the group's help shows each one's short help, so ``dsh --help`` imports
    every such module: they import their machinery in the command bodies, not at their top.
    """

    def __init__(self, *args: Any, lazy_commands: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_commands and cmd_name not in self.commands:
            module, _, attribute = self.lazy_commands[cmd_name].partition(":")
            command = getattr(importlib.import_module(module), attribute)
            if not isinstance(command, click.Command):
                raise TypeError(f"{self.lazy_commands[cmd_name]} is not a click command")
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        _write_output_whole()
        # A usage error (or a group's help, for `dsh tools`) is shown on stderr by click itself,
        # once make_context or invoke has raised it.
        with _reader_gone_is_sigpipe():
            return super().main(*args, **kwargs)

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        # `dsh --help` prints here, while the arguments are parsed (importing every command's module
        # for its short help, which Ctrl-C may interrupt): click catches a broken pipe and Ctrl-C
        # from this and from invoke itself, so only handlers inside both see them. The interrupt's
        # message goes to stderr, whose reader may be gone too: the pipe's handler is the outer one.
        # A usage error found here is shown by click after this returns: its show is made to exit 130 too.
        with _reader_gone_is_sigpipe(), _interrupt_exits_130(), _error_shown_interruptibly():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        # Ctrl-C where no event loop handles it: a slow plugin import in `config dump`, a sync command.
        # A command's usage error (its arguments are parsed here) is shown by click after this returns.
        with _reader_gone_is_sigpipe(), _interrupt_exits_130(), _error_shown_interruptibly():
            try:
                return super().invoke(ctx)
            finally:
                # What is still buffered is written here, where a reader gone is handled;
                # at interpreter exit it would be an "Exception ignored" message and status 120.
                sys.stdout.flush()


# `sessions`, `run-code` and `sdk` are defined with the subsystem they drive; `config`, `tools` and `demo` below.
@click.group(
    cls=LazyGroup,
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    lazy_commands={
        "run-code": "dsh_core.codemode.cli:run_code_command",
        "sdk": "dsh_core.codemode.cli:sdk_command",
        "sessions": "dsh_core.sessions.cli:sessions_group",
    },
)
@click.option(
    "-p", "--prompt", "task", metavar="TASK", help="Run one headless agent turn on TASK and print the answer."
)
@click.option("--session", "session_id", metavar="ID", help="With -p: continue this session.")
@click.option("--agent", "agent_id", help="With -p: the agent to run (default: the first one).")
@config_option
@click.pass_context
def main(
    ctx: click.Context, task: str | None, session_id: str | None, agent_id: str | None, configs: tuple[str, ...]
) -> None:
    """dsh: a tool runtime for LLM agents, with a sandboxed Code Mode."""
    _escape_lone_surrogates()
    if ctx.invoked_subcommand is not None:
        # These options configure a -p run, and no command reads them: ignoring them would
        # run `dsh --agent coder tools call ...` as the first agent without a word.
        command = f"'dsh {ctx.invoked_subcommand}'"
        if task is not None:
            raise click.UsageError(
                f"-p TASK is a run of its own and takes no command, but {command} was given too", ctx
            )
        for value, option in ((session_id, "--session"), (agent_id, "--agent")):
            if value is not None:
                raise click.UsageError(
                    f"{option} applies only to a -p run; {command} does not read it "
                    "(a command's own options go after its name)",
                    ctx,
                )
        if configs and ctx.invoked_subcommand == "demo":
            raise click.UsageError(
                "--config does not apply to 'dsh demo': it always runs its own shipped "
                "deployment in a temporary workspace",
                ctx,
            )
        return
    if task is None:
        for value, option in ((session_id, "--session"), (agent_id, "--agent")):
            if value is not None:
                raise click.UsageError(f"{option} needs -p TASK (the run it applies to)", ctx)
        click.echo(ctx.get_help())
        return
    from dsh_core.agent.cli import run_prompt

    run_prompt(load_config(list(configs)), task, session_id=session_id, agent_id=agent_id)


@main.group("config")
def config_group() -> None:
    """Inspect the effective deployment configuration."""


@config_group.command("dump")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON: a list of {path, value, source}.")
@click.pass_context
def config_dump(ctx: click.Context, configs: tuple[str, ...], as_json: bool) -> None:
    """Show the effective config, each value with the file it came from.

    The deployment is checked as every run checks it before starting a plugin (each
    plugin found and importable, each row's config valid against its plugin's schema):
    one that fails is refused (exit 2), not shown as if it were in force. What only
    starting a plugin reveals (a missing script file, say) is not checked.
    """
    from dsh_core.config import dump, dump_text
    from dsh_core.harness import load_plugins

    deployment = load_config(_configs(ctx, configs))
    try:
        load_plugins(deployment)
    except DshError as error:
        fail(error.message, 2)
    if as_json:
        emit_json([{"path": p, "value": thaw(v), "source": s} for p, v, s in dump(deployment)])
    else:
        click.echo(dump_text(deployment))


@main.group("tools")
def tools_group() -> None:
    """List and call tools."""


async def _with_harness(deployment: Deployment, work: Callable[[Any], Awaitable[T]]) -> T:
    from dsh_core.boot import start_harness

    harness = await start_harness(deployment)
    try:
        return await work(harness)
    finally:
        await harness.aclose()


def _boot_and_run(deployment: Deployment, work: Callable[[Any], Awaitable[T]]) -> T:
    try:
        # The command prints its output once the harness is closed, or `--json` is no JSON.
        return run_async(lambda: _with_harness(deployment, work), stdout_to_stderr=True)
    except DshError as error:
        fail(error.message, 2)


@tools_group.command("list")
@config_option
@click.option("--agent", "agent_id", help="The agent whose view to show (default: the first one).")
@click.option("--json", "as_json", is_flag=True, help='Print {"mode", "visible", "wire"}.')
@click.pass_context
def tools_list(ctx: click.Context, configs: tuple[str, ...], agent_id: str | None, as_json: bool) -> None:
    """The visible tools and what the model is shown in the current mode."""

    async def work(harness: Any) -> dict[str, Any]:
        scope = harness.agent(agent_id)
        registry = harness.registry
        return {
            "mode": registry.mode_for(scope),
            "visible": registry.names(scope),
            "wire": [thaw(schema.to_json()) for schema in registry.wire_schemas(scope)],
        }

    listing = _boot_and_run(load_config(_configs(ctx, configs)), work)
    if as_json:
        emit_json(listing)
        return
    wire = {tool["name"] for tool in listing["wire"]}
    click.echo(f"mode: {listing['mode']}")
    for name in listing["visible"]:
        click.echo(f"  {name}{'' if name in wire else '   (reachable from run_code only)'}")


@tools_group.command("call")
@click.argument("name")
@click.option("--args", "raw_args", default="{}", show_default=True, help="The arguments, a JSON object.")
@click.option("--agent", "agent_id", help="The calling agent (default: the first one).")
@click.option("--json", "as_json", is_flag=True, help='Print {"ok", "error", "content", "value"}.')
@config_option
@click.pass_context
def tools_call(
    ctx: click.Context, name: str, raw_args: str, agent_id: str | None, as_json: bool, configs: tuple[str, ...]
) -> None:
    """One model-direct call of NAME through the whole pipeline.

    The exit status is 1 if the call failed (denied, unknown tool, invalid arguments, the tool's
    error), 2 for bad usage or config.
    """

    def refuse(constant: str) -> object:
        # Python's json reads NaN and Infinity, which no JSON holds (the agent loop refuses them too).
        raise ValueError(f"{constant} is not valid JSON")

    try:
        arguments = json.loads(raw_args, parse_constant=refuse)
    except (ValueError, RecursionError) as error:  # ValueError: also an integer past int's digit limit
        fail(f"--args is not valid JSON: {error}", 2)

    async def work(harness: Any) -> ToolResult:
        result: ToolResult = await harness.call(name, arguments, agent=agent_id)
        return result

    result = _boot_and_run(load_config(_configs(ctx, configs)), work)
    if as_json:
        emit_json(result_json(result))
    else:
        echo_outside_text(result.text, err=result.is_error)
    sys.exit(1 if result.is_error else 0)


# -- the demo (dsh_core.agent.demo) -----------------------------------------------------------------------
@main.command("demo")
@click.option("--keep", is_flag=True, help="Keep the temporary workspace (and its session database).")
def demo_command(keep: bool) -> None:
    """Run the shipped Code Mode demo offline in a temporary workspace and show what happened."""
    from dsh_core.agent.demo import demo_main

    demo_main(keep=keep)

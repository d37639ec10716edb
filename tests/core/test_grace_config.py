"""A deployment's ``[tools] approval_grace_s`` and ``[lifecycle] task_grace_s`` reach the runtime and the scopes.

Observed through a harness: a plugin whose approval channel and background task both ignore their
cancellation is left after the configured graces, and named in a warning saying how long it was waited for.
The approval grace must be below the task grace (the loader and the harness refuse it otherwise), so that a
tool call a disposed scope cancels ends within the scope's wait even when its approval channel is deaf.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from dsh_core import PreDecision, define_tool, hookimpl
from dsh_core.config import Deployment, LifecycleSection, PluginRow, ToolsSection, compose, load_deployment
from dsh_core.errors import ConfigError
from dsh_core.harness import Harness
from dsh_core.model import ApprovalOutcome, ApprovalRequest, ToolExecution, ToolExecutionInput
from dsh_core.plugins import PluginCatalog
from dsh_core.runtime import APPROVAL_GRACE_S
from dsh_core.scope import TASK_GRACE_S, Scope

pytestmark = pytest.mark.anyio


class Deaf:
    """Asks before every call, and neither its ask nor its background task (``poller``) heeds a cancellation until
    released; ``asked`` is set once it is asked."""

    def __init__(self, scope: Scope, *, poller: bool = True) -> None:
        self.release = asyncio.Event()
        self.asked = asyncio.Event()
        self.task = scope.spawn(self._ignore_cancellation(), name="deaf-poller") if poller else None

    async def _ignore_cancellation(self) -> None:
        while not self.release.is_set():
            with contextlib.suppress(asyncio.CancelledError):  # what the graces are for: a cancellation swallowed
                await self.release.wait()

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        async def execute(args: Any, ctx: Any) -> Any:
            return {}

        register(
            define_tool(
                name="echo",
                description="Echo.",
                execute=execute,
                parameters={"type": "object"},
                output_schema={"type": "object"},
            )
        )

    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> PreDecision:
        return PreDecision.ask("check")

    @hookimpl
    def dsh_approve(self, request: ApprovalRequest) -> Any:
        async def ask() -> ApprovalOutcome:
            self.asked.set()
            await self._ignore_cancellation()
            return ApprovalOutcome.REJECTED

        return ask()


async def test_the_configured_graces_bound_the_wait_for_a_deaf_channel_and_a_deaf_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    made: list[Deaf] = []

    def deaf(scope: Scope, config: Any) -> Deaf:
        made.append(Deaf(scope))
        return made[-1]

    deployment = compose(
        [
            (
                "dsh.toml",
                {
                    "tools": {"approval_timeout_s": 0.05, "approval_grace_s": 0.125},
                    "lifecycle": {"task_grace_s": 0.25},
                    "plugins": [{"id": "deaf", "use": "deaf"}],
                },
            )
        ],
        env={},
    )
    harness = await Harness.start(deployment, catalog=PluginCatalog(entry_points=[], extra={"deaf": deaf}))
    (plugin,) = made
    assert plugin.task is not None
    try:
        with caplog.at_level(logging.WARNING, logger="dsh"):
            result = await asyncio.wait_for(harness.call("echo", {}), 5)
            assert result.code == "DENIED"
            await asyncio.wait_for(harness.aclose(), 5)
        warnings = [r.getMessage() for r in caplog.records if r.name == "dsh" and r.levelno == logging.WARNING]
        channel = [w for w in warnings if "ignored its withdrawal" in w]
        assert len(channel) == 1 and "plugin 'deaf'" in channel[0] and "for 0.125 s" in channel[0], warnings
        task = [w for w in warnings if "did not end within" in w]
        assert len(task) == 1 and "'deaf-poller'" in task[0] and "within 0.25 s" in task[0], warnings
        assert not plugin.task.done()  # left running, as the warning says
    finally:
        plugin.release.set()
        await asyncio.wait_for(plugin.task, 5)


# A tool call whose scope is disposed unwinds through its approval ask: the ask is withdrawn and its
# channel waited for up to approval_grace_s. The scope waits task_grace_s for the call's task, so an
# approval grace at or above the task grace (the same 5 s of both once was) let the call outlive the dispose.

_WHY = (
    "a tool call whose scope is disposed waits out the approval grace for an approval channel that ignores "
    "its withdrawal, and would outlive the scope's wait for it"
)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"a.toml": "[tools]\napproval_grace_s = 60\n[lifecycle]\ntask_grace_s = 5\n"},
            "tools.approval_grace_s = 60 (from a.toml) must be below lifecycle.task_grace_s = 5 (from a.toml)",
            id="above",
        ),
        pytest.param(
            {"a.toml": "[tools]\napproval_grace_s = 2.5\n[lifecycle]\ntask_grace_s = 2.5\n"},
            "tools.approval_grace_s = 2.5 (from a.toml) must be below lifecycle.task_grace_s = 2.5 (from a.toml)",
            id="equal",
        ),
        pytest.param(
            {"a.toml": "[tools]\napproval_grace_s = 8\n", "b.toml": "[lifecycle]\ntask_grace_s = 6\n"},
            "tools.approval_grace_s = 8 (from a.toml) must be below lifecycle.task_grace_s = 6 (from b.toml)",
            id="overlay",
        ),
        pytest.param(
            {"a.toml": "[lifecycle]\ntask_grace_s = 3\n"},
            "tools.approval_grace_s = 5 (the default) must be below lifecycle.task_grace_s = 3 (from a.toml)",
            id="default-approval-grace",
        ),
    ],
)
def test_the_config_loader_refuses_an_approval_grace_not_below_the_task_grace(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, files: dict[str, str], expected: str
) -> None:
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_deployment(list(files), env={})
    assert caught.value.message == (
        f"{expected}: {_WHY}; lower [tools] approval_grace_s or raise [lifecycle] task_grace_s"
    )


def test_the_config_loader_takes_an_approval_grace_below_the_task_grace(tmp_path: Any) -> None:
    path = tmp_path / "a.toml"
    path.write_text("[tools]\napproval_grace_s = 4.5\n[lifecycle]\ntask_grace_s = 5\n", encoding="utf-8")
    deployment = load_deployment([path], env={})
    assert (deployment.tools.approval_grace_s, deployment.lifecycle.task_grace_s) == (4.5, 5.0)


def test_the_default_approval_grace_is_below_the_default_task_grace() -> None:
    """Else a deployment that sets neither would be refused, and the runtime and scopes built without one leak."""
    assert APPROVAL_GRACE_S < TASK_GRACE_S
    defaults = compose([("empty.toml", {})], env={})
    assert defaults.tools.approval_grace_s < defaults.lifecycle.task_grace_s


async def test_the_harness_refuses_a_deployment_whose_approval_grace_is_not_below_its_task_grace() -> None:
    """A Deployment built in code never went through the loader: the harness that builds the runtime checks it."""
    started: list[str] = []

    def record(scope: Scope, config: Any) -> object:
        started.append("started")
        return object()

    deployment = Deployment(
        tools=ToolsSection(approval_grace_s=0.5),
        lifecycle=LifecycleSection(task_grace_s=0.25),
        plugins=(PluginRow(id="record", use="record"),),
    )
    with pytest.raises(ConfigError) as caught:
        await Harness.start(deployment, catalog=PluginCatalog(entry_points=[], extra={"record": record}))
    assert caught.value.message == (
        f"tools.approval_grace_s = 0.5 must be below lifecycle.task_grace_s = 0.25: {_WHY}; "
        "lower [tools] approval_grace_s or raise [lifecycle] task_grace_s"
    )
    assert started == []  # refused before any plugin ran


async def test_a_tool_call_spawned_in_a_plugins_scope_ends_within_its_dispose_despite_a_deaf_channel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With graces the loader accepts, the call waits out the approval grace and still ends inside the task grace."""
    made: list[tuple[Scope, Deaf]] = []

    def deaf(scope: Scope, config: Any) -> Deaf:
        made.append((scope, Deaf(scope, poller=False)))
        return made[-1][1]

    # The task grace is far above the approval grace: a loop stalled across both deadlines must not fire the
    # scope's warning; a runtime that did not bound its wait for the deaf channel still fails, 20 s on.
    deployment = compose(
        [
            (
                "dsh.toml",
                {
                    "tools": {"approval_grace_s": 0.125},
                    "lifecycle": {"task_grace_s": 20},
                    "plugins": [{"id": "deaf", "use": "deaf"}],
                },
            )
        ],
        env={},
    )
    harness = await Harness.start(deployment, catalog=PluginCatalog(entry_points=[], extra={"deaf": deaf}))
    ((scope, plugin),) = made
    call = scope.spawn(
        harness.runtime.execute(ToolExecutionInput(call_id="c1", name="echo", arguments={})), name="spawned-call"
    )
    try:
        await asyncio.wait_for(plugin.asked.wait(), 20)
        with caplog.at_level(logging.WARNING, logger="dsh"):
            await asyncio.wait_for(harness.aclose(), 20)
        assert call.done()
        warnings = [r.getMessage() for r in caplog.records if r.name == "dsh" and r.levelno == logging.WARNING]
        assert [w for w in warnings if "did not end within" in w] == []
        assert len([w for w in warnings if "ignored its withdrawal for 0.125 s" in w]) == 1, warnings
    finally:
        plugin.release.set()
        await asyncio.wait_for(harness.aclose(), 20)  # closing twice is harmless; a failed close must not leak

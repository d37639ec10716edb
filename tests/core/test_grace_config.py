"""A deployment's ``[tools] approval_grace_s`` and ``[lifecycle] task_grace_s`` reach the runtime and the scopes.

Observed through a harness: a plugin whose approval channel and background task both ignore their
cancellation is left after the configured graces, and named in a warning saying how long it was waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from dsh_core import PreDecision, define_tool, hookimpl
from dsh_core.config import compose
from dsh_core.harness import Harness
from dsh_core.model import ApprovalOutcome, ApprovalRequest, ToolExecution
from dsh_core.plugins import PluginCatalog
from dsh_core.scope import Scope

pytestmark = pytest.mark.anyio


class Deaf:
    """Asks before every call, and neither its ask nor its background task heeds a cancellation until released."""

    def __init__(self, scope: Scope) -> None:
        self.release = asyncio.Event()
        self.task = scope.spawn(self._ignore_cancellation(), name="deaf-poller")

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

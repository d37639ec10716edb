"""Agent runs: the loop (:mod:`.loop`), the provider seam (:mod:`.provider`) and the CLI (:mod:`.cli`)."""

from typing import TYPE_CHECKING

from dsh_core.lazy import lazy_exports

if TYPE_CHECKING:
    from dsh_core.agent.loop import (
        DEFAULT_MAX_TURNS,
        AgentLoop,
        LoopObserver,
        RunResult,
        StopReason,
        ToolCallRecord,
        history_from_events,
        run_agent,
    )
    from dsh_core.agent.provider import Message, Provider, ProviderError, normalize_assistant, openai_tools

__all__ = [
    "DEFAULT_MAX_TURNS",
    "AgentLoop",
    "LoopObserver",
    "Message",
    "Provider",
    "ProviderError",
    "RunResult",
    "StopReason",
    "ToolCallRecord",
    "history_from_events",
    "normalize_assistant",
    "openai_tools",
    "run_agent",
]

# Imported on first use (see dsh_core.lazy): importing a module of this package, as `dsh --help`
# does, must not load the loop.
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            "dsh_core.agent.loop": [
                "DEFAULT_MAX_TURNS",
                "AgentLoop",
                "LoopObserver",
                "RunResult",
                "StopReason",
                "ToolCallRecord",
                "history_from_events",
                "run_agent",
            ],
            "dsh_core.agent.provider": ["Message", "Provider", "ProviderError", "normalize_assistant", "openai_tools"],
        },
    )

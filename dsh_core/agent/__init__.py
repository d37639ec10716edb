"""Agent runs: the loop (:mod:`.loop`), the provider seam (:mod:`.provider`) and the CLI (:mod:`.cli`)."""

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

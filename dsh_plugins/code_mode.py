"""The built-in ``code-mode`` plugin: the Code Mode prompt filter.

Under an effective ``code`` mode the model can call only ``run_code``, so the
per-tool guidance sections (``tool:<name>``, which tell the model to call a
tool directly) are removed from that scope's system prompt. The core's
``tools:code-only`` rule and ``tools:sdk`` section stay: programs still reach
every tool through the SDK. Under ``native`` and ``both`` nothing changes.

It is a plugin rather than core behaviour because it is presentation, not
security (the collapse itself is enforced by the registry whatever the
prompt says): a deployment that wants the guidance kept under ``code`` drops
the ``code-mode`` row.
"""

from __future__ import annotations

from collections.abc import Sequence

from dsh_core import PromptContext, PromptSection, Scope, hookimpl
from dsh_core import plugin as plugin_factory
from dsh_core.lossless import JSON

__all__ = ["CodeModePromptFilter", "plugin", "TOOL_GUIDANCE_PREFIX"]

#: Sections whose name starts with this are per-tool guidance.
TOOL_GUIDANCE_PREFIX = "tool:"


class CodeModePromptFilter:
    """Drops ``tool:*`` sections from the prompt of scopes whose effective mode is ``code``."""

    @hookimpl
    def dsh_prompt_filter(
        self, context: PromptContext, sections: Sequence[PromptSection]
    ) -> Sequence[PromptSection] | None:
        """Remove per-tool guidance under ``code``; keep everything else (``None`` elsewhere)."""
        if context.mode != "code":
            return None
        return [section for section in sections if not section.name.startswith(TOOL_GUIDANCE_PREFIX)]


@plugin_factory(config_schema={"type": "object", "additionalProperties": False})
def plugin(scope: Scope, config: JSON) -> CodeModePromptFilter:
    """The ``code-mode`` entry point: one prompt filter per config row (no config)."""
    return CodeModePromptFilter()

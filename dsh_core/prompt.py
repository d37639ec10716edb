"""System-prompt assembly: named sections from the core and from plugins, in a defined order.

Sections are merged by name (a nearer scope's section replaces a farther
one's; the core's own sections are the farthest), empty ones are dropped,
the rest sorted by ``(order, name)``, then every ``dsh_prompt_filter`` runs in
call order. The result never depends on plugin registration order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dsh_core.errors import DshError
from dsh_core.hooks import Hooks
from dsh_core.model import PromptContext, PromptSection
from dsh_core.registry import ToolRegistry
from dsh_core.scope import Scope

__all__ = ["PromptAssembler", "CoreSection", "PromptAssemblyError"]

#: A core section provider: returns a section (or ``None``) for a context; may raise to fail assembly loudly.
CoreSection = Callable[[PromptContext], "PromptSection | None"]


class PromptAssemblyError(DshError, ValueError):
    """Two contributions claim one section name at the same scope level."""

    code = "PROMPT_ASSEMBLY_FAILED"


class PromptAssembler:
    """Builds an agent's system prompt from core section providers and the prompt hooks."""

    def __init__(self, hooks: Hooks, registry: ToolRegistry, core: Sequence[CoreSection] = ()) -> None:
        self.hooks = hooks
        self.registry = registry
        self.core = list(core)

    def context(self, agent: Scope | None) -> PromptContext:
        """The context prompt hooks see for ``agent`` (its effective mode included)."""
        return PromptContext(agent=agent, mode=self.registry.mode_for(agent))

    def sections(self, agent: Scope | None) -> list[PromptSection]:
        """The ordered, filtered sections of ``agent``'s system prompt."""
        context = self.context(agent)
        chosen: dict[str, tuple[PromptSection, int, str]] = {}
        contributions: list[tuple[PromptSection, int, str]] = []
        for provider in self.core:
            section = provider(context)
            if section is not None:
                contributions.append((section, -1, "dsh"))
        contributions.extend(self.hooks.prompt_sections(context))
        # A clash is an error whether or not a nearer scope's section of that name wins: otherwise
        # it would be reported or not depending on the order in which the plugins answered.
        origins: dict[tuple[str, int], str] = {}
        for section, depth, origin in contributions:
            level = (section.name, depth)
            if level in origins:
                raise PromptAssemblyError(
                    f"prompt section {section.name!r} is contributed twice at one scope level "
                    f"(by {origins[level]!r} and {origin!r})"
                )
            origins[level] = origin
            current = chosen.get(section.name)
            if current is None or depth > current[1]:
                chosen[section.name] = (section, depth, origin)
        ordered = sorted((s for s, _, _ in chosen.values() if s.text.strip()), key=lambda s: (s.order, s.name))
        return self.hooks.prompt_filter(context, ordered)

    def assemble(self, agent: Scope | None) -> str:
        """The system prompt text: the sections' texts joined by blank lines."""
        return "\n\n".join(section.text.strip() for section in self.sections(agent))

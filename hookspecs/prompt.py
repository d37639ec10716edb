"""System-prompt assembly: named, ordered sections."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from dsh_hookspecs import hookspec

if TYPE_CHECKING:
    from dsh_core.model import PromptContext, PromptSection


@hookspec
def dsh_prompt_sections(context: PromptContext) -> Iterable[PromptSection] | PromptSection | None:
    """Contribute system-prompt sections for ``context.agent`` in ``context.mode``.

    Sections are sorted by ``(order, name)``, never by plugin order. Names are
    namespaced by convention (``tool:<name>`` for per-tool guidance, order
    100-199; ``tools:*`` is the core's). A section whose name another
    contributor already used replaces it when it comes from a nearer scope
    (agent over deployment); two contributions of one name at the same scope
    level are an error naming the section. Empty sections are dropped.
    Raising, or returning anything but sections, fails the assembly with an
    error reading ``dsh_prompt_sections of plugin '<name>' failed: <Type>:
    <text>`` (a ``DshError`` keeps its own code and message).
    """


@hookspec
def dsh_prompt_filter(context: PromptContext, sections: Sequence[PromptSection]) -> Sequence[PromptSection] | None:
    """Filter or rewrite the assembled sections; return the new list or ``None`` to keep them.

    Implementations run in call order, each seeing the previous one's output;
    the last output is authoritative. Raising, or returning anything but
    sections, fails the assembly with an error reading ``dsh_prompt_filter of
    plugin '<name>' failed: <Type>: <text>`` (a ``DshError`` keeps its own
    code and message).
    """

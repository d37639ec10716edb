"""A failing prompt hook fails the assembly naming its hook and plugin, like every other hook."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from dsh_core import hookimpl
from dsh_core.hooks import HookFailure, Hooks
from dsh_core.model import PromptContext, PromptSection
from dsh_core.prompt import PromptAssembler
from dsh_core.registry import ToolRegistry


class _Sections:
    def __init__(self, make: Any) -> None:
        self.make = make

    @hookimpl
    def dsh_prompt_sections(self, context: PromptContext) -> Any:
        return self.make()


class _Filter:
    def __init__(self, make: Any) -> None:
        self.make = make

    @hookimpl
    def dsh_prompt_filter(self, context: PromptContext, sections: Sequence[PromptSection]) -> Any:
        return self.make(sections)


def _config_lookup() -> Any:
    return {}["section"]  # a bug in the plugin: KeyError


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        (_Sections(_config_lookup), "dsh_prompt_sections of plugin 'notes' failed: KeyError: 'section'"),
        (
            _Sections(lambda: 42),
            "dsh_prompt_sections of plugin 'notes' failed: TypeError: 'int' object is not iterable",
        ),
        (
            _Sections(lambda: ["be brief"]),
            "dsh_prompt_sections of plugin 'notes' failed: TypeError: returned str, expected PromptSection",
        ),
        (_Filter(lambda sections: _config_lookup()), "dsh_prompt_filter of plugin 'notes' failed: KeyError: 'section'"),
        (
            _Filter(lambda sections: [s.text for s in sections]),
            "dsh_prompt_filter of plugin 'notes' failed: TypeError: returned str, expected PromptSection",
        ),
        # A section that is one in type only would fail the assembly later, naming nobody.
        (
            _Sections(lambda: [PromptSection("notes", None)]),  # type: ignore[arg-type]
            "dsh_prompt_sections of plugin 'notes' failed: TypeError: returned section 'notes' whose text is "
            "NoneType, expected str",
        ),
        (
            _Sections(lambda: [PromptSection("notes", "Be brief.", "10")]),  # type: ignore[arg-type]
            "dsh_prompt_sections of plugin 'notes' failed: TypeError: returned section 'notes' whose order is "
            "str, expected int",
        ),
        # NaN sorts nowhere: the order of every section around it would follow the plugins' order.
        (
            _Sections(lambda: [PromptSection("notes", "Be brief.", float("nan"))]),
            "dsh_prompt_sections of plugin 'notes' failed: TypeError: returned section 'notes' whose order is "
            "NaN, which sorts nowhere",
        ),
        (
            _Filter(lambda sections: [PromptSection(1, "Be brief.")]),  # type: ignore[arg-type]
            "dsh_prompt_filter of plugin 'notes' failed: TypeError: returned section 1 whose name is int, expected str",
        ),
    ],
)
def test_a_failing_prompt_hook_names_its_hook_and_plugin(plugin: object, message: str) -> None:
    hooks = Hooks()
    hooks.register(plugin, name="notes")
    assembler = PromptAssembler(hooks, ToolRegistry(), core=[lambda context: PromptSection("persona", "Be kind.")])
    with pytest.raises(HookFailure) as raised:
        assembler.assemble(None)
    assert raised.value.message == message
    assert raised.value.hook == message.split(" ", 1)[0] and raised.value.plugin == "notes"


def test_a_plugin_raising_a_typed_error_keeps_its_message() -> None:
    from dsh_core.prompt import PromptAssemblyError

    def refuse() -> Any:
        raise PromptAssemblyError("the persona section is mandatory")

    hooks = Hooks()
    hooks.register(_Sections(refuse), name="notes")
    with pytest.raises(HookFailure) as raised:
        PromptAssembler(hooks, ToolRegistry()).assemble(None)
    assert raised.value.message == "the persona section is mandatory"
    assert raised.value.code == "PROMPT_ASSEMBLY_FAILED"


class _Contributions:
    """Hooks stand-in answering with given contributions, in the given order."""

    def __init__(self, contributions: list[tuple[PromptSection, int, str]]) -> None:
        self.contributions = contributions

    def prompt_sections(self, context: PromptContext) -> list[tuple[PromptSection, int, str]]:
        return self.contributions

    def prompt_filter(self, context: PromptContext, sections: list[PromptSection]) -> list[PromptSection]:
        return sections


@pytest.mark.parametrize("order", [(0, 1, 2), (0, 2, 1), (2, 0, 1)])
def test_a_clash_at_one_level_is_an_error_whatever_the_order_and_a_nearer_scope(order: tuple[int, ...]) -> None:
    """Before, a nearer scope's section answering between the two clashing ones hid the clash."""
    from dsh_core.prompt import PromptAssemblyError

    made = [
        (PromptSection("notes", "a"), 0, "alpha"),
        (PromptSection("notes", "agent's"), 1, "agent-notes"),
        (PromptSection("notes", "b"), 0, "beta"),
    ]
    assembler = PromptAssembler(_Contributions([made[i] for i in order]), ToolRegistry())  # type: ignore[arg-type]
    with pytest.raises(PromptAssemblyError, match=r"prompt section 'notes' is contributed twice at one scope level"):
        assembler.assemble(None)


def test_one_plugin_contributing_a_name_at_two_levels_is_no_clash() -> None:
    assembler = PromptAssembler(
        _Contributions(
            [
                (PromptSection("notes", "root"), 0, "notes"),  # type: ignore[arg-type]
                (PromptSection("notes", "agent"), 1, "notes"),
            ]
        ),
        ToolRegistry(),
    )
    assert assembler.assemble(None) == "agent"

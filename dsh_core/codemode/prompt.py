"""The core's Code Mode prompt sections: ``tools:code-only`` and ``tools:sdk``.

Both follow the calling scope's *effective* mode (``registry.mode_for``), not
the deployment default:

* ``tools:code-only`` (order 99, just before the 100-199 per-tool guidance
  band) renders only under ``code``: ``run_code`` is the only directly
  callable tool.
* ``tools:sdk`` (order 150) renders under ``code`` and ``both``: the SDK for
  the code runtime's language, re-rendered at each assembly from the scope's
  live visible tools (``run_code`` excluded). Under a non-native mode, a
  missing runtime or a language with no renderer raises, so every assembly
  fails loudly instead of sending the model a transport it cannot use.

Removing the ``tool:*`` guidance sections under ``code`` is not done here: it
is the built-in ``code-mode`` plugin's prompt filter
(:mod:`dsh_plugins.code_mode`), so a deployment can keep that guidance by
leaving the plugin out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from dsh_core.codemode.sdk import render_sdk, sdk_tools
from dsh_core.codemode.transport import CodeRuntimeRef, resolve_code_runtime
from dsh_core.model import PromptContext, PromptSection
from dsh_core.registry import TRANSPORT_NAME, ToolRegistry

__all__ = [
    "CODE_ONLY_SECTION",
    "SDK_SECTION",
    "CODE_ONLY_ORDER",
    "SDK_ORDER",
    "code_mode_sections",
    "CodeModeUnavailableError",
]

#: Name and order of the rule section shown under ``code``.
CODE_ONLY_SECTION: Final = "tools:code-only"
CODE_ONLY_ORDER: Final = 99
#: Name and order of the SDK section shown under ``code`` and ``both``.
SDK_SECTION: Final = "tools:sdk"
SDK_ORDER: Final = 150

CODE_ONLY_TEXT: Final = (
    f"`{TRANSPORT_NAME}` is the only tool you can call directly. Calling any other tool by name fails "
    f"with UNKNOWN_TOOL: call the tools described below from inside a `{TRANSPORT_NAME}` program instead."
)


class CodeModeUnavailableError(RuntimeError):
    """A non-native mode is in effect but the SDK cannot be rendered (no runtime, unknown language)."""


def code_mode_sections(
    registry: ToolRegistry, code_runtime: CodeRuntimeRef
) -> list[Callable[[PromptContext], PromptSection | None]]:
    """The two core section providers, for :class:`dsh_core.prompt.PromptAssembler` ``core=``."""

    def code_only(context: PromptContext) -> PromptSection | None:
        if context.mode != "code":
            return None
        return PromptSection(CODE_ONLY_SECTION, CODE_ONLY_TEXT, CODE_ONLY_ORDER)

    def sdk(context: PromptContext) -> PromptSection | None:
        mode = context.mode
        if mode == "native":
            return None
        runtime = resolve_code_runtime(code_runtime)
        where = f"agent {context.agent.path!r}" if context.agent is not None else "the deployment"
        if runtime is None:
            raise CodeModeUnavailableError(
                f'mode "{mode}" of {where} requires a code runtime, but none is available: '
                'configure [code_runtime] or set the tools mode to "native"'
            )
        try:
            text = render_sdk(runtime.language, sdk_tools(registry.definitions(context.agent)))
        except ValueError as error:
            raise CodeModeUnavailableError(f'mode "{mode}" of {where}: {error}') from None
        return PromptSection(SDK_SECTION, text, SDK_ORDER)

    return [code_only, sdk]

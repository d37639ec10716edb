"""The ``scripted`` provider: replays assistant turns from a JSONL file — the offline model.

Each non-blank line of the script is one assistant message in OpenAI shape,
optionally with an ``expect`` guard checked against the request::

    {"expect": {"last_role": "user", "tools_include": ["read"]}, "role": "assistant", "content": null,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "read", "arguments": "{\\"path\\": \\"a.txt\\"}"}}]}
    {"expect": {"last_role": "tool"}, "role": "assistant", "content": "Done."}

The provider is stateless: the next turn is the one after the assistant
messages already in the conversation, so a resumed session continues the
script. It fails clearly (a :class:`~dsh_core.agent.provider.ProviderError`
naming the file and line) when an earlier assistant message differs from the
script, when an ``expect`` guard fails, or when the script is exhausted.

``expect`` keys: ``last_role`` (role of the last message), ``last_content_contains``
(substring of its content), ``tools_include`` / ``tools_exclude`` (tool names
offered in the request), ``system_contains`` (substring of the system prompt),
``model`` (the model the agent asked for).

Without a ``script``, every request is answered with a short notice that no
model is configured (so ``dsh -p`` works out of the box and says how to
point it at a real endpoint); ``endpoint_vars``, which the default deployment
sets from its environment, lets it say which half of an endpoint is set.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from dsh_core import Scope, hookimpl
from dsh_core.agent.provider import Message, OnText, Provider, ProviderError, ToolSpec, normalize_assistant
from dsh_core.lossless import find_loss
from dsh_core.plugins import CONFIG_DIR_SERVICE
from dsh_core.plugins import plugin as declare_plugin

__all__ = ["plugin", "ScriptedProvider", "ScriptTurn", "load_script", "NO_MODEL_NOTICE", "no_model_notice"]

#: The answer of a scripted provider without a script.
NO_MODEL_NOTICE: Final = (
    "dsh has no model configured, so this answer comes from the offline `scripted` provider. "
    "To use a real model, set DSH_BASE_URL, DSH_MODEL and DSH_API_KEY (any OpenAI-compatible endpoint), "
    "or run `dsh demo` for an offline walk-through of Code Mode."
)


def no_model_notice(environ: Mapping[str, str]) -> str:
    """:data:`NO_MODEL_NOTICE`, saying which half of an endpoint ``environ`` sets without the other."""
    partial = [name for name in ("DSH_MODEL", "DSH_API_KEY") if environ.get(name)]
    if partial and not environ.get("DSH_BASE_URL"):
        return (
            f"{NO_MODEL_NOTICE} ({' and '.join(partial)} {'is' if len(partial) == 1 else 'are'} set but "
            "DSH_BASE_URL is not: dsh never guesses the endpoint.)"
        )
    return NO_MODEL_NOTICE


_EXPECT_KEYS: Final = {
    "last_role": str,
    "last_content_contains": str,
    "system_contains": str,
    "model": str,
    "tools_include": list,
    "tools_exclude": list,
}

CONFIG_SCHEMA: Final = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {
            "type": "string",
            "minLength": 1,
            "default": "scripted",
            "description": "the provider name agents select with provider = ...",
        },
        "endpoint_vars": {
            "type": "array",
            "uniqueItems": True,
            "items": {"enum": ["DSH_MODEL", "DSH_API_KEY"]},
            "description": (
                "names (never values) of the endpoint variables set without "
                "DSH_BASE_URL where the default deployment was built; the no-model "
                "notice names them"
            ),
        },
        "script": {
            "type": "string",
            "minLength": 1,
            "description": (
                "path of the JSONL script (a relative path is read from the directory of the config file that sets it)"
            ),
        },
    },
}


class ScriptTurn:
    """One scripted assistant message, where it came from, and its optional guard."""

    __slots__ = ("line", "message", "expect")

    def __init__(self, line: int, message: Message, expect: Mapping[str, Any] | None) -> None:
        self.line = line
        self.message = message
        self.expect = expect


def _check_expect(where: str, expect: object) -> Mapping[str, Any]:
    if not isinstance(expect, Mapping):
        raise ProviderError("script-invalid", f"{where}: expect must be an object")
    for key, value in expect.items():
        kind = _EXPECT_KEYS.get(key)
        if kind is None:
            raise ProviderError(
                "script-invalid", f"{where}: unknown expect key {key!r} (known: {', '.join(sorted(_EXPECT_KEYS))})"
            )
        if not isinstance(value, kind) or (kind is list and not all(isinstance(v, str) for v in value)):
            raise ProviderError(
                "script-invalid", f"{where}: expect.{key} must be {'a list of strings' if kind is list else 'a string'}"
            )
    return expect


def _ids_for_turn(turn: int) -> Callable[[int], str]:
    """Deterministic ids for scripted calls that give none: ``call_<turn>_<n>``."""
    return lambda index: f"call_{turn}_{index + 1}"


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def load_script(path: str | Path) -> list[ScriptTurn]:
    """Parse and check a JSONL script; every error names the file and the line.

    Lines are strict JSON: ``NaN`` and ``Infinity``, which Python's parser
    accepts, are refused, as is any number a session event could not record
    (``1e400``, ``-0.0``), instead of failing the run that replays the line.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ProviderError("script-invalid", f"cannot read script {source!r}: {error.strerror or error}") from None
    turns: list[ScriptTurn] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            raw = json.loads(line, parse_constant=_refuse_constant)
        except json.JSONDecodeError as error:
            raise ProviderError(
                "script-invalid", f"{where}: not valid JSON: {error.msg} (column {error.colno})"
            ) from None
        except ValueError as error:  # a constant refused above
            raise ProviderError("script-invalid", f"{where}: not valid JSON: {error}") from None
        except RecursionError:
            raise ProviderError("script-invalid", f"{where}: not valid JSON: nested too deeply") from None
        if not isinstance(raw, dict):
            raise ProviderError("script-invalid", f"{where}: each line must be a JSON object (one assistant message)")
        loss = find_loss(raw)
        if loss is not None:
            raise ProviderError("script-invalid", f"{where}: {loss}")
        expect = _check_expect(where, raw.pop("expect")) if "expect" in raw else None
        try:
            message = normalize_assistant(raw, who=where, fallback_ids=_ids_for_turn(len(turns) + 1))
        except ProviderError as error:
            raise ProviderError("script-invalid", error.message) from None
        turns.append(ScriptTurn(number, message, expect))
    if not turns:
        raise ProviderError("script-invalid", f"{source}: the script has no turns")
    return turns


def _signature(message: Mapping[str, Any]) -> tuple[str, tuple[tuple[str, object], ...]]:
    """What must match between a scripted turn and the history (ids and whitespace ignored)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", {})
        arguments = function.get("arguments", "")
        try:
            parsed: object = json.dumps(json.loads(arguments), sort_keys=True) if arguments.strip() else {}
        except (ValueError, AttributeError):
            parsed = arguments
        calls.append((str(function.get("name")), parsed))
    return (message.get("content") or "").strip(), tuple(calls)


def _describe(message: Mapping[str, Any]) -> str:
    content, calls = _signature(message)
    if calls:
        return "tool calls " + ", ".join(name for name, _ in calls)
    return f"text {content[:60]!r}"


class ScriptedProvider:
    """A :class:`~dsh_core.agent.provider.Provider` replaying a script (see the module docstring)."""

    def __init__(
        self, turns: Sequence[ScriptTurn] | None, *, source: str = "<script>", notice: str = NO_MODEL_NOTICE
    ) -> None:
        self.turns = list(turns) if turns is not None else None
        self.source = source
        #: The answer to every request when there is no script.
        self.notice = notice
        #: Every request received: ``{"messages", "tools", "model"}`` (for assertions in tests).
        self.requests: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"<ScriptedProvider {self.source!r}>"

    @classmethod
    def from_file(cls, path: str | Path) -> ScriptedProvider:
        """A provider replaying the script at ``path``."""
        return cls(load_script(path), source=str(path))

    async def complete(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        *,
        on_text: OnText | None = None,
        model: str | None = None,
    ) -> Message:
        """The scripted turn after the assistant messages already in ``messages``."""
        self.requests.append(
            {"messages": copy.deepcopy(list(messages)), "tools": [dict(t) for t in tools], "model": model}
        )
        if self.turns is None:
            reply: Message = {"role": "assistant", "content": self.notice}
        else:
            reply = self._next(messages, tools, model)
        if on_text is not None and reply.get("content"):
            await on_text(reply["content"])
        return reply

    def _next(self, messages: Sequence[Message], tools: Sequence[ToolSpec], model: str | None) -> Message:
        assert self.turns is not None
        prior = [m for m in messages if m.get("role") == "assistant"]
        for index, said in enumerate(prior):
            if index >= len(self.turns):
                break
            turn = self.turns[index]
            if _signature(said) != _signature(turn.message):
                raise ProviderError(
                    "script-diverged",
                    (
                        f"{self.source}:{turn.line}: the conversation diverged from the script at assistant turn "
                        f"{index + 1}: the history has {_describe(said)}, the script has {_describe(turn.message)}"
                    ),
                )
        index = len(prior)
        if index >= len(self.turns):
            raise ProviderError(
                "script-exhausted",
                (
                    f"{self.source}: script exhausted: the conversation asks for assistant turn {index + 1}, "
                    f"but the script has only {len(self.turns)} turn(s)"
                ),
            )
        turn = self.turns[index]
        if turn.expect:
            problem = _unmet(turn.expect, messages, tools, model)
            if problem is not None:
                raise ProviderError(
                    "script-diverged",
                    f"{self.source}:{turn.line}: expect failed at assistant turn {index + 1}: {problem}",
                )
        return copy.deepcopy(turn.message)


def _unmet(
    expect: Mapping[str, Any], messages: Sequence[Message], tools: Sequence[ToolSpec], model: str | None
) -> str | None:
    last = messages[-1] if messages else {}
    names = {str(t.get("name")) for t in tools}
    if "last_role" in expect and last.get("role") != expect["last_role"]:
        return f"last_role {expect['last_role']!r} expected, the last message has role {last.get('role')!r}"
    if "last_content_contains" in expect:
        content = last.get("content")
        if not isinstance(content, str) or expect["last_content_contains"] not in content:
            return (
                f"last_content_contains {expect['last_content_contains']!r} expected, "
                f"the last message says {str(content)[:120]!r}"
            )
    if "system_contains" in expect:
        system = next((m.get("content") for m in messages if m.get("role") == "system"), None)
        if not isinstance(system, str) or expect["system_contains"] not in system:
            return f"system_contains {expect['system_contains']!r} expected, not in the system prompt"
    if "model" in expect and model != expect["model"]:
        return f"model {expect['model']!r} expected, the agent asked for {model!r}"
    missing = [n for n in expect.get("tools_include", ()) if n not in names]
    if missing:
        return f"tools_include: {', '.join(missing)} not offered (offered: {', '.join(sorted(names)) or 'none'})"
    present = [n for n in expect.get("tools_exclude", ()) if n in names]
    if present:
        return f"tools_exclude: {', '.join(present)} offered"
    return None


class ScriptedPlugin:
    """Registers one :class:`ScriptedProvider` under its configured name."""

    def __init__(self, name: str, provider: Provider) -> None:
        self.name = name
        self.provider = provider

    @hookimpl
    def dsh_register_providers(self, register: Callable[[str, Provider], None]) -> None:
        """Register the provider."""
        register(self.name, self.provider)


@declare_plugin(config_schema=CONFIG_SCHEMA)
def plugin(scope: Scope, config: Any) -> ScriptedPlugin:
    """Plugin factory of ``scripted`` (the script is loaded and checked at start-up)."""
    script = config.get("script")
    if script:
        path = Path(script).expanduser()
        # A relative path is the config file's (as in tox's and pytest's configs), else the working directory's.
        config_dir: Path | None = scope.lookup(CONFIG_DIR_SERVICE)
        provider = ScriptedProvider.from_file(path if config_dir is None else config_dir / path)
    else:
        # The environment is read once, by the deployment that set endpoint_vars, never here: a
        # deployment built from a given env must not answer from the process's.
        set_names = config.get("endpoint_vars", ())
        provider = ScriptedProvider(None, notice=no_model_notice(dict.fromkeys(set_names, "set")))
    return ScriptedPlugin(str(config.get("name", "scripted")), provider)

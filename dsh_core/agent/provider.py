"""The provider seam: one async function from a conversation to one assistant message.

Messages are OpenAI chat-completions dicts (``role``/``content``/``tool_calls``
/``tool_call_id``); tools are ``{"name", "description", "parameters"}`` dicts
(:meth:`dsh_core.model.ToolSchema.to_json`), which a provider puts on the wire
in its own shape (OpenAI: ``{"type": "function", "function": ...}``). The
provider is stateless: it receives the whole history on every call. Streaming
is a side channel (``on_text``), so the loop never sees deltas. Cancelling
the awaiting task cancels the request; providers must not swallow it.

The returned message is ``{"role": "assistant", "content": str | None,
"tool_calls": [...]}`` (``tool_calls`` omitted or empty for a final answer),
with each call ``{"id", "type": "function", "function": {"name",
"arguments": <JSON text>}}``. Optional metadata (``finish_reason``,
``usage``, and ``refusal``: true when the content is the model's refusal)
rides in a ``"_meta"`` key, which the loop records and strips.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

from dsh_core.errors import DshError

__all__ = [
    "Message",
    "ToolSpec",
    "OnText",
    "Provider",
    "ProviderError",
    "openai_tools",
    "normalize_assistant",
    "wire_message",
]

Message: TypeAlias = dict[str, Any]
ToolSpec: TypeAlias = Mapping[str, Any]
OnText: TypeAlias = Callable[[str], Awaitable[None]]


class ProviderError(DshError):
    """A model request failed; ``kind`` says how, the message names the provider and the cause.

    Kinds: ``auth``, ``model-not-found``, ``context-length``, ``malformed-response``,
    ``malformed-tool-call``, ``rate-limited``, ``server``, ``http``, ``connection``,
    ``no-model``, ``script-diverged``, ``script-exhausted``, ``script-invalid``, and
    ``cancelled`` (the loop's: a request cancelled though the run was not aborted).
    """

    code = "PROVIDER_FAILED"

    def __init__(self, kind: str, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


@runtime_checkable
class Provider(Protocol):
    """A model provider (see the module docstring for the message shapes)."""

    async def complete(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        *,
        on_text: OnText | None = None,
        model: str | None = None,
    ) -> Message:
        """Return the assistant's next message. ``model`` (the agent's) overrides the provider's default."""
        ...


def openai_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Tool schemas in OpenAI's ``tools`` request shape."""
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("parameters", {"type": "object"}),
            },
        }
        for t in tools
    ]


def wire_message(message: Mapping[str, Any]) -> Message:
    """A history message as sent to a server: private keys (``_meta``) dropped.

    An assistant message with neither content nor tool calls (a model that said
    nothing: a ``length`` or ``content_filter`` finish) is sent with empty text:
    servers refuse a null ``content`` without ``tool_calls`` (Ollama, llama.cpp,
    Azure), which made every later request of a resumed session fail.
    """
    wired = {k: v for k, v in message.items() if not k.startswith("_")}
    if wired.get("role") == "assistant" and wired.get("content") is None and not wired.get("tool_calls"):
        wired["content"] = ""
    return wired


def _fail(who: str, text: str) -> ProviderError:
    return ProviderError("malformed-tool-call", f"{who}: {text}")


def normalize_assistant(raw: object, *, who: str, fallback_ids: Callable[[int], str] | None = None) -> Message:
    """Check and canonicalize an assistant message; raise :class:`ProviderError` naming the culprit.

    Accepts what OpenAI-compatible servers actually send: ``arguments`` as an
    object (some servers) is re-encoded as JSON text, a missing call id is
    filled from ``fallback_ids(index)``, and so is an id an earlier call of
    the message already has (each result must answer exactly one call),
    ``content`` as a list of text parts is joined. Anything else malformed is
    an error (a ``malformed-tool-call`` when a tool call is the culprit).
    """
    if not isinstance(raw, Mapping):
        raise ProviderError(
            "malformed-response", f"{who}: the assistant message is {type(raw).__name__}, expected an object"
        )
    role = raw.get("role", "assistant")
    if role != "assistant":
        raise ProviderError("malformed-response", f"{who}: expected role 'assistant', got {role!r}")
    content = raw.get("content")
    if isinstance(content, list):
        content = "".join(
            part.get("text", "") for part in content if isinstance(part, Mapping) and part.get("type") == "text"
        )
    if content is not None and not isinstance(content, str):
        raise ProviderError(
            "malformed-response", f"{who}: content is {type(content).__name__}, expected a string or null"
        )
    message: Message = {"role": "assistant", "content": content}
    calls = raw.get("tool_calls") or []
    if not isinstance(calls, list):
        raise _fail(who, f"tool_calls is {type(calls).__name__}, expected a list")
    normalized: list[dict[str, Any]] = []
    taken: set[str] = set()
    for index, call in enumerate(calls):
        where = f"tool_calls[{index}]"
        if not isinstance(call, Mapping):
            raise _fail(who, f"{where} is {type(call).__name__}, expected an object")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise _fail(who, f"{where} has no 'function' object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(who, f"{where}.function.name is missing or not a string")
        arguments = function.get("arguments", "")
        if arguments is None:
            arguments = ""
        if isinstance(arguments, Mapping):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise _fail(
                who, f"{where}.function.arguments of tool {name!r} is {type(arguments).__name__}, expected JSON text"
            )
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id or call_id in taken:
            if fallback_ids is None:
                problem = "has no id" if not isinstance(call_id, str) or not call_id else f"repeats id {call_id!r}"
                raise _fail(who, f"{where} (tool {name!r}) {problem}")
            # Results are matched to calls by id: two calls under one id left the model unable to tell
            # their results apart, and a resumed history kept only the first.
            call_id = fallback_ids(index)
            while call_id in taken:
                call_id += "_"
        taken.add(call_id)
        normalized.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    if normalized:
        message["tool_calls"] = normalized
    meta = raw.get("_meta")
    if isinstance(meta, Mapping):
        message["_meta"] = dict(meta)
    return message

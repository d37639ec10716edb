"""Value types of the tool pipeline: definitions, executions, results, decisions.

Everything handed to a hook is a frozen attrs instance; JSON payloads inside
them are frozen lossless values (:func:`dsh_core.lossless.freeze`). Changes
are made with :func:`attrs.evolve`, never in place.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import attrs
import cattrs.preconf.json
from attrs import field, frozen
from jsonschema.protocols import Validator

from dsh_core.abort import AbortSignal
from dsh_core.lossless import JSON, dumps, freeze, join_surrogate_pairs

if TYPE_CHECKING:
    from dsh_core.scope import Scope

__all__ = [
    "TextBlock",
    "ImageBlock",
    "ContentBlock",
    "content_problem",
    "ContextMessage",
    "ToolErrorInfo",
    "ToolResult",
    "ToolOutput",
    "ToolDefinition",
    "ToolSchema",
    "ExecutionToken",
    "ToolExecutionInput",
    "ToolExecution",
    "ToolContext",
    "PreDecision",
    "ApprovalOutcome",
    "ApprovalRequest",
    "PostDecision",
    "PromptSection",
    "PromptContext",
    "Middleware",
    "Proceed",
    "ExecutionMode",
    "converter",
    "text_of",
]

ExecutionMode: TypeAlias = Literal["parallel", "exclusive"]


def _str_field(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{type(instance).__name__}.{attribute.name} must be str, got {type(value).__name__}")


def _shown(value: Any) -> Any:
    # Text that is shown, not a value: a surrogate pair held as two code points (text a plugin decoded
    # with surrogatepass) becomes its character, as every JSON hop made it, so the session event that
    # records it stays lossless JSON. What is not a str (None included) is left as it is for the
    # field's check.
    return join_surrogate_pairs(value) if type(value) is str else value


@frozen
class TextBlock:
    """A text content block, shown to the model. ``text`` must be a ``str`` (checked when built)."""

    text: str = field(converter=_shown, validator=_str_field)
    type: Literal["text"] = "text"


@frozen
class ImageBlock:
    """An image content block: base64 ``data`` of ``mime_type`` (both ``str``, checked when built)."""

    data: str = field(validator=_str_field)
    mime_type: str = field(validator=_str_field)
    type: Literal["image"] = "image"


ContentBlock: TypeAlias = TextBlock | ImageBlock


def content_problem(content: object) -> str | None:
    """Why ``content`` is not a tuple of well-formed content blocks, or ``None`` when it is.

    Blocks are checked when built; this is for content that reaches the pipeline
    around those checks (a block altered with ``object.__setattr__``), so that no
    result whose content cannot be read is ever emitted.
    """
    if type(content) is tuple:
        for block in content:
            if not (type(block) is TextBlock and type(block.text) is str):
                break
        else:
            return None  # the common case: text blocks only
    else:
        return f"content is {type(content).__name__}, expected a tuple of content blocks"
    for index, block in enumerate(content):
        if isinstance(block, TextBlock):
            fields: tuple[str, ...] = ("text",)
        elif isinstance(block, ImageBlock):
            fields = ("data", "mime_type")
        else:
            return f"block {index} is {type(block).__name__}, expected TextBlock or ImageBlock"
        for name in fields:
            value = getattr(block, name)
            if not isinstance(value, str):
                return f"block {index}: {type(block).__name__}.{name} is {type(value).__name__}, expected str"
    return None


def _content_tuple(value: Sequence[ContentBlock] | str) -> tuple[ContentBlock, ...]:
    if isinstance(value, str):
        return (TextBlock(value),)
    blocks = tuple(value)
    for block in blocks:
        if not isinstance(block, TextBlock | ImageBlock):
            raise TypeError(f"content blocks must be TextBlock or ImageBlock, got {type(block).__name__}")
    return blocks


def _contexts(value: Iterable[ContextMessage]) -> tuple[ContextMessage, ...]:
    contexts = tuple(value)
    for context in contexts:
        if not isinstance(context, ContextMessage):
            # A plain string would otherwise pass here and break whoever reads ``.text`` later.
            raise TypeError(
                f"additional_contexts holds {type(context).__name__}, expected ContextMessage "
                "(wrap text in ContextMessage(text))"
            )
    return contexts


def _examples(value: Iterable[JSON]) -> tuple[JSON, ...]:
    return tuple(freeze(x) for x in value)


def text_of(content: Sequence[ContentBlock]) -> str:
    """Join the text of content blocks; non-text blocks read as ``[<type> content]``."""
    return "\n".join(b.text if isinstance(b, TextBlock) else f"[{b.type} content]" for b in content)


@frozen
class ContextMessage:
    """Context attached to a result for the next model turn (a user-role message).

    ``text`` must be a ``str`` and ``source`` a ``str`` or ``None`` (checked when built).
    """

    text: str = field(converter=_shown, validator=_str_field)
    source: str | None = field(default=None, converter=_shown, validator=attrs.validators.optional(_str_field))


@frozen
class ToolErrorInfo:
    """The error of a failed result: a stable ``code`` and a model-readable ``message``."""

    code: str = field(converter=_shown, validator=_str_field)
    message: str = field(converter=_shown, validator=_str_field)


def _error_field(instance: object, attribute: attrs.Attribute[ToolErrorInfo | None], value: object) -> None:
    if value is not None and not isinstance(value, ToolErrorInfo):
        raise TypeError(
            f"{type(instance).__name__}.{attribute.name} must be ToolErrorInfo or None, got {type(value).__name__}"
        )


@frozen
class ToolResult:
    """The outcome of one execution.

    A success has ``error is None`` and carries the canonical JSON ``value``; a
    failure carries ``error`` and never a value or ``concludes_turn``. The
    model sees ``content``.
    """

    content: tuple[ContentBlock, ...] = field(converter=_content_tuple)
    value: JSON = field(default=None, converter=freeze)
    # Checked here: a middleware's or hook's ``error="boom"`` failed deep in the executor, unnamed.
    error: ToolErrorInfo | None = field(default=None, validator=_error_field)
    additional_contexts: tuple[ContextMessage, ...] = field(default=(), converter=_contexts)
    concludes_turn: bool = False

    def __attrs_post_init__(self) -> None:
        # Checked here, not by whoever reads it: the agent loop ends a turn on ``concludes_turn``
        # and the CLI prints ``value`` without asking which kind of result it holds, so a failure
        # a middleware authored with either would otherwise pass as (part of) a success.
        if self.error is not None and (self.concludes_turn or self.value is not None):
            extra = "concludes_turn" if self.concludes_turn else "a value"
            raise ValueError(f"a failed ToolResult ({self.error.code}) cannot carry {extra}")

    @property
    def is_error(self) -> bool:
        """True for a failed result."""
        return self.error is not None

    @property
    def code(self) -> str | None:
        """The error code of a failed result, else ``None``."""
        return None if self.error is None else self.error.code

    @property
    def text(self) -> str:
        """The model-facing text of the content."""
        return text_of(self.content)

    @classmethod
    def failure(
        cls,
        code: str,
        message: str,
        *,
        content: Sequence[ContentBlock] | str | None = None,
        additional_contexts: Sequence[ContextMessage] = (),
    ) -> ToolResult:
        """A failed result; the content defaults to ``Error: <message>``."""
        return cls(
            content=f"Error: {message}" if content is None else content,
            error=ToolErrorInfo(str(code), message),
            additional_contexts=tuple(additional_contexts),
        )


Renderer: TypeAlias = Callable[[JSON, JSON], "Sequence[ContentBlock] | str"]


def _freeze_schema(value: Mapping[str, Any]) -> JSON:
    return freeze(value)


# One line of JSON: the C encoder is used, and models read it as well as indented text, for fewer tokens.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "))


def render_json(args: JSON, value: JSON) -> tuple[ContentBlock, ...]:
    """The default renderer: a string value raw, anything else as one line of JSON."""
    if isinstance(value, str):
        return (TextBlock(value),)
    if type(value) is int:
        return (TextBlock(int.__repr__(value)),)  # exactly the encoder's text for an int
    try:
        return (TextBlock(_COMPACT.encode(value)),)
    except RecursionError:  # lossless values may nest deeper than the C encoder recurses
        return (TextBlock(dumps(value)),)


@frozen
class ToolOutput:
    """What a tool returns: the JSON Schema of its value and how the model sees it."""

    schema: JSON = field(converter=_freeze_schema)
    render: Renderer = render_json


@frozen
class ToolSchema:
    """The model-facing projection of a tool: name, description, parameters."""

    name: str
    description: str
    parameters: JSON

    def to_json(self) -> dict[str, Any]:
        """The ``{"name", "description", "parameters"}`` dict sent to providers."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@frozen(eq=False)
class ToolDefinition:
    """A registered tool. Build one with :func:`dsh_core.define_tool`.

    ``execute(args, ctx)`` receives frozen lossless arguments and a
    :class:`ToolContext`, returns the canonical JSON value, and must honour
    ``ctx.signal``. ``is_concurrency_safe(args)`` makes a call parallel only
    by returning exactly ``True``. ``finalize_content(execution, result)`` is
    a last-mile content transform applied exactly once to every outcome.
    Content that ``output.render`` or ``finalize_content`` gives (or raising
    in ``render``) that is not well-formed blocks makes the result an
    ``INVALID_TOOL_OUTPUT`` error naming the tool; a raising
    ``finalize_content`` gives ``TOOL_FAILED``.
    ``annotations`` are behaviour hints policies may read (never sent to the
    model): ``read_only`` (the tool changes nothing) and ``workspace_confined``
    (every path it touches is checked to lie inside its workspace root).
    """

    name: str
    description: str
    parameters: JSON = field(converter=_freeze_schema)
    output: ToolOutput
    execute: Callable[[JSON, ToolContext], Awaitable[JSON]]
    is_concurrency_safe: Callable[[JSON], object] | None = None
    finalize_content: Callable[[ToolExecution, ToolResult], Sequence[ContentBlock] | None] | None = None
    examples: tuple[JSON, ...] = field(default=(), converter=_examples)
    annotations: JSON = field(factory=dict, converter=freeze)
    parameters_validator: Validator = field(default=None, repr=False)
    output_validator: Validator = field(default=None, repr=False)
    #: Fast validity predicates (see :func:`dsh_core.schema.fast_check`); ``None`` means "use the validator".
    parameters_check: Callable[[object], bool] | None = field(default=None, repr=False)
    output_check: Callable[[object], bool] | None = field(default=None, repr=False)

    @property
    def schema(self) -> ToolSchema:
        """The model-facing projection."""
        return ToolSchema(self.name, self.description, self.parameters)


class ExecutionToken:
    """An opaque identity minted per execution; only ``is`` comparison means anything."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<ExecutionToken>"


def _signal_default() -> AbortSignal:
    return AbortSignal.never()


@frozen(eq=False)
class ToolExecutionInput:
    """What a caller asks the runtime to execute.

    ``parent`` is set only by a transport's sub-dispatch (``run_code``) and
    marks the call as nested; it is the opaque token of the outer execution,
    and counts only while that execution's body runs and with its ``agent``
    (see :meth:`~dsh_core.runtime.ToolRuntime.open_nesting`).
    """

    call_id: str
    name: str
    arguments: object
    signal: AbortSignal = field(factory=_signal_default)
    agent: Scope | None = None
    parent: ExecutionToken | None = None
    root_call_id: str | None = None


@frozen(eq=False)
class ToolExecution:
    """An execution as the pipeline and hooks see it (frozen, arguments frozen)."""

    call_id: str
    root_call_id: str
    name: str
    arguments: JSON
    signal: AbortSignal
    agent: Scope | None
    parent: ExecutionToken | None
    token: ExecutionToken
    #: The tool definition the call was created against, the one its body runs (``None`` for a name no
    #: tool had then). Policy hooks judge this one, never the registry's entry at their own stage: a
    #: tool replaced meanwhile fails the call at dispatch, so what was judged is what runs.
    definition: ToolDefinition | None = None

    @property
    def nested(self) -> bool:
        """True for a call made from inside a ``run_code`` program."""
        return self.parent is not None


class ToolContext:
    """What a tool body receives besides its arguments."""

    __slots__ = ("_concludes", "_contexts", "execution")

    def __init__(self, execution: ToolExecution) -> None:
        self.execution = execution
        self._contexts: list[ContextMessage] = []
        self._concludes = False

    @property
    def signal(self) -> AbortSignal:
        """The caller's abort signal; a body must stop promptly once it aborts."""
        return self.execution.signal

    @property
    def call_id(self) -> str:
        """This execution's call id."""
        return self.execution.call_id

    def defer_context(self, message: ContextMessage | str) -> None:
        """Attach a context message to this execution's result (kept in call order)."""
        self._contexts.append(message if isinstance(message, ContextMessage) else ContextMessage(message))

    def conclude_turn(self) -> None:
        """Mark a successful result as ending the agent's current turn."""
        self._concludes = True

    @property
    def deferred_contexts(self) -> tuple[ContextMessage, ...]:
        """Contexts deferred so far."""
        return tuple(self._contexts)

    @property
    def concludes_turn(self) -> bool:
        """True once :meth:`conclude_turn` was called."""
        return self._concludes


#: The kinds of :class:`PreDecision` and :class:`PostDecision`, and nothing else.
PRE_KINDS: tuple[str, ...] = ("allow", "deny", "ask")
POST_KINDS: tuple[str, ...] = ("accept", "replace-value", "replace-content", "block")


def _kind_of(kinds: tuple[str, ...]) -> Callable[[object, attrs.Attribute[str], object], None]:
    def check(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
        if value not in kinds:
            raise ValueError(
                f"{type(instance).__name__} kind must be one of {', '.join(map(repr, kinds))}, got {value!r}"
            )

    return check


def _optional_str(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{type(instance).__name__}.{attribute.name} must be str or None, got {type(value).__name__}")


@frozen
class PreDecision:
    """A pre-execute vote: ``allow``, ``deny`` (with a reason) or ``ask`` a person.

    Any other ``kind`` is refused here (``ValueError``), and the core treats a
    decision it does not recognise as a failure of the plugin that returned
    it: a mistyped vote never counts as ``allow``.
    """

    kind: Literal["allow", "deny", "ask"] = field(validator=_kind_of(PRE_KINDS))
    reason: str | None = field(default=None, validator=_optional_str)

    @classmethod
    def allow(cls) -> PreDecision:
        """Let the call proceed (to guards)."""
        return cls("allow")

    @classmethod
    def deny(cls, reason: str) -> PreDecision:
        """Refuse the call; ``reason`` is what the model reads."""
        return cls("deny", reason)

    @classmethod
    def ask(cls, reason: str | None = None) -> PreDecision:
        """Ask a person through the approval hook."""
        return cls("ask", reason)


class ApprovalOutcome(StrEnum):
    """How an approval request was resolved."""

    ALLOWED = "allowed"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"


@frozen(eq=False)
class ApprovalRequest:
    """A request to a person to allow one call; ``signal`` aborts with the call."""

    execution: ToolExecution
    reason: str | None
    signal: AbortSignal


@frozen
class PostDecision:
    """A post-execute decision about a result.

    ``accept`` keeps it; ``replace-value`` swaps the value (re-validated and
    re-rendered; successes only); ``replace-content`` swaps what the model
    sees; ``block`` turns it into a failure whose content is ``feedback``.
    Any decision may add ``additional_contexts``. Any other ``kind`` is refused
    here (``ValueError``), and the core treats a decision it does not
    recognise as a failure of the plugin that returned it.
    """

    kind: Literal["accept", "replace-value", "replace-content", "block"] = field(validator=_kind_of(POST_KINDS))
    value: JSON = field(default=None, converter=freeze)
    content: tuple[ContentBlock, ...] = field(default=(), converter=_content_tuple)
    additional_contexts: tuple[ContextMessage, ...] = field(default=(), converter=_contexts)

    @classmethod
    def accept(cls, additional_contexts: Sequence[ContextMessage] = ()) -> PostDecision:
        """Keep the result (optionally adding contexts)."""
        return cls("accept", additional_contexts=tuple(additional_contexts))

    @classmethod
    def replace_value(cls, value: JSON, additional_contexts: Sequence[ContextMessage] = ()) -> PostDecision:
        """Replace a successful result's value."""
        return cls("replace-value", value=value, additional_contexts=tuple(additional_contexts))

    @classmethod
    def replace_content(
        cls, content: Sequence[ContentBlock] | str, additional_contexts: Sequence[ContextMessage] = ()
    ) -> PostDecision:
        """Replace what the model sees of the result."""
        return cls("replace-content", content=content, additional_contexts=tuple(additional_contexts))

    @classmethod
    def block(
        cls, feedback: Sequence[ContentBlock] | str, additional_contexts: Sequence[ContextMessage] = ()
    ) -> PostDecision:
        """Turn the result into a failure; ``feedback`` is what the model reads."""
        return cls("block", content=feedback, additional_contexts=tuple(additional_contexts))


@frozen
class PromptSection:
    """A named, ordered part of the system prompt. Sections sort by ``(order, name)``."""

    name: str
    text: str
    order: int = 500


@frozen(eq=False)
class PromptContext:
    """What prompt hooks see: the agent scope (or ``None``) and its effective mode."""

    agent: Scope | None
    mode: str


Proceed: TypeAlias = Callable[[ToolExecution], Awaitable[ToolResult]]
Middleware: TypeAlias = Callable[[ToolExecution, Proceed], Awaitable[ToolResult]]


def _make_converter() -> cattrs.Converter:
    conv = cattrs.preconf.json.make_converter(forbid_extra_keys=True)

    def structure_block(obj: Mapping[str, Any], _: object) -> ContentBlock:
        kind = obj.get("type")
        if kind == "text":
            return conv.structure(obj, TextBlock)
        if kind == "image":
            return conv.structure(obj, ImageBlock)
        raise ValueError(f"unknown content block type {kind!r}")

    conv.register_structure_hook(TextBlock | ImageBlock, structure_block)
    return conv


#: The one cattrs converter of dsh (wire and storage shapes of the value types).
converter = _make_converter()

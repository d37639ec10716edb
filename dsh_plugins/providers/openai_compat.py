"""The ``openai`` provider: any OpenAI-compatible chat-completions endpoint, over ``httpx``.

Works with OpenAI, DeepSeek, vLLM, Ollama (``/v1``) and llama.cpp servers.
Config (``[[plugins]] use = "openai"``)::

    base_url = "https://api.deepseek.com/v1"   # the URL before /chat/completions
    model = "deepseek-chat"                   # default model (an agent's `model` overrides it)
    api_key_env = "DSH_API_KEY"               # NAME of the variable holding the key (never the key)
    timeout_s = 120, connect_timeout_s = 10   # read and connect timeouts
    max_retries = 2                           # on 408/409/429/5xx and connection errors
    backoff_base_s = 0.5, backoff_max_s = 8   # jittered exponential backoff; Retry-After wins
    stream = false                            # SSE streaming (deltas assembled into tool calls)
    stream_usage = true                       # when streaming, ask for usage (stream_options.include_usage)

Failures are :class:`~dsh_core.agent.provider.ProviderError` with a ``kind``:
``auth`` (401/403), ``model-not-found`` (404), ``context-length`` (a 400 that
says the prompt is too long), ``malformed-response`` / ``malformed-tool-call``,
``rate-limited`` / ``server`` / ``connection`` (after the retries; a stream
that ends before its ``finish_reason`` or ``[DONE]`` is a ``connection``
failure too), ``http`` (any other status or HTTP failure) and ``no-model``.
An error event in a stream before any of the answer came is judged by the
status it names (``code`` 429, ``server_error``, ``overloaded_error``...) as a
response with that status is, retries included; after part of the answer, it
is an ``http`` failure, not retried (the part was shown already).
A streaming request answered with a plain JSON completion is accepted as
one. A body is read up to 4 MiB (an event stream: 64 MiB); a larger one is
a ``malformed-response``, not read further. Numbers JSON cannot carry (``NaN``, ``Infinity``, ``1e400``, ``-0.0``)
in the usage the server reports become null (``-0.0``: 0), never a failed
run; in tool-call arguments they reach the loop as written, which tells the
model its arguments are not valid JSON. A model's refusal (``refusal``, streamed
or not) is the answer's content when it has none, and ``_meta`` says
``"refusal": true``. The key is read from the
environment at each request and never appears in a message, a repr or a log.
"""

from __future__ import annotations

import asyncio
import codecs
import datetime
import json
import math
import os
import random
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from email.utils import parsedate_to_datetime
from typing import Any, Final

import httpx

from dsh_core import Scope, hookimpl
from dsh_core.agent.provider import (
    Message,
    OnText,
    Provider,
    ProviderError,
    ToolSpec,
    normalize_assistant,
    openai_tools,
    wire_message,
)
from dsh_core.config import without_url_credentials
from dsh_core.plugins import plugin as declare_plugin

__all__ = ["plugin", "OpenAICompatProvider", "CONFIG_SCHEMA"]

CONFIG_SCHEMA: Final = {
    "type": "object",
    "additionalProperties": False,
    "required": ["base_url"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "default": "openai"},
        "base_url": {"type": "string", "pattern": "^https?://", "description": "an http(s) URL"},
        "model": {"type": "string", "minLength": 1},
        "api_key_env": {
            "type": "string",
            "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$(?!\n)",
            "description": "the name of an environment variable",
        },
        "timeout_s": {"type": "number", "exclusiveMinimum": 0},
        "connect_timeout_s": {"type": "number", "exclusiveMinimum": 0},
        "max_retries": {"type": "integer", "minimum": 0, "maximum": 10},
        "backoff_base_s": {"type": "number", "minimum": 0},
        "backoff_max_s": {"type": "number", "minimum": 0},
        "max_retry_after_s": {"type": "number", "minimum": 0},
        "stream": {"type": "boolean"},
        "stream_usage": {
            "type": "boolean",
            "default": True,
            "description": (
                "when streaming, send stream_options = {include_usage = true} so the "
                "server reports usage; false for a server that rejects the field"
            ),
        },
        "temperature": {"type": "number", "minimum": 0},
        "max_tokens": {"type": "integer", "minimum": 1},
        "extra_body": {"type": "object", "description": "extra request fields, merged into every request"},
    },
}

#: At most this much of a response that is not an event stream is read (to parse it, or to quote it):
#: a chat completion is far smaller; a server sending more is not waited for, nor held in memory.
_MAX_PLAIN_BODY: Final = 4 * 1024 * 1024
#: At most this much of an event stream is read: its chunks repeat their envelope for every few
#: characters of the answer, and a long answer streamed takes some tens of MiB.
_MAX_STREAM_BYTES: Final = 64 * 1024 * 1024

#: Statuses worth retrying (the OpenAI SDK's set): timeout, conflict, rate limit, server errors.
RETRY_STATUSES: Final = frozenset({408, 409, 429})

# Substrings servers use to say the prompt does not fit (OpenAI, vLLM, llama.cpp, Ollama, DeepSeek).
_CONTEXT_MARKERS: Final = (
    "context_length_exceeded",
    "maximum context length",
    "context length",
    "context window",
    "too many tokens",
    "prompt is too long",
    "exceeds the available context",
    "n_ctx",
    "input is too long",
)


#: Error types and codes of an error event that stand for an HTTP status (OpenAI, Anthropic-style servers), so that
#: :meth:`OpenAICompatProvider._failure` can judge the event as it judges that status.
_ERROR_NAME_STATUS: Final = {
    "rate_limit_exceeded": 429,
    "rate_limit_error": 429,
    "server_error": 500,
    "internal_server_error": 500,
    "api_error": 500,
    "service_unavailable": 503,
}


def _error_status(error: object) -> int | None:
    """The HTTP status a stream's error event stands for (a status number or a known type or code), if any.

    vLLM and OpenRouter send the status as ``code``; OpenAI and Anthropic-style servers name it
    (``server_error``, ``overloaded_error``); some send just a string.
    """
    names: list[object] = [error]
    if isinstance(error, Mapping):
        for field in (error.get("status"), error.get("code")):
            value = int(field) if isinstance(field, str) and field.isascii() and field.isdigit() else field
            if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
                return value
        names = [error.get("type"), error.get("code")]
    for name in names:
        if isinstance(name, str):
            lowered = name.strip().lower()
            if "overloaded" in lowered:
                return 503
            if lowered in _ERROR_NAME_STATUS:
                return _ERROR_NAME_STATUS[lowered]
    return None


class _ErrorEvent(Exception):
    """A stream chunk that is an error event; ``error`` is what to raise unless it is judged as a status."""

    def __init__(self, error: ProviderError, status: int | None, text: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.status = status
        self.text = text


class _Retry(Exception):
    """An attempt failed in a way worth retrying; ``error`` is what to raise when retries run out."""

    def __init__(self, error: ProviderError, retry_after: float | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.retry_after = retry_after


def _retry_after(headers: httpx.Headers) -> float | None:
    """Seconds the server asks us to wait (``retry-after-ms``, ``retry-after`` seconds or HTTP date)."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        # An HTTP-date is GMT; the asctime form (and "-0000") parses without a zone, which
        # timestamp() would read as local time, hours off wherever that is not UTC.
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - time.time())


def _detail(text: str, redact: Callable[[str], str] = lambda text: text) -> str:
    """The server's own error message (``{"error": {"message"}}`` or plain text), shortened.

    What is shortened is ``redact``-ed first: a secret cut in two would escape it.
    """
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to parse: quote it raw
        data = None
    if isinstance(data, Mapping):
        error = data.get("error", data)
        if isinstance(error, Mapping) and isinstance(error.get("message"), str):
            code = error.get("code") or error.get("type")
            text = str(error["message"])
            return text + (f" ({code})" if isinstance(code, str) and code not in text else "")
        if isinstance(error, str):
            return error
        if isinstance(data.get("detail"), str):
            return str(data["detail"])
    if data is not None:
        # Quoted decoded: a key written with JSON escapes (\/ or \uXXXX) would slip past redaction.
        text = json.dumps(data, ensure_ascii=False)
    text = redact(" ".join(text.split()))
    return text[:300] + ("…" if len(text) > 300 else "") if text else "(empty response body)"


def _quote(text: str, redact: Callable[[str], str]) -> str:
    """``_detail(text)`` with the API key redacted from it.

    The raw body is redacted, then whatever ``_detail`` decodes from it (a key
    that only shows once a JSON string is decoded: ``\\/`` or ``\\uXXXX``
    escapes) before it is shortened (a key cut in two would leak its first
    part), and the result once more.
    """
    return redact(_detail(redact(text), redact))


def _finite_float(text: str) -> float | None:
    number = float(text)
    if not math.isfinite(number):
        return None  # 1e400 and the like: too large for a float
    return 0.0 if number == 0 else number  # -0.0 reads back as 0 from JSON: not lossless


def _null_constant(name: str) -> None:
    return None  # NaN, Infinity, -Infinity


def _meta(finish_reason: object, usage: object, refusal: bool = False) -> dict[str, Any]:
    """An answer's ``_meta`` (what is set of ``finish_reason`` and ``usage``; ``refusal``) as lossless JSON.

    Python's parser accepts ``NaN`` and ``Infinity`` (and reads ``1e400`` as
    infinity, and keeps ``-0.0``), none of which JSON can carry: the session
    event of the assistant message would be refused and a good answer lost.
    This is metadata, so such a number becomes null (``-0.0`` becomes 0).
    ``"refusal": true`` is set when the model refused (see :func:`_with_refusal`).
    """
    meta = {key: value for key, value in (("finish_reason", finish_reason), ("usage", usage)) if value is not None}
    try:
        cleaned: dict[str, Any] = json.loads(json.dumps(meta), parse_constant=_null_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):  # nested too deep to copy: keep what is certainly plain
        cleaned = {"finish_reason": finish_reason} if isinstance(finish_reason, str) else {}
    if refusal:
        cleaned["refusal"] = True
    return cleaned


def _with_refusal(message: Message, refusal: object) -> bool:
    """Make a refusal the content of ``message`` when it has none; whether the model refused.

    OpenAI puts a refusal (typically to a JSON-schema ``response_format``) in
    ``refusal``, with ``content`` null: ignored, it ended the run with an empty
    answer that passed for a good one. Content the message does have is kept.
    """
    if not isinstance(refusal, str) or not refusal:
        return False
    if not message.get("content"):
        message["content"] = refusal
    return True


def _fallback_ids() -> Callable[[int], str]:
    """Ids for tool calls a server sent without one: unique per response, so never reused in a conversation."""
    prefix = secrets.token_hex(4)
    return lambda index: f"call_{prefix}_{index + 1}"


def _request_body(body: dict[str, Any]) -> bytes:
    """The request as UTF-8 JSON (as httpx's ``json=`` writes it), lone surrogates shown as U+FFFD.

    A file name that is not valid UTF-8 reaches the conversation as lone surrogates
    (``os.listdir`` decodes with ``surrogateescape``). JSON text cannot carry them to a
    server as UTF-8, and the model can read a replacement character; failing the whole
    request instead ended the run at the first such name.
    """
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


def _header_safe(key: str) -> bool:
    """Whether ``key`` can go in an HTTP header as is: printable ASCII, no surrounding whitespace."""
    return key == key.strip() and all(" " <= char <= "~" for char in key)


class OpenAICompatProvider:
    """A :class:`~dsh_core.agent.provider.Provider` for OpenAI-compatible chat completions."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str | None = None,
        api_key_env: str | None = None,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 2,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 8.0,
        max_retry_after_s: float = 60.0,
        stream: bool = False,
        stream_usage: bool = True,
        temperature: float | None = None,
        max_tokens: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        name: str = "openai",
        transport: httpx.AsyncBaseTransport | None = None,
        env: Mapping[str, str] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        # What messages show: a base_url may carry credentials (https://user:secret@host), and
        # errors reach stderr, logs and the session; requests still use the URL as given.
        self.shown_url = without_url_credentials(self.url)
        self.model = model
        self.api_key_env = api_key_env
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_retry_after_s = max_retry_after_s
        self.stream = stream
        self.stream_usage = stream_usage
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})
        self._env = os.environ if env is None else env
        self._sleep = sleep
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s), transport=transport
        )
        #: Attempts made by the last request (1 = no retry), for diagnostics and tests.
        self.last_attempts = 0

    def __repr__(self) -> str:
        key = f" key from ${self.api_key_env}" if self.api_key_env else ""
        return f"<OpenAICompatProvider {self.name!r} {self.shown_url} model={self.model!r}{key}>"

    async def aclose(self) -> None:
        """Close the HTTP client (the plugin's scope does this on dispose)."""
        await self._client.aclose()

    # -- request ------------------------------------------------------------------------------------------

    def _key(self) -> str | None:
        if not self.api_key_env:
            return None
        return self._env.get(self.api_key_env) or None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = self._key()
        if key:
            if not _header_safe(key):
                # httpx would fail quoting the header (the key with it, escaped past redaction) or on
                # the encoding: say which variable is wrong, never what it holds, and do not retry.
                raise ProviderError(
                    "auth",
                    f"{self.name}: ${self.api_key_env} cannot be sent as an API key: it "
                    "holds a line break, a control or non-ASCII character, or leading or "
                    "trailing whitespace (the value is not shown)",
                )
            headers["Authorization"] = f"Bearer {key}"
        if self.stream:
            headers["Accept"] = "text/event-stream"
        return headers

    def _redact(self, text: str) -> str:
        key = self._key()
        return text.replace(key, "***") if key and len(key) >= 4 else text

    def _quote(self, text: str) -> str:
        """A response body as quoted in an error: the server's message, shortened, without the API key."""
        return _quote(text, self._redact)

    def _body(self, messages: Sequence[Message], tools: Sequence[ToolSpec], model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": [wire_message(m) for m in messages]}
        if tools:
            body["tools"] = openai_tools(tools)
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.stream and self.stream_usage:
            # OpenAI and vLLM stream usage only when asked, in a last chunk with no choices. Before
            # extra_body, which may replace it; stream_usage = false leaves it out for a server that objects.
            body["stream_options"] = {"include_usage": True}
        body.update(self.extra_body)
        if self.stream:
            body["stream"] = True
        return body

    async def complete(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        *,
        on_text: OnText | None = None,
        model: str | None = None,
    ) -> Message:
        """POST the conversation and return the assistant message (retrying what is worth retrying)."""
        try:
            return await self._complete(messages, tools, on_text, model)
        except ProviderError as error:
            # Bodies are quoted redacted where they are read; this also covers what other code
            # quotes from them (normalize_assistant echoes a field): the key never leaves in an error.
            message = self._redact(error.message)
            if message == error.message:
                raise
            raise ProviderError(error.kind, message, status=error.status) from None

    async def _complete(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec], on_text: OnText | None, model: str | None
    ) -> Message:
        chosen = model or self.model
        if not chosen:
            raise ProviderError(
                "no-model",
                f"{self.name}: no model configured: set `model` in the provider's "
                "plugin config or the agent's `model` (or DSH_MODEL, for the "
                "endpoint DSH_BASE_URL sets up)",
            )
        body = self._body(messages, tools, chosen)
        attempt = 0
        while True:
            attempt += 1
            self.last_attempts = attempt
            try:
                if self.stream:
                    return await self._stream_once(body, chosen, on_text)
                return await self._once(body, chosen)
            except _Retry as retry:
                if attempt > self.max_retries:
                    raise ProviderError(
                        retry.error.kind,
                        f"{retry.error.message} (gave up after {attempt} attempt{'s' if attempt > 1 else ''})",
                        status=retry.error.status,
                    ) from None
                delay = retry.retry_after
                if delay is None:
                    delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
                    delay *= random.uniform(0.5, 1.0)  # jitter: clients that failed together retry apart
                elif delay > self.max_retry_after_s:
                    raise ProviderError(
                        retry.error.kind,
                        f"{retry.error.message}; the server asks to retry after "
                        f"{delay:.0f}s, more than max_retry_after_s "
                        f"({self.max_retry_after_s:g}s)",
                        status=retry.error.status,
                    ) from None
                await self._sleep(delay)

    def _failure(self, status: int, text: str, headers: httpx.Headers, model: str, *, label: str = "HTTP") -> Exception:
        """The error for an HTTP error status: a :class:`_Retry` or a final :class:`ProviderError`.

        ``label`` names where the status came from in the message (``HTTP 503``; a stream's error event).
        """
        detail = self._quote(text)
        where = f"{self.name}: {self.shown_url}"
        if status in (401, 403):
            hint = (
                f"check the API key in ${self.api_key_env}"
                if self._key()
                else f"${self.api_key_env} is not set"
                if self.api_key_env
                else "no API key is configured (set api_key_env to the name of the variable holding it)"
            )
            return ProviderError(
                "auth", f"{where}: authentication failed ({label} {status}): {detail}; {hint}", status=status
            )
        if status == 404:
            return ProviderError(
                "model-not-found",
                f"{where}: model {model!r} not found ({label} 404): {detail} "
                "(check `model` and that base_url ends before "
                "/chat/completions)",
                status=status,
            )
        lowered = detail.lower()
        if status in (400, 413, 422) and any(marker in lowered for marker in _CONTEXT_MARKERS):
            return ProviderError(
                "context-length",
                f"{where}: the conversation is too long for model {model!r} ({label} {status}): {detail}",
                status=status,
            )
        if status in RETRY_STATUSES or status >= 500:
            kind = "rate-limited" if status == 429 else "server"
            return _Retry(
                ProviderError(kind, f"{where}: {label} {status}: {detail}", status=status), _retry_after(headers)
            )
        return ProviderError("http", f"{where}: {label} {status}: {detail}", status=status)

    def _connection(self, error: httpx.HTTPError) -> _Retry:
        what = "timed out" if isinstance(error, httpx.TimeoutException) else "failed"
        return _Retry(
            ProviderError(
                "connection", f"{self.name}: {self.shown_url}: request {what}: {type(error).__name__}: {error}"
            )
        )

    def _http_failure(self, error: Exception) -> ProviderError:
        """Any other ``httpx`` failure (an undecodable body, too many redirects, a bad URL), not retried."""
        if isinstance(error, httpx.DecodingError):
            return ProviderError(
                "malformed-response",
                f"{self.name}: {self.shown_url}: the response body could not be "
                f"decoded: {type(error).__name__}: {error}",
            )
        return ProviderError(
            "http",
            f"{self.name}: {self.shown_url}: request failed: {type(error).__name__}: "
            f"{without_url_credentials(str(error))}",
        )

    def _completion(self, text: str) -> Message:
        """A plain (non-streamed) chat completion body as an assistant message with its ``_meta``."""
        try:
            data = json.loads(text)
            choice = data["choices"][0]
            raw = choice["message"]
            finish, usage = choice.get("finish_reason"), data.get("usage")
            refusal = raw.get("refusal") if isinstance(raw, Mapping) else None  # normalize_assistant names a non-object
        except RecursionError:
            raise ProviderError(
                "malformed-response",
                f"{self.name}: {self.shown_url}: the response is JSON nested too deeply to parse: {self._quote(text)}",
            ) from None
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise ProviderError(
                "malformed-response",
                f"{self.name}: {self.shown_url}: the response is not a chat completion: {self._quote(text)}",
            ) from None
        message = normalize_assistant(raw, who=f"{self.name}: {self.shown_url}", fallback_ids=_fallback_ids())
        message["_meta"] = _meta(finish, usage, _with_refusal(message, refusal))
        return message

    async def _once(self, body: dict[str, Any], model: str) -> Message:
        try:
            async with self._client.stream(
                "POST", self.url, content=_request_body(body), headers=self._headers()
            ) as response:
                text, whole = await _read_capped(response)
        except httpx.TransportError as error:
            raise self._connection(error) from None
        except (httpx.HTTPError, httpx.InvalidURL) as error:
            raise self._http_failure(error) from None
        if response.status_code >= 400:
            raise self._failure(response.status_code, text, response.headers, model)
        if not whole:
            raise self._too_large(text)
        return self._completion(text)

    def _too_large(self, text: str, what: str = "the response is") -> ProviderError:
        return ProviderError(
            "malformed-response",
            f"{self.name}: {self.shown_url}: {what} larger than "
            f"{_size(_MAX_PLAIN_BODY)} (not read further): {self._quote(text)}",
        )

    # -- streaming ------------------------------------------------------------------------------------------

    async def _stream_once(self, body: dict[str, Any], model: str, on_text: OnText | None) -> Message:
        who = f"{self.name}: {self.shown_url}"
        assembler = _StreamAssembler(who, self._redact)
        started = done = False
        plain = _PlainBody()
        try:
            async with self._client.stream(
                "POST", self.url, content=_request_body(body), headers=self._headers()
            ) as response:
                if response.status_code >= 400:
                    text, _ = await _read_capped(response)
                    raise self._failure(response.status_code, text, response.headers, model)
                async for data in _sse_data(response, plain, who):
                    started = True
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        fragment = assembler.feed(data)
                    except _ErrorEvent as event:
                        if event.status is None or assembler.received:
                            # After part of the answer, a retry would show that part again (as a broken stream).
                            raise event.error from None
                        # None of the answer came: the request failed as one answered with that status does.
                        raise self._failure(
                            event.status, event.text, httpx.Headers(), model, label="mid-stream error"
                        ) from None
                    if fragment and on_text is not None:
                        await on_text(fragment)
        except httpx.TransportError as error:
            if assembler.finish_reason is not None:
                # The answer was complete; only its usage and [DONE] were lost (as on a clean close).
                return assembler.message()
            if started:
                # Part of the answer was already shown (on_text): replaying it would duplicate it.
                raise ProviderError(
                    "connection",
                    f"{who}: the stream broke after it started (not retried): {type(error).__name__}: {error}",
                ) from None
            raise self._connection(error) from None
        except (httpx.HTTPError, httpx.InvalidURL) as error:
            raise self._http_failure(error) from None
        if not started:
            # No event at all: a server that ignored stream=true sends a plain completion (or an error object).
            return await self._plain_answer(plain, on_text)
        if not done and assembler.finish_reason is None:
            # A clean close mid-answer looks like the end of the stream: only [DONE] or a finish_reason says so.
            raise ProviderError(
                "connection",
                f"{who}: the stream ended before it finished (no finish_reason and no [DONE]; not retried)",
            )
        return assembler.message()

    async def _plain_answer(self, plain: _PlainBody, on_text: OnText | None) -> Message:
        """The answer of a streaming request that got no event stream (see :meth:`_stream_once`)."""
        who = f"{self.name}: {self.shown_url}"
        text = plain.text()
        if plain.truncated:
            raise self._too_large(text, "the response is not an event stream and is")
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or nested too deeply to parse
            data = None
        if isinstance(data, Mapping) and "choices" not in data and "error" in data:
            raise ProviderError(
                "http", f"{who}: the server answered with an error instead of a stream: {self._quote(text)}"
            )
        if not isinstance(data, Mapping):
            raise ProviderError(
                "malformed-response",
                f"{who}: the response is neither an event stream nor a chat completion: {self._quote(text)}",
            )
        message = self._completion(text)
        if message.get("content") and on_text is not None:
            await on_text(message["content"])
        return message


class _PlainBody:
    """The lines of a response that are not server-sent events (kept up to :data:`_MAX_PLAIN_BODY`)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.size = 0
        self.truncated = False

    def add(self, line: str) -> None:
        if self.size + len(line) > _MAX_PLAIN_BODY:
            self.truncated = True
            return
        self.lines.append(line)
        self.size += len(line) + 1

    def text(self) -> str:
        return "\n".join(self.lines)


#: The fields of a server-sent event; any other line is not part of an event stream.
_SSE_FIELDS: Final = frozenset({"data", "event", "id", "retry"})


#: Where a line of an event stream ends: CRLF, LF or CR, and nowhere else.
_LINE_BREAK: Final = re.compile(r"\r\n|\r|\n")


def _size(limit: int) -> str:
    return f"{limit // 2**20} MiB" if limit >= 2**20 else f"{limit} bytes"


async def _read_capped(response: httpx.Response) -> tuple[str, bool]:
    """The body of a response that is no event stream, as UTF-8 text, and whether it was read whole.

    Reading stops after :data:`_MAX_PLAIN_BODY` bytes: the connection is dropped, not drained.
    A byte order mark opening it is dropped, as :func:`_lines` drops it: the same completion
    must read alike whether or not it answers a streaming request.
    """
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > _MAX_PLAIN_BODY:
            return b"".join(chunks)[:_MAX_PLAIN_BODY].decode("utf-8-sig", "replace"), False
    return b"".join(chunks).decode("utf-8-sig", "replace"), True


async def _lines(response: httpx.Response, who: str) -> AsyncIterator[str]:
    """The lines of a response body as UTF-8, split where server-sent events split them (CRLF, LF, CR).

    A body larger than :data:`_MAX_STREAM_BYTES` fails (comments and keep-alives count too).

    Not ``aiter_lines``: it splits as ``str.splitlines`` does, at U+2028, U+0085, form feeds and more,
    which JSON strings may hold unescaped, so a chunk carrying one was cut in two and failed as not JSON.
    """
    # utf-8-sig: one byte order mark opening the body is dropped, as the SSE spec says (kept, it
    # would be read into the first line's field name and lose the first event).
    decoder = codecs.getincrementaldecoder("utf-8-sig")("replace")
    line: list[str] = []  # pieces of the line not yet ended
    held_cr = False  # a CR ending one piece of text may be the first half of a CRLF
    size = 0
    async for raw in response.aiter_bytes():
        size += len(raw)
        if size > _MAX_STREAM_BYTES:
            raise ProviderError(
                "malformed-response",
                f"{who}: the response is larger than {_size(_MAX_STREAM_BYTES)} (not read further)",
            )
        text = decoder.decode(raw)
        if held_cr:
            text, held_cr = "\r" + text, False
        if text.endswith("\r"):
            text, held_cr = text[:-1], True
        parts = _LINE_BREAK.split(text)
        line.append(parts[0])
        if len(parts) == 1:
            continue
        yield "".join(line)
        for part in parts[1:-1]:
            yield part
        line = [parts[-1]]
    line.append(decoder.decode(b"", final=True))
    rest = "".join(line)
    if rest or held_cr:
        yield rest


async def _sse_data(response: httpx.Response, plain: _PlainBody, who: str) -> AsyncIterator[str]:
    """The ``data`` payloads of a server-sent-event stream (multi-line data joined by newlines).

    Lines that are no SSE field go to ``plain``: if no event came, they are the body to report.
    """
    lines: list[str] = []
    started = False
    async for line in _lines(response, who):
        if line == "":
            if lines:
                started = True
                yield "\n".join(lines)
                lines = []
            continue
        if line.startswith(":"):
            continue  # a comment / keep-alive
        field, _, value = line.partition(":")
        if field == "data":
            lines.append(value[1:] if value.startswith(" ") else value)
        elif field not in _SSE_FIELDS:
            plain.add(line)
            if plain.truncated and not started:
                return  # no event stream, and more than a plain answer can be: read no further
    if lines:
        yield "\n".join(lines)


class _StreamAssembler:
    """Builds one assistant message from ``chat.completion.chunk`` deltas."""

    def __init__(self, who: str, redact: Callable[[str], str]) -> None:
        self.who = who
        self.redact = redact  # chunks quoted in errors are quoted without the API key
        self.parts: list[str] = []
        self.refusal_parts: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.slot_of_index: dict[int, int] = {}
        self.finish_reason: str | None = None
        self.usage: object = None

    def feed(self, data: str) -> str | None:
        """Apply one chunk; return its text fragment (if any). An error event raises :class:`_ErrorEvent`."""
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ProviderError(
                "malformed-response", f"{self.who}: a stream chunk is not JSON: {self.redact(data)[:200]!r}"
            ) from None
        except RecursionError:
            raise ProviderError(
                "malformed-response",
                f"{self.who}: a stream chunk is JSON nested too deeply to parse: {self.redact(data)[:200]!r}",
            ) from None
        if not isinstance(chunk, Mapping):
            raise ProviderError("malformed-response", f"{self.who}: a stream chunk is not an object")
        if chunk.get("error") is not None:  # some servers send "error": null in every chunk
            quoted = json.dumps(chunk)
            error = ProviderError(
                "http", f"{self.who}: the server reported an error mid-stream: {_quote(quoted, self.redact)}"
            )
            raise _ErrorEvent(error, _error_status(chunk["error"]), quoted)
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        fragment: str | None = None
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise ProviderError(
                "malformed-response",
                f"{self.who}: a stream chunk's 'choices' is {type(choices).__name__}, expected a list",
            )
        for choice in choices:
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
            delta = choice.get("delta") or {}
            if not isinstance(delta, Mapping):
                raise ProviderError(
                    "malformed-response",
                    f"{self.who}: a stream chunk's 'delta' is {type(delta).__name__}, expected an object",
                )
            text = delta.get("content")
            if isinstance(text, str) and text:
                self.parts.append(text)
                fragment = (fragment or "") + text
            refusal = delta.get("refusal")
            if isinstance(refusal, str) and refusal:
                self.refusal_parts.append(refusal)
                if not self.parts:
                    # Shown as content is: without content, the refusal is the answer (see _with_refusal).
                    fragment = (fragment or "") + refusal
            tool_calls = delta.get("tool_calls") or []
            if not isinstance(tool_calls, list):
                raise ProviderError(
                    "malformed-tool-call",
                    f"{self.who}: a stream chunk's 'tool_calls' is {type(tool_calls).__name__}, expected a list",
                )
            for position, call in enumerate(tool_calls):
                self._tool_delta(position, call)
        return fragment

    def _tool_delta(self, position: int, delta: object) -> None:
        if not isinstance(delta, Mapping):
            raise ProviderError("malformed-tool-call", f"{self.who}: a tool-call delta is not an object")
        index = delta.get("index", position)
        if not isinstance(index, int):
            raise ProviderError("malformed-tool-call", f"{self.who}: a tool-call delta has index {index!r}")
        call_id = delta.get("id")
        slot = self.slot_of_index.get(index)
        function = delta.get("function") or {}
        # Some servers (Ollama) reuse index 0 for parallel calls and tell them apart only by a new id; the
        # first delta of such a call names its tool. Others (Poolside) change the id after the first delta
        # of one call: a new id without a name continues the call.
        named = isinstance(function, Mapping) and bool(function.get("name"))
        if slot is None or (call_id and named and self.calls[slot]["id"] and self.calls[slot]["id"] != call_id):
            self.calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot = len(self.calls) - 1
            self.slot_of_index[index] = slot
        entry = self.calls[slot]
        if call_id:
            entry["id"] = call_id
        if not isinstance(function, Mapping):
            raise ProviderError("malformed-tool-call", f"{self.who}: tool call {index}: 'function' is not an object")
        name = function.get("name")
        # Some servers (MiniMax on NVIDIA NIM, Fireworks, Kimi) resend the whole name in every delta:
        # appending that turned "read" into "readread". Others send it in fragments, which still add up.
        if isinstance(name, str) and name != entry["function"]["name"]:
            entry["function"]["name"] += name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            entry["function"]["arguments"] += arguments
        elif isinstance(arguments, Mapping):
            entry["function"]["arguments"] += json.dumps(arguments, ensure_ascii=False)

    @property
    def received(self) -> bool:
        """Whether any of the answer came (text, shown through ``on_text``, a refusal or a tool call)."""
        return bool(self.parts or self.refusal_parts or self.calls)

    def message(self) -> Message:
        """The assembled assistant message (checked)."""
        raw: dict[str, Any] = {"role": "assistant", "content": "".join(self.parts) or None}
        if self.calls:
            raw["tool_calls"] = self.calls
        message = normalize_assistant(raw, who=self.who, fallback_ids=_fallback_ids())
        message["_meta"] = _meta(self.finish_reason, self.usage, _with_refusal(message, "".join(self.refusal_parts)))
        return message


class OpenAIPlugin:
    """Registers one :class:`OpenAICompatProvider`; its HTTP client closes with the plugin's scope."""

    def __init__(self, provider: OpenAICompatProvider) -> None:
        self.provider = provider

    @hookimpl
    def dsh_register_providers(self, register: Callable[[str, Provider], None]) -> None:
        """Register the provider under its configured name."""
        register(self.provider.name, self.provider)


@declare_plugin(config_schema=CONFIG_SCHEMA)
def plugin(scope: Scope, config: Any) -> OpenAIPlugin:
    """Plugin factory of ``openai``."""
    options = {k: v for k, v in dict(config).items() if k != "extra_body"}
    provider = OpenAICompatProvider(**options, extra_body=config.get("extra_body"))
    scope.on_dispose(provider.aclose)
    return OpenAIPlugin(provider)

"""The OpenAI-compatible HTTP provider against a loopback fake server."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest

from dsh_core import define_tool, hookimpl
from dsh_core.agent.loop import open_session_store, run_agent
from dsh_core.agent.provider import ProviderError
from dsh_core.config import compose, default_deployment
from dsh_core.harness import Harness
from dsh_core.lossless import is_lossless
from dsh_core.plugins import PluginCatalog
from dsh_core.scope import Scope
from dsh_plugins.providers.openai_compat import OpenAICompatProvider, plugin

from .conftest import FakeServer, completion

pytestmark = pytest.mark.anyio

SECRET = "sk-test-0123456789"
TOOLS = [{"name": "add", "description": "Add.", "parameters": {"type": "object"}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'}}


def provider(server: FakeServer, **options: Any) -> tuple[OpenAICompatProvider, list[float]]:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    options.setdefault("model", "m1")
    made = OpenAICompatProvider(
        base_url=server.url + "/",
        api_key_env="TEST_KEY",
        env={"TEST_KEY": SECRET},
        backoff_base_s=0.01,
        sleep=sleep,
        **options,
    )
    return made, slept


async def failure(server: FakeServer, **options: Any) -> tuple[ProviderError, list[float]]:
    """The ProviderError one request raises (the client closed either way), and the back-off sleeps."""
    client, slept = provider(server, **options)
    try:
        with pytest.raises(ProviderError) as caught:
            await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    return caught.value, slept


async def test_tool_calls_are_parsed_and_the_request_has_the_openai_shape(server: FakeServer) -> None:
    server.reply(body=completion(None, [CALL], finish="tool_calls"))
    client, _ = provider(server)
    try:
        history = [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "2+40?"},
            {"role": "assistant", "content": "hm", "_meta": {"usage": 1}},
        ]
        message = await client.complete(history, TOOLS)
    finally:
        await client.aclose()
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [CALL],
        "_meta": {"finish_reason": "tool_calls", "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    }
    (request,) = server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == f"Bearer {SECRET}"
    body = request["body"]
    assert body["model"] == "m1" and "stream" not in body
    assert body["tools"] == [{"type": "function", "function": TOOLS[0]}]
    assert body["messages"][-1] == {"role": "assistant", "content": "hm"}  # private keys stripped
    assert SECRET not in repr(client) and "TEST_KEY" in repr(client)


async def test_the_agent_model_overrides_and_arguments_objects_are_reencoded(server: FakeServer) -> None:
    server.reply(
        body=completion(None, [{"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}])
    )
    client, _ = provider(server, temperature=0.2, max_tokens=50, extra_body={"seed": 7})
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [], model="m2")
    finally:
        await client.aclose()
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    body = server.requests[0]["body"]
    assert (body["model"], body["temperature"], body["max_tokens"], body["seed"]) == ("m2", 0.2, 50, 7)
    assert "tools" not in body


async def test_streaming_assembles_text_and_tool_calls_by_index(server: FakeServer) -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    server.stream(
        [
            ": keep-alive",
            chunk({"role": "assistant", "content": "Let me "}),
            chunk({"content": "add."}),
            chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "c1", "type": "function", "function": {"name": "add", "arguments": ""}}
                    ]
                }
            ),
            chunk(
                {
                    "tool_calls": [
                        {"index": 1, "id": "c2", "type": "function", "function": {"name": "mul", "arguments": '{"a"'}}
                    ]
                }
            ),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 2,'}}]}),
            chunk({"tool_calls": [{"index": 1, "function": {"arguments": ": 3}"}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "b": 40}'}}]}, "tool_calls"),
            {"choices": [], "usage": {"total_tokens": 9}},
        ]
    )
    fragments: list[str] = []

    async def on_text(text: str) -> None:
        fragments.append(text)

    client, _ = provider(server, stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], TOOLS, on_text=on_text)
    finally:
        await client.aclose()
    assert fragments == ["Let me ", "add."]
    assert message["content"] == "Let me add."
    assert [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
    ] == [("c1", "add", {"a": 2, "b": 40}), ("c2", "mul", {"a": 3})]
    assert message["_meta"] == {"finish_reason": "tool_calls", "usage": {"total_tokens": 9}}
    assert server.requests[0]["body"]["stream"] is True
    assert server.requests[0]["headers"]["Accept"] == "text/event-stream"


async def test_streaming_tells_apart_calls_that_reuse_index_zero(server: FakeServer) -> None:
    # Ollama-style: parallel calls all arrive with index 0 and differ only by id.
    server.stream(
        [
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {"index": 0, "id": "a", "function": {"name": "read", "arguments": '{"path": "x"}'}}
                            ]
                        },
                    }
                ]
            },
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {"index": 0, "id": "b", "function": {"name": "read", "arguments": '{"path": "y"}'}}
                            ]
                        },
                    }
                ]
            },
        ]
    )
    client, _ = provider(server, stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], TOOLS)
    finally:
        await client.aclose()
    assert [(c["id"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("a", '{"path": "x"}'),
        ("b", '{"path": "y"}'),
    ]


async def test_streaming_continues_a_call_whose_id_changes_after_its_first_delta(server: FakeServer) -> None:
    # Poolside sends one id with the name and another with every later delta of the same call; a new
    # id without a name is no new call (Ollama's parallel calls on index 0 each come with their name).
    def delta(call: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": finish}]}

    server.stream(
        [
            delta({"index": 0, "id": "first", "type": "function", "function": {"name": "add", "arguments": '{"a"'}}),
            delta({"index": 0, "id": "later", "function": {"arguments": ": 2, "}}),
            delta({"index": 0, "id": "later", "function": {"arguments": '"b": 40}'}}),
            delta(
                {"index": 0, "id": "next", "type": "function", "function": {"name": "add", "arguments": "{}"}},
                "tool_calls",
            ),
        ]
    )
    client, _ = provider(server, stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], TOOLS)
    finally:
        await client.aclose()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("add", {"a": 2, "b": 40}),
        ("add", {}),
    ]
    assert len({c["id"] for c in message["tool_calls"]}) == 2


async def test_streaming_takes_a_name_resent_in_every_delta_once(server: FakeServer) -> None:
    # MiniMax on NVIDIA NIM, Fireworks and Kimi repeat the whole name in each delta of a call; a name
    # sent in fragments still adds up.
    def delta(call: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": finish}]}

    server.stream(
        [
            delta({"index": 0, "id": "a", "type": "function", "function": {"name": "read", "arguments": '{"pa'}}),
            delta({"index": 0, "id": "a", "type": "function", "function": {"name": "read", "arguments": 'th": 1}'}}),
            delta({"index": 1, "id": "b", "type": "function", "function": {"name": "ad", "arguments": ""}}),
            delta({"index": 1, "function": {"name": "d", "arguments": "{}"}}, "tool_calls"),
        ]
    )
    client, _ = provider(server, stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], TOOLS)
    finally:
        await client.aclose()
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("read", '{"path": 1}'),
        ("add", "{}"),
    ]


async def test_429_and_5xx_are_retried_honouring_retry_after(server: FakeServer) -> None:
    server.reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "2"})
    server.reply(503, "upstream overloaded")
    server.reply(body=completion("hi"))
    client, slept = provider(server, max_retries=2)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert message["content"] == "hi" and client.last_attempts == 3
    assert slept[0] == 2.0  # the server's Retry-After, not the backoff
    assert 0.005 <= slept[1] <= 0.02  # jittered exponential backoff (base 0.01, second attempt)


async def test_retry_after_ms_and_streams_are_retried_before_they_start(server: FakeServer) -> None:
    server.reply(429, "busy", {"retry-after-ms": "250"})
    server.stream([{"choices": [{"index": 0, "delta": {"content": "ok"}}]}])
    client, slept = provider(server, stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert message["content"] == "ok" and slept == [0.25]


@pytest.mark.parametrize("form", ["%a %b %d %H:%M:%S %Y", "%a, %d %b %Y %H:%M:%S -0000"])
async def test_a_retry_after_date_without_a_zone_is_gmt(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    # HTTP-dates are GMT; the asctime form carries no zone and was read as local time: five hours
    # west of UTC, a 30 s wait became 18,030 s, beyond max_retry_after_s, and the request failed.
    import time

    monkeypatch.setenv("TZ", "XXX+05")
    time.tzset()
    try:
        when = time.strftime(form, time.gmtime(time.time() + 30))
        server.reply(429, "busy", {"Retry-After": when})
        server.reply(body=completion("ok"))
        client, slept = provider(server)
        try:
            message = await client.complete([{"role": "user", "content": "x"}], [])
        finally:
            await client.aclose()
    finally:
        monkeypatch.undo()
        time.tzset()
    assert message["content"] == "ok"
    assert len(slept) == 1 and 25 <= slept[0] <= 31


async def test_retries_run_out_with_a_clear_error(server: FakeServer) -> None:
    for _ in range(3):
        server.reply(429, {"error": {"message": "quota", "code": "rate_limit_exceeded"}})
    error, slept = await failure(server, max_retries=2)
    assert error.kind == "rate-limited" and error.status == 429
    assert "HTTP 429: quota (rate_limit_exceeded) (gave up after 3 attempts)" in error.message
    assert len(slept) == 2


async def test_a_retry_after_beyond_the_limit_is_not_waited_for(server: FakeServer) -> None:
    server.reply(429, "later", {"Retry-After": "3600"})
    error, slept = await failure(server)
    assert "retry after 3600s, more than max_retry_after_s" in error.message
    assert slept == []


@pytest.mark.parametrize(
    ("status", "body", "kind", "text"),
    [
        (
            401,
            {"error": {"message": f"Incorrect API key provided: {SECRET}"}},
            "auth",
            "authentication failed (HTTP 401): Incorrect API key provided: ***; check the API key in $TEST_KEY",
        ),
        (403, "forbidden", "auth", "authentication failed (HTTP 403): forbidden"),
        (
            404,
            {"error": {"message": "The model `m1` does not exist"}},
            "model-not-found",
            "model 'm1' not found (HTTP 404): The model `m1` does not exist",
        ),
        (
            400,
            {
                "error": {
                    "message": "This model's maximum context length is 8192 tokens",
                    "code": "context_length_exceeded",
                }
            },
            "context-length",
            "the conversation is too long for model 'm1' (HTTP 400): This model's maximum context length",
        ),
        (
            400,
            {"error": {"message": "the request exceeds the available context size (n_ctx)"}},
            "context-length",
            "too long",
        ),
        (400, {"error": {"message": "temperature must be <= 2"}}, "http", "HTTP 400: temperature must be <= 2"),
        (200, "<html>not json</html>", "malformed-response", "the response is not a chat completion: <html>"),
        (
            200,
            completion(None, [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]),
            "malformed-tool-call",
            "tool_calls[0].function.name is missing",
        ),
        (
            200,
            completion(None, [{"id": "c", "type": "function", "function": {"name": "x", "arguments": 5}}]),
            "malformed-tool-call",
            "arguments of tool 'x' is int, expected JSON text",
        ),
    ],
)
async def test_each_failure_has_a_clear_error(server: FakeServer, status: int, body: Any, kind: str, text: str) -> None:
    server.reply(status, body)
    error, slept = await failure(server)
    assert error.kind == kind
    assert text in error.message and SECRET not in error.message
    assert slept == [] and len(server.requests) == 1  # none of these is retried


async def test_an_error_inside_a_stream_is_reported(server: FakeServer) -> None:
    server.stream([{"error": {"message": "model crashed"}}], done=False)
    error, _ = await failure(server, stream=True)
    assert "mid-stream: model crashed" in error.message


def delta_chunk(delta: Any, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_an_undecodable_body_is_a_provider_error(server: FakeServer, stream: bool) -> None:
    server.reply(200, "not gzip", {"Content-Encoding": "gzip"})
    error, slept = await failure(server, stream=stream)
    assert error.kind == "malformed-response"
    assert "the response body could not be decoded: DecodingError" in error.message
    assert slept == []


@pytest.mark.parametrize(
    ("chunk", "kind", "text"),
    [
        (delta_chunk(["content"]), "malformed-response", "a stream chunk's 'delta' is list, expected an object"),
        ({"choices": {"index": 0}}, "malformed-response", "a stream chunk's 'choices' is dict, expected a list"),
        (delta_chunk({"tool_calls": {"index": 0}}), "malformed-tool-call", "'tool_calls' is dict, expected a list"),
    ],
)
async def test_a_malformed_stream_chunk_is_a_provider_error(
    server: FakeServer, chunk: Any, kind: str, text: str
) -> None:
    server.stream([chunk])
    error, _ = await failure(server, stream=True)
    assert error.kind == kind and text in error.message


#: JSON nested deeper than Python's parser recurses: it raised RecursionError, not ValueError.
TOO_DEEP = "[" * 100_000


@pytest.mark.parametrize(
    ("stream", "status", "body", "kind", "text"),
    [
        (False, 200, TOO_DEEP, "malformed-response", "the response is JSON nested too deeply to parse: [[[["),
        (False, 400, TOO_DEEP, "http", "HTTP 400: [[[["),
        (False, 400, '{"error": ' + TOO_DEEP + "}", "http", 'HTTP 400: {"error": [[[['),
        (True, 400, TOO_DEEP, "http", "HTTP 400: [[[["),
        (True, 200, TOO_DEEP, "malformed-response", "neither an event stream nor a chat completion: [[[["),
        (
            True,
            200,
            ("sse", ["data: " + TOO_DEEP]),
            "malformed-response",
            "a stream chunk is JSON nested too deeply to parse: '[[[[",
        ),
    ],
)
async def test_a_body_nested_too_deeply_to_parse_is_a_provider_error_quoting_a_short_excerpt(
    server: FakeServer, stream: bool, status: int, body: Any, kind: str, text: str
) -> None:
    if isinstance(body, tuple):
        server.stream(body[1], done=False)
    else:
        server.reply(status, body)
    error, slept = await failure(server, stream=stream)
    assert error.kind == kind and text in error.message
    assert len(error.message) < 500 and slept == []


async def test_a_stream_that_ends_before_it_finished_is_not_an_answer(server: FakeServer) -> None:
    server.stream([delta_chunk({"content": "The answer is: first, "})], done=False)
    error, slept = await failure(server, stream=True)
    assert error.kind == "connection"
    assert "the stream ended before it finished" in error.message
    assert slept == [] and len(server.requests) == 1  # part of it was shown already: not replayed


@pytest.mark.parametrize("finished", [True, False])
async def test_a_stream_that_breaks_after_its_finish_reason_is_an_answer(finished: bool) -> None:
    # The finish_reason ends the answer; only the usage chunk and [DONE] were still to come. A reset
    # there lost a complete answer, while a clean close at the same point was accepted.
    import httpx

    chunks = [
        {"choices": [{"index": 0, "delta": {"content": "4"}}]},
        {"choices": [{"index": 0, "delta": {"content": "2"}, "finish_reason": "stop" if finished else None}]},
    ]

    async def body() -> Any:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        raise httpx.ReadError("connection reset by peer")

    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, headers={"Content-Type": "text/event-stream"}, content=body())
    )
    client = OpenAICompatProvider(base_url="http://model.invalid/v1", model="m", stream=True, transport=transport)
    try:
        if finished:
            message = await client.complete([{"role": "user", "content": "x"}], [])
            assert message["content"] == "42" and message["_meta"] == {"finish_reason": "stop"}
        else:
            with pytest.raises(ProviderError, match="broke after it started") as caught:
                await client.complete([{"role": "user", "content": "x"}], [])
            assert caught.value.kind == "connection"
    finally:
        await client.aclose()
    assert client.last_attempts == 1


async def test_a_finish_reason_without_done_completes_a_stream(server: FakeServer) -> None:
    server.stream([delta_chunk({"content": "all"}), delta_chunk({}, "stop")], done=False)
    client, _ = provider(server, stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert message["content"] == "all" and message["_meta"] == {"finish_reason": "stop"}


@pytest.mark.parametrize(
    ("body", "kind", "text"),
    [
        (
            {"error": {"message": "upstream overloaded"}},
            "http",
            "the server answered with an error instead of a stream: upstream overloaded",
        ),
        (
            "<html>gateway</html>",
            "malformed-response",
            "the response is neither an event stream nor a chat completion: <html>gateway</html>",
        ),
        ("", "malformed-response", "(empty response body)"),
    ],
)
async def test_a_streaming_request_without_events_fails_naming_the_body(
    server: FakeServer, body: Any, kind: str, text: str
) -> None:
    server.reply(200, body)
    error, _ = await failure(server, stream=True)
    assert error.kind == kind and text in error.message


async def test_a_plain_completion_answers_a_streaming_request(server: FakeServer) -> None:
    server.reply(body=completion("full answer"))
    fragments: list[str] = []

    async def on_text(text: str) -> None:
        fragments.append(text)

    client, _ = provider(server, stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [], on_text=on_text)
    finally:
        await client.aclose()
    assert message["content"] == "full answer" and message["_meta"]["finish_reason"] == "stop"
    assert fragments == ["full answer"]


#: A body whose text puts the key across the 300-character cut of the quoted detail.
_STRADDLING = "<html>" + "x" * 277 + " bad key " + SECRET + "</html>"


@pytest.mark.parametrize(
    ("stream", "status", "body", "kind"),
    [
        # 200 JSON that is neither a completion nor an error: non-streamed, and the streaming fallback.
        (False, 200, {"detail": f"token {SECRET} is not allowed"}, "malformed-response"),
        (True, 200, {"detail": f"token {SECRET} is not allowed"}, "malformed-response"),
        # A key that straddles the shortening of a quoted body.
        (False, 200, _STRADDLING, "malformed-response"),
        (True, 200, _STRADDLING, "malformed-response"),
        (False, 400, _STRADDLING, "http"),
        (True, 400, _STRADDLING, "http"),
        # A key that only appears once the JSON string is decoded.
        (False, 400, '{"error": {"message": "bad key \\u0073k-test-0123456789"}}', "http"),
        (True, 200, '{"error": {"message": "bad key \\u0073k-test-0123456789"}}', "http"),
        # The same, in a body of a shape with no message field, quoted whole.
        (False, 400, '{"errors": [{"msg": "bad key \\u0073k-test-0123456789"}]}', "http"),
        (True, 200, '{"errors": [{"msg": "bad key \\u0073k-test-0123456789"}]}', "malformed-response"),
        # The same, decoded just across the 300-character cut.
        (False, 400, '{"errors": "' + "A" * 278 + '\\u0073k-test-0123456789"}', "http"),
        # A field of the message echoed by normalize_assistant.
        (False, 200, {"choices": [{"message": {"role": f"user {SECRET}"}}]}, "malformed-response"),
        # Stream chunks: one that is not JSON (cut at 200 characters) and an error mid-stream.
        (True, 200, ("sse", ["data: " + "x" * 192 + SECRET]), "malformed-response"),
        (True, 200, ("sse", ["data: " + json.dumps({"error": {"message": f"bad key {SECRET}"}})]), "http"),
    ],
)
async def test_the_api_key_never_appears_in_an_error_not_even_in_part(
    server: FakeServer, stream: bool, status: int, body: Any, kind: str
) -> None:
    if isinstance(body, tuple):
        server.stream(body[1], done=False)
    else:
        server.reply(status, body)
    error, _ = await failure(server, stream=stream, max_retries=0)
    assert error.kind == kind
    message = error.message
    assert SECRET[:6] not in message, message  # no prefix of it either
    assert SECRET[2:8] not in message, message  # nor the key still JSON-escaped (\u0073k-test-...)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "key", [SECRET + "\r", SECRET + "\n", "sk-test\n-0123456789", SECRET + "\x00", SECRET + " ", "sk-tést-0123456789"]
)
async def test_an_api_key_no_header_can_carry_fails_without_quoting_it(
    server: FakeServer, stream: bool, key: str
) -> None:
    # A key read from a CRLF .env file ends in "\r": httpx refused the header quoting the key with its
    # escapes (which redaction did not match), and retried that as a connection failure.
    client = OpenAICompatProvider(
        base_url=server.url,
        model="m",
        api_key_env="TEST_KEY",
        env={"TEST_KEY": key},
        stream=stream,
        max_retries=2,
        backoff_base_s=0.0,
    )
    try:
        with pytest.raises(ProviderError) as caught:
            await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert caught.value.kind == "auth" and "$TEST_KEY" in caught.value.message
    assert "sk-t" not in caught.value.message and "0123" not in caught.value.message
    assert client.last_attempts == 1 and server.requests == []


async def test_a_truncated_plain_body_is_quoted_without_the_api_key(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsh_plugins.providers import openai_compat

    monkeypatch.setattr(openai_compat, "_MAX_PLAIN_BODY", 1000)
    server.reply(200, f"<html> bad key {SECRET}\n" + "y" * 2000)
    error, _ = await failure(server, stream=True)
    assert (
        "the response is not an event stream and is larger than 1000 bytes (not read further): <html> bad key ***"
        in error.message
    )
    assert SECRET[:6] not in error.message


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_call_without_an_id_gets_a_unique_one_streamed_or_not(server: FakeServer, stream: bool) -> None:
    anonymous = {"type": "function", "function": {"name": "add", "arguments": "{}"}}
    for _ in range(2):
        if stream:
            server.stream([delta_chunk({"tool_calls": [dict(anonymous, index=0)]}, "tool_calls")])
        else:
            server.reply(body=completion(None, [anonymous], finish="tool_calls"))
    client, _ = provider(server, stream=stream)
    try:
        ids = [
            (await client.complete([{"role": "user", "content": "x"}], TOOLS))["tool_calls"][0]["id"] for _ in range(2)
        ]
    finally:
        await client.aclose()
    assert all(i.startswith("call_") for i in ids) and ids[0] != ids[1]


async def test_no_model_and_no_server_fail_clearly() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    client = OpenAICompatProvider(
        base_url=f"http://127.0.0.1:{port}/v1", max_retries=1, backoff_base_s=0.0, sleep=sleep
    )
    try:
        with pytest.raises(ProviderError, match="no model configured"):
            await client.complete([], [])
        with pytest.raises(ProviderError) as caught:
            await client.complete([{"role": "user", "content": "x"}], [], model="m")
    finally:
        await client.aclose()
    assert caught.value.kind == "connection" and "gave up after 2 attempts" in caught.value.message
    assert len(slept) == 1


async def test_the_plugin_closes_its_client_with_its_scope(server: FakeServer) -> None:
    scope = Scope("plugin:openai")
    instance = plugin(scope, {"base_url": server.url, "model": "m"})
    client = instance.provider._client
    assert not client.is_closed
    await scope.dispose()
    assert client.is_closed


class AddTool:
    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        async def add(args: Any, ctx: Any) -> Any:
            return args["a"] + args["b"]

        register(define_tool(name="add", description="Add two integers.", parameters={"type": "object"}, execute=add))


async def test_the_loop_runs_against_an_openai_compatible_server(
    server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSH_TEST_KEY", SECRET)
    server.reply(body=completion(None, [CALL], finish="tool_calls"))
    server.reply(body=completion("42"))
    deployment = compose(
        [
            (
                "test",
                {
                    "agents": [{"id": "main", "provider": "openai", "model": "agent-model"}],
                    "plugins": [
                        {"id": "tools", "use": "tools"},
                        {
                            "id": "openai",
                            "use": "openai",
                            "config": {"base_url": server.url, "model": "m", "api_key_env": "DSH_TEST_KEY"},
                        },
                    ],
                },
            )
        ],
        env={},
    )
    harness = await Harness.start(
        deployment, catalog=PluginCatalog(extra={"tools": lambda s, c: AddTool()}, strict=True)
    )
    try:
        result = await run_agent(harness, "2+40?", record=False)
    finally:
        await harness.aclose()
    assert result.ok and result.answer == "42"
    second = server.requests[1]["body"]
    assert second["model"] == "agent-model"
    assert second["messages"][0]["role"] == "system"
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    assert [t["function"]["name"] for t in second["tools"]] == ["add"]


def test_an_api_key_variable_name_with_a_trailing_newline_is_refused() -> None:
    """The config pattern ended in ``$``, which jsonschema (Python ``re``) also matches before a final newline."""
    from dsh_core.errors import ConfigError
    from dsh_core.testing.loader import check_config

    check_config("openai", plugin, {"base_url": "http://x/v1", "api_key_env": "OPENAI_API_KEY"})
    with pytest.raises(ConfigError, match="api_key_env"):
        check_config("openai", plugin, {"base_url": "http://x/v1", "api_key_env": "OPENAI_API_KEY\n"})


def test_three_environment_variables_point_the_default_deployment_at_an_endpoint(tmp_path: Path) -> None:
    env = {"DSH_BASE_URL": "http://localhost:11434/v1", "DSH_MODEL": "qwen3", "DSH_API_KEY": SECRET}
    deployment = default_deployment(tmp_path, env=env)
    row = deployment.plugin("openai")
    assert row is not None
    assert dict(row.config) == {"base_url": "http://localhost:11434/v1", "api_key_env": "DSH_API_KEY", "model": "qwen3"}
    assert deployment.agent("main").provider == "openai"  # type: ignore[union-attr]
    assert deployment.source_of("agents[main].provider") == "env:DSH_BASE_URL"
    assert SECRET not in json.dumps(dict(row.config))  # the key itself never enters the config
    plain = default_deployment(tmp_path, env={})
    assert plain.plugin("openai") is None and plain.agent("main").provider == "scripted"  # type: ignore[union-attr]


async def test_lone_surrogates_reach_the_server_as_replacement_characters(server: FakeServer) -> None:
    # A file name that is not UTF-8 comes back from os.listdir as lone surrogates; httpx's json=
    # could not encode it and the request (and the run) failed before anything was sent.
    server.reply(body=completion("ok"))
    client, _ = provider(server)
    try:
        message = await client.complete([{"role": "user", "content": "files: caf\udce9.txt, d\u00e9j\u00e0.txt"}], [])
    finally:
        await client.aclose()
    assert message["content"] == "ok"
    (request,) = server.requests
    assert request["body"]["messages"][0]["content"] == "files: caf\ufffd.txt, d\u00e9j\u00e0.txt"


# Numbers Python's json reads but JSON cannot carry, as a server might send them in usage.
_ODD_USAGE = (
    '{"prompt_tokens": 3, "cost": NaN, "rate": Infinity, "low": -Infinity, "big": 1e400, '
    '"zero": -0.0, "timings": {"per_s": [NaN, 1.5]}}'
)
_CLEAN_USAGE = {
    "prompt_tokens": 3,
    "cost": None,
    "rate": None,
    "low": None,
    "big": None,
    "zero": 0.0,
    "timings": {"per_s": [None, 1.5]},
}


@pytest.mark.parametrize("stream", [False, True])
async def test_numbers_json_cannot_carry_in_usage_become_null(server: FakeServer, stream: bool) -> None:
    if stream:
        server.stream([delta_chunk({"content": "42"}, "stop"), 'data: {"choices": [], "usage": ' + _ODD_USAGE + "}"])
    else:
        server.reply(
            body='{"choices": [{"index": 0, "message": {"role": "assistant", "content": "42"}, '
            '"finish_reason": "stop"}], "usage": ' + _ODD_USAGE + "}"
        )
    client, _ = provider(server, stream=stream)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert message["_meta"] == {"finish_reason": "stop", "usage": _CLEAN_USAGE}
    assert is_lossless(message)
    assert math.copysign(1.0, message["_meta"]["usage"]["zero"]) == 1.0


def test_usage_nested_too_deep_to_copy_is_left_out() -> None:
    from dsh_plugins.providers.openai_compat import _meta

    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    assert _meta("stop", {"x": deep}) == {"finish_reason": "stop"}
    assert _meta(float("nan"), {"x": deep}) == {}


async def test_a_run_with_odd_numbers_in_usage_and_arguments_is_recorded_and_answers(
    server: FakeServer, tmp_path: Path
) -> None:
    # A NaN in usage failed the run when the assistant message was recorded; a NaN in an arguments
    # object reaches the loop as JSON text, which tells the model its arguments are not valid JSON.
    server.reply(
        body='{"choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": '
        '[{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '
        '{"a": NaN, "b": 1}}}]}, "finish_reason": "tool_calls"}], "usage": {"cost": NaN}}'
    )
    server.reply(
        body='{"choices": [{"index": 0, "message": {"role": "assistant", "content": "42"}, '
        '"finish_reason": "stop"}], "usage": {"cost": Infinity, "total_tokens": 8}}'
    )
    deployment = compose(
        [
            (
                "test",
                {
                    "sessions": {"home": str(tmp_path / "home")},
                    "agents": [{"id": "main", "provider": "openai"}],
                    "plugins": [
                        {"id": "tools", "use": "tools"},
                        {"id": "sessions", "use": "sqlite-sessions"},
                        {"id": "openai", "use": "openai", "config": {"base_url": server.url, "model": "m"}},
                    ],
                },
            )
        ],
        env={},
    )
    harness = await Harness.start(
        deployment, catalog=PluginCatalog(extra={"tools": lambda s, c: AddTool()}, strict=True)
    )
    try:
        result = await run_agent(harness, "2+40?")
    finally:
        await harness.aclose()
    assert result.ok and result.answer == "42", result.error
    tool_reply = server.requests[1]["body"]["messages"][-1]
    assert tool_reply["role"] == "tool" and "not valid JSON" in tool_reply["content"]
    assert "NaN" in tool_reply["content"]


async def test_a_resumed_session_sends_a_silent_answer_as_empty_text(server: FakeServer, tmp_path: Path) -> None:
    # A model that said nothing (finish_reason "length") ends the run with content null and no tool calls.
    # Ollama, llama.cpp and Azure refuse such an assistant message, so resuming the session always failed.
    server.reply(body=completion(None, finish="length"))
    server.reply(body=completion("ok"))
    deployment = compose(
        [
            (
                "test",
                {
                    "sessions": {"home": str(tmp_path / "home")},
                    "agents": [{"id": "main", "provider": "openai"}],
                    "plugins": [
                        {"id": "sessions", "use": "sqlite-sessions"},
                        {"id": "openai", "use": "openai", "config": {"base_url": server.url, "model": "m"}},
                    ],
                },
            )
        ],
        env={},
    )
    harness = await Harness.start(deployment, catalog=PluginCatalog(strict=True))
    try:
        first = await run_agent(harness, "hi")
        assert first.ok and first.answer == ""
        second = await run_agent(harness, "again", session_id=first.session_id)
        assert second.ok and second.answer == "ok", second.error
    finally:
        await harness.aclose()
    sent = server.requests[1]["body"]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[2] == {"role": "assistant", "content": ""}


async def test_a_streaming_request_asks_for_usage_and_the_run_records_it(server: FakeServer, tmp_path: Path) -> None:
    # OpenAI and vLLM send usage in a stream only with stream_options.include_usage, as a last chunk
    # with no choices (every other chunk has "usage": null, as vLLM sends it).
    server.stream(
        [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "4"}}], "usage": None},
            {"choices": [{"index": 0, "delta": {"content": "2"}, "finish_reason": "stop"}], "usage": None},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
        ]
    )
    deployment = compose(
        [
            (
                "test",
                {
                    "sessions": {"home": str(tmp_path / "home")},
                    "agents": [{"id": "main", "provider": "openai"}],
                    "plugins": [
                        {"id": "sessions", "use": "sqlite-sessions"},
                        {
                            "id": "openai",
                            "use": "openai",
                            "config": {"base_url": server.url, "model": "m", "stream": True},
                        },
                    ],
                },
            )
        ],
        env={},
    )
    harness = await Harness.start(deployment, catalog=PluginCatalog(strict=True))
    try:
        result = await run_agent(harness, "6*7?")
        assert result.ok and result.answer == "42", result.error
        store = open_session_store(harness)
        try:
            assert result.session_id is not None
            events = await store.load(result.session_id)
        finally:
            await store.close()
    finally:
        await harness.aclose()
    body = server.requests[0]["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    (assistant,) = [event for event in events if event.kind == "message/assistant"]
    assert assistant.payload["meta"] == {
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


@pytest.mark.parametrize(
    ("options", "sent"),
    [
        ({}, None),  # not streaming: no stream_options
        ({"stream": True, "stream_usage": False}, None),  # a server that rejects the field
        (
            {"stream": True, "extra_body": {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}},
            {"include_usage": True, "continuous_usage_stats": True},
        ),  # extra_body replaces it
    ],
)
async def test_stream_options_can_be_left_out_or_replaced(
    server: FakeServer, options: dict[str, Any], sent: Any
) -> None:
    if options.get("stream"):
        server.stream([delta_chunk({"content": "ok"}, "stop")])
    else:
        server.reply(body=completion("ok"))
    client, _ = provider(server, **options)
    try:
        await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert server.requests[0]["body"].get("stream_options") == sent


async def test_stream_usage_is_a_config_option() -> None:
    from dsh_core.errors import ConfigError
    from dsh_core.testing.loader import check_config

    check_config("openai", plugin, {"base_url": "http://x/v1", "stream": True, "stream_usage": False})
    with pytest.raises(ConfigError, match="stream_usage"):
        check_config("openai", plugin, {"base_url": "http://x/v1", "stream_usage": "no"})
    scope = Scope("plugin:openai")
    try:
        assert plugin(scope, {"base_url": "http://x/v1", "stream_usage": False}).provider.stream_usage is False
    finally:
        await scope.dispose()


async def test_credentials_in_the_base_url_never_reach_a_message(server: FakeServer) -> None:
    """A base_url may carry a user and password; errors reach stderr, logs and the session."""
    server.reply(401, "no")
    host = server.url.removeprefix("http://")
    client = OpenAICompatProvider(
        base_url=f"http://user:hunter2@{host}/",
        model="m1",
        api_key_env="TEST_KEY",
        env={"TEST_KEY": SECRET},
        backoff_base_s=0.01,
    )
    try:
        with pytest.raises(ProviderError) as caught:
            await client.complete([{"role": "user", "content": "x"}], [])
        assert "hunter2" not in caught.value.message and "user:" not in caught.value.message
        assert f"http://***@{host}/chat/completions" in caught.value.message
        assert "hunter2" not in repr(client)
    finally:
        await client.aclose()
    unreachable = OpenAICompatProvider(
        base_url="http://user:hunter2@127.0.0.1:9/", model="m1", max_retries=0, env={}, backoff_base_s=0.01
    )
    try:
        with pytest.raises(ProviderError) as caught:
            await unreachable.complete([{"role": "user", "content": "x"}], [])
        assert "hunter2" not in caught.value.message, caught.value.message
    finally:
        await unreachable.aclose()


@pytest.mark.parametrize("separator", ["\n", "\r\n", "\r"])
async def test_a_stream_splits_lines_only_where_server_sent_events_do(server: FakeServer, separator: str) -> None:
    # JSON text may hold U+2028, U+2029, U+0085, form feeds and the like unescaped (servers that write
    # UTF-8 do), and SSE ends a line only at CR, LF or CRLF: splitting as str.splitlines does cut such a
    # chunk in two, and the run failed with "a stream chunk is not JSON".
    text = "a\u2028b\u2029c\x85d\x0ce\x1cf\x1dg\x1eh\x0bi"
    events = [
        "data: " + json.dumps(delta_chunk({"content": text}), ensure_ascii=False),
        "data: " + json.dumps(delta_chunk({}, "stop")),
    ]
    server.responses.append(
        (200, {"Content-Type": "text/event-stream"}, ("sse", [event.replace("\n", separator) for event in events]))
    )
    client, _ = provider(server, stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert message["content"] == text and message["_meta"] == {"finish_reason": "stop"}


async def test_a_byte_order_mark_opening_a_stream_is_ignored(server: FakeServer) -> None:
    # The SSE spec: one leading U+FEFF is ignored. Read as part of the first line, it made that
    # line's field "\ufeffdata", no SSE field, and the first chunk (here all the text) was lost.
    events = [
        "\ufeffdata: " + json.dumps(delta_chunk({"content": "hello"})),
        "data: " + json.dumps(delta_chunk({}, "stop")),
    ]
    server.responses.append((200, {"Content-Type": "text/event-stream"}, ("sse", events)))
    client, _ = provider(server, stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert message["content"] == "hello"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_byte_order_mark_opening_a_plain_completion_is_ignored(server: FakeServer, stream: bool) -> None:
    # RFC 8259 lets a parser ignore it. A streaming request answered with a plain completion dropped
    # it (read as an event stream), the same completion answering a plain request failed as not JSON.
    server.reply(body="\ufeff" + json.dumps(completion("hello")), headers={"Content-Type": "application/json"})
    client, _ = provider(server, stream=stream)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert message["content"] == "hello"


async def test_a_plain_completion_keeps_line_separators_in_its_strings(server: FakeServer) -> None:
    # The same for a plain completion answering a streaming request: it is read line by line too.
    server.reply(body=json.dumps(completion("one\u2028two\x85three"), ensure_ascii=False))
    client, _ = provider(server, stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert message["content"] == "one\u2028two\x85three"


class _Endless:
    """A response body that never ends (``head``, then ``x`` forever, in lines if ``head`` ends one).

    ``sent`` counts the bytes given out.
    """

    def __init__(self, head: bytes) -> None:
        self.head = head
        self.sent = 0

    async def __aiter__(self) -> Any:
        yield self.head
        unit = b"x" * 65535 + (b"\n" if self.head.endswith(b"\n") else b"x")
        while True:
            self.sent += len(unit)
            yield unit


@pytest.mark.parametrize(
    ("stream", "status", "head", "kind", "text"),
    [
        (False, 200, b'{"choices": "', "malformed-response", "the response is larger than 1 MiB"),
        (False, 500, b'{"error": "', "server", "HTTP 500"),
        (True, 500, b'{"error": "', "server", "HTTP 500"),
        # A line with no end is held until the limit on streams; lines of a plain body, to the limit on those.
        (True, 200, b'{"choices": "', "malformed-response", "the response is larger than 2 MiB"),
        (True, 200, b'{"choices": "\n', "malformed-response", "not an event stream and is larger than 1 MiB"),
        (True, 200, b'data: {"choices": "', "malformed-response", "the response is larger than 2 MiB"),
        (True, 200, b": keep-alive\n" * 100_000, "malformed-response", "the response is larger than 2 MiB"),
    ],
)
async def test_an_endless_body_is_read_only_up_to_a_limit(
    monkeypatch: pytest.MonkeyPatch, stream: bool, status: int, head: bytes, kind: str, text: str
) -> None:
    # A hostile or broken server could send gigabytes: every byte was read (or held) before anything failed.
    import httpx

    from dsh_plugins.providers import openai_compat

    monkeypatch.setattr(openai_compat, "_MAX_PLAIN_BODY", 2**20)
    monkeypatch.setattr(openai_compat, "_MAX_STREAM_BYTES", 2 * 2**20)
    body = _Endless(head)
    content_type = "text/event-stream" if head.startswith((b"data", b":")) else "application/json"
    transport = httpx.MockTransport(
        lambda request: httpx.Response(status, headers={"Content-Type": content_type}, content=body)
    )
    client = OpenAICompatProvider(
        base_url="http://model.invalid/v1", model="m", stream=stream, transport=transport, max_retries=0
    )
    try:
        with pytest.raises(ProviderError) as caught:
            await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert caught.value.kind == kind and text in caught.value.message
    assert len(caught.value.message) < 600
    assert body.sent <= 3 * 2**20


REFUSAL = "I'm sorry, I can't help with that."


def _mock_client(responses: list[Any], **options: Any) -> tuple[OpenAICompatProvider, list[float]]:
    """A provider answering each request with the next of ``responses`` (a JSON body, or a list of SSE chunks)."""
    import httpx

    queue = list(responses)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    def answer(request: httpx.Request) -> httpx.Response:
        response = queue.pop(0)
        if isinstance(response, httpx.Response):
            return response
        if isinstance(response, list):
            events = "".join(
                f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n" for chunk in response
            )
            return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, content=events.encode())
        return httpx.Response(200, json=response)

    client = OpenAICompatProvider(
        base_url="http://model.invalid/v1",
        model="m",
        transport=httpx.MockTransport(answer),
        backoff_base_s=0.01,
        sleep=sleep,
        **options,
    )
    return client, slept


@pytest.mark.parametrize(
    ("content", "expected"), [(None, REFUSAL), ("", REFUSAL), ("Here is the JSON.", "Here is the JSON.")]
)
async def test_a_refusal_is_the_answer_when_there_is_no_content(content: str | None, expected: str) -> None:
    # With a JSON-schema response_format, OpenAI puts a refusal in message.refusal and leaves content null:
    # the run ended with an empty answer, exit 0, and nothing said the model had refused.
    body = completion(content)
    body["choices"][0]["message"]["refusal"] = REFUSAL
    client, _ = _mock_client([body])
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert message["content"] == expected
    assert message["_meta"] == {
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        "refusal": True,
    }


@pytest.mark.parametrize("refusal", [None, ""])
async def test_a_null_or_empty_refusal_is_no_refusal(refusal: str | None) -> None:
    body = completion("fine")
    body["choices"][0]["message"]["refusal"] = refusal
    client, _ = _mock_client([body, [delta_chunk({"content": "fine", "refusal": refusal}, "stop")]])
    try:
        plain = await client.complete([{"role": "user", "content": "x"}], [])
        client.stream = True
        streamed = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert plain["content"] == streamed["content"] == "fine"
    assert "refusal" not in plain["_meta"] and "refusal" not in streamed["_meta"]


async def test_a_streamed_refusal_is_shown_and_is_the_answer() -> None:
    chunks = [
        delta_chunk({"role": "assistant", "content": None, "refusal": ""}),
        delta_chunk({"refusal": "I'm sorry, "}),
        delta_chunk({"refusal": "I can't help with that."}),
        delta_chunk({}, "stop"),
    ]
    fragments: list[str] = []

    async def on_text(text: str) -> None:
        fragments.append(text)

    client, _ = _mock_client([chunks], stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [], on_text=on_text)
    finally:
        await client.aclose()
    assert fragments == ["I'm sorry, ", "I can't help with that."]
    assert message["content"] == REFUSAL
    assert message["_meta"] == {"finish_reason": "stop", "refusal": True}


def _refusing_deployment(server: FakeServer, tmp_path: Path, stream: bool) -> dict[str, Any]:
    return {
        "sessions": {"home": str(tmp_path / "home")},
        "agents": [{"id": "main", "provider": "openai"}],
        "plugins": [
            {"id": "sessions", "use": "sqlite-sessions"},
            {"id": "openai", "use": "openai", "config": {"base_url": server.url, "model": "m", "stream": stream}},
        ],
    }


def _queue_refusal(server: FakeServer, stream: bool) -> None:
    if stream:
        server.stream(
            [delta_chunk({"role": "assistant", "content": None, "refusal": REFUSAL}), delta_chunk({}, "stop")]
        )
    else:
        body = completion(None)
        body["choices"][0]["message"]["refusal"] = REFUSAL
        server.reply(body=body)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refusal_ends_the_run_with_it_as_the_answer_and_the_session_keeps_it(
    server: FakeServer, tmp_path: Path, stream: bool
) -> None:
    _queue_refusal(server, stream)
    deployment = compose([("test", _refusing_deployment(server, tmp_path, stream))], env={})
    harness = await Harness.start(deployment, catalog=PluginCatalog(strict=True))
    try:
        result = await run_agent(harness, "extract the fields")
        store = open_session_store(harness)
        try:
            assert result.session_id is not None
            events = await store.load(result.session_id)
        finally:
            await store.close()
    finally:
        await harness.aclose()
    assert result.ok and result.answer == REFUSAL and result.refusal, result.error
    (assistant,) = [event for event in events if event.kind == "message/assistant"]
    assert assistant.payload["message"] == {"role": "assistant", "content": REFUSAL}
    assert assistant.payload["meta"]["refusal"] is True


@pytest.mark.parametrize("stream", [False, True])
async def test_dsh_p_prints_a_refusal_with_a_warning(server: FakeServer, tmp_path: Path, stream: bool) -> None:
    import os
    import subprocess
    import sys

    import anyio

    _queue_refusal(server, stream)
    path = tmp_path / "dsh.toml"
    # JSON strings and booleans are TOML ones too.
    path.write_text(f"""
[sessions]
home = {json.dumps(str(tmp_path / "home"))}

[[agents]]
id = "main"
provider = "openai"

[[plugins]]
id = "sessions"
use = "sqlite-sessions"

[[plugins]]
id = "openai"
use = "openai"
config = {{ base_url = {json.dumps(server.url)}, model = "m", stream = {json.dumps(stream)} }}
""")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    done = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "dsh_core", "--config", str(path), "-p", "extract the fields"],
            cwd=tmp_path,
            env=environ,
            text=True,
            capture_output=True,
            timeout=60,
            check=False,
        )
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == REFUSAL + "\n"
    assert done.stderr == "dsh: warning: the model refused; the answer is its refusal\n"


ANSWER_CHUNKS = [delta_chunk({"role": "assistant", "content": "4"}), delta_chunk({"content": "2"}, "stop")]


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ({"message": "Rate limit reached", "code": 429}, "rate-limited"),
        ({"message": "Provider returned error", "code": "502"}, "server"),
        ({"message": "Overloaded", "type": "overloaded_error"}, "server"),
        ({"message": "The server had an error while processing your request.", "type": "server_error"}, "server"),
        ("overloaded", "server"),
    ],
)
@pytest.mark.parametrize("role_first", [False, True])
async def test_an_error_event_before_anything_was_received_is_retried_as_a_failed_request(
    error: Any, kind: str, role_first: bool
) -> None:
    # The request failed before any of the answer came (a role-only delta carries none of it): nothing was
    # shown, so it is retried as a 429/5xx response is. It failed the run at once.
    failed = ([delta_chunk({"role": "assistant"})] if role_first else []) + [{"error": error}]
    fragments: list[str] = []

    async def on_text(text: str) -> None:
        fragments.append(text)

    client, slept = _mock_client([failed, ANSWER_CHUNKS], stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [], on_text=on_text)
    finally:
        await client.aclose()
    assert message["content"] == "42" and fragments == ["4", "2"]
    assert client.last_attempts == 2 and len(slept) == 1

    client, slept = _mock_client([failed] * 3, stream=True, max_retries=2)
    try:
        with pytest.raises(ProviderError) as caught:
            await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert caught.value.kind == kind and "(gave up after 3 attempts)" in caught.value.message
    assert "mid-stream" in caught.value.message and len(slept) == 2


@pytest.mark.parametrize(
    "received",
    [
        delta_chunk({"content": "The answer is "}),
        delta_chunk({"refusal": "I'm sorry"}),
        delta_chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "add", "arguments": ""}}]}),
    ],
)
async def test_an_error_event_after_part_of_the_answer_is_not_retried(received: dict[str, Any]) -> None:
    # Part of the answer was received (text shown through on_text): a retry would show it again.
    client, slept = _mock_client(
        [[received, {"error": {"message": "Overloaded", "code": 503}}], ANSWER_CHUNKS], stream=True
    )
    try:
        with pytest.raises(ProviderError) as caught:
            await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert caught.value.kind == "http" and "mid-stream: Overloaded" in caught.value.message
    assert client.last_attempts == 1 and slept == []


@pytest.mark.parametrize(
    ("error", "kind", "text"),
    [
        ({"message": "model crashed"}, "http", "mid-stream: model crashed"),
        ({"message": "bad request", "code": 400}, "http", "mid-stream error 400: bad request"),
        (
            {"message": "This model's maximum context length is 8192 tokens", "code": 400},
            "context-length",
            "the conversation is too long for model 'm' (mid-stream error 400)",
        ),
        ("something went wrong", "http", "mid-stream: something went wrong"),
    ],
)
async def test_an_error_event_that_is_not_worth_retrying_is_not_retried(error: Any, kind: str, text: str) -> None:
    client, slept = _mock_client([[{"error": error}], ANSWER_CHUNKS], stream=True)
    try:
        with pytest.raises(ProviderError) as caught:
            await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert caught.value.kind == kind and text in caught.value.message, caught.value.message
    assert client.last_attempts == 1 and slept == []


async def test_a_null_error_in_a_stream_chunk_is_no_error() -> None:
    # Some servers send "error": null in every chunk: the first one failed the request.
    chunks = [{**chunk, "error": None} for chunk in ANSWER_CHUNKS]
    client, _ = _mock_client([chunks], stream=True)
    try:
        message = await client.complete([{"role": "user", "content": "x"}], [])
    finally:
        await client.aclose()
    assert message["content"] == "42" and client.last_attempts == 1

"""A loopback fake of an OpenAI-compatible server: scripted responses, recorded requests."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


class FakeServer:
    """Answers each POST with the next queued response and records what it received."""

    def __init__(self) -> None:
        self.responses: list[tuple[int, dict[str, str], Any]] = []
        self.requests: list[dict[str, Any]] = []
        self.url = ""

    def reply(self, status: int = 200, body: Any = None, headers: dict[str, str] | None = None) -> None:
        """Queue a JSON (or raw text) response."""
        self.responses.append((status, headers or {}, body))

    def stream(self, chunks: list[Any], *, done: bool = True) -> None:
        """Queue an SSE response of ``chunks`` (objects become ``data: <json>``)."""
        events = [c if isinstance(c, str) else "data: " + json.dumps(c) for c in chunks]
        if done:
            events.append("data: [DONE]")
        self.responses.append((200, {"Content-Type": "text/event-stream"}, ("sse", events)))


def completion(
    content: str | None = None, tool_calls: list[dict[str, Any]] | None = None, finish: str = "stop"
) -> dict[str, Any]:
    """A chat.completion response body."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            raw = self.rfile.read(length)
            fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(raw)})
            if not fake.responses:
                self.send_response(500)
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "no response queued"}}')
                return
            status, headers, body = fake.responses.pop(0)
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if isinstance(body, tuple) and body[0] == "sse":
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                for event in body[1]:
                    self.wfile.write((event + "\n\n").encode())
                    self.wfile.flush()
                return
            payload = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        yield fake
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)

"""dsh-http-fetch through the dsh pipeline, against a local server on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from dsh_http_fetch import host_allowed, html_to_text

from dsh_core import AbortController
from dsh_core.config import compose
from dsh_core.harness import Harness
from dsh_core.model import ToolResult
from dsh_core.plugins import PluginCatalog
from dsh_core.testing import ToolPluginConformance

PAGE = b"""<!doctype html><html><head><title>Hello  page</title><style>body{color:red}</style>
<script>alert('x')</script></head><body><h1>Welcome</h1><p>First   paragraph
with <b>bold</b> text.</p><ul><li>one</li><li>two</li></ul></body></html>"""


class Handler(BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass

    def send(self, status: int, body: bytes, content_type: str = "text/html; charset=utf-8",
             headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        Handler.hits.append(self.path)
        port = self.server.server_address[1]
        if self.path == "/page":
            self.send(200, PAGE)
        elif self.path == "/plain":
            self.send(200, b"just text", "text/plain")
        elif self.path == "/redirect-in":
            self.send(302, b"", headers={"Location": "/plain"})
        elif self.path == "/redirect-out":
            self.send(302, b"", headers={"Location": f"http://localhost:{port}/plain"})
        elif self.path == "/loop":
            self.send(302, b"", headers={"Location": "/loop"})
        elif self.path == "/big":
            self.send(200, b"a" * 100_000, "text/plain")
        elif self.path == "/image":
            self.send(200, b"\x89PNG", "image/png")
        elif self.path == "/drip":
            # Each byte arrives well within httpx's per-read timeout; the whole body takes 20 s.
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "100")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass  # the client gave up
        elif self.path == "/slow":
            time.sleep(2)
            self.send(200, b"late", "text/plain")
        else:
            self.send(404, b"<p>no such page</p>")


@pytest.fixture
def server() -> Iterator[str]:
    """A local HTTP server on 127.0.0.1; yields its host:port."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    Handler.hits.clear()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def run(server: str, scenario: Callable[[Harness], Awaitable[Any]], **config: Any) -> Any:
    row = {"id": "web", "use": "http-fetch", "config": {"allowed_hosts": [server], **config}}

    async def main() -> Any:
        deployment = compose([("test", {"plugins": [row]})], env={})
        harness = await Harness.start(deployment, catalog=PluginCatalog(strict=True))
        try:
            return await scenario(harness)
        finally:
            await harness.aclose()

    return asyncio.run(main())


def fetch(server: str, url: str, **config: Any) -> ToolResult:
    result: ToolResult = run(server, lambda h: h.call("fetch", {"url": url}), **config)
    return result


def test_html_is_extracted_to_text(server: str) -> None:
    result = fetch(server, f"http://{server}/page")
    assert result.value == {"url": f"http://{server}/page", "status": 200, "content_type": "text/html",
                            "title": "Hello page", "text": "Welcome\nFirst paragraph with bold text.\none\ntwo",
                            "truncated": False}
    assert "# Hello page" in result.text
    raw: ToolResult = run(server, lambda h: h.call("fetch", {"url": f"http://{server}/page", "raw": True}))
    assert "<script>" in raw.value["text"]


def test_redirects_inside_the_allow_list_are_followed(server: str) -> None:
    result = fetch(server, f"http://{server}/redirect-in")
    assert result.value["url"] == f"http://{server}/plain" and result.value["text"] == "just text"


def test_a_redirect_to_a_host_outside_the_allow_list_is_refused_before_the_request(server: str) -> None:
    result = fetch(server, f"http://{server}/redirect-out")
    assert result.code == "TOOL_FAILED"
    port = server.split(":")[1]
    assert (f"redirect from http://{server}/redirect-out to http://localhost:{port}/plain refused: "
            "host 'localhost' is not in the allowed hosts") in result.text
    assert Handler.hits == ["/redirect-out"]


@pytest.mark.parametrize(("url", "message"), [
    ("http://example.com/", "host 'example.com' is not in the allowed hosts"),
    ("http://127.0.0.1:1/", "host '127.0.0.1' is not in the allowed hosts"),  # other port
    ("file:///etc/passwd", "only http and https URLs can be fetched, not 'file'"),
    ("not a url", "only http and https URLs can be fetched"),
])
def test_urls_outside_the_allow_list_are_refused(server: str, url: str, message: str) -> None:
    result = fetch(server, url)
    assert result.code == "TOOL_FAILED" and message in result.text
    assert Handler.hits == []


def test_size_cap_redirect_loop_binary_and_errors(server: str) -> None:
    big = fetch(server, f"http://{server}/big", max_bytes=2048)
    assert big.value["truncated"] is True and len(big.value["text"]) == 2048
    loop = fetch(server, f"http://{server}/loop", max_redirects=2)
    assert "more than 2 redirects" in loop.text
    image = fetch(server, f"http://{server}/image")
    assert "is image/png, not text" in image.text
    missing = fetch(server, f"http://{server}/missing")
    assert missing.code == "TOOL_FAILED" and "HTTP 404 Not Found" in missing.text and "no such page" in missing.text


def test_timeouts_and_aborts_are_honoured(server: str) -> None:
    started = time.monotonic()
    slow = fetch(server, f"http://{server}/slow", timeout_s=0.3)
    assert "timed out after 0.3 s" in slow.text and time.monotonic() - started < 2

    async def scenario(harness: Harness) -> tuple[ToolResult, float]:
        controller = AbortController()
        asyncio.get_running_loop().call_later(0.2, controller.abort, "stop")
        begun = time.monotonic()
        result = await harness.call("fetch", {"url": f"http://{server}/slow"}, signal=controller.signal)
        return result, time.monotonic() - begun

    result, elapsed = run(server, scenario)
    assert result.code == "ABORTED" and elapsed < 1.5


def test_the_timeout_bounds_the_whole_request_not_each_read(server: str) -> None:
    started = time.monotonic()
    result = fetch(server, f"http://{server}/drip", timeout_s=1)
    elapsed = time.monotonic() - started
    assert result.code == "TOOL_FAILED" and elapsed < 3
    assert f"fetching http://{server}/drip timed out after 1 s (timeout_s bounds the whole request" in result.text


def test_ipv6_allow_list_entries_are_parsed_with_brackets() -> None:
    import httpx
    from dsh_http_fetch import parse_host_entry

    assert parse_host_entry("::1") == ("::1", "")
    assert parse_host_entry("[::1]") == ("::1", "")
    assert parse_host_entry("[::1]:8080") == ("::1", "8080")
    assert parse_host_entry("[FE80::1]:443") == ("fe80::1", "443")
    assert parse_host_entry("h:8080") == ("h", "8080")
    assert parse_host_entry("*.python.org") == ("*.python.org", "")
    for bad in ("[::1", "[::1]x", "[::1]:", "h:", "h:http", ":80"):
        with pytest.raises(ValueError, match="malformed allowed_hosts entry"):
            parse_host_entry(bad)
    assert host_allowed(httpx.URL("http://[::1]:8080/"), ["[::1]:8080"])
    assert not host_allowed(httpx.URL("http://[::1]:9090/"), ["[::1]:8080"])
    assert host_allowed(httpx.URL("http://[::1]:9090/"), ["::1"])
    assert host_allowed(httpx.URL("https://[::1]/"), ["[::1]"])
    assert not host_allowed(httpx.URL("http://[::2]/"), ["::1"])


def test_an_ipv6_entry_is_enforced_through_the_pipeline(server: str) -> None:
    """A bracketed IPv6 entry loads, allows nothing else, and a malformed one refuses to load."""
    result = run(server, lambda h: h.call("fetch", {"url": f"http://{server}/plain"}),
                 allowed_hosts=["[::1]:8080", server])
    assert result.value["text"] == "just text"
    refused = run(server, lambda h: h.call("fetch", {"url": "http://[::1]:9090/"}), allowed_hosts=["[::1]:8080"])
    assert refused.code == "TOOL_FAILED" and "host '::1' is not in the allowed hosts" in refused.text
    with pytest.raises(Exception, match="malformed allowed_hosts entry"):
        run(server, lambda h: h.call("fetch", {"url": f"http://{server}/plain"}), allowed_hosts=["[::1"])


def test_helpers() -> None:
    import httpx

    assert host_allowed(httpx.URL("https://docs.python.org/3/"), ["*.python.org"])
    assert not host_allowed(httpx.URL("https://python.org.evil.com/"), ["*.python.org"])
    assert host_allowed(httpx.URL("http://h:8080/"), ["h:8080"])
    assert not host_allowed(httpx.URL("http://h/"), ["h:8080"])
    assert html_to_text("<p>a&amp;b</p><br>c") == (None, "a&b\nc")


class TestHttpFetchConformance(ToolPluginConformance):
    """The dsh conformance kit; the example fetches from the local server."""

    plugin_name = "http-fetch"

    @pytest.fixture
    def plugin_config(self, server: str, tmp_path: Path) -> dict[str, Any]:
        return {"allowed_hosts": [server], "example_url": f"http://{server}/page"}

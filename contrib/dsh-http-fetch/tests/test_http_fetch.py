"""dsh-http-fetch through the dsh pipeline, against a local server on 127.0.0.1 only.

Connecting to 127.0.0.1 needs ``allowed_addresses`` (the plugin connects only to
public addresses by default), so the tests opt in explicitly. Host names other
than IP literals are answered by a fake resolver (the ``dns`` fixture), and a
guard fails any connection that is not to 127.0.0.1: nothing reaches the
internet, whatever the code under test does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import ipaddress
import logging
import math
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar
from urllib.parse import parse_qs, quote, urlsplit

import dsh_http_fetch
import httpcore
import pytest
from dsh_http_fetch import address_refusal, host_allowed, html_to_text, parse_address_entry

from dsh_core import AbortController, AbortSignal, ToolError
from dsh_core.config import compose
from dsh_core.harness import Harness
from dsh_core.model import ToolResult
from dsh_core.plugins import PluginCatalog
from dsh_core.testing import ToolPluginConformance

PAGE = b"""<!doctype html><html><head><title>Hello  page</title><style>body{color:red}</style>
<script>alert('x')</script></head><body><h1>Welcome</h1><p>First   paragraph
with <b>bold</b> text.</p><ul><li>one</li><li>two</li></ul></body></html>"""

LT_FLOOD = 1_500_000  # "< " pairs of /lt-flood: 3 MB, ~4 s for html.parser

TEXT = "Grüße, plain text that compresses: ".encode() + b"la " * 1000


def _raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


# /encoded/<name>: TEXT (or what is named) served with a Content-Encoding.
ENCODED: dict[str, tuple[str, bytes]] = {
    "gzip": ("gzip", gzip.compress(TEXT)),
    "x-gzip": ("x-gzip", gzip.compress(TEXT)),
    "gzip-members": ("gzip", gzip.compress(TEXT[:50]) + gzip.compress(TEXT[50:])),  # one file, two members
    "gzip-trailing": ("gzip", gzip.compress(TEXT) + b"\r\njunk"),  # after a whole member: ignored
    "deflate-trailing": ("deflate", zlib.compress(TEXT) + b"\r\njunk"),
    "deflate-zlib": ("deflate", zlib.compress(TEXT)),  # what RFC 9110 says deflate is
    "deflate-raw": ("deflate", _raw_deflate(TEXT)),  # what some servers send instead
    "stacked": ("deflate, GZIP", gzip.compress(zlib.compress(TEXT))),  # deflated, then gzipped
    "identity": ("identity", TEXT),
    "empty-gzip": ("gzip", b""),
    "br": ("br", b"\x8b\x02\x80hello\x03"),
    "zstd": ("zstd", b"(\xb5/\xfd hello"),
    "unknown": ("gzip, x-squash", gzip.compress(TEXT)),
    "too-many": ("gzip, gzip, gzip, gzip", gzip.compress(gzip.compress(gzip.compress(gzip.compress(TEXT))))),
    "corrupt-gzip": ("gzip", b"\x1f\x8b\x08\x00" + b"not really gzip at all" * 10),
    "corrupt-deflate": ("deflate", b"\xff\xff\xff\xff garbage"),
    "cut-gzip": ("gzip", gzip.compress(TEXT)[:-6]),  # the stream stops before its trailer
    # Raw bytes that decode to (almost) nothing: would be read until the timeout, however long the body.
    "empty-members": ("gzip", gzip.compress(b"") * 200_000),
    "endless-trailer": ("deflate", zlib.compress(b"short") + b"\0" * 4_000_000),
    # The same inside an outer coding, which compresses them a thousandfold: a few KiB of raw bytes, so the
    # raw count alone let the inner coding churn through megabytes (gigabytes, three codings deep) in one go.
    "stacked-empty-members": ("gzip, gzip", gzip.compress(gzip.compress(b"", mtime=0) * 400_000)),
    "stacked-endless-trailer": ("deflate, gzip", gzip.compress(zlib.compress(b"short") + b"\0" * 4_000_000)),
}


@functools.cache
def gzip_bomb() -> bytes:
    """64 MiB of one repeated byte, gzipped to about 64 KiB: one or two reads off the socket."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"a" * (1 << 20)
    return b"".join(compressor.compress(block) for _ in range(64)) + compressor.flush()


class Handler(BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []
    host_headers: ClassVar[list[str]] = []
    accept_encodings: ClassVar[list[str | None]] = []
    accepts: ClassVar[list[str | None]] = []
    # /hold: how many requests are in the handler at once, and the most there ever were.
    holding: ClassVar[int] = 0
    most_held: ClassVar[int] = 0
    hold_lock: ClassVar[threading.Lock] = threading.Lock()

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass

    def send(
        self,
        status: int,
        body: bytes,
        content_type: str = "text/html; charset=utf-8",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        Handler.hits.append(self.path)
        Handler.host_headers.append(self.headers.get("Host", ""))
        Handler.accept_encodings.append(self.headers.get("Accept-Encoding"))
        Handler.accepts.append(self.headers.get("Accept"))
        port = self.server.server_address[1]
        target = parse_qs(urlsplit(self.path).query).get("url", [""])[0]
        if self.path == "/page" or self.path.startswith("/page?"):  # /page?anything: the same page
            self.send(200, PAGE)
        elif self.path == "/plain":
            self.send(200, b"just text", "text/plain")
        elif self.path == "/redirect-in":
            self.send(302, b"", headers={"Location": "/plain"})
        elif self.path == "/redirect-out":
            self.send(302, b"", headers={"Location": f"http://localhost:{port}/plain"})
        elif self.path.startswith("/to?"):
            self.send(302, b"", headers={"Location": target})
        elif self.path == "/loop":
            self.send(302, b"", headers={"Location": "/loop"})
        elif self.path == "/big":
            self.send(200, b"a" * 100_000, "text/plain")
        elif self.path.startswith("/encoded/"):
            encoding, body = ENCODED[self.path.removeprefix("/encoded/")]
            self.send(200, body, "text/plain; charset=utf-8", headers={"Content-Encoding": encoding})
        elif self.path == "/gone-br":
            self.send(410, b"\x8b\x02\x80gone\x03", headers={"Content-Encoding": "br"})
        elif self.path == "/bomb":
            self.send(200, gzip_bomb(), "text/plain", headers={"Content-Encoding": "gzip"})
        elif self.path.startswith("/typed/"):  # /typed/application/yaml: a short text document of that type
            self.send(200, "openapi: 3.1.0 # ü".encode(), self.path.removeprefix("/typed/"))
        elif self.path == "/image":
            self.send(200, b"\x89PNG", "image/png")
        elif self.path == "/gone-image":
            self.send(410, b"\x89PNG", "image/png")
        elif self.path == "/drip":
            # Each byte arrives well within httpx's per-read timeout; the whole body takes 100 s.
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "500")
            self.end_headers()
            try:
                for _ in range(500):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass  # the client gave up
        elif self.path.startswith("/charset/"):  # /charset/<name>: "Grüße" in UTF-8, declared as <name>
            self.send(200, "Grüße".encode(), f"text/plain; charset={self.path.removeprefix('/charset/')}")
        elif self.path.startswith("/bytes/"):  # /bytes/<name>/<hex>: those bytes, declared as <name>
            name, _, data = self.path.removeprefix("/bytes/").partition("/")
            self.send(200, bytes.fromhex(data), f"text/plain; charset={name}")
        elif self.path.startswith("/ascii/"):  # /ascii/<name>: ASCII text, declared as <name>
            self.send(200, b"The page-text", f"text/plain; charset={self.path.removeprefix('/ascii/')}")
        elif self.path.startswith("/bom/"):  # /bom/<codec>: "Grüße" with a byte order mark, declared as Latin-1
            codec = self.path.removeprefix("/bom/")
            self.send(200, "\ufeffGrüße".encode(codec), "text/html; charset=iso-8859-1")
        elif self.path == "/lt-flood":  # hostile HTML: every "<" is a separate step of html.parser
            self.send(200, b"< " * LT_FLOOD)
        elif self.path.startswith("/xml-encoding/"):  # encoding only in the XML declaration; /xml-encoding/<type>
            body = '<?xml version="1.0" encoding="ISO-8859-1"?>\n<rss><title>Grüße</title></rss>'.encode("latin-1")
            self.send(200, body, self.path.removeprefix("/xml-encoding/"))
        elif self.path.startswith("/meta-charset/"):  # charset only in the page; /meta-charset/<header charset>
            header = self.path.removeprefix("/meta-charset/")
            body = (
                '<html><head><meta http-equiv="Content-Type" content="text/html; charset=windows-1252">'
                "<title>Grüße</title></head><p>Grüße</p>"
            )
            self.send(200, body.encode("cp1252"), f"text/html; charset={header}" if header else "text/html")
        elif self.path.startswith("/hold"):  # /hold?n: held a moment, counting the requests held at once
            with Handler.hold_lock:
                Handler.holding += 1
                Handler.most_held = max(Handler.most_held, Handler.holding)
            time.sleep(0.3)
            with Handler.hold_lock:
                Handler.holding -= 1
            self.send(200, self.path.encode(), "text/plain")
        elif self.path == "/slow":
            time.sleep(60)  # far beyond what the tests allow a timed-out or aborted fetch (daemon threads)
            self.send(200, b"late", "text/plain")
        else:
            self.send(404, b"<p>no such page</p>")


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A page answered after the client gave up (/slow, past a test's timeout or abort) finds the
        # connection closed: expected, and not worth a traceback on the test run's stderr.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def server() -> Iterator[str]:
    """A local HTTP server on 127.0.0.1; yields its host:port."""
    httpd = _QuietServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    Handler.hits.clear()
    Handler.host_headers.clear()
    Handler.accept_encodings.clear()
    Handler.accepts.clear()
    Handler.holding = Handler.most_held = 0
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


class FakeDNS:
    """Answers for test host names, in order (the last one repeats); every lookup is recorded."""

    def __init__(self) -> None:
        self.records: dict[str, list[list[str]]] = {}
        self.lookups: list[str] = []

    def add(self, host: str, *answers: list[str]) -> None:
        self.records[host] = list(answers)

    async def resolve(self, host: str, port: int) -> list[str]:
        try:
            return [str(ipaddress.ip_address(host))]  # an IP literal is not looked up
        except ValueError:
            pass
        self.lookups.append(host)
        answers = self.records.get(host)
        if not answers:
            raise socket.gaierror(socket.EAI_NONAME, f"no test record for {host!r}")
        return answers.pop(0) if len(answers) > 1 else answers[0]


@pytest.fixture(autouse=True)
def connections(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The hosts httpcore's socket layer was asked to connect to; anything but 127.0.0.1 is refused."""
    opened: list[str] = []
    real = httpcore.AnyIOBackend.connect_tcp

    async def guarded(
        self: httpcore.AnyIOBackend, host: str, port: int, *args: Any, **kwargs: Any
    ) -> httpcore.AsyncNetworkStream:
        opened.append(host)
        if host != "127.0.0.1":
            raise httpcore.ConnectError(f"test guard: a connection to {host!r} was attempted")
        return await real(self, host, port, *args, **kwargs)

    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", guarded)
    return opened


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> FakeDNS:
    """Replaces the plugin's resolver: names resolve only to what a test says."""
    fake = FakeDNS()
    monkeypatch.setattr(dsh_http_fetch, "resolve", fake.resolve)
    return fake


def run(server: str, scenario: Callable[[Harness], Awaitable[Any]], **config: Any) -> Any:
    # The server is on loopback, which is refused unless allowed_addresses lists it.
    row = {
        "id": "web",
        "use": "http-fetch",
        "config": {"allowed_hosts": [server], "allowed_addresses": ["127.0.0.1"], **config},
    }

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
    assert result.value == {
        "url": f"http://{server}/page",
        "status": 200,
        "content_type": "text/html",
        "title": "Hello page",
        "text": "Welcome\nFirst paragraph with bold text.\none\ntwo",
        "truncated": False,
    }
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
    assert (
        f"redirect from http://{server}/redirect-out to http://localhost:{port}/plain refused: "
        "host 'localhost' is not in the allowed hosts"
    ) in result.text
    assert Handler.hits == ["/redirect-out"]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://example.com/", "host 'example.com' is not in the allowed hosts"),
        ("http://127.0.0.1:1/", "host '127.0.0.1' is not in the allowed hosts"),  # other port
        ("file:///etc/passwd", "only http and https URLs can be fetched, not 'file'"),
        ("not a url", "only http and https URLs can be fetched"),
    ],
)
def test_urls_outside_the_allow_list_are_refused(server: str, url: str, message: str) -> None:
    result = fetch(server, url)
    assert result.code == "TOOL_FAILED" and message in result.text
    assert Handler.hits == []


@pytest.mark.parametrize("port", ["65536", "99999999999", "-1"])
def test_a_port_outside_the_tcp_range_is_an_invalid_url(server: str, port: str) -> None:
    # httpx parses any integer as a port, and an entry without a port allows every port of its host: the
    # socket layer then raised OverflowError inside anyio's task group, reported as "ExceptionGroup: unhandled
    # errors in a TaskGroup (1 sub-exception)" and nothing else.
    url = f"http://127.0.0.1:{port}/"
    result = fetch(server, url, allowed_hosts=["127.0.0.1"])
    assert result.code == "TOOL_FAILED"
    assert f"invalid URL {url!r}: port {port} is not a TCP port (0 to 65535)" in result.text
    redirect = fetch(server, f"http://{server}/to?url={quote(url)}", allowed_hosts=[server, "127.0.0.1"])
    assert f"redirect from http://{server}/to?url=" in redirect.text and "is not a TCP port" in redirect.text


def test_a_host_that_is_not_valid_idna_is_an_invalid_url(server: str) -> None:
    # httpx parses an "xn--" label lazily: URL.host raises IDNAError, which escaped the URL check unexplained.
    bad = "http://xn--zz.example.com/"
    result = fetch(server, bad, allowed_hosts=[server, "*.example.com"])
    assert result.code == "TOOL_FAILED" and f"invalid URL {bad!r}" in result.text
    redirect = fetch(server, f"http://{server}/to?url={quote(bad)}", allowed_hosts=[server, "*.example.com"])
    assert redirect.code == "TOOL_FAILED"
    assert f"redirect from http://{server}/to?url=" in redirect.text and "invalid URL" in redirect.text


@pytest.mark.parametrize(
    "content_type",
    [
        "application/yaml",
        "application/x-yaml",
        "application/openapi+yaml",
        "application/toml",
        "application/ecmascript",
        "application/sql",
        "application/ld+json",
        "image/svg+xml",
        "text/markdown",
    ],
)
def test_text_formats_with_an_application_type_are_text(server: str, content_type: str) -> None:
    # YAML (RFC 9512: application/yaml and the +yaml suffix), TOML, SQL, ECMAScript: text, served as application/*.
    result = fetch(server, f"http://{server}/typed/{content_type}")
    assert result.code is None, result.text
    assert result.value["text"] == "openapi: 3.1.0 # ü" and result.value["content_type"] == content_type


def test_size_cap_redirect_loop_binary_and_errors(server: str) -> None:
    big = fetch(server, f"http://{server}/big", max_bytes=2048)
    assert big.value["truncated"] is True and len(big.value["text"]) == 2048
    loop = fetch(server, f"http://{server}/loop", max_redirects=2)
    assert "more than 2 redirects" in loop.text
    image = fetch(server, f"http://{server}/image")
    assert "is image/png, not text" in image.text
    gone = fetch(server, f"http://{server}/gone-image")  # an error status says more than its page's type
    assert gone.code == "TOOL_FAILED" and "HTTP 410 Gone for" in gone.text
    assert "(its body is image/png, not shown)" in gone.text
    missing = fetch(server, f"http://{server}/missing")
    assert missing.code == "TOOL_FAILED" and "HTTP 404 Not Found" in missing.text and "no such page" in missing.text


# --- Content-Encoding: decoded here, with the size cap applied while decoding ----------------------------------


def test_the_request_offers_only_the_encodings_the_plugin_decodes_itself(server: str) -> None:
    fetch(server, f"http://{server}/plain")
    assert Handler.accept_encodings == ["gzip, deflate, identity"]


def test_the_accept_header_is_a_valid_list_of_media_ranges(server: str) -> None:
    # "*/json" is no media range (RFC 9110, section 12.5.1: "*/*", "type/*" or "type/subtype"), and servers that
    # parse Accept strictly (Spring, for one) answer 406 Not Acceptable to it, whatever the page is.
    fetch(server, f"http://{server}/plain")
    (accept,) = Handler.accepts
    assert accept is not None
    ranges = [part.split(";")[0].strip() for part in accept.split(",")]
    for media in ranges:
        kind, slash, subtype = media.partition("/")
        assert kind and slash and subtype and (kind != "*" or subtype == "*"), f"{media!r} in Accept: {accept}"
    assert {"text/html", "application/json"} <= set(ranges)


@pytest.mark.parametrize(
    "name",
    [
        "gzip",
        "x-gzip",
        "gzip-members",
        "gzip-trailing",
        "deflate-zlib",
        "deflate-raw",
        "deflate-trailing",
        "stacked",
        "identity",
    ],
)
def test_compressed_bodies_are_decoded(server: str, name: str) -> None:
    result = fetch(server, f"http://{server}/encoded/{name}")
    assert result.value["text"] == TEXT.decode() and result.value["truncated"] is False


def test_an_empty_compressed_body_is_empty(server: str) -> None:
    result = fetch(server, f"http://{server}/encoded/empty-gzip")
    assert result.value["text"] == "" and result.value["truncated"] is False


def test_the_size_cap_counts_decoded_bytes(server: str) -> None:
    result = fetch(server, f"http://{server}/encoded/stacked", max_bytes=1024)
    assert result.value["truncated"] is True and result.value["text"].encode() == TEXT[:1024]


def test_a_gzip_bomb_is_cut_while_it_is_decoded_not_after(server: str) -> None:
    """64 MiB of gzip-compressed text arrives in one or two reads; it must never expand in memory beyond the cap.

    httpx's decoders turn each raw chunk into one decoded chunk, whatever its size, and a cap applied after
    that is too late: here a single 64 KiB read would be 64 MiB in memory before it was cut to 1 MiB.
    """
    gzip_bomb()  # built before the measurement

    async def scenario(harness: Harness) -> tuple[ToolResult, int]:
        tracemalloc.start()
        try:
            result = await harness.call("fetch", {"url": f"http://{server}/bomb"})
            return result, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    max_bytes = 1 << 20
    result, peak = run(server, scenario, max_bytes=max_bytes)
    assert result.value["truncated"] is True and result.value["text"] == "a" * max_bytes
    assert peak < 8 * max_bytes, f"{peak / (1 << 20):.1f} MiB allocated while fetching a body cut at 1 MiB"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("br", "the body's Content-Encoding 'br' was not asked for and cannot be decoded (only gzip and deflate are)"),
        ("zstd", "the body's Content-Encoding 'zstd' was not asked for and cannot be decoded"),
        ("unknown", "the body's Content-Encoding 'x-squash' was not asked for and cannot be decoded"),
        ("too-many", "the body has 4 stacked content encodings (gzip, gzip, gzip, gzip); at most 3 are decoded"),
        ("corrupt-gzip", "the body is not valid gzip data (Error -3 while decompressing data"),
        ("corrupt-deflate", "the body is not valid deflate data (Error -3 while decompressing data"),
        ("cut-gzip", "the body's gzip data ends before its compressed stream does"),
    ],
)
def test_a_body_that_cannot_be_decoded_is_a_clear_error(server: str, name: str, message: str) -> None:
    result = fetch(server, f"http://{server}/encoded/{name}")
    assert result.code == "TOOL_FAILED"
    assert f"fetching http://{server}/encoded/{name} failed: {message}" in result.text


@pytest.mark.parametrize(
    ("name", "coding", "decoded"),
    [
        ("empty-members", "gzip", 0),
        ("endless-trailer", "deflate", 5),
        ("stacked-empty-members", "gzip, gzip", 0),
        ("stacked-endless-trailer", "deflate, gzip", 5),
    ],
)
def test_a_body_that_decodes_to_next_to_nothing_is_not_read_to_its_end(
    server: str, name: str, coding: str, decoded: int
) -> None:
    result = fetch(server, f"http://{server}/encoded/{name}", max_bytes=1024)
    assert result.code == "TOOL_FAILED", result.value
    raw_limit = 2 * 1025 + 64 * 1024
    assert (
        f"fetching http://{server}/encoded/{name} failed: the body's {coding} data took more than {raw_limit} "
        f"bytes to decode to {decoded}; compressed data is never that much larger"
    ) in result.text


def test_an_error_status_is_reported_before_an_encoding_that_cannot_be_decoded(server: str) -> None:
    result = fetch(server, f"http://{server}/gone-br")
    assert result.code == "TOOL_FAILED"
    assert (
        f"HTTP 410 Gone for http://{server}/gone-br (its body is not shown: the body's Content-Encoding 'br' "
        "was not asked for and cannot be decoded"
    ) in result.text


def test_timeouts_and_aborts_are_honoured(server: str) -> None:
    started = time.monotonic()
    slow = fetch(server, f"http://{server}/slow", timeout_s=0.3)
    assert "timed out after 0.3 s" in slow.text and time.monotonic() - started < 20  # not /slow's 60 s

    async def scenario(harness: Harness) -> tuple[ToolResult, float]:
        controller = AbortController()
        asyncio.get_running_loop().call_later(0.2, controller.abort, "stop")
        begun = time.monotonic()
        result = await harness.call("fetch", {"url": f"http://{server}/slow"}, signal=controller.signal)
        return result, time.monotonic() - begun

    result, elapsed = run(server, scenario, timeout_s=3600)
    assert result.code == "ABORTED" and elapsed < 20  # not /slow's 60 s


def test_the_timeout_bounds_the_whole_request_not_each_read(server: str) -> None:
    started = time.monotonic()
    result = fetch(server, f"http://{server}/drip", timeout_s=1)
    elapsed = time.monotonic() - started
    assert result.code == "TOOL_FAILED" and elapsed < 20  # not the 100 s the body takes
    assert f"fetching http://{server}/drip timed out after 1 s (timeout_s bounds the whole request" in result.text


def test_max_concurrent_bounds_the_fetches_in_flight_and_the_rest_wait_their_turn(server: str) -> None:
    # A Code Mode program can gather a thousand fetches: without a bound each opens its own connection at once.
    async def scenario(harness: Harness) -> list[ToolResult]:
        return list(
            await asyncio.gather(*(harness.call("fetch", {"url": f"http://{server}/hold?{i}"}) for i in range(6)))
        )

    results = run(server, scenario, max_concurrent=2)
    assert [r.value["text"] for r in results] == [f"/hold?{i}" for i in range(6)]
    assert Handler.most_held == 2


def test_a_fetch_waiting_for_a_slot_times_out_within_its_own_timeout(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With one timeout_s for all, a slot is freed by its holder's deadline, before a waiter's; a waiter runs
    # out of time while waiting when the holder takes long to let go (closing a connection, say). A holder
    # that lets go a second after its timeout stands in for that.
    # A holder that lets go a minute after its timeout: a waiter that waited for it is told by far.
    real = dsh_http_fetch.HttpFetch._request
    holding: list[bool] = []

    async def slow_to_let_go(self: dsh_http_fetch.HttpFetch, url: Any, raw: bool) -> dict[str, Any]:
        if url.path != "/slow":
            return await real(self, url, raw)
        holding.append(True)
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(60)
        raise AssertionError("unreachable")

    monkeypatch.setattr(dsh_http_fetch.HttpFetch, "_request", slow_to_let_go)

    async def scenario(harness: Harness) -> tuple[ToolResult, float]:
        holder = asyncio.ensure_future(harness.call("fetch", {"url": f"http://{server}/slow"}))
        while not holding:  # the holder has its slot
            await asyncio.sleep(0.01)
        begun = time.monotonic()
        waiting = await harness.call("fetch", {"url": f"http://{server}/plain"})
        elapsed = time.monotonic() - begun
        holder.cancel()  # cuts its minute of letting go short
        await asyncio.gather(holder, return_exceptions=True)
        return waiting, elapsed

    waiting, elapsed = run(server, scenario, max_concurrent=1, timeout_s=0.5)
    assert waiting.code == "TOOL_FAILED" and elapsed < 20, elapsed  # not the holder's 60.5 s
    assert (
        f"fetching http://{server}/plain timed out after 0.5 s waiting for its turn: max_concurrent (1) "
        "fetches were in flight"
    ) in waiting.text
    assert "/plain" not in Handler.hits


def test_a_fetch_waiting_for_a_slot_is_aborted_at_once(server: str) -> None:
    async def scenario(harness: Harness) -> tuple[ToolResult, float]:
        holder = asyncio.ensure_future(harness.call("fetch", {"url": f"http://{server}/slow"}))
        while "/slow" not in Handler.hits:  # the holder has its slot
            await asyncio.sleep(0.01)
        controller = AbortController()
        asyncio.get_running_loop().call_later(0.2, controller.abort, "stop")
        begun = time.monotonic()
        result = await harness.call("fetch", {"url": f"http://{server}/plain"}, signal=controller.signal)
        elapsed = time.monotonic() - begun
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
        return result, elapsed

    result, elapsed = run(server, scenario, max_concurrent=1, timeout_s=3600)
    assert result.code == "ABORTED" and elapsed < 20  # not the holder's 60 s (/slow)
    assert "/plain" not in Handler.hits


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8"])
def test_max_concurrent_must_be_a_positive_integer(server: str, value: Any) -> None:
    with pytest.raises(Exception, match=r"config\.max_concurrent: (?!unknown key)"):
        fetch(server, f"http://{server}/plain", max_concurrent=value)


def test_converting_a_hostile_page_does_not_stall_the_event_loop(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # html.parser takes seconds for a megabyte of stray "<" (linear, but a few microseconds each); run on the
    # event loop, that stalled every other call and stream of the process, and no timeout could interrupt it.
    # The conversion below does not start until the loop has turned while it was in progress: on the loop
    # itself it would wait out its whole bound (and report it), so no clock and no machine load decides this.
    real = dsh_http_fetch.html_to_text
    converting = threading.Event()
    loop_turned = threading.Event()
    waited: list[bool] = []

    def after_the_loop_turns(html: str) -> tuple[str | None, str]:
        converting.set()
        waited.append(loop_turned.wait(30))
        return real(html)

    monkeypatch.setattr(dsh_http_fetch, "html_to_text", after_the_loop_turns)

    async def scenario(harness: Harness) -> ToolResult:
        async def turn_once_converting() -> None:
            while not converting.is_set():
                await asyncio.sleep(0.005)
            loop_turned.set()

        watcher = asyncio.ensure_future(turn_once_converting())
        try:
            return await harness.call("fetch", {"url": f"http://{server}/lt-flood"})
        finally:
            watcher.cancel()

    # A 3 MB page of stray "<" takes seconds to convert, more on a loaded machine: no timeout may cut it here.
    result = run(server, scenario, max_bytes=4 << 20, timeout_s=600)
    assert waited == [True]
    assert result.value["truncated"] is False and result.value["text"].startswith("< < <")


def test_html_is_converted_on_the_plugins_own_threads_not_the_default_executor(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop's default executor runs the DNS lookups (loop.getaddrinfo) of this plugin and of everything
    # else in the process: a burst of large conversions there would hold up every lookup.
    threads: list[threading.Thread] = []
    real = dsh_http_fetch.html_to_text

    def recording(html: str) -> tuple[str | None, str]:
        threads.append(threading.current_thread())
        return real(html)

    monkeypatch.setattr(dsh_http_fetch, "html_to_text", recording)
    result = fetch(server, f"http://{server}/page")
    assert result.value["title"] == "Hello page"
    assert len(threads) == 1 and threads[0].name.startswith("dsh-http-fetch-html"), threads


def test_disposing_the_plugin_waits_for_a_running_conversion_and_leaves_no_thread(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A conversion cannot be interrupted: the call ends at its timeout, and the conversion runs on. Disposing
    # the plugin must not leave its thread behind (the conformance kit counts threads left after dispose).
    threads: list[threading.Thread] = []
    real = dsh_http_fetch.html_to_text

    def slow(html: str) -> tuple[str | None, str]:
        threads.append(threading.current_thread())
        time.sleep(1)
        return real(html)

    monkeypatch.setattr(dsh_http_fetch, "html_to_text", slow)
    row = {
        "id": "web",
        "use": "http-fetch",
        "config": {"allowed_hosts": [server], "allowed_addresses": ["127.0.0.1"], "timeout_s": 0.3},
    }

    async def main() -> tuple[ToolResult, list[threading.Thread]]:
        harness = await Harness.start(
            compose([("test", {"plugins": [row]})], env={}), catalog=PluginCatalog(strict=True)
        )
        try:
            result = await harness.call("fetch", {"url": f"http://{server}/page"})
        finally:
            await harness.aclose()
        # Checked before the loop closes: asyncio.run would join the default executor's threads itself.
        return result, [t for t in threading.enumerate() if t in threads or t.name.startswith("dsh-http-fetch")]

    result, left = asyncio.run(main())
    assert result.code == "TOOL_FAILED" and "timed out after 0.3 s" in result.text
    assert len(threads) == 1 and left == [], left


def test_disposing_the_plugin_gives_up_on_a_stuck_conversion_after_its_grace_and_drops_its_result(
    server: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A conversion cannot be interrupted, and dispose waited for it with no bound: a pathological page held the
    # disposal (and the process's exit: the interpreter joins a ThreadPoolExecutor's threads) for as long as it
    # ran. Dispose now waits dispose_grace_s, warns naming the pages still converting and leaves their (daemon)
    # threads; what they finish later goes nowhere, and a page that had not started converting is dropped.
    started: list[threading.Thread] = []
    release = threading.Event()
    real = dsh_http_fetch.html_to_text

    def stuck(html: str) -> tuple[str | None, str]:
        started.append(threading.current_thread())
        release.wait()
        return real(html)

    monkeypatch.setattr(dsh_http_fetch, "html_to_text", stuck)
    thread_errors: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    config = {"allowed_hosts": [server], "allowed_addresses": ["127.0.0.1"], "dispose_grace_s": 0.05}
    instance = dsh_http_fetch.HttpFetch(config)
    urls = [f"http://{server}/page?{n}" for n in range(3)]  # two converter threads: one page waits its turn
    ctx = SimpleNamespace(signal=AbortSignal.never())

    async def main() -> list[Any]:
        calls = [asyncio.ensure_future(instance.fetch({"url": url}, ctx)) for url in urls]
        async with asyncio.timeout(30):  # a bound against a hang (dispose waited forever), not a timing
            # Two pages converting, and the third waiting in the converter's queue.
            while len(started) < 2 or len(instance._conversions) < 3:
                await asyncio.sleep(0.01)
            await instance.aclose()  # returns after the grace, the two conversions still running
            return await asyncio.gather(*calls, return_exceptions=True)

    Handler.hits.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="dsh.http_fetch"):
            outcomes = asyncio.run(main())
        assert all(isinstance(outcome, ToolError) for outcome in outcomes), outcomes
        messages = [str(outcome) for outcome in outcomes]
        assert all(url in message for url, message in zip(urls, messages, strict=True)), messages
        abandoned = [url for url, message in zip(urls, messages, strict=True) if "still converting" in message]
        dropped = [url for url, message in zip(urls, messages, strict=True) if "before converting" in message]
        assert len(abandoned) == 2 and len(dropped) == 1, messages
        warnings = [record.getMessage() for record in caplog.records if record.name == "dsh.http_fetch"]
        assert len(warnings) == 1 and "0.05 s" in warnings[0], warnings
        assert all(url in warnings[0] for url in abandoned) and dropped[0] not in warnings[0], warnings
        assert len(started) == 2 and all(thread.is_alive() and thread.daemon for thread in started), started
    finally:
        release.set()
    for thread in started:
        thread.join(30)  # a bound against a hang, not a timing: the conversion ends at once
    assert not any(thread.is_alive() for thread in started)
    # The finished conversions delivered nothing and raised nothing; the page that waited never started.
    assert len(started) == 2 and thread_errors == []
    assert [record for record in caplog.records if record.levelno >= logging.ERROR] == []


_EXIT_SCRIPT = """
import asyncio, threading, httpx, dsh_http_fetch
started, never = threading.Event(), threading.Event()
def stuck(html):
    started.set()
    never.wait()
dsh_http_fetch.html_to_text = stuck
instance = dsh_http_fetch.HttpFetch({"allowed_hosts": ["example.com"], "dispose_grace_s": 0.05})
async def main():
    call = asyncio.ensure_future(instance._convert(httpx.URL("https://example.com/stuck"), "<p>x"))
    while not started.is_set():
        await asyncio.sleep(0.01)
    await instance.aclose()
    await asyncio.gather(call, return_exceptions=True)
asyncio.run(main())
print("disposed")
"""


def test_a_conversion_left_running_by_dispose_does_not_hold_up_the_interpreters_exit() -> None:
    # The interpreter joins a ThreadPoolExecutor's threads at exit: a conversion dispose gave up on kept the
    # process alive until it ended (here: never). The converter threads are daemon threads.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-c", _EXIT_SCRIPT]
    # timeout: a bound against the hang, not a timing
    completed = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=120)
    assert completed.returncode == 0 and completed.stdout == "disposed\n", completed
    assert "https://example.com/stuck" in completed.stderr, completed.stderr


@pytest.mark.parametrize("value", [0, -1, True, "5"])
def test_dispose_grace_s_must_be_a_positive_number(server: str, value: Any) -> None:
    with pytest.raises(Exception, match=r"config\.dispose_grace_s: (?!unknown key)"):
        fetch(server, f"http://{server}/plain", dispose_grace_s=value)


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, 10**400, True, "5"])
def test_a_plugin_built_without_the_schema_refuses_a_grace_that_is_not_positive_and_finite(
    server: str, value: Any
) -> None:
    with pytest.raises(ToolError, match=r"http-fetch: dispose_grace_s must be a positive finite number"):
        dsh_http_fetch.HttpFetch({"allowed_hosts": [server], "dispose_grace_s": value})


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
    result = run(
        server, lambda h: h.call("fetch", {"url": f"http://{server}/plain"}), allowed_hosts=["[::1]:8080", server]
    )
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


@pytest.mark.parametrize(
    ("url", "entry"),
    [
        ("http://docs.python.org/", "docs.python.org."),  # an entry written as a fully qualified name
        ("http://docs.python.org./", "docs.python.org."),
        ("http://x.python.org/", "*.python.org."),
        ("http://[::1]/", "0:0::1"),  # one IPv6 address, spelled two ways
        ("http://[0:0::1]:8080/", "[::1]:8080"),
        ("http://[::FFFF:1.2.3.4]/", "::ffff:102:304"),
    ],
)
def test_an_entry_matches_its_host_however_either_is_spelled(url: str, entry: str) -> None:
    # Each was an entry that matched no URL at all: the trailing dot was dropped from the URL's host only,
    # and IPv6 addresses were compared as written.
    import httpx

    assert host_allowed(httpx.URL(url), [entry])


@pytest.mark.parametrize(
    ("url", "entry"),
    [
        ("http://www.bücher.de/", "*.bücher.de"),  # httpx shows a host as Unicode only when its first label is xn--
        ("http://www.xn--bcher-kva.de/", "*.bücher.de"),
        ("http://bücher.de/", "xn--bcher-kva.de"),  # an entry in its ASCII form
        ("http://xn--bcher-kva.de/", "xn--bcher-kva.de"),
        ("http://BÜCHER.de./", "Bücher.de"),
    ],
)
def test_an_internationalized_name_matches_in_either_spelling(url: str, entry: str) -> None:
    import httpx

    assert host_allowed(httpx.URL(url), [entry])
    assert not host_allowed(httpx.URL(url.replace("de/", "com/").replace("de./", "com./")), [entry])


def test_preformatted_text_keeps_its_lines_and_indentation() -> None:
    # Code examples on documentation pages are <pre> blocks: flattened to one line, Python lost its meaning.
    page = "<p>Example:</p><pre>def f(x):\n    if x:\n\treturn <b>1</b>\n</pre><p>after   it</p>"
    assert html_to_text(page) == (None, "Example:\ndef f(x):\n    if x:\n\treturn 1\nafter it")


def test_a_head_left_open_does_not_hide_the_body() -> None:
    # </head> (like </p> and </li>) may be left out: the body starts the page's text all the same.
    page = "<html><head><meta charset=utf-8><title>T</title><body><p>Hello world</p><p>Second"
    assert html_to_text(page) == ("T", "Hello world\nSecond")


def test_the_title_is_the_pages_not_its_icons() -> None:
    # Inline SVG icons carry <title> elements of their own (their tooltip); the page's title is the first one.
    page = (
        "<html><head><title>Page</title></head><body><p>Text <svg><title>Search icon</title><path/></svg>"
        "more</p><title>stray</title><p>end</p>"
    )
    assert html_to_text(page) == ("Page", "Text\nmore\nend")
    assert html_to_text("<svg><title>Logo</title></svg><p>x") == (None, "x")


@pytest.mark.parametrize("tail", ["<a" * 100_000, "</" * 100_000, "<?" * 100_000, "<!" * 100_000, "<![CDATA[" * 20_000])
def test_markup_left_open_at_the_end_is_converted_in_linear_time(tail: str) -> None:
    # html.parser before Python 3.13.4 (CVE-2025-6069) rescans the rest of the document for every "<" of an
    # unfinished construct at its end: 200 KB of "<a" took minutes, on the event loop, where no timeout reaches.
    started = time.monotonic()
    title, text = html_to_text("<title>T</title><p>kept</p>" + tail)
    assert time.monotonic() - started < 2
    assert (title, text) == ("T", "kept")  # as in a browser: a tag, comment, ... cut by the end of file is dropped


def test_a_title_in_many_pieces_is_converted_in_linear_time() -> None:
    # Markup inside <title> splits its text into pieces, and each piece was appended by copying the whole title
    # so far: quadratic. 12 MB of title in 24,000 pieces took ~14 s against ~0.9 s for the same markup in a <p>
    # (a 15 MB one, 30 s against 0.7 s), on a converter thread that no timeout or abort stops.
    piece = "x" * 500 + "<b>"

    def seconds(page: str) -> float:
        started = time.perf_counter()
        html_to_text(page)
        return time.perf_counter() - started

    body = seconds("<p>" + piece * 24_000)
    title = seconds("<title>" + piece * 24_000)
    assert title < 4 * body + 1, (title, body)
    assert html_to_text("<title>a<b>b</b> c</title><p>x") == ("ab c", "x")


def test_a_lone_lt_at_the_end_is_text() -> None:
    assert html_to_text("<p>a <")[1] == "a <"
    assert html_to_text("<p>a </")[1] == "a </"
    assert html_to_text("<p>a</p><script>x<a<a")[1] == "a"


@pytest.mark.parametrize(
    "charset", ["base64", "hex", "rot13", "zlib", "idna", "punycode", "undefined", "x-no-such-charset"]
)
def test_a_declared_charset_python_cannot_decode_text_with_falls_back_to_utf8(server: str, charset: str) -> None:
    # Python's codec registry also holds bytes-to-bytes codecs, which bytes.decode refuses (LookupError), and
    # text codecs that fail on any input or with errors="replace" (UnicodeError).
    result = fetch(server, f"http://{server}/charset/{charset}")
    assert result.code is None and result.value["text"] == "Grüße"


@pytest.mark.parametrize("charset", ["punycode", "PUNYCODE"])
def test_a_page_is_never_decoded_as_punycode(server: str, charset: str) -> None:
    # Punycode encodes host-name labels, not documents (no browser knows it as a charset), and Python's decoder
    # is quadratic: a 1 MiB text/plain page declaring it took minutes to decode, on the event loop, with the
    # whole process stalled and neither the timeout nor an abort able to end it. ASCII text is valid punycode
    # ("The page-text" decodes to "Th\u0cc6e page"), so declaring it garbled any page; it is read as UTF-8.
    result = fetch(server, f"http://{server}/ascii/{charset}")
    assert result.code is None and result.value["text"] == "The page-text", result.text


@pytest.mark.parametrize(
    ("charset", "body"),
    [
        ("utf-7", b"a+2AA-b"),
        ("UTF-7", b"+2D3cAA-"),
        ("unicode_escape", b"a\\ud800b"),
        ("raw_unicode_escape", b"a\\ud800b"),
        ("utf_32", b"ab"),
    ],
)
def test_a_page_is_decoded_only_with_an_encoding_browsers_know(server: str, charset: str, body: bytes) -> None:
    # Python's registry holds text codecs no web page is written in: utf-7 and the escape codecs turned ASCII
    # bytes into lone surrogates ("a+2AA-b" into "a\ud800b") that reached the model. Such a page is read as UTF-8.
    result = fetch(server, f"http://{server}/bytes/{charset}/{body.hex()}")
    assert result.code is None and result.value["text"] == body.decode("utf-8"), result.text


@pytest.mark.parametrize(
    ("charset", "text"),
    [
        ("windows-1251", "Привет"),
        ("koi8-r", "Привет"),
        ("shift_jis", "こんにちは"),
        ("gb18030", "你好"),
        ("iso-8859-15", "€uro"),
        ("euc-kr", "안녕"),
    ],
)
def test_the_encodings_browsers_know_are_still_decoded(server: str, charset: str, text: str) -> None:
    result = fetch(server, f"http://{server}/bytes/{charset}/{text.encode(charset).hex()}")
    assert result.code is None and result.value["text"] == text, result.text


def test_an_html_page_without_a_charset_header_is_decoded_as_its_meta_tag_says(server: str) -> None:
    result = fetch(server, f"http://{server}/meta-charset/")
    assert (result.value["title"], result.value["text"]) == ("Grüße", "Grüße")
    # The header, when there is one, wins (WHATWG: BOM, then Content-Type, then the <meta> prescan).
    result = fetch(server, f"http://{server}/meta-charset/utf-8")
    assert result.value["text"] == "Gr\ufffd\ufffde"


@pytest.mark.parametrize("content_type", ["application/rss+xml", "text/xml", "application/xml"])
def test_an_xml_document_without_a_charset_header_is_decoded_as_its_declaration_says(
    server: str, content_type: str
) -> None:
    # RFC 7303, section 4.3: without a charset parameter (or a BOM), the XML declaration names the encoding.
    result = fetch(server, f"http://{server}/xml-encoding/{content_type}")
    assert result.code is None and "<title>Grüße</title>" in result.value["text"], result.text
    result = fetch(server, f"http://{server}/xml-encoding/{content_type};charset=utf-8")  # the header wins
    assert "<title>Gr\ufffd\ufffde</title>" in result.value["text"]


@pytest.mark.parametrize("codec", ["utf-8", "utf-16-le", "utf-16-be"])
def test_a_byte_order_mark_decides_the_encoding(server: str, codec: str) -> None:
    # As in browsers (WHATWG encoding sniffing): a BOM wins over the declared charset, and is not text.
    result = fetch(server, f"http://{server}/bom/{codec}")
    assert result.value["text"] == "Grüße"


class TestHttpFetchConformance(ToolPluginConformance):
    """The dsh conformance kit; the example fetches from the local server."""

    plugin_name = "http-fetch"

    @pytest.fixture
    def plugin_config(self, server: str, tmp_path: Path) -> dict[str, Any]:
        return {"allowed_hosts": [server], "allowed_addresses": ["127.0.0.1"], "example_url": f"http://{server}/page"}


# --- Addresses: DNS rebinding ---------------------------------------------------------------------------------

REFUSAL_HINT = (
    "; only public addresses are connected to, unless the address or its network is in "
    "allowed_addresses in the http-fetch config"
)


def test_the_local_server_itself_is_refused_without_allowed_addresses(server: str) -> None:
    result = fetch(server, f"http://{server}/plain", allowed_addresses=[])
    assert result.code == "TOOL_FAILED"
    assert (
        f"fetching http://{server}/plain refused: host '127.0.0.1' is 127.0.0.1 (a loopback address)" + REFUSAL_HINT
    ) in result.text
    assert Handler.hits == []


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        ("127.0.0.1", "a loopback address"),
        ("169.254.169.254", "a link-local address"),
        ("10.1.2.3", "a private address"),
        ("0.0.0.0", "the unspecified address"),
        ("::1", "a loopback address"),
        ("::ffff:127.0.0.1", "the IPv4-mapped form of 127.0.0.1, a loopback address"),
        ("::ffff:169.254.169.254", "the IPv4-mapped form of 169.254.169.254, a link-local address"),
        ("64:ff9b::a9fe:a9fe", "a NAT64 address for 169.254.169.254, a link-local address"),
    ],
)
def test_an_allowed_name_that_resolves_to_a_non_public_address_is_refused(
    server: str, dns: FakeDNS, connections: list[str], answer: str, kind: str
) -> None:
    port = server.split(":")[1]
    dns.add("rebind.test", [answer])
    result = fetch(server, f"http://rebind.test:{port}/plain", allowed_hosts=["rebind.test"], allowed_addresses=[])
    assert result.code == "TOOL_FAILED"
    assert (
        f"fetching http://rebind.test:{port}/plain refused: host 'rebind.test' resolves to {answer} ({kind})"
        + REFUSAL_HINT
    ) in result.text
    assert connections == [] and Handler.hits == []


def test_an_ipv4_mapped_loopback_literal_is_refused(server: str, connections: list[str]) -> None:
    port = server.split(":")[1]
    result = fetch(server, f"http://[::ffff:127.0.0.1]:{port}/plain", allowed_hosts=["*"], allowed_addresses=[])
    assert result.code == "TOOL_FAILED"
    # An IP literal is not looked up, whatever its spelling: "is", not "resolves to".
    assert (
        f"fetching http://[::ffff:127.0.0.1]:{port}/plain refused: host '::ffff:127.0.0.1' is ::ffff:7f00:1 "
        "(the IPv4-mapped form of 127.0.0.1, a loopback address)" + REFUSAL_HINT
    ) in result.text
    assert connections == [] and Handler.hits == []


def test_one_internal_answer_among_public_ones_refuses_the_host_before_any_connection(
    server: str, dns: FakeDNS, connections: list[str]
) -> None:
    port = server.split(":")[1]
    dns.add("mixed.test", ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c", "10.0.0.7"])
    result = fetch(server, f"http://mixed.test:{port}/plain", allowed_hosts=["mixed.test"])
    assert "host 'mixed.test' resolves to 10.0.0.7 (a private address)" in result.text
    assert connections == []


@pytest.mark.parametrize(
    ("target", "refusal"),
    [
        ("http://metadata.test/latest/", "host 'metadata.test' resolves to 169.254.169.254 (a link-local address)"),
        ("http://169.254.169.254/latest/", "host '169.254.169.254' is 169.254.169.254 (a link-local address)"),
        ("http://intranet.test/", "host 'intranet.test' resolves to 10.0.0.5 (a private address)"),
    ],
)
def test_a_redirect_to_a_non_public_address_is_refused_before_the_request(
    server: str, dns: FakeDNS, connections: list[str], target: str, refusal: str
) -> None:
    dns.add("metadata.test", ["169.254.169.254"])
    dns.add("intranet.test", ["10.0.0.5"])
    start = f"http://{server}/to?url={quote(target, safe='')}"
    result = fetch(server, start, allowed_hosts=[server, "metadata.test", "169.254.169.254", "intranet.test"])
    assert result.code == "TOOL_FAILED"
    assert f"redirect from {start} to {target} refused: {refusal}" + REFUSAL_HINT in result.text
    assert Handler.hits == [start.removeprefix(f"http://{server}")]
    assert connections == ["127.0.0.1"]


def test_an_allowed_private_range_is_fetched_with_the_name_in_the_host_header(
    server: str, dns: FakeDNS, connections: list[str]
) -> None:
    port = server.split(":")[1]
    dns.add("intranet.test", ["127.0.0.1"])
    result = fetch(
        server,
        f"http://intranet.test:{port}/plain",
        allowed_hosts=["intranet.test"],
        allowed_addresses=["10.0.0.0/8", "127.0.0.0/8"],
    )
    assert result.value["text"] == "just text"
    assert Handler.host_headers == [f"intranet.test:{port}"]
    assert connections == ["127.0.0.1"]
    # The range allows what it names and nothing else.
    dns.add("other.test", ["192.168.1.1"])
    other = fetch(
        server,
        f"http://other.test:{port}/plain",
        allowed_hosts=["other.test"],
        allowed_addresses=["10.0.0.0/8", "127.0.0.0/8"],
    )
    assert "host 'other.test' resolves to 192.168.1.1 (a private address)" in other.text


def test_the_connection_uses_the_checked_answer_and_never_a_second_lookup(
    server: str, dns: FakeDNS, connections: list[str]
) -> None:
    """The name is looked up once per connection and the socket goes to that answer.

    A check that did its own lookup before the client's would see 127.0.0.1
    (allowed here) and let the client connect to the next answer, the rebound
    169.254.169.254.
    """
    port = server.split(":")[1]
    dns.add("rebind.test", ["127.0.0.1"], ["169.254.169.254"])
    config: dict[str, Any] = {"allowed_hosts": ["rebind.test"], "allowed_addresses": ["127.0.0.1"]}
    result = fetch(server, f"http://rebind.test:{port}/plain", **config)
    assert result.value["text"] == "just text"
    assert dns.lookups == ["rebind.test"]
    assert connections == ["127.0.0.1"]
    assert Handler.host_headers == [f"rebind.test:{port}"]
    # The next connection (here a later call) looks the name up again and gets the rebound answer: refused.
    again = fetch(server, f"http://rebind.test:{port}/plain", **config)
    assert "host 'rebind.test' resolves to 169.254.169.254 (a link-local address)" in again.text
    assert dns.lookups == ["rebind.test", "rebind.test"] and connections == ["127.0.0.1"]


def test_a_name_rebinding_between_redirect_hops_is_refused_on_the_next_hop(
    server: str, dns: FakeDNS, connections: list[str]
) -> None:
    port = server.split(":")[1]
    dns.add("rebind.test", ["127.0.0.1"], ["169.254.169.254"])
    result = fetch(server, f"http://rebind.test:{port}/redirect-in", allowed_hosts=["rebind.test"])
    assert (
        f"redirect from http://rebind.test:{port}/redirect-in to http://rebind.test:{port}/plain refused: "
        "host 'rebind.test' resolves to 169.254.169.254 (a link-local address)"
    ) in result.text
    assert Handler.hits == ["/redirect-in"] and connections == ["127.0.0.1"]


def test_tls_is_negotiated_for_the_name_not_the_address(dns: FakeDNS, connections: list[str]) -> None:
    """SNI (and so the certificate check) uses the URL's host name although the socket goes to the address."""
    names: list[str | None] = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # no certificate: the handshake fails after the ClientHello
    context.sni_callback = lambda _sock, name, _ctx: names.append(name)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn, contextlib.suppress(OSError):  # ssl.SSLError is an OSError
            context.wrap_socket(conn, server_side=True)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    dns.add("secure.test", ["127.0.0.1"])
    try:
        result = fetch(f"secure.test:{port}", f"https://secure.test:{port}/", timeout_s=5)
    finally:
        thread.join(5)
        listener.close()
    assert result.code == "TOOL_FAILED" and "ConnectError" in result.text
    assert names == ["secure.test"] and connections == ["127.0.0.1"]


def test_a_name_that_does_not_resolve_is_a_tool_error(server: str, dns: FakeDNS) -> None:
    result = fetch(server, "http://nowhere.test/", allowed_hosts=["nowhere.test"])
    assert result.code == "TOOL_FAILED"
    assert "fetching http://nowhere.test/ failed: ConnectError: cannot resolve 'nowhere.test'" in result.text


def test_a_name_the_resolver_cannot_encode_is_a_connect_error_naming_the_host(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """socket.getaddrinfo encodes a str host with the idna codec, which raises UnicodeError (not OSError) on
    an empty or over-long label: a name that does not resolve, not an unexplained crash of the tool."""

    def offline_getaddrinfo(host: str | bytes, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str):
            host.encode("idna")  # what the real one does before any lookup
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", offline_getaddrinfo)
    host = "a" * 64 + ".test"
    result = fetch(server, f"http://{host}/", allowed_hosts=[host])
    assert result.code == "TOOL_FAILED"
    assert f"fetching http://{host}/ failed: ConnectError: cannot resolve '{host}'" in result.text


def test_lookups_that_hang_do_not_take_the_event_loops_worker_threads(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """getaddrinfo runs on the loop's default executor, which everything else shares (asyncio.to_thread, the
    model client's own lookups) and which has only min(32, cpus + 4) threads. A fetch that times out leaves
    its lookup running until the resolver gives up, so a burst of fetches to names whose DNS never answers
    must not occupy all of those threads."""
    release = threading.Event()

    def hanging_getaddrinfo(host: str | bytes, port: Any, *args: Any, **kwargs: Any) -> Any:
        release.wait(10)  # a DNS server that never answers (until the test ends)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", hanging_getaddrinfo)

    async def scenario(harness: Harness) -> tuple[list[ToolResult], bool]:
        try:
            calls = [harness.call("fetch", {"url": f"http://h{i}.slow.test/"}) for i in range(12)]
            results = await asyncio.gather(*calls)
            try:  # a full executor runs this only once a lookup gives up: 10 s after it began
                await asyncio.wait_for(asyncio.to_thread(lambda: None), 5)
            except TimeoutError:
                return results, False
            return results, True
        finally:
            release.set()

    results, free = run(server, scenario, allowed_hosts=["*.slow.test"], timeout_s=0.3)
    assert all(r.code == "TOOL_FAILED" and "timed out" in r.text for r in results)
    assert free, "the default executor was full of the fetches' DNS lookups"


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("0.0.0.0", "the unspecified address"),
        ("127.0.0.1", "a loopback address"),
        ("127.1.2.3", "a loopback address"),
        ("10.0.0.1", "a private address"),
        ("172.16.0.1", "a private address"),
        ("192.168.0.1", "a private address"),
        ("169.254.169.254", "a link-local address"),
        ("100.64.0.1", "not a globally routable address"),
        ("224.0.0.1", "a multicast address"),
        ("255.255.255.255", "a private address"),
        ("::", "the unspecified address"),
        ("::1", "a loopback address"),
        ("::ffff:127.0.0.1", "the IPv4-mapped form of 127.0.0.1, a loopback address"),
        ("::ffff:10.0.0.1", "the IPv4-mapped form of 10.0.0.1, a private address"),
        ("::ffff:0.0.0.0", "the IPv4-mapped form of 0.0.0.0, the unspecified address"),
        ("::127.0.0.1", "a reserved address"),
        ("fe80::1", "a link-local address"),
        ("fe80::1%1", "a link-local address"),
        ("fc00::1", "a private address"),
        ("fec0::1", "a site-local address"),
        ("ff02::1", "a multicast address"),
        ("64:ff9b::7f00:1", "a NAT64 address for 127.0.0.1, a loopback address"),
        ("64:ff9b:1::1", "a local-use NAT64 address"),
        ("2002:7f00:1::1", "a 6to4 address for 127.0.0.1, a loopback address"),
    ],
)
def test_non_public_addresses_are_refused(address: str, kind: str) -> None:
    assert address_refusal(address) == kind


@pytest.mark.parametrize(
    "address",
    ["8.8.8.8", "93.184.215.14", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"],
)
def test_public_addresses_are_allowed(address: str) -> None:
    assert address_refusal(address) is None


# What Python 3.13 (and the 3.12/3.11 security releases of 2024) added to ipaddress's non-global networks.
_NEWER_PYTHON_NON_GLOBAL = [ipaddress.ip_network(n) for n in ("192.0.0.0/24", "2002::/16", "64:ff9b:1::/48")]


@pytest.mark.parametrize("tables", ["this python", "newer python"])
def test_the_verdicts_do_not_depend_on_the_python_version(monkeypatch: pytest.MonkeyPatch, tables: str) -> None:
    """The plugin's policy, not the ipaddress tables of the running Python, decides the edge cases.

    Newer Pythons count all of 2002::/16 (6to4), 64:ff9b:1::/48 and 192.0.0.0/24 as private; 3.11.7 and
    3.12.1 call them global. A 6to4 address is judged by the IPv4 address it carries, the other two are
    always refused, with the same reason on every version.
    """
    if tables == "newer python":
        for cls in (ipaddress.IPv4Address, ipaddress.IPv6Address):
            older = cls.is_private.fget

            def is_private(self: Any, older: Any = older) -> bool:
                return bool(older(self)) or any(self in network for network in _NEWER_PYTHON_NON_GLOBAL)

            monkeypatch.setattr(cls, "is_private", property(is_private))
        assert ipaddress.ip_address("2002:808:808::1").is_private  # the simulation is in force
    assert address_refusal("2002:808:808::1") is None
    assert address_refusal("2002:7f00:1::1") == "a 6to4 address for 127.0.0.1, a loopback address"
    assert address_refusal("2002:a9fe:a9fe::") == "a 6to4 address for 169.254.169.254, a link-local address"
    assert address_refusal("64:ff9b:1::a9fe:a9fe") == "a local-use NAT64 address"
    assert address_refusal("192.0.0.100") == "an IETF protocol assignment (192.0.0.0/24)"
    assert address_refusal("192.0.0.1") == "an IETF protocol assignment (192.0.0.0/24)"


def test_allowed_addresses_admit_exactly_their_networks() -> None:
    allowed = [parse_address_entry("10.0.0.0/8"), parse_address_entry("::1"), parse_address_entry(" 127.0.0.1 ")]
    assert address_refusal("10.9.8.7", allowed) is None
    assert address_refusal("::ffff:10.9.8.7", allowed) is None  # the same IPv4 destination
    assert address_refusal("64:ff9b::a09:807", allowed) is None  # NAT64 to 10.9.8.7
    assert address_refusal("::1", allowed) is None
    assert address_refusal("127.0.0.1", allowed) is None
    assert address_refusal("127.0.0.2", allowed) == "a loopback address"
    assert address_refusal("11.0.0.1", allowed) is None  # public anyway
    assert address_refusal("192.168.0.1", allowed) == "a private address"
    assert address_refusal("169.254.169.254", allowed) == "a link-local address"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("intranet.corp", "malformed allowed_addresses entry 'intranet.corp'"),
        ("10.0.0.1/8", "10.0.0.1/8 has host bits set"),
        ("10.0.0.0/33", "malformed allowed_addresses entry '10.0.0.0/33'"),
    ],
)
def test_a_malformed_allowed_addresses_entry_refuses_to_load(server: str, entry: str, message: str) -> None:
    with pytest.raises(Exception, match=message):
        fetch(server, f"http://{server}/plain", allowed_addresses=[entry])


def test_the_checked_addresses_are_tried_in_order(server: str, dns: FakeDNS, connections: list[str]) -> None:
    """When the first address cannot be connected to, the next checked one is; never the name."""
    port = server.split(":")[1]
    dns.add("two.test", ["::1", "127.0.0.1"])  # the guard fails ::1 as an unreachable address would
    result = fetch(
        server, f"http://two.test:{port}/plain", allowed_hosts=["two.test"], allowed_addresses=["127.0.0.1", "::1"]
    )
    assert result.value["text"] == "just text"
    assert connections == ["::1", "127.0.0.1"] and dns.lookups == ["two.test"]


def test_a_disposal_cancelled_during_its_grace_says_how_long_it_waited_not_the_whole_grace(
    server: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    started = threading.Event()
    release = threading.Event()
    real = dsh_http_fetch.html_to_text

    def stuck(html: str) -> tuple[str | None, str]:
        started.set()
        release.wait()
        return real(html)

    monkeypatch.setattr(dsh_http_fetch, "html_to_text", stuck)
    config = {"allowed_hosts": [server], "allowed_addresses": ["127.0.0.1"], "dispose_grace_s": 3600}
    instance = dsh_http_fetch.HttpFetch(config)
    ctx = SimpleNamespace(signal=AbortSignal.never())

    async def main() -> None:
        call = asyncio.ensure_future(instance.fetch({"url": f"http://{server}/page"}, ctx))
        async with asyncio.timeout(30):  # a bound against a hang, not a timing
            while not started.is_set():
                await asyncio.sleep(0.01)
            disposal = asyncio.ensure_future(instance.aclose())
            await asyncio.sleep(0)  # the disposal is waiting out its grace
            disposal.cancel()
            with pytest.raises(asyncio.CancelledError):
                await disposal
            with pytest.raises(ToolError, match="still converting"):
                await call

    try:
        with caplog.at_level(logging.WARNING, logger="dsh.http_fetch"):
            asyncio.run(main())
    finally:
        release.set()
    (warning,) = [record.getMessage() for record in caplog.records if record.name == "dsh.http_fetch"]
    assert "of the 3600 s grace" in warning and "after 3.6e+03 s" not in warning, warning

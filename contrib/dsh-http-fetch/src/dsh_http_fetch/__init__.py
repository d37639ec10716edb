"""dsh-http-fetch: one ``fetch`` tool that GETs a URL from an allowed host and returns its text.

Every hop is checked: the first URL and each redirect target must use http or
https and name an allowed host, so a redirect cannot lead the tool anywhere
the config does not allow. Every connection is checked too, by address: the
host is resolved once, when the connection is opened, each address it
resolves to must be public (or in ``allowed_addresses``), and the socket
connects to that checked address (TLS and the ``Host`` header keep the
name). So an allowed name that resolves, or re-resolves, to 127.0.0.1,
169.254.169.254 or 10.x (DNS rebinding) reaches nothing. Responses are read
up to ``max_bytes``, counted after decoding: gzip and deflate bodies are
decoded here, and decoding stops at the cap; HTML is reduced to readable text
(scripts and styles dropped, block elements on their own lines). Proxy
settings from the environment are ignored.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import contextlib
import fnmatch
import ipaddress
import logging
import queue
import re
import socket
import ssl
import threading
import weakref
import zlib
from collections.abc import Callable, Iterable, Sequence
from html.parser import HTMLParser
from typing import Any

import httpcore
import httpx
import idna

from dsh_core import AbortedError, Scope, ToolContext, ToolError, define_tool, hookimpl, plugin
from dsh_core.bounds import is_positive_seconds

__all__ = [
    "plugin",
    "HttpFetch",
    "AddressRefused",
    "address_refusal",
    "html_to_text",
    "host_allowed",
    "parse_address_entry",
    "parse_host_entry",
    "resolve",
    "DISPOSE_GRACE_S",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["allowed_hosts"],
    "properties": {
        "allowed_hosts": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "string", "minLength": 1},
            "description": 'hosts the tool may fetch from: "example.com", "*.python.org", '
            '"127.0.0.1:8080" (with a port: that port only), "::1", "[::1]:8080"',
        },
        "timeout_s": {"type": "number", "exclusiveMinimum": 0, "default": 15},
        "max_bytes": {
            "type": "integer",
            "minimum": 1024,
            "default": 1048576,
            "description": "most bytes of a response body that are read",
        },
        "max_redirects": {"type": "integer", "minimum": 0, "default": 5},
        "max_concurrent": {
            "type": "integer",
            "minimum": 1,
            "default": 8,
            "description": "most fetches in flight at once; more wait their turn, within their timeout_s",
        },
        "allowed_addresses": {
            "type": "array",
            "default": [],
            "items": {"type": "string", "minLength": 1},
            "uniqueItems": True,
            "description": "addresses and networks that are not public (loopback, private, "
            'link-local, ...) but may be connected to: "10.20.0.0/16", '
            '"127.0.0.1", "::1". By default only public addresses are.',
        },
        "example_url": {"type": "string", "description": "the URL of the tool's example (for the conformance kit)"},
        "dispose_grace_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": 5,
            "description": "how long disposing the plugin waits for HTML conversions already running; then it "
            "warns and leaves them to finish alone",
        },
    },
}

_BLOCKS = {
    "p",
    "div",
    "br",
    "li",
    "ul",
    "ol",
    "tr",
    "table",
    "section",
    "article",
    "header",
    "footer",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "pre",
    "blockquote",
    "hr",
    "title",
    "nav",
    "main",
    "dd",
    "dt",
}
# Not "head": its end tag may be left out (``<head><title>T</title><body>...``), and skipping until a
# </head> that never comes would drop the whole page. What else a head holds is skipped or has no text.
_SKIPPED = {"script", "style", "noscript", "template", "svg"}


# Private-use stand-ins for the spaces and tabs of <pre> text while lines are collapsed.
_PRE_PROTECT = str.maketrans({" ": "\ue000", "\t": "\ue001", "\r": "\n"})
_PRE_RESTORE = str.maketrans({"\ue000": " ", "\ue001": "\t"})


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        # The title's pieces (markup inside <title> splits its text), joined once: appending each to the whole
        # title so far copies it every time, quadratic in a title of many pieces.
        self.title_parts: list[str] = []
        self._skip = 0
        self._pre = 0  # inside <pre>: line breaks and indentation are the text's
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title" and not self._skip and not self.title_parts and not self._in_title:
            self._in_title = True
        elif tag in _SKIPPED or tag == "title":
            # Any other <title> (an inline SVG icon's, a stray second one) is not the page's, nor shown.
            self._skip += 1
        elif tag == "pre":
            self._pre += 1
        if tag in _BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title" and self._in_title:
            self._in_title = False
        elif (tag in _SKIPPED or tag == "title") and self._skip:
            self._skip -= 1
        elif tag == "pre" and self._pre:
            self._pre -= 1
        if tag in _BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title_parts.append(data)
        elif self._skip:
            pass
        elif self._pre:
            # Kept as written: spaces and tabs in a form the whitespace collapsing leaves alone.
            self.parts.append(data.replace("\r\n", "\n").translate(_PRE_PROTECT))
        else:
            # Source line breaks are just whitespace in HTML; lines come from block elements.
            self.parts.append(re.sub(r"\s+", " ", data))


def html_to_text(html: str) -> tuple[str | None, str]:
    """``(title, text)`` of an HTML document: scripts/styles dropped, whitespace collapsed per line."""
    parser = _TextExtractor()
    parser.feed(html)
    # What feed() leaves is one construct that the end of the document cut (a tag, comment, <!...>, <?...>),
    # or an unclosed script/style. close() in html.parser before Python 3.13.4 (CVE-2025-6069) turns such a
    # construct into text one "<" at a time, rescanning the rest for each: quadratic, on the event loop.
    # A browser drops it (end of file in a tag or comment), as newer html.parser does; so it is dropped here.
    # A lone "<" or "</" at the very end is text, in both.
    rest = parser.rawdata
    if rest.startswith("<") and rest not in ("<", "</") and not getattr(parser, "cdata_elem", None):
        parser.rawdata = ""
    parser.close()
    lines = (
        re.sub(r"\s+", " ", line).strip().translate(_PRE_RESTORE).rstrip() for line in "".join(parser.parts).split("\n")
    )
    text = "\n".join(line for line in lines if line)
    raw_title = "".join(parser.title_parts)
    title = re.sub(r"\s+", " ", raw_title).strip() if raw_title else None
    return title, text


def parse_host_entry(entry: str) -> tuple[str, str]:
    """``(host pattern, port or "")`` of an ``allowed_hosts`` entry.

    ``host``, ``host:port``, ``[v6]``, ``[v6]:port``; a bare address with several
    colons (``::1``) is an IPv6 host without a port. :class:`ValueError` if malformed.
    """
    text = entry.strip().lower()
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"malformed allowed_hosts entry {entry!r}: expected [address] or [address]:port")
        port = rest[1:]
        if rest and not port:
            raise ValueError(f"malformed allowed_hosts entry {entry!r}: empty port")
    elif text.count(":") > 1:
        host, port = text, ""  # a bare IPv6 address; write [address]:port to name a port
    else:
        host, colon, port = text.partition(":")
        if colon and not port:
            raise ValueError(f"malformed allowed_hosts entry {entry!r}: empty port")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"malformed allowed_hosts entry {entry!r}: expected host, host:port or [address]:port")
    return host, port


def parse_address_entry(entry: str) -> IPNetwork:
    """The network of an ``allowed_addresses`` entry (an address is a network of one). :class:`ValueError` if not."""
    try:
        return ipaddress.ip_network(entry.strip(), strict=True)
    except ValueError as error:
        raise ValueError(
            f"malformed allowed_addresses entry {entry!r}: {error}; expected an address or a network "
            "such as 10.20.0.0/16 (not a host name: a name's address is what DNS rebinding changes)"
        ) from None


# NAT64 (RFC 6052): a gateway carries 64:ff9b::a.b.c.d to the IPv4 address a.b.c.d.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# Networks the ipaddress module classifies differently across Python versions (3.13 and the 2024 security
# releases count them as private, 3.11.7 and 3.12.1 as global); named here so every version refuses them.
_ALWAYS_REFUSED: tuple[tuple[IPNetwork, str], ...] = (
    (ipaddress.IPv4Network("192.0.0.0/24"), "an IETF protocol assignment (192.0.0.0/24)"),
    # RFC 8215: a network's own NAT64 prefix, the IPv4 address inside it at a place only that network knows.
    (ipaddress.IPv6Network("64:ff9b:1::/48"), "a local-use NAT64 address"),
)


def _non_public(ip: IPAddress) -> str | None:
    """What kind of non-public address ``ip`` is ("a loopback address", ...), or None for a public unicast one.

    ``is_global`` alone is not enough: multicast, site-local and the deprecated
    IPv4-compatible ``::a.b.c.d`` count as global in some Python versions.
    """
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast:
        return "a multicast address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "a site-local address"
    for network, kind in _ALWAYS_REFUSED:
        if ip in network:
            return kind
    if ip.is_private:
        return "a private address"
    if ip.is_reserved:
        return "a reserved address"
    if not ip.is_global:
        return "not a globally routable address"
    return None


def address_refusal(address: str, allowed: Sequence[IPNetwork] = ()) -> str | None:
    """Why a connection to ``address`` is refused, or None if the address is public or in ``allowed``.

    An IPv6 address that carries an IPv4 destination is judged by that IPv4
    address: ``::ffff:127.0.0.1`` (IPv4-mapped) is loopback, ``64:ff9b::a00:1``
    (NAT64) reaches 10.0.0.1, and a 6to4 address ``2002:a00:1::`` reaches 10.0.0.1
    through a relay. (Only that IPv4 address: whether 2002::/16 itself counts as
    global depends on the Python version.)
    """
    ip = ipaddress.ip_address(address)
    if any(ip in network for network in allowed):
        return None
    judged: list[tuple[IPAddress, str]] = [(ip, "")]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            judged = [(ip.ipv4_mapped, f"the IPv4-mapped form of {ip.ipv4_mapped}, ")]
        elif ip in _NAT64:
            embedded = ipaddress.IPv4Address(ip.packed[-4:])
            judged = [(embedded, f"a NAT64 address for {embedded}, ")]
        elif ip.sixtofour is not None:
            judged = [(ip.sixtofour, f"a 6to4 address for {ip.sixtofour}, ")]
    for form, how in judged:
        kind = _non_public(form)
        if kind and not any(form in network for network in allowed):
            return how + kind
    return None


# getaddrinfo blocks, so it runs on the loop's default executor, which the rest of the process shares
# (asyncio.to_thread, other clients' lookups) and which has min(32, cpus + 4) threads. A name whose DNS
# never answers holds a thread until the system resolver gives up, long after the fetch timed out; at most
# this many threads are ever in the plugin's lookups, so a burst of such fetches stalls only fetches.
_LOOKUP_THREADS = 2
_lookup_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _lookup_done(lookup: asyncio.Future[Any], slots: asyncio.Semaphore) -> None:
    slots.release()
    if not lookup.cancelled():
        lookup.exception()  # retrieved: nobody awaits a lookup whose fetch gave up


async def resolve(host: str, port: int) -> list[str]:
    """The addresses a connection to ``host`` may use, in the resolver's order; an IP literal is itself.

    The one lookup of a connection: the addresses returned here are checked and
    then connected to, so there is no second lookup that could answer otherwise.
    """
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    slots = _lookup_slots.setdefault(loop, asyncio.Semaphore(_LOOKUP_THREADS))
    await slots.acquire()
    try:
        lookup = loop.run_in_executor(None, socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    except BaseException:
        slots.release()
        raise
    # The slot is freed when the thread is, not when the caller gives up: a cancelled await (timeout, abort)
    # leaves getaddrinfo running until the system resolver gives up, and that thread is still taken.
    lookup.add_done_callback(lambda done: _lookup_done(done, slots))
    infos = await asyncio.shield(lookup)
    addresses: list[str] = []
    for family, _type, _proto, _name, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6) and sockaddr[0] not in addresses:
            addresses.append(str(sockaddr[0]))
    return addresses


# HTML is converted on threads of the plugin's own, not on the loop's default executor, whose threads the
# DNS lookups (above) and the rest of the process share: a burst of large pages (about 2 s per MiB at worst)
# would hold up every lookup behind it. Two: conversions are CPU-bound and share the GIL anyway.
_CONVERTER_THREADS = 2
_CONVERTER_NAME = "dsh-http-fetch-html"

# A conversion cannot be interrupted: html.parser holds its thread until the page is done (seconds per hostile
# MiB, longer on a loaded machine). Disposing the plugin waits this long (config: dispose_grace_s) for the ones
# running, then warns and leaves them, rather than hold the disposal (and whatever waits on it) for as long.
DISPOSE_GRACE_S = 5.0

log = logging.getLogger("dsh.http_fetch")

_Conversion = concurrent.futures.Future[tuple[str | None, str]]


class _Converter:
    """The plugin's converter threads: :func:`html_to_text` of each submitted page, in submission order.

    Not a ``ThreadPoolExecutor``: the interpreter joins its threads at exit, so a conversion that dispose
    gave up on would still hold the exit of the process until it ended. These are daemon threads; nothing
    is lost if one is cut off at exit, as the result of a conversion dispose gave up on goes nowhere.
    """

    def __init__(self, threads: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[_Conversion, str] | None] = queue.SimpleQueue()
        # Taken to start a conversion and to fail one from outside its thread, so neither happens inside the other.
        self._lock = threading.Lock()
        self._running: dict[threading.Thread, _Conversion] = {}  # what each thread converts now
        self.threads = [
            threading.Thread(target=self._work, name=f"{_CONVERTER_NAME}_{index}", daemon=True)
            for index in range(threads)
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, html: str) -> _Conversion:
        """Queue a conversion of ``html``; its future (one cancelled or failed before it starts is skipped)."""
        future: _Conversion = concurrent.futures.Future()
        self._jobs.put((future, html))
        return future

    def fail(
        self, conversions: dict[_Conversion, str], why: Callable[[str], str], *, running: bool
    ) -> dict[_Conversion, str]:
        """Fail those of ``conversions`` not done and started (``running``) or not, with ``ToolError(why(url))``.

        A failed conversion that was queued is never started; one that was running delivers its result nowhere.
        """
        failed: dict[_Conversion, str] = {}
        with self._lock:
            for future, url in conversions.items():
                if not future.done() and future.running() == running:
                    future.set_exception(ToolError(why(url)))
                    failed[future] = url
        return failed

    def stop(self) -> None:
        """Let each thread end once it has run or skipped what is queued before now."""
        for _ in self.threads:
            self._jobs.put(None)

    def busy_with(self, conversions: Iterable[_Conversion]) -> set[threading.Thread]:
        """The threads running one of ``conversions``."""
        wanted = set(conversions)
        with self._lock:
            return {thread for thread, future in self._running.items() if future in wanted}

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(*job)
            del job  # an idle thread holds no page

    def _run(self, future: _Conversion, html: str) -> None:
        me = threading.current_thread()
        with self._lock:
            # A future failed by fail() is done: set_running_or_notify_cancel would raise on it.
            if future.done() or not future.set_running_or_notify_cancel():
                return
            self._running[me] = future
        outcome: tuple[str | None, str] | BaseException
        try:
            outcome = html_to_text(html)
        except BaseException as error:  # as ThreadPoolExecutor: the awaiting call gets it
            outcome = error
        with self._lock:
            del self._running[me]
        # fail() may have given up on this conversion and finished its future: the result goes nowhere.
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)


def _is_ip_literal(host: str) -> bool:
    """True if ``host`` is an IP address in any spelling (``::ffff:127.0.0.1``): it is connected to, not looked up."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class AddressRefused(Exception):
    """A connection to ``host`` would go to ``address``, which is not public and not allowed."""

    def __init__(self, host: str, address: str, reason: str) -> None:
        super().__init__(f"host {host!r} {'is' if _is_ip_literal(host) else 'resolves to'} {address} ({reason})")
        self.host, self.address, self.reason = host, address, reason


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """Opens the fetch's TCP connections: resolve once, check every address, connect to a checked one.

    httpcore hands ``connect_tcp`` the URL's host name; the socket is opened to
    the IP address that was checked (an IP literal needs no lookup in anyio),
    while httpcore still uses the name for TLS (SNI and the certificate check)
    and httpx for the ``Host`` header.
    """

    def __init__(self, allowed: Sequence[IPNetwork]) -> None:
        self._allowed = tuple(allowed)
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                addresses = await resolve(host, port)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host!r} timed out") from None
        except (OSError, UnicodeError) as error:  # UnicodeError: getaddrinfo's idna encoding (an empty or long label)
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {error}") from None
        if not addresses:
            raise httpcore.ConnectError(f"{host!r} resolves to no address")
        # All of them, before any connection: a name with one internal answer among public ones is refused.
        for address in addresses:
            reason = address_refusal(address, self._allowed)
            if reason:
                raise AddressRefused(host, address, reason)
        for address in addresses[:-1]:  # one after another, in the resolver's order; the last one's error is raised
            with contextlib.suppress(httpcore.ConnectError, httpcore.ConnectTimeout):
                return await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
        return await self._inner.connect_tcp(
            addresses[-1], port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _CheckedTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport (request and error mapping, streaming) on a pool that connects via the backend.

    httpx 0.28 takes no network backend, so the pool it builds is replaced by one
    that has ours; if a later httpx keeps its pool elsewhere this refuses to build
    rather than fetch unchecked (and the tests that pin the check fail).
    """

    def __init__(self, backend: _CheckedBackend, ssl_context: ssl.SSLContext) -> None:
        super().__init__(verify=ssl_context, trust_env=False)
        if not isinstance(getattr(self, "_pool", None), httpcore.AsyncConnectionPool):
            raise ToolError(
                "http-fetch: this httpx version has no connection pool where expected, so the address "
                "check cannot be installed; refusing to fetch"
            )
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context, network_backend=backend, keepalive_expiry=5.0
        )


def host_allowed(url: httpx.URL, allowed: list[str]) -> bool:
    """True if the URL's host (and port, when an entry names one) matches an allowed entry."""
    # Compared in ASCII (IDNA) form, the name that is looked up: httpx's url.host is Unicode only when the
    # first label is xn-- (www.xn--bcher-kva.de stays ASCII), so "*.bücher.de" or "xn--bcher-kva.de" missed.
    host = _normal_host(url.raw_host.decode("ascii", errors="replace"))
    port = url.port or (443 if url.scheme == "https" else 80)
    for entry in allowed:
        pattern, want_port = parse_host_entry(entry)
        if want_port and want_port != str(port):
            continue
        if fnmatch.fnmatchcase(host, _normal_host(_ascii_pattern(pattern))):
            return True
    return False


def _normal_host(host: str) -> str:
    """``host`` (a URL's, or an entry's pattern) as compared: lower case, no trailing dot, an IP address compressed.

    ``docs.python.org.`` is ``docs.python.org``, and ``0:0::1`` and ``::FFFF:1.2.3.4`` are ``::1`` and
    ``::ffff:102:304``, in a URL and in an entry alike.
    """
    host = host.lower().rstrip(".")
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host))
    return host


def _ascii_pattern(pattern: str) -> str:
    """An ``allowed_hosts`` host pattern with its Unicode labels in IDNA form, as httpx encodes a URL's host."""
    if pattern.isascii():
        return pattern
    labels = pattern.rstrip(".").split(".")
    for index, label in enumerate(labels):
        if not label.isascii() and not any(c in label for c in "*?["):
            # A label IDNA refuses stays Unicode: no URL's host has it, so the pattern matches nothing.
            with contextlib.suppress(idna.IDNAError):
                labels[index] = idna.alabel(label).decode("ascii")
    return ".".join(labels)


class HttpFetch:
    """The plugin instance: the allow list, limits and the ``fetch`` tool."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.allowed: list[str] = list(config["allowed_hosts"])
        try:
            parsed = [parse_host_entry(entry) for entry in self.allowed]
        except ValueError as error:
            raise ToolError(f"http-fetch: {error}") from None
        self.timeout_s: float = config.get("timeout_s", 15)
        self.max_bytes: int = config.get("max_bytes", 1048576)
        self.max_redirects: int = config.get("max_redirects", 5)
        self.max_concurrent: int = config.get("max_concurrent", 8)
        # One per event loop: a semaphore is bound to the loop it first waits on.
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        try:
            self.allowed_addresses: list[IPNetwork] = [
                parse_address_entry(entry) for entry in config.get("allowed_addresses", [])
            ]
        except ValueError as error:
            raise ToolError(f"http-fetch: {error}") from None
        self._ssl_context: ssl.SSLContext | None = None
        grace = config.get("dispose_grace_s", DISPOSE_GRACE_S)
        if not is_positive_seconds(grace):
            raise ToolError(f"http-fetch: dispose_grace_s must be a positive finite number of seconds, not {grace!r}")
        self.dispose_grace_s: float = grace
        self._converter: _Converter | None = None  # started by the first conversion
        self._conversions: dict[_Conversion, str] = {}  # each to the URL of its page
        self._conversions_lock = threading.Lock()  # the dict loses its futures on the converter's threads
        self._closed = False
        concrete = next((_netloc(h, p) for h, p in parsed if "*" not in h and "?" not in h and "[" not in h), None)
        example = config.get("example_url") or (f"https://{concrete}/" if concrete else None)
        self.examples = [{"url": example}] if example else []

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        """Register ``fetch``."""
        register(
            define_tool(
                name="fetch",
                description=(
                    "Fetch a web page or text document with HTTP GET and return its text (HTML is "
                    f"converted to plain text). Allowed hosts: {', '.join(self.allowed)}. Responses are "
                    f"cut at {self.max_bytes} bytes."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "url": {"type": "string", "description": "an http(s) URL on an allowed host"},
                        "raw": {
                            "type": "boolean",
                            "default": False,
                            "description": "return HTML source instead of extracted text",
                        },
                    },
                    "required": ["url"],
                    "additionalProperties": False,
                },
                output_schema={
                    "type": "object",
                    "properties": {
                        "url": {"type": "string"},
                        "status": {"type": "integer"},
                        "content_type": {"type": "string"},
                        "title": {"type": ["string", "null"]},
                        "text": {"type": "string"},
                        "truncated": {"type": "boolean"},
                    },
                    "required": ["url", "status", "content_type", "title", "text", "truncated"],
                },
                execute=self.fetch,
                render=_render,
                is_concurrency_safe=True,
                examples=self.examples,
                annotations={"read_only": True},
            )
        )

    def _check(self, raw: str, *, via: str | None = None) -> httpx.URL:
        prefix = f"redirect from {via} to {raw} refused: " if via else ""
        try:
            url = httpx.URL(raw)
            url.host  # noqa: B018 -- an "xn--" host is IDNA-decoded only here, and may raise (IDNAError)
        except Exception as error:
            raise ToolError(f"{prefix}invalid URL {raw!r}: {error}") from None
        # httpx takes any integer as a port; the socket layer would raise OverflowError, in anyio's task group.
        if url.port is not None and not 0 <= url.port <= 65535:
            raise ToolError(f"{prefix}invalid URL {raw!r}: port {url.port} is not a TCP port (0 to 65535)")
        if url.scheme not in ("http", "https"):
            raise ToolError(f"{prefix}only http and https URLs can be fetched, not {url.scheme or 'a relative URL'!r}")
        if not url.host:
            raise ToolError(f"{prefix}the URL {raw!r} names no host")
        if not host_allowed(url, self.allowed):
            raise ToolError(
                f"{prefix}host {url.host!r} is not in the allowed hosts ({', '.join(self.allowed)}); "
                "ask the user to add it to allowed_hosts in the http-fetch config"
            )
        return url

    async def fetch(self, args: Any, ctx: ToolContext) -> Any:
        """Body of ``fetch``: the request races the call's abort signal."""
        url = self._check(args["url"])
        work = asyncio.ensure_future(self._fetch(url, bool(args.get("raw", False))))
        try:
            await ctx.signal.until(work)
        finally:
            if not work.done():
                work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        if ctx.signal.aborted:
            raise AbortedError(ctx.signal.reason)
        return work.result()

    async def _fetch(self, url: httpx.URL, raw: bool) -> dict[str, Any]:
        # httpx's timeout bounds each network operation; this one bounds the whole call (a server
        # dripping a byte at a time, redirects, the body), and the wait for a slot with it: a call
        # queued behind max_concurrent others still ends within its own timeout_s.
        slots = self._slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(self.max_concurrent))
        waiting = True
        try:
            async with asyncio.timeout(self.timeout_s):
                async with slots:
                    waiting = False
                    return await self._request(url, raw)
        except TimeoutError:
            if waiting:
                raise ToolError(
                    f"fetching {url} timed out after {self.timeout_s:g} s waiting for its turn: "
                    f"max_concurrent ({self.max_concurrent}) fetches were in flight"
                ) from None
            raise ToolError(
                f"fetching {url} timed out after {self.timeout_s:g} s (timeout_s bounds the whole "
                "request: connecting, redirects and reading the body)"
            ) from None

    async def _request(self, url: httpx.URL, raw: bool) -> dict[str, Any]:
        timeout = httpx.Timeout(self.timeout_s)
        if self._ssl_context is None:  # built on first use (loading the CA bundle takes a moment), then shared
            self._ssl_context = httpx.create_ssl_context(trust_env=False)
        transport = _CheckedTransport(_CheckedBackend(self.allowed_addresses), self._ssl_context)
        via: httpx.URL | None = None
        try:
            # trust_env=False: no proxies or netrc credentials from the environment.
            async with httpx.AsyncClient(
                transport=transport, follow_redirects=False, timeout=timeout, trust_env=False
            ) as client:
                for _ in range(self.max_redirects + 1):
                    headers = {"Accept": _ACCEPT, "Accept-Encoding": _ACCEPT_ENCODING}
                    async with client.stream("GET", url, headers=headers) as response:
                        if response.is_redirect:
                            location = response.headers.get("location", "")
                            via, url = url, self._check(str(url.join(location)), via=str(url))
                            continue
                        return await self._read(url, response, raw)
                raise ToolError(f"more than {self.max_redirects} redirects starting from the URL; giving up")
        except AddressRefused as refused:
            what = f"redirect from {via} to {url}" if via is not None else f"fetching {url}"
            raise ToolError(
                f"{what} refused: {refused}; only public addresses are connected to, unless the "
                "address or its network is in allowed_addresses in the http-fetch config"
            ) from None
        except UnicodeError as error:
            # httpx prepares a redirect's next request itself, even when not following it, and an "xn--" host
            # in the Location that is not valid IDNA raises IDNAError there, which is no httpx.HTTPError.
            raise ToolError(
                f"redirect from {url} refused: its Location header is an invalid URL ({type(error).__name__}: {error})"
            ) from None
        except httpx.TimeoutException:
            raise ToolError(f"fetching {url} timed out after {self.timeout_s:g} s") from None
        except httpx.HTTPError as error:
            raise ToolError(f"fetching {url} failed: {type(error).__name__}: {error}") from None

    async def _read(self, url: httpx.URL, response: httpx.Response, raw: bool) -> dict[str, Any]:
        content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
        textual = content_type.startswith("text/") or content_type.endswith(_TEXT_SUFFIXES) or not content_type
        if not textual:
            if response.status_code >= 400:  # the status says more than the type of its error page
                raise ToolError(
                    f"HTTP {response.status_code} {response.reason_phrase} for {url} (its body is "
                    f"{content_type}, not shown)"
                )
            raise ToolError(f"{url} is {content_type}, not text; only text documents can be fetched")
        body = await self._body(url, response)
        truncated = len(body) > self.max_bytes
        del body[self.max_bytes :]
        html = content_type in ("text/html", "application/xhtml+xml")
        charset = response.charset_encoding
        if charset is None and content_type.endswith("xml"):
            charset = _xml_encoding(body)
        if charset is None and html:
            charset = _meta_charset(body)
        text = _decode(body, charset)
        title = None
        if html and not raw:
            # On a worker thread: html.parser takes a few microseconds per "<", seconds for a hostile megabyte,
            # and on the event loop that would stall every other call and stream of the process.
            title, text = await self._convert(url, text)
        if response.status_code >= 400:
            snippet = text[:500] + ("..." if len(text) > 500 else "")
            raise ToolError(f"HTTP {response.status_code} {response.reason_phrase} for {url}: {snippet}")
        return {
            "url": str(url),
            "status": response.status_code,
            "content_type": content_type or "unknown",
            "title": title,
            "text": text,
            "truncated": truncated,
        }

    async def _convert(self, url: httpx.URL, html: str) -> tuple[str | None, str]:
        """:func:`html_to_text` of ``html`` (the page at ``url``) on the plugin's converter threads."""
        if self._closed:
            raise ToolError(
                "http-fetch was shut down while fetching (its plugin was disposed); the page was not converted"
            )
        if self._converter is None:
            self._converter = _Converter(_CONVERTER_THREADS)
        future = self._converter.submit(html)
        with self._conversions_lock:
            self._conversions[future] = str(url)
        future.add_done_callback(self._forget_conversion)
        # A call that ends (timeout, abort) while its page waits in the queue cancels the conversion; one that
        # is already running cannot be stopped, and finishes in the background, its result dropped.
        return await asyncio.wrap_future(future)

    def _forget_conversion(self, future: _Conversion) -> None:
        with self._conversions_lock:
            self._conversions.pop(future, None)

    async def aclose(self) -> None:
        """Stop the converter threads, waiting at most ``dispose_grace_s`` for running conversions.

        Queued conversions are dropped, and later fetches of HTML fail. A running conversion cannot be
        interrupted: it is waited for, without blocking the event loop, for at most the grace; one still
        running then is named in a warning and left to finish on its daemon thread, its result delivered
        nowhere. A call still awaiting a dropped or abandoned page gets an error saying so.
        """
        self._closed = True
        converter, self._converter = self._converter, None
        if converter is None:
            return
        converter.stop()
        with self._conversions_lock:
            conversions = dict(self._conversions)
        shut = "http-fetch was shut down (its plugin was disposed)"
        queued = converter.fail(conversions, lambda url: f"{shut} before converting the page at {url}", running=False)
        waits = [asyncio.wrap_future(future) for future in conversions if future not in queued]
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            if waits:
                await asyncio.wait(waits, timeout=self.dispose_grace_s)
        finally:  # a disposal cancelled during the grace gives up at once
            for wait in waits:
                wait.cancel()  # done, or its conversion is failed below: nothing more is set on it
            abandoned = converter.fail(
                conversions, lambda url: f"{shut} while still converting the page at {url}", running=True
            )
            if abandoned:
                # Cancelled, the disposal waited less than its grace: say how long it did wait.
                waited = min(loop.time() - began, self.dispose_grace_s)
                log.warning(
                    "http-fetch: disposed while %d HTML conversion(s) still ran after %.3g s of the %g s grace "
                    "(dispose_grace_s); they are left to finish on daemon threads, their results dropped: %s",
                    len(abandoned),
                    waited,
                    self.dispose_grace_s,
                    ", ".join(abandoned.values()),
                )
        stuck = converter.busy_with(abandoned)
        for thread in converter.threads:
            if thread not in stuck:
                thread.join()  # idle, or ending its last conversion: the join does not block the loop

    async def _body(self, url: httpx.URL, response: httpx.Response) -> bytearray:
        """The decoded body, read from the raw bytes up to ``max_bytes + 1`` (one more: whether it was cut)."""
        header = response.headers.get("content-encoding", "")
        codings = _content_codings(header)
        refused = next((c for c in codings if c not in _DECODED_CODINGS), None)
        if refused is not None:
            raise _body_error(
                url,
                response,
                f"the body's Content-Encoding {refused!r} was not asked for and "
                "cannot be decoded (only gzip and deflate are)",
            )
        if len(codings) > _MAX_CODINGS:
            raise _body_error(
                url,
                response,
                f"the body has {len(codings)} stacked content encodings ({header}); at most {_MAX_CODINGS} are decoded",
            )
        limit = self.max_bytes + 1
        raw_limit = 2 * limit + _DECODED_CHUNK
        decoding = _Decoding(codings, raw_limit)
        raw = 0
        body = bytearray()
        try:
            async for chunk in response.aiter_raw():
                raw += len(chunk)
                decoding.feed(chunk)
                while len(body) < limit and (out := decoding.read(min(_DECODED_CHUNK, limit - len(body)))):
                    body += out
                if len(body) >= limit:
                    return body
                if raw > raw_limit:
                    # Compressed data is never much larger than what it holds, so such a body is a stream of
                    # empty blocks or members, or endless bytes after its end: it would be read (and
                    # inflated) until the timeout for nothing. (_Decoding holds inner codings to the same.)
                    raise _Overlong
            decoding.finish()
        except _Overlong:
            raise _body_error(
                url,
                response,
                f"the body's {header} data took more than {raw_limit} bytes to decode "
                f"to {len(body)}; compressed data is never that much larger than what "
                "it holds",
            ) from None
        except _Undecodable as error:
            raise _body_error(url, response, str(error)) from None
        return body


# Media types outside text/* that are text: JSON, XML and YAML with their "+json", "+xml", "+yaml" suffixes
# (application/ld+json, image/svg+xml, application/openapi+yaml), and scripts, TOML and SQL (application/yaml,
# application/x-yaml, application/toml, application/sql, application/ecmascript).
_TEXT_SUFFIXES = ("json", "xml", "yaml", "javascript", "ecmascript", "toml", "sql")

# The media types the request prefers: text, HTML and JSON first. Every range is "type/subtype", "type/*" or
# "*/*" (RFC 9110, section 12.5.1): servers that parse Accept strictly answer 406 to a malformed one such as
# "*/json". "*/*" comes last, as browsers send it, so a server that negotiates strictly answers with what it has
# rather than 406; a type that is not text is then refused by its Content-Type, before its body is read.
_ACCEPT = "text/html, application/xhtml+xml, application/json, text/*;q=0.9, application/xml;q=0.9, */*;q=0.1"

# The content codings the request offers. The plugin decodes them itself, from the raw bytes, because httpx's
# decoders have no limit on their output: each raw chunk becomes one decoded chunk, so a 64 KiB read of a gzip
# bomb would be 64 MiB in memory before the size cap could cut it.
_ACCEPT_ENCODING = "gzip, deflate, identity"
_DECODED_CODINGS = ("gzip", "x-gzip", "deflate")  # x-gzip: an old name of gzip (RFC 9110, section 8.4.1.3)
_MAX_CODINGS = 3  # "gzip, gzip" is legal but unheard of; each stacked coding holds its own zlib window
_DECODED_CHUNK = 64 * 1024  # the most a coding decodes at a time into the next one


class _Undecodable(Exception):
    """The body is not what its Content-Encoding says (corrupt, or cut before its compressed stream ends)."""


class _Overlong(Exception):
    """A coding took more input than any honest body needs to reach the size cap (see :class:`_Decoding`)."""


class _Identity:
    """No coding: the raw bytes, at most ``limit`` at a time."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> None:
        self._pending += data

    def read(self, limit: int) -> bytes:
        out, self._pending = self._pending[:limit], self._pending[limit:]
        return out

    def finish(self) -> None:
        pass


class _Inflater:
    """One gzip or deflate coding undone with zlib, never more than ``limit`` bytes per read (``max_length``).

    Input that does not fit the limit waits in ``unconsumed_tail`` until the next read. A gzip body
    may hold several members, one after another; what follows the first member and is not a member
    is ignored, as other clients do, and so is anything after a deflate stream.
    """

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._gzip = coding != "deflate"
        self._zlib: Any = zlib.decompressobj(16 + zlib.MAX_WBITS) if self._gzip else None  # deflate: see read
        self._pending = b""
        self._seen = False  # any input: an empty body is empty in every coding
        self._complete = False  # the first stream ended
        self._ignoring = False  # the rest of the body is after the end

    def feed(self, data: bytes) -> None:
        self._seen = self._seen or bool(data)
        if not self._ignoring:
            self._pending += data

    def read(self, limit: int) -> bytes:
        while self._pending:
            if self._zlib is None:
                if len(self._pending) < 2:
                    return b""
                self._zlib = zlib.decompressobj(_deflate_wbits(self._pending[:2]))
            elif self._zlib.eof:
                if not self._gzip:
                    self._pending, self._ignoring = b"", True
                    return b""
                self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)  # the next member
            try:
                out: bytes = self._zlib.decompress(self._pending, limit)
            except zlib.error as error:
                if self._complete:  # trailing bytes after a whole member
                    self._pending, self._ignoring = b"", True
                    return b""
                raise _Undecodable(f"the body is not valid {self.coding} data ({error})") from None
            if self._zlib.eof:
                self._complete = True
                self._pending = self._zlib.unused_data
            else:
                self._pending = self._zlib.unconsumed_tail
            if out:
                return out
        return b""

    def finish(self) -> None:
        """Raise :class:`_Undecodable` if the input ended inside the first compressed stream."""
        if self._seen and not self._complete:
            raise _Undecodable(f"the body's {self.coding} data ends before its compressed stream does")


def _deflate_wbits(head: bytes) -> int:
    """zlib's wbits for a deflate body starting with ``head`` (its first two bytes).

    "deflate" is zlib-wrapped deflate (RFC 1950), but some servers send raw deflate. zlib's own
    check of the two header bytes decides, as trying the wrapper first and falling back to raw
    deflate on an error at the start would, without holding the input for a second try.
    """
    try:
        zlib.decompressobj().decompress(head)
    except zlib.error:
        return -zlib.MAX_WBITS
    return zlib.MAX_WBITS


class _Decoding:
    """A body's content codings undone: raw bytes are fed in, decoded bytes read out at most ``limit`` at a time.

    ``Content-Encoding: deflate, gzip`` was deflated, then gzipped: the last coding is undone first.
    Every stage is bounded, so what is in memory at once is a few chunks, whatever the body expands to.

    An inner coding may be fed at most ``most_input`` bytes (:class:`_Overlong` past that), as the
    caller holds the raw bytes to: an outer coding expands a thousandfold, so a few KiB of raw body
    could otherwise feed an inner one gigabytes of empty members or of bytes after its end, all
    decoded in one :meth:`read` on the event loop, where neither the timeout nor an abort can stop it.
    """

    def __init__(self, codings: Sequence[str], most_input: int) -> None:
        self._stages: list[_Identity | _Inflater] = [_Inflater(c) for c in reversed(codings)] or [_Identity()]
        self._most_input = most_input
        self._fed = [0] * len(self._stages)  # what each stage has been fed (stage 0: counted by the caller)

    def feed(self, data: bytes) -> None:
        self._stages[0].feed(data)

    def read(self, limit: int) -> bytes:
        """Up to ``limit`` decoded bytes; empty when everything fed so far is decoded."""
        return self._pull(len(self._stages) - 1, limit)

    def _pull(self, index: int, limit: int) -> bytes:
        stage = self._stages[index]
        while not (out := stage.read(limit)) and index:
            more = self._pull(index - 1, _DECODED_CHUNK)
            if not more:
                break
            self._fed[index] += len(more)
            if self._fed[index] > self._most_input:
                raise _Overlong
            stage.feed(more)
        return out

    def finish(self) -> None:
        for stage in self._stages:
            stage.finish()


# <meta charset="x"> and <meta http-equiv="Content-Type" content="text/html; charset=x">, in the first 1024 bytes
# (where WHATWG's prescan looks, and where a page must declare it).
_META_CHARSET = re.compile(rb"<meta[^>]*?charset\s*=\s*[\"']?\s*([a-z0-9_.:-]+)", re.IGNORECASE)


def _meta_charset(body: bytearray) -> str | None:
    """The charset an HTML page declares in a ``<meta>`` tag, for a response whose header declares none."""
    match = _META_CHARSET.search(body, 0, 1024)
    if match is None:
        return None
    return _declared_in_ascii(match.group(1))


# <?xml version="1.0" encoding="x"?> at the start of a document (RFC 7303, section 4.3: what names the encoding
# of an XML document whose Content-Type has no charset parameter and that has no BOM).
_XML_ENCODING = re.compile(rb"""\s*<\?xml\s[^>]*?encoding\s*=\s*["']([A-Za-z][A-Za-z0-9._-]*)["']""")


def _xml_encoding(body: bytearray) -> str | None:
    """The encoding an XML document's declaration names, for a response whose header declares none."""
    match = _XML_ENCODING.match(body[:1024])
    if match is None:
        return None
    return _declared_in_ascii(match.group(1))


def _declared_in_ascii(name: bytes) -> str:
    """The encoding a ``<meta>`` tag or an XML declaration names, as the body is decoded with.

    A UTF-16 one is read as UTF-8 (WHATWG's rule for ``<meta>``, applied to XML alike): a document the
    declaration could be read from in ASCII is not in UTF-16, which a byte order mark would have said.
    """
    encoding = name.decode("ascii").lower()
    return "utf-8" if encoding.startswith("utf-16") else encoding


_BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


# The Python codecs (by their canonical names) of the encodings of the WHATWG Encoding Standard, the ones a
# browser decodes a page with. A page declaring any other codec of Python's registry is read as UTF-8: the
# registry also holds codecs no page is written in, and some are hazards. utf-7 and the escape codecs turn
# ASCII bytes into lone surrogates ("a+2AA-b" is "a\ud800b"); punycode, a codec of host-name labels, decodes
# in time quadratic in the text (a 1 MiB page: minutes, on the event loop, where neither the timeout nor an
# abort can stop it) and garbles any ASCII page; bytes-to-bytes codecs (base64, zlib) are no text encoding.
_DOCUMENT_CODECS = frozenset(
    {
        "utf-8",
        "utf-16",
        "utf-16-le",
        "utf-16-be",
        "ascii",
        "cp866",
        "koi8-r",
        "koi8-u",
        "mac-roman",
        "mac-cyrillic",
        "cp874",
        "cp1250",
        "cp1251",
        "cp1252",
        "cp1253",
        "cp1254",
        "cp1255",
        "cp1256",
        "cp1257",
        "cp1258",
        *(f"iso8859-{part}" for part in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16)),
        "gbk",
        "gb2312",
        "gb18030",
        "big5",
        "big5hkscs",
        "euc_jp",
        "iso2022_jp",
        "shift_jis",
        "cp932",
        "euc_kr",
        "cp949",
    }
)


def _decode(body: bytearray, charset: str | None) -> str:
    """``body`` as text in its declared ``charset``, or UTF-8 if Python cannot decode text with that codec.

    A byte order mark comes first, as in browsers (WHATWG "BOM sniff"): it names the encoding whatever
    the header says, and is not part of the text. httpx passes on any name Python's codec registry
    knows; only the encodings browsers know (:data:`_DOCUMENT_CODECS`) are used, and a page declaring
    any other (``utf-7``, ``punycode``, ``base64``, an unknown name) is read as UTF-8.
    """
    for bom, codec in _BOMS:
        if body.startswith(bom):
            return body[len(bom) :].decode(codec, errors="replace")
    try:
        codec = "utf-8" if charset is None else codecs.lookup(charset).name
    except LookupError:
        codec = "utf-8"
    return body.decode(codec if codec in _DOCUMENT_CODECS else "utf-8", errors="replace")


def _content_codings(header: str) -> list[str]:
    """The codings a ``Content-Encoding`` value names, in the order they were applied (``identity`` dropped)."""
    return [c for c in (part.strip().lower() for part in header.split(",")) if c and c != "identity"]


def _netloc(host: str, port: str) -> str:
    """``host[:port]`` for a URL, an IPv6 address in brackets."""
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}" if port else shown


def _body_error(url: httpx.URL, response: httpx.Response, problem: str) -> ToolError:
    """Why the body of ``url`` cannot be shown; an error status comes first, as it says more."""
    if response.status_code >= 400:
        return ToolError(
            f"HTTP {response.status_code} {response.reason_phrase} for {url} (its body is not shown: {problem})"
        )
    return ToolError(f"fetching {url} failed: {problem}")


def _render(_args: Any, value: Any) -> str:
    head = f"{value['url']} ({value['status']}, {value['content_type']})"
    if value["title"]:
        head += f"\n# {value['title']}"
    tail = "\n[cut at the size limit]" if value["truncated"] else ""
    return f"{head}\n\n{value['text']}{tail}"


@plugin(config_schema=CONFIG_SCHEMA)
def http_fetch_plugin(scope: Scope, config: Any) -> HttpFetch:
    """Entry point ``http-fetch``: the ``fetch`` tool limited to ``config["allowed_hosts"]``."""
    instance = HttpFetch(dict(config))
    scope.on_dispose(instance.aclose)
    return instance


plugin = http_fetch_plugin

"""The documented standard-library preload works in a worker: common entry points, not just the imports.

A preloaded module may import a helper only when one of its functions is
first used (``datetime.strptime`` imports ``_strptime``); a worker's import
check would refuse that helper, naming a module the program never imported.
The entry points here run inside real workers at every level.
"""

from __future__ import annotations

import ast

from dsh_core.coderuntime import STDLIB_PRELOAD

from .conftest import run_one

#: name -> program text, run in a fresh namespace; each line a common entry point.
ENTRY_POINTS = {
    "datetime": r"""
import datetime
datetime.datetime.strptime("2024-05-01 12:00", "%Y-%m-%d %H:%M")
datetime.datetime.fromisoformat("2024-01-02T03:04:05+01:00")
datetime.date(2024, 1, 2).strftime("%A %B %d %c %x %X")
datetime.datetime.now().astimezone().tzname()
datetime.datetime.now(datetime.timezone.utc).isoformat()
""",
    "time": r"""
import time
time.strptime("2024", "%Y")
time.strftime("%c", time.localtime())
time.mktime(time.localtime())
time.gmtime(), time.monotonic(), time.perf_counter(), time.process_time(), time.ctime()
""",
    "calendar": r"""
import calendar
calendar.month_name[1], calendar.monthrange(2024, 2), calendar.isleap(2024), calendar.weekday(2024, 1, 1)
calendar.TextCalendar().formatmonth(2024, 1)
calendar.HTMLCalendar().formatmonth(2024, 1)
calendar.timegm((2024, 1, 1, 0, 0, 0))
""",
    "string": r"""
import string
string.Template("$a").substitute(a=1), string.capwords("a b"), string.Formatter().format("{0}", 1)
""",
    "collections": r"""
import collections, collections.abc
collections.namedtuple("P", "x y")(1, 2)._asdict()
collections.Counter("abca").most_common(1), collections.OrderedDict(a=1), collections.defaultdict(list)
collections.ChainMap({}, {}), collections.deque([1], maxlen=2)
collections.UserDict(), collections.UserList(), collections.UserString("x")
isinstance([], collections.abc.Sequence)
""",
    "typing": r"""
import typing
class P(typing.NamedTuple):
    x: int
class T(typing.TypedDict):
    a: int
class A:
    x: typing.Optional[typing.List[int]]
    y: "int"
class G(typing.Generic[typing.TypeVar("X")]):
    pass
@typing.runtime_checkable
class Pr(typing.Protocol):
    def f(self): ...
P(1), typing.get_type_hints(A), isinstance(1, Pr)
typing.get_origin(list[int]), typing.get_args(typing.Union[int, str])
""",
    "dataclasses": r"""
import dataclasses
@dataclasses.dataclass(frozen=True, order=True)
class A:
    x: int
    y: list = dataclasses.field(default_factory=list)
@dataclasses.dataclass(slots=True, kw_only=True)
class B:
    z: int = 0
dataclasses.asdict(A(1)), dataclasses.astuple(A(1)), dataclasses.replace(A(1), x=2), dataclasses.fields(A)
B(z=1), repr(A(1)), dataclasses.make_dataclass("C", ["a"])
""",
    "enum": r"""
import enum
class C(enum.StrEnum):
    A = enum.auto()
class F(enum.IntFlag):
    X = 1
    Y = 2
@enum.unique
class E(enum.Enum):
    A = 1
C.A, F.X | F.Y, E["A"], E(1), list(E), repr(F.X | F.Y)
""",
    "re": r"""
import re
re.sub("a", lambda m: "b", "aa"), re.escape("a.b"), re.findall(r"(?i)\w+", "Ab c"), re.split(r"\s+", "a b")
re.compile(r"(?P<x>\d+)").match("12").groupdict(), re.fullmatch("[\u00e9]", "\u00e9")
re.compile("a", re.VERBOSE | re.MULTILINE | re.DOTALL)
""",
    "statistics": r"""
import statistics, decimal, fractions
statistics.quantiles([1, 2, 3, 4, 5], n=4)
statistics.NormalDist(0, 1).cdf(0), statistics.NormalDist.from_samples([1, 2, 3]).inv_cdf(0.5)
statistics.correlation([1, 2, 3], [1, 2, 4]), statistics.covariance([1, 2, 3], [1, 2, 4])
statistics.linear_regression([1, 2, 3], [1, 2, 4])
statistics.mean([1, 2]), statistics.fmean([1.0]), statistics.geometric_mean([1, 2]), statistics.harmonic_mean([1])
statistics.median([1, 2, 3]), statistics.mode([1, 1]), statistics.stdev([1, 2]), statistics.pvariance([1, 2])
statistics.mean([decimal.Decimal(1)]), statistics.mean([fractions.Fraction(1, 3)])
""",
    "traceback": r"""
import traceback, sys
try:
    1 / 0
except Exception as e:
    traceback.format_exc(), traceback.format_exception(e), traceback.extract_tb(e.__traceback__)
    traceback.format_stack(), list(traceback.TracebackException.from_exception(e).format())
    traceback.print_exc(file=sys.stdout)
""",
    "uuid": r"""
import uuid
uuid.uuid1(), uuid.uuid3(uuid.NAMESPACE_DNS, "x"), uuid.uuid4(), uuid.uuid5(uuid.NAMESPACE_URL, "x")
uuid.UUID("12345678123456781234567812345678").hex, uuid.getnode()
""",
    "json": r"""
import json, datetime, decimal
json.dumps({"d": datetime.date(2024, 1, 1)}, default=str, indent=2, sort_keys=True, ensure_ascii=False)
json.loads('{"a": [1, 2.5, null]}', parse_float=decimal.Decimal), json.loads(b"[1]")
json.JSONDecoder().raw_decode("[1]")
try:
    json.loads("{")
except json.JSONDecodeError as e:
    str(e)
""",
    "decimal fractions": r"""
import decimal, fractions
with decimal.localcontext() as c:
    c.prec = 3
    decimal.Decimal(1) / 3
decimal.Decimal("1.2345").quantize(decimal.Decimal("0.01"), rounding=decimal.ROUND_HALF_UP)
format(decimal.Decimal("1234.5"), ",.2f"), decimal.Decimal(2).sqrt(), decimal.Decimal(10).ln()
fractions.Fraction("3/4") + fractions.Fraction(1.5), fractions.Fraction(0.1).limit_denominator(10)
""",
    "textwrap difflib": r"""
import textwrap, difflib
textwrap.dedent("  a"), textwrap.fill("a " * 100, 20), textwrap.indent("a", " "), textwrap.shorten("a b c d", 5)
difflib.get_close_matches("appel", ["apple"]), list(difflib.ndiff(["a"], ["b"]))
list(difflib.unified_diff(["a"], ["b"])), difflib.SequenceMatcher(None, "ab", "ac").ratio()
difflib.HtmlDiff().make_table(["a"], ["b"])
""",
    "pathlib": r"""
import pathlib, os.path
p = pathlib.PurePosixPath("/a/b.tar.gz")
p.suffixes, p.with_suffix(".x"), p.relative_to("/a"), p.match("*.gz"), pathlib.PurePath("a") / "b", p.as_uri()
pathlib.PureWindowsPath("c:/a").parts, os.path.relpath("/a/b", "/a"), os.path.expanduser("~")
""",
    "hashlib hmac secrets": r"""
import hashlib, hmac, secrets
hashlib.md5(b"x").hexdigest(), hashlib.sha1(b"x").hexdigest(), hashlib.sha256(b"x").hexdigest()
hashlib.sha3_256(b"x").hexdigest(), hashlib.blake2b(b"x").hexdigest(), hashlib.new("sha512", b"x")
hashlib.shake_128(b"x").hexdigest(4), hashlib.pbkdf2_hmac("sha256", b"x", b"s", 10)
hmac.new(b"k", b"m", "sha256").hexdigest(), hmac.digest(b"k", b"m", "sha256")
secrets.token_hex(8), secrets.token_urlsafe(8), secrets.choice("ab"), secrets.randbelow(10)
""",
    "random": r"""
import random
random.seed("abc")
random.random(), random.choices([1, 2], k=3), random.sample(range(10), 3), random.randint(1, 2)
random.gauss(0, 1), random.Random(5).random(), random.SystemRandom().random(), random.randbytes(3)
random.triangular(), random.betavariate(1, 1), random.expovariate(1), random.shuffle([1, 2])
""",
    "codecs": r"""
import codecs, io
"\u00e9".encode("latin-1"), "\u00e9".encode("cp1252"), b"\x93x\x94".decode("cp1252")
"x".encode("utf-16-le"), "x".encode("utf-16-be"), codecs.lookup("utf-16").name
"x".encode("utf-8-sig"), b"\xef\xbb\xbfx".decode("utf-8-sig"), b"\xff".decode("ascii", errors="replace")
"\u00e9".encode("unicode_escape"), b"\\u00e9".decode("unicode_escape"), "\u00fc".encode("punycode")
codecs.encode(b"x", "hex"), codecs.decode("78", "hex"), codecs.encode(b"x", "base64")
codecs.decode(codecs.encode(b"x", "zlib"), "zlib")
io.TextIOWrapper(io.BytesIO(b"\x93x"), encoding="cp1252").read()
io.TextIOWrapper(io.BytesIO(b"x"), encoding="latin-1").read()
io.TextIOWrapper(io.BytesIO(b"x"), encoding="ascii").read()
""",
    "unicodedata html shlex": r"""
import unicodedata, html, shlex
unicodedata.normalize("NFKD", "\u00e9"), unicodedata.name("\u00e9"), unicodedata.category("x")
html.unescape("&amp;&eacute;&#x41;"), html.escape("<a>"), shlex.split('a "b c"'), shlex.quote("a b")
format(1234567, "n"), f"{1234567:,}"
""",
    "ipaddress": r"""
import ipaddress
list(ipaddress.ip_network("10.0.0.0/30")), ipaddress.ip_address("::1").is_loopback
ipaddress.ip_address("10.0.0.1").is_private, ipaddress.ip_interface("10.0.0.1/24").network
ipaddress.ip_address("1.2.3.4").reverse_pointer
""",
    "csv": r"""
import csv, io
csv.Sniffer().sniff("a,b\n1,2"), csv.Sniffer().has_header("a,b\n1,2")
list(csv.reader(io.StringIO("a,b\n1,2"))), list(csv.DictReader(io.StringIO("a,b\n1,2")))
csv.writer(io.StringIO(), quoting=csv.QUOTE_ALL).writerow([1, "a"])
w = csv.DictWriter(io.StringIO(), ["a"])
w.writeheader()
w.writerow({"a": 1})
""",
    "fnmatch pprint": r"""
import fnmatch, pprint
fnmatch.filter(["a.py"], "*.py"), fnmatch.translate("*.py"), pprint.pformat({"a": [1] * 30}, width=20)
pprint.pp({"a": 1})
""",
    "binary": r"""
import struct, zlib, base64, binascii, array
struct.unpack("<HH", struct.pack(">I", 1)), zlib.decompress(zlib.compress(b"x" * 100, 9))
zlib.compressobj(wbits=31).compress(b"x"), base64.b64decode(base64.b64encode(b"x"))
base64.b32encode(b"x"), base64.b85encode(b"x"), base64.a85encode(b"x")
binascii.hexlify(b"x", "-"), binascii.crc32(b"x"), array.array("d", [1.0]).tobytes()
""",
    "ast": r"""
import ast
t = ast.parse("x = 1 + 2")
ast.dump(t, indent=1), ast.literal_eval('[1, {"a": (2, 3)}]'), ast.unparse(t), list(ast.walk(t))
""",
    "functional": r"""
import functools, itertools, operator, copy, heapq, bisect, graphlib, colorsys, math, cmath
@functools.singledispatch
def f(x):
    return 0
@f.register
def _(x: int):
    return 1
class C:
    @functools.cached_property
    def p(self):
        return 1
f(1), C().p, functools.reduce(operator.add, [1, 2]), functools.lru_cache(maxsize=2)(abs)(1)
list(itertools.pairwise([1, 2, 3])), list(itertools.groupby("aab")), copy.deepcopy({"a": [1, {2}]})
heapq.nlargest(2, [1, 3, 2]), bisect.bisect_left([1, 3], 2), colorsys.rgb_to_hsv(1, 0, 0)
list(graphlib.TopologicalSorter({"a": {"b"}}).static_order())
math.comb(5, 2), math.fsum([0.1] * 10), cmath.sqrt(-1)
""",
    "abc numbers types weakref keyword reprlib": r"""
import abc, numbers, types, weakref, keyword, reprlib
class A(abc.ABC):
    @abc.abstractmethod
    def f(self): ...
class W:
    pass
w = W()
isinstance(1, numbers.Integral), types.SimpleNamespace(a=1), weakref.ref(w)(), weakref.WeakSet()
weakref.finalize(w, lambda: None), keyword.iskeyword("if"), reprlib.repr(list(range(100)))
""",
    "urllib.parse": r"""
import urllib.parse as up
up.urlparse("http://a/b?c=d#e"), up.urlencode({"a": "b c", "x": ["1", "2"]}, doseq=True)
up.quote("a b/\u00e9"), up.unquote_plus("a+b"), up.parse_qs("a=1&a=2"), up.urljoin("http://a/b/", "../c")
up.urlparse("http://b\u00fccher.de/").hostname, up.quote("\u00e9", encoding="latin-1")
""",
    "contextlib io linecache": r"""
import contextlib, io, linecache
io.StringIO("a\nb").readlines(), io.BytesIO(b"x").getvalue(), linecache.getline("<nothing>", 1)
with contextlib.suppress(KeyError):
    {}["x"]
with contextlib.redirect_stdout(io.StringIO()):
    print("x")
with contextlib.ExitStack() as s:
    s.callback(lambda: None)
""",
}

PROGRAM = f"""
import asyncio
failures = {{}}
for name, source in {ENTRY_POINTS!r}.items():
    try:
        exec(compile(source, name, "exec", dont_inherit=True), {{}})
    except BaseException as error:
        failures[name] = f"{{type(error).__name__}}: {{error}}"

def blocking():
    return 1

async def taskgroup():
    async with asyncio.TaskGroup() as group:
        task = group.create_task(asyncio.sleep(0, result=2))
    return task.result()

async def timeout():
    async with asyncio.timeout(1):
        return await asyncio.wait_for(asyncio.sleep(0, result=3), 1)

waits = {{
    "asyncio.to_thread": lambda: asyncio.to_thread(blocking),
    "run_in_executor": lambda: asyncio.get_running_loop().run_in_executor(None, blocking),
    "TaskGroup": taskgroup,
    "asyncio.timeout": timeout,
}}
for name, start in waits.items():
    try:
        await start()
    except BaseException as error:
        failures[name] = f"{{type(error).__name__}}: {{error}}"
return failures
"""


def test_every_documented_module_is_exercised() -> None:
    imported = set()
    for node in ast.walk(ast.parse(PROGRAM + "\n".join(ENTRY_POINTS.values()))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert sorted(set(STDLIB_PRELOAD) - imported) == []


def test_common_entry_points_of_the_preloaded_modules_work_in_a_worker(level: str) -> None:
    result = run_one(PROGRAM, [], isolation=level)
    assert result.error is None, result.error
    assert result.value == {}


def test_a_codec_that_is_not_preloaded_is_named_as_such_and_can_be_preloaded() -> None:
    program = (
        "out = []\n"
        "for name in ('idna', 'KOI8-R', 'no-such-codec'):\n"
        "    try:\n"
        "        out.append(str('x'.encode(name)))\n"
        "    except LookupError as error:\n"
        "        out.append(str(error))\n"
        "return out"
    )
    result = run_one(program, [], isolation="auto")
    assert result.value == [
        "encoding 'idna' is not available in the code runtime; "
        "a deployment can allow it with code_runtime.preload (module 'encodings.idna')",
        "encoding 'koi8_r' is not available in the code runtime; "
        "a deployment can allow it with code_runtime.preload (module 'encodings.koi8_r')",
        "unknown encoding: no-such-codec",
    ], result.error
    program = "return 'b\\u00fccher.de'.encode('idna').decode()"
    preloaded = run_one(program, [], isolation="auto", preload=("encodings.idna",))
    assert preloaded.value == "xn--bcher-kva.de", preloaded.error

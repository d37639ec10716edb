"""dsh-sqlite-query through the dsh pipeline, and the conformance kit on it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from dsh_sqlite_query._worker import NotUtf8

from dsh_core import AbortController
from dsh_core.config import compose
from dsh_core.harness import Harness
from dsh_core.model import ToolResult
from dsh_core.plugins import PluginCatalog
from dsh_core.testing import ToolPluginConformance

Call = Callable[..., Awaitable[ToolResult]]


def make_db(path: Path) -> Path:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT, avatar BLOB, score REAL)")
        db.executemany(
            "INSERT INTO users (name, avatar, score) VALUES (?, ?, ?)",
            [(f"user{i}", b"\x00\x01" if i == 0 else None, i / 2) for i in range(50)],
        )
    db.close()
    return path


def run(database: Path, scenario: Callable[[Harness], Awaitable[Any]], **config: Any) -> Any:
    """Boot a harness with only this plugin (found through its entry point) and run ``scenario``."""
    row = {"id": "db", "use": "sqlite-query", "config": {"database": str(database), **config}}

    async def main() -> Any:
        deployment = compose([("test", {"plugins": [row]})], env={})
        harness = await Harness.start(deployment, catalog=PluginCatalog(strict=True))
        try:
            return await scenario(harness)
        finally:
            await harness.aclose()

    return asyncio.run(main())


def query(database: Path, sql: str, params: Any = None, **config: Any) -> ToolResult:
    args: dict[str, Any] = {"sql": sql}
    if params is not None:
        args["params"] = params
    result: ToolResult = run(database, lambda h: h.call("sql_query", args), **config)
    return result


def test_rows_come_back_as_json_with_columns(tmp_path: Path) -> None:
    db = make_db(tmp_path / "app.db")
    result = query(db, "SELECT id, name, avatar, score FROM users WHERE id <= 2 ORDER BY id")
    assert result.value == {
        "columns": ["id", "name", "avatar", "score"],
        "rows": [[1, "user0", {"blob_base64": "AAE="}, 0.0], [2, "user1", None, 0.5]],
        "row_count": 2,
        "truncated": False,
    }
    assert result.text.splitlines()[0] == "id\tname\tavatar\tscore"


def test_an_infinite_real_is_tagged_not_confused_with_text(tmp_path: Path) -> None:
    # +-inf came back as the strings "Infinity"/"-Infinity", the same as TEXT holding those words.
    db = make_db(tmp_path / "app.db")
    with sqlite3.connect(db) as setup:
        setup.execute("INSERT INTO users (name, score) VALUES ('Infinity', 9e999), ('-Infinity', -9e999)")
    setup.close()
    result = query(db, "SELECT name, score FROM users WHERE name LIKE '%Infinity' ORDER BY score")
    assert result.code is None, result.text
    assert result.value["rows"] == [["-Infinity", {"real": "-Infinity"}], ["Infinity", {"real": "Infinity"}]]
    # What the model reads: the tag as JSON, apart from the text.
    assert result.text.splitlines()[1:3] == ['"-Infinity"\t{"real": "-Infinity"}', '"Infinity"\t{"real": "Infinity"}']


def test_text_that_is_not_utf8_comes_back_as_its_bytes_tagged(tmp_path: Path) -> None:
    # Invalid UTF-8 was decoded with errors="replace": x'ff41' came back as "\ufffdA", the same as
    # TEXT really holding U+FFFD, and the bytes were lost.
    db = make_db(tmp_path / "app.db")
    with sqlite3.connect(db) as setup:  # a surrogate as UTF-8 (CESU-8), which UTF-8 forbids
        setup.execute("INSERT INTO users (id, name) VALUES (100, CAST(x'eda080' AS TEXT))")
    setup.close()
    result = query(db, "SELECT CAST(x'ff41' AS TEXT) AS bad, 'ok \ufffd' AS good, name FROM users WHERE id = 100")
    assert result.code is None, result.text
    assert result.value["rows"] == [[{"text_base64": "/0E="}, "ok \ufffd", {"text_base64": "7aCA"}]]
    assert result.text.splitlines()[1] == '{"text_base64": "/0E="}\t"ok \ufffd"\t{"text_base64": "7aCA"}'


def _schema_with_names_that_are_not_utf8(path: Path) -> Path:
    """A table whose column names hold bytes that are not UTF-8: SQLite keeps the schema's text as given."""
    with sqlite3.connect(path) as setup:
        setup.execute("CREATE TABLE t (ab INTEGER, cd TEXT)")
        setup.execute("INSERT INTO t VALUES (1, 'x')")
        setup.execute("PRAGMA writable_schema = ON")
        setup.execute(
            "UPDATE sqlite_schema SET sql = CAST(? AS TEXT) WHERE name = 't'",
            (b'CREATE TABLE t ("a\xffb" INTEGER, "c\xfed" TEXT)',),
        )
    setup.close()
    return path


def test_a_column_whose_name_is_not_utf8_is_refused_with_a_message_naming_it(tmp_path: Path) -> None:
    # Python's sqlite3 cannot decode such a name for the authorizer, and so refuses the read (safely), and then
    # cannot decode SQLite's message either: the error was a bare "SQL error: 'utf-8' codec can't decode byte
    # 0xff in position 13", naming neither the column nor what to do. No result can be given: the rows are
    # never read, and Python's sqlite3 would not give the result's column names either.
    db = _schema_with_names_that_are_not_utf8(tmp_path / "app.db")
    result = query(db, "SELECT * FROM t")
    assert result.code == "TOOL_FAILED"
    assert (
        "SQL error: access to t.a\\xffb is prohibited (SQLite's message holds bytes that are not UTF-8" in result.text
    ), result.text
    assert "SELECT name FROM pragma_table_info('<table>')" in result.text
    # What the message points to works: the names, as cells are given, and the other columns.
    names = query(db, "SELECT name FROM pragma_table_info('t')")
    assert names.value["rows"] == [[{"text_base64": "Yf9i"}], [{"text_base64": "Y/5k"}]]
    assert query(db, "SELECT rowid FROM t").value["rows"] == [[1]]


def test_a_negative_zero_real_is_tagged_not_made_zero(tmp_path: Path) -> None:
    # -0.0 came back as 0.0, though a column without affinity stores it and SQLite tells them apart
    # (atan2(0, -0.0) is pi). dsh's lossless JSON refuses -0.0: not every reader keeps its sign.
    db = make_db(tmp_path / "app.db")
    with sqlite3.connect(db) as setup:
        setup.execute("CREATE TABLE t (x)")
        setup.execute("INSERT INTO t VALUES (-0.0), (0.0)")
    setup.close()
    result = query(db, "SELECT x, atan2(0.0, x) > 0 AS negative FROM t ORDER BY rowid")
    assert result.code is None, result.text
    assert result.value["rows"] == [[{"real": "-0.0"}, 1], [0.0, 0]]
    assert result.text.splitlines()[1] == '{"real": "-0.0"}\t1'


def test_integers_and_reals_at_their_limits_come_back_exact(tmp_path: Path) -> None:
    # SQLite's 64-bit integers are past JSON's safe 2**53, but dsh's lossless JSON keeps any int
    # Python can write: they must come back as the same ints, not floats or strings.
    db = make_db(tmp_path / "app.db")
    result = query(
        db,
        "SELECT 9223372036854775807, -9223372036854775808, 9007199254740993, "
        "5e-324, -2.2250738585072014e-308, 1.7976931348623157e308, 0.1",
    )
    assert result.code is None, result.text
    row = result.value["rows"][0]
    assert row == [2**63 - 1, -(2**63), 2**53 + 1, 5e-324, -2.2250738585072014e-308, 1.7976931348623157e308, 0.1]
    assert [type(v) for v in row] == [int] * 3 + [float] * 4
    assert result.text.splitlines()[1].split("\t")[:3] == [
        "9223372036854775807",
        "-9223372036854775808",
        "9007199254740993",
    ]


def test_text_with_nul_characters_comes_back_whole(tmp_path: Path) -> None:
    result = query(make_db(tmp_path / "app.db"), "SELECT CAST(x'410042' AS TEXT) AS t")
    assert result.code is None, result.text
    assert result.value["rows"] == [["A\x00B"]]


def test_the_text_the_model_reads_tells_text_from_null_numbers_and_tags(tmp_path: Path) -> None:
    # The model reads the rendered text, not the value: cells were str()-ed, so TEXT 'NULL' read as
    # NULL, TEXT '1' as the INTEGER 1, TEXT that spells a tag as that tag, and a tab or a newline
    # in TEXT split the cell or the row.
    result = query(
        make_db(tmp_path / "app.db"),
        "SELECT 'NULL' AS a, NULL AS b, '1' AS c, 1 AS d, '{\"real\": \"Infinity\"}' AS e, 9e999 AS f, "
        "'a' || char(9) || 'b' || char(10) || 'c' AS g, 0.5 AS h",
    )
    assert result.code is None, result.text
    assert result.value["rows"] == [
        ["NULL", None, "1", 1, '{"real": "Infinity"}', {"real": "Infinity"}, "a\tb\nc", 0.5]
    ]
    lines = result.text.splitlines()
    assert len(lines) == 3 and lines[0] == "a\tb\tc\td\te\tf\tg\th" and lines[2] == "(1 row)"
    assert lines[1].split("\t") == [
        '"NULL"',
        "null",
        '"1"',
        "1",
        '"{\\"real\\": \\"Infinity\\"}"',
        '{"real": "Infinity"}',
        '"a\\tb\\nc"',
        "0.5",
    ]


def test_column_names_in_the_text_the_model_reads_never_split_a_column_or_the_header(tmp_path: Path) -> None:
    # Names were joined bare with tabs: a tab or newline in a name split the header, so the header and the
    # rows no longer lined up. A name that would be ambiguous bare is its JSON, as cells are: one with a
    # control character or a backslash, an empty one, one starting with '"' (else it would read as JSON) or
    # '{' (a tag).
    result = query(
        make_db(tmp_path / "app.db"),
        'SELECT 1 AS "a\tb", 2 AS "c\nd", 3 AS """q""", 4 AS "{x}", 5 AS "", 6 AS "b\\s", 7 AS plain, 8 AS "two words"',
    )
    assert result.code is None, result.text
    assert result.value["columns"] == ["a\tb", "c\nd", '"q"', "{x}", "", "b\\s", "plain", "two words"]
    lines = result.text.splitlines()
    assert len(lines) == 3 and lines[2] == "(1 row)"
    assert lines[0].split("\t") == ['"a\\tb"', '"c\\nd"', '"\\"q\\""', '"{x}"', '""', '"b\\\\s"', "plain", "two words"]
    assert lines[1].split("\t") == ["1", "2", "3", "4", "5", "6", "7", "8"]


def test_unicode_line_breaks_in_cells_and_names_never_split_a_row_or_the_header(tmp_path: Path) -> None:
    # JSON leaves U+0085, U+2028 and U+2029 unescaped, yet str.splitlines (and many renderers) break lines
    # at them: a cell or a name holding one read as an extra row, or cut the header short.
    breaks = ["\x85", "\u2028", "\u2029"]
    names = [f"n{b}x" for b in breaks]
    sql = "SELECT " + ", ".join(f"'c' || char({ord(b)}) || 'd' AS \"n{b}x\"" for b in breaks)
    result = query(make_db(tmp_path / "app.db"), f"{sql} UNION ALL {sql}")
    assert result.code is None, result.text
    assert result.value["columns"] == names
    assert result.value["rows"] == [[f"c{b}d" for b in breaks]] * 2
    lines = result.text.splitlines()
    assert len(lines) == 1 + 2 + 1 and lines[3] == "(2 rows)"  # header, two rows, footer
    assert lines[0].split("\t") == ['"n\\u0085x"', '"n\\u2028x"', '"n\\u2029x"']
    assert lines[1].split("\t") == lines[2].split("\t") == ['"c\\u0085d"', '"c\\u2028d"', '"c\\u2029d"']
    assert [json.loads(cell) for cell in lines[1].split("\t")] == result.value["rows"][0]


def test_del_and_c1_controls_in_cells_and_names_are_escaped_and_printable_text_is_not(tmp_path: Path) -> None:
    # JSON escapes C0 controls but leaves DEL (invisible) and the C1 controls as they are, and some
    # terminals take U+009B (CSI) and friends as the start of an escape sequence: the reader never saw
    # them. Each is escaped as JSON's \uXXXX, so the cell still parses back to its value; printable
    # non-ASCII text is shown as it is.
    controls = [chr(code) for code in range(0x7F, 0xA0)]
    printable = ["\u00e9", "\u4e2d", "\U0001f600"]
    names = [f"n{c}x" for c in controls + printable]
    sql = "SELECT " + ", ".join(f"'c' || char({ord(c)}) || 'd' AS \"n{c}x\"" for c in controls + printable)
    result = query(make_db(tmp_path / "app.db"), sql)
    assert result.code is None, result.text
    assert result.value["columns"] == names
    assert result.value["rows"] == [[f"c{c}d" for c in controls + printable]]
    lines = result.text.splitlines()
    assert len(lines) == 3 and lines[2] == "(1 row)"
    header, cells = lines[0].split("\t"), lines[1].split("\t")
    assert header == [f'"n\\u{ord(c):04x}x"' for c in controls] + [f"n{c}x" for c in printable]
    assert cells == [f'"c\\u{ord(c):04x}d"' for c in controls] + [f'"c{c}d"' for c in printable]
    assert [json.loads(cell) for cell in cells] == result.value["rows"][0]
    assert [json.loads(name) for name in header[: len(controls)]] == names[: len(controls)]


def test_invisible_format_characters_in_cells_and_names_are_escaped(tmp_path: Path) -> None:
    # Zero-width characters and Unicode tags (U+E0000 block) can hide text from a person reading what
    # the model read; a bidirectional override reorders a row on screen. Each is escaped (a surrogate
    # pair beyond the BMP), and the cell still parses back to its value.
    hidden = ["\u200b", "\u202e", "\u2066", "\ufeff", "\U000e0041"]
    sql = "SELECT " + ", ".join(f"'c' || char({ord(c)}) || 'd' AS \"n{c}x\"" for c in hidden)
    result = query(make_db(tmp_path / "app.db"), sql)
    assert result.code is None, result.text
    assert result.value["rows"] == [[f"c{c}d" for c in hidden]]
    header, cells = (line.split("\t") for line in result.text.splitlines()[:2])
    escaped = ["\\u200b", "\\u202e", "\\u2066", "\\ufeff", "\\udb40\\udc41"]
    assert cells == [f'"c{e}d"' for e in escaped]
    assert header == [f'"n{e}x"' for e in escaped]
    assert [json.loads(cell) for cell in cells] == result.value["rows"][0]


def test_every_format_character_of_this_pythons_unicode_is_escaped() -> None:
    # The escaped ranges are written out (a scan of the Unicode database at import would cost a
    # quarter of a second): a Python with a newer Unicode that adds format characters fails here.
    import unicodedata

    from dsh_sqlite_query import _render_cell

    missed = [
        f"U+{code:04X}"
        for code in range(sys.maxunicode + 1)
        if unicodedata.category(chr(code)) == "Cf"
        and (chr(code) in _render_cell(chr(code)) or json.loads(_render_cell(chr(code))) != chr(code))
    ]
    assert missed == [], f"format characters shown raw (Unicode {unicodedata.unidata_version}): {missed}"


def test_the_row_cap_truncates_and_says_so(tmp_path: Path) -> None:
    result = query(make_db(tmp_path / "app.db"), "SELECT id FROM users", max_rows=10)
    assert result.value["row_count"] == 10 and result.value["truncated"] is True
    assert "truncated: add a LIMIT" in result.text


def test_parameters_are_bound_never_formatted(tmp_path: Path) -> None:
    db = make_db(tmp_path / "app.db")
    sneaky = "x'; DROP TABLE users; --"
    result = query(db, "SELECT ? AS echoed, count(*) AS n FROM users WHERE name = ?", [sneaky, sneaky])
    assert result.value["rows"] == [[sneaky, 0]]
    named = query(db, "SELECT name FROM users WHERE id = :id", {"id": 3})
    assert named.value["rows"] == [["user2"]]
    wrong = query(db, "SELECT ?", [])
    assert wrong.code == "TOOL_FAILED" and "SQL error: Incorrect number of bindings" in wrong.text


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO users (name) VALUES ('evil')",
        "DELETE FROM users",
        "DROP TABLE users",
        "UPDATE users SET name = 'x'",
        "PRAGMA writable_schema = ON",
        "ATTACH DATABASE 'other.db' AS other",
        "CREATE TABLE t (x)",
        "BEGIN",
        "VACUUM INTO 'other.db'",
    ],
)
def test_anything_but_reading_is_refused_and_changes_nothing(tmp_path: Path, sql: str) -> None:
    db = make_db(tmp_path / "app.db")
    before = db.read_bytes()
    result = query(db, sql)
    assert result.code == "TOOL_FAILED"
    assert "only read-only queries are allowed" in result.text
    assert db.read_bytes() == before
    assert not (tmp_path / "other.db").exists()


def test_table_valued_json_functions_can_be_read(tmp_path: Path) -> None:
    # json_each and json_tree are eponymous virtual tables, which SQLite sets up on first use
    # through what the authorizer sees as an update of sqlite_master: they were refused.
    db = make_db(tmp_path / "app.db")
    result = query(db, "SELECT key, value FROM json_each(?) ORDER BY key", ['{"a": 1, "b": [2]}'])
    assert result.code is None, result.text
    assert result.value["rows"] == [["a", 1], ["b", "[2]"]]
    nested = query(
        db,
        "SELECT u.name, j.value FROM users AS u, json_tree('[1,[2]]') AS j "
        "WHERE u.id = 1 AND j.type = 'integer' ORDER BY j.id",
    )
    assert nested.code is None, nested.text
    assert nested.value["rows"] == [["user0", 1], ["user0", 2]]


def test_the_schema_introspection_pragma_functions_can_be_read(tmp_path: Path) -> None:
    # pragma_table_info() and friends run their PRAGMA inside the SELECT, which the authorizer
    # refused although the README promised table-valued functions work.
    db = make_db(tmp_path / "app.db")
    with sqlite3.connect(db) as setup:
        setup.execute("CREATE INDEX users_name ON users (name)")
    setup.close()
    result = query(db, "SELECT name, type FROM pragma_table_info(?) ORDER BY cid", ["users"])
    assert result.code is None, result.text
    assert result.value["rows"] == [["id", "INTEGER"], ["name", "TEXT"], ["avatar", "BLOB"], ["score", "REAL"]]
    joined = query(
        db, "SELECT il.name, ii.name FROM pragma_index_list('users') AS il, pragma_index_info(il.name) AS ii"
    )
    assert joined.code is None, joined.text
    assert joined.value["rows"] == [["users_name", "name"]]
    for sql in (
        "SELECT count(*) FROM pragma_table_xinfo('users', 'main')",
        "SELECT count(*) FROM pragma_index_xinfo('users_name')",
        "SELECT count(*) FROM pragma_foreign_key_list('users')",
    ):
        assert query(db, sql).code is None, sql


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM pragma_writable_schema",
        "SELECT * FROM pragma_user_version",
        "SELECT * FROM pragma_database_list",  # the host's file paths
        "SELECT * FROM pragma_journal_mode",
        "PRAGMA table_info(users)",  # PRAGMA statements stay refused, even the allowed ones
    ],
)
def test_other_pragmas_stay_refused(tmp_path: Path, sql: str) -> None:
    db = make_db(tmp_path / "app.db")
    result = query(db, sql)
    assert result.code == "TOOL_FAILED"
    assert "only read-only queries are allowed" in result.text


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE sqlite_master SET sql = 'x'",
        "UPDATE sqlite_schema SET name = 'x' WHERE name IN (SELECT key FROM json_each('[1]'))",
        "WITH j AS (SELECT value FROM json_each('[1]')) UPDATE users SET name = 'x'",
    ],
)
def test_an_update_of_the_schema_is_still_refused(tmp_path: Path, sql: str) -> None:
    db = make_db(tmp_path / "app.db")
    before = db.read_bytes()
    result = query(db, sql)
    assert result.code == "TOOL_FAILED"
    assert "only read-only queries are allowed" in result.text or "may not be modified" in result.text
    assert db.read_bytes() == before


def test_the_schema_set_up_is_allowed_only_inside_a_select() -> None:
    from dsh_sqlite_query._worker import _authorizer

    master = (sqlite3.SQLITE_UPDATE, "sqlite_master", "sql", "main", None)
    in_select = _authorizer()
    assert in_select(sqlite3.SQLITE_SELECT, None, None, None, None) == sqlite3.SQLITE_OK
    assert in_select(*master) == sqlite3.SQLITE_OK
    assert in_select(sqlite3.SQLITE_UPDATE, "users", "name", "main", None) == sqlite3.SQLITE_DENY
    elsewhere = _authorizer()
    assert elsewhere(*master) == sqlite3.SQLITE_DENY
    assert elsewhere(sqlite3.SQLITE_SELECT, None, None, None, None) == sqlite3.SQLITE_OK
    assert elsewhere(*master) == sqlite3.SQLITE_DENY  # a subquery's SELECT does not make it one
    table_info = (sqlite3.SQLITE_PRAGMA, "table_info", "users", None, None)
    assert in_select(*table_info) == sqlite3.SQLITE_OK
    assert in_select(sqlite3.SQLITE_PRAGMA, "writable_schema", "1", None, None) == sqlite3.SQLITE_DENY
    assert elsewhere(*table_info) == sqlite3.SQLITE_DENY


def _has_fts3_tokenizer() -> bool:
    with contextlib.closing(sqlite3.connect(":memory:")) as db:
        try:
            db.execute("SELECT fts3_tokenizer('simple')")
        except sqlite3.Error:
            return False
    return True


@pytest.mark.skipif(not _has_fts3_tokenizer(), reason="this SQLite has no fts3_tokenizer()")
@pytest.mark.parametrize(
    "sql", ["SELECT fts3_tokenizer('simple')", "SELECT hex(FTS3_TOKENIZER('simple', x'4141414141414141'))"]
)
def test_fts3_tokenizer_cannot_read_or_install_native_pointers(tmp_path: Path, sql: str) -> None:
    """fts3_tokenizer leaks a C pointer (one argument) or installs one as tokenizer code (two)."""
    result = query(make_db(tmp_path / "app.db"), sql)
    assert result.code == "TOOL_FAILED"
    assert "only read-only queries are allowed" in result.text


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("SELEC name FROM users", 'SQL error: near "SELEC": syntax error'),
        ("SELECT nope FROM users", "SQL error: no such column: nope"),
        ("SELECT 1; SELECT 2", "SQL error: You can only execute one statement at a time."),
        ("SELECT '\0'", "SQL error: the query contains a null character"),
        # SQLite's message quotes the query: the error is told by its code, not by words in it.
        ('SELECT * FROM "database is locked"', "SQL error: no such table: database is locked"),
        ('SELECT * FROM "string or blob too big"', "SQL error: no such table: string or blob too big"),
        ('SELECT users."not authorized" FROM users', "SQL error: no such column: users.not authorized"),
    ],
)
def test_malformed_sql_gets_a_clear_error(tmp_path: Path, sql: str, message: str) -> None:
    result = query(make_db(tmp_path / "app.db"), sql)
    assert result.code == "TOOL_FAILED"
    assert result.error is not None and result.error.message == message


def test_a_missing_database_file_is_named(tmp_path: Path) -> None:
    result = query(tmp_path / "missing.db", "SELECT 1")
    assert f"the database file {tmp_path / 'missing.db'} does not exist" in result.text
    assert not (tmp_path / "missing.db").exists()  # mode=ro never creates it


def test_a_path_starting_with_two_slashes_is_opened(tmp_path: Path) -> None:
    # POSIX keeps a leading "//" (abspath too), and "file:" + "//tmp/app.db" is a URI whose authority is "tmp":
    # SQLite refused it ("invalid uri authority: tmp") although the file exists and is found.
    db = make_db(tmp_path / "app.db")
    result = query(Path("/" + str(db)), "SELECT count(*) AS n FROM users")
    assert result.code is None, result.text
    assert result.value["rows"] == [[50]]


ENDLESS = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"


def test_a_runaway_query_is_interrupted_by_the_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    result = query(make_db(tmp_path / "app.db"), ENDLESS, timeout_s=0.3)
    assert time.monotonic() - started < 60  # not never
    assert "the query ran longer than 0.3 s and was interrupted" in result.text


def test_abort_interrupts_a_running_query(tmp_path: Path) -> None:
    async def scenario(harness: Harness) -> tuple[ToolResult, float]:
        controller = AbortController()
        asyncio.get_running_loop().call_later(0.2, controller.abort, "stop")
        started = time.monotonic()
        result = await harness.call("sql_query", {"sql": ENDLESS}, signal=controller.signal)
        return result, time.monotonic() - started

    result, elapsed = run(make_db(tmp_path / "app.db"), scenario, timeout_s=3600)
    assert result.code == "ABORTED" and elapsed < 60  # not the hour of timeout_s


def test_an_abort_while_the_worker_starts_is_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An abort that lands while the worker process starts must still stop the call, and the worker."""
    from dsh_sqlite_query import SqliteQuery

    original_spawn, original_query = SqliteQuery._spawn, SqliteQuery.query
    workers: list[asyncio.subprocess.Process] = []

    async def slow_start(self: SqliteQuery) -> Any:
        await asyncio.sleep(0.3)  # a worker that is slow to start: the abort lands first
        workers.append(await original_spawn(self))
        return workers[-1]

    controller = AbortController()

    async def abort_on_entry(self: SqliteQuery, args: Any, ctx: Any) -> Any:
        asyncio.get_running_loop().call_soon(controller.abort, "stop")  # what the kit's abort check does
        return await original_query(self, args, ctx)

    monkeypatch.setattr(SqliteQuery, "_spawn", slow_start)
    monkeypatch.setattr(SqliteQuery, "query", abort_on_entry)

    async def scenario(harness: Harness) -> tuple[ToolResult, float]:
        started = time.monotonic()
        result = await harness.call("sql_query", {"sql": ENDLESS}, signal=controller.signal)
        return result, time.monotonic() - started

    result, elapsed = run(make_db(tmp_path / "app.db"), scenario, timeout_s=3600)
    assert result.code == "ABORTED" and elapsed < 60  # not the hour of timeout_s
    assert [worker.returncode is not None for worker in workers] == [True]


def test_cancelling_a_call_kills_and_reaps_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """asyncio cancellation (no abort): the worker running the never-ending statement is killed and reaped."""
    from dsh_sqlite_query import SqliteQuery

    original = SqliteQuery._spawn
    workers: list[asyncio.subprocess.Process] = []

    async def tracked(self: SqliteQuery) -> Any:
        workers.append(await original(self))
        return workers[-1]

    monkeypatch.setattr(SqliteQuery, "_spawn", tracked)

    async def scenario(harness: Harness) -> tuple[bool, float]:
        task = asyncio.ensure_future(harness.call("sql_query", {"sql": ENDLESS}))
        while not workers:  # however long a loaded machine takes to start it
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert len(workers) == 1 and workers[0].returncode is None
        started = time.monotonic()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return workers[0].returncode is not None, time.monotonic() - started

    reaped, elapsed = run(make_db(tmp_path / "app.db"), scenario, timeout_s=3600)
    assert reaped and elapsed < 60  # not the hour of timeout_s


def _held_workers(monkeypatch: pytest.MonkeyPatch, hold_s: float) -> dict[str, int]:
    """Hold each worker ``hold_s`` before it gets its request; counts the workers alive at once (``most``)."""
    from dsh_sqlite_query import SqliteQuery

    original_spawn, original_exchange, original_reap = SqliteQuery._spawn, SqliteQuery._exchange, SqliteQuery._reap
    counts = {"alive": 0, "most": 0}

    async def spawn(self: SqliteQuery) -> asyncio.subprocess.Process:
        process = await original_spawn(self)
        counts["alive"] += 1
        counts["most"] = max(counts["most"], counts["alive"])
        return process

    async def exchange(self: SqliteQuery, process: asyncio.subprocess.Process, request: dict[str, Any]) -> bytes:
        await asyncio.sleep(hold_s)
        return await original_exchange(self, process, request)

    async def reap(process: asyncio.subprocess.Process, exchange: asyncio.Future[bytes]) -> None:
        try:
            await original_reap(process, exchange)
        finally:
            counts["alive"] -= 1

    monkeypatch.setattr(SqliteQuery, "_spawn", spawn)
    monkeypatch.setattr(SqliteQuery, "_exchange", exchange)
    monkeypatch.setattr(SqliteQuery, "_reap", staticmethod(reap))
    return counts


def test_max_concurrent_bounds_the_workers_alive_at_once_and_the_rest_wait_their_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every call starts a Python process that may use memory_mb: a model's batch of parallel calls, or a
    # Code Mode program gathering them, started one process per call all at once, with no bound at all.
    counts = _held_workers(monkeypatch, 0.3)

    async def scenario(harness: Harness) -> list[ToolResult]:
        calls = (harness.call("sql_query", {"sql": "SELECT ? AS i", "params": [i]}) for i in range(6))
        return list(await asyncio.gather(*calls))

    results = run(make_db(tmp_path / "app.db"), scenario, max_concurrent=2)
    assert [r.value["rows"] for r in results] == [[[i]] for i in range(6)]
    assert counts == {"alive": 0, "most": 2}


def test_a_query_waiting_for_its_turn_is_aborted_at_once_and_times_out_within_timeout_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = _held_workers(monkeypatch, 3600)  # the holder never finishes on its own

    async def scenario(harness: Harness) -> tuple[ToolResult, float, ToolResult, float]:
        holder = asyncio.ensure_future(harness.call("sql_query", {"sql": "SELECT 1"}))
        while not counts["alive"]:  # the holder has its turn and its worker
            await asyncio.sleep(0.01)
        controller = AbortController()
        asyncio.get_running_loop().call_later(0.2, controller.abort, "stop")
        begun = time.monotonic()
        aborted = await harness.call("sql_query", {"sql": "SELECT 2"}, signal=controller.signal)
        aborted_after = time.monotonic() - begun
        begun = time.monotonic()
        waited = await harness.call("sql_query", {"sql": "SELECT 3"})
        waited_after = time.monotonic() - begun
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
        return aborted, aborted_after, waited, waited_after

    aborted, aborted_after, waited, waited_after = run(
        make_db(tmp_path / "app.db"), scenario, max_concurrent=1, timeout_s=1
    )
    assert aborted.code == "ABORTED" and aborted_after < 20
    assert waited.code == "TOOL_FAILED" and waited_after < 20  # not the holder's hour
    assert (
        "the query could not start within 1 s: max_concurrent (1) queries were running; try again later" in waited.text
    )
    assert counts == {"alive": 0, "most": 1}


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4"])
def test_max_concurrent_must_be_a_positive_integer(tmp_path: Path, value: Any) -> None:
    with pytest.raises(Exception, match=r"config\.max_concurrent: (?!unknown key)"):
        query(make_db(tmp_path / "app.db"), "SELECT 1", max_concurrent=value)


def _spawning(monkeypatch: pytest.MonkeyPatch, code: str) -> list[asyncio.subprocess.Process]:
    """Make the plugin start ``python -c code`` instead of its worker; the list collects the processes."""
    from dsh_sqlite_query import SqliteQuery

    workers: list[asyncio.subprocess.Process] = []

    async def spawn(self: SqliteQuery) -> asyncio.subprocess.Process:
        workers.append(
            await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
        )
        return workers[-1]

    monkeypatch.setattr(SqliteQuery, "_spawn", spawn)
    return workers


def test_a_worker_that_does_not_answer_is_killed_after_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workers = _spawning(monkeypatch, "import time; time.sleep(3600)")  # stuck in one long step
    started = time.monotonic()
    result = query(make_db(tmp_path / "app.db"), "SELECT 1", timeout_s=0.2)
    assert time.monotonic() - started < 60  # killed at timeout_s + KILL_GRACE_S, not left its hour
    assert "the query ran longer than 0.2 s and was interrupted" in result.text
    assert len(workers) == 1 and workers[0].returncode is not None


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("import sys; sys.exit(3)", "the query worker ended without an answer (exit status 3)"),
        ("import sys; sys.stdout.write('x' * (3 << 20))", "the query worker's answer is longer than"),
    ],
)
def test_a_worker_without_a_proper_answer_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, message: str
) -> None:
    workers = _spawning(monkeypatch, code)
    result = query(make_db(tmp_path / "app.db"), "SELECT 1")
    assert result.code == "TOOL_FAILED" and message in result.text, result.text
    assert workers[0].returncode is not None


class TestSqliteQueryConformance(ToolPluginConformance):
    """The dsh conformance kit, on an empty scratch database."""

    plugin_name = "sqlite-query"

    @pytest.fixture
    def plugin_config(self, tmp_path: Path) -> dict[str, Any]:
        return {"database": str(make_db(tmp_path / "kit.db"))}


def test_a_value_larger_than_the_byte_cap_is_not_returned_and_a_huge_one_never_built(tmp_path: Path) -> None:
    db = make_db(tmp_path / "app.db")
    result = query(db, "SELECT zeroblob(100000) AS big", max_bytes=65536)  # 133 KB of base64
    assert result.code == "TOOL_FAILED"
    assert "the first row alone is about 133357 bytes, more than the 65536-byte limit" in result.text
    assert "substr()" in result.text
    # zeroblob(10**8) would be 100 MB in the worker and 133 MB of base64: past the 8 MiB one
    # value may take (memory_mb = 64), SQLite refuses to build it.
    result = query(db, "SELECT zeroblob(100000000) AS big", max_bytes=65536)
    assert result.code == "TOOL_FAILED"
    assert "larger than 8388608 bytes, the most one value may take" in result.text


def test_the_byte_cap_truncates_rows_and_says_so(tmp_path: Path) -> None:
    db = make_db(tmp_path / "app.db")
    sql = "SELECT id, printf('%.30000c', 'x') AS filler FROM users ORDER BY id"  # 30,000 bytes a row
    result = query(db, sql, max_bytes=100_000)
    assert result.code is None, result.text
    assert result.value["row_count"] == 3 and result.value["truncated"] is True
    assert [row[0] for row in result.value["rows"]] == [1, 2, 3]
    wide = "SELECT printf('%.40000c', 'x') || printf('%.40000c', 'y') AS a, printf('%.40000c', 'z') AS b"
    result = query(db, wide, max_bytes=100_000)
    # 120000 characters, 4 quotes, a comma, 2 brackets and the comma after the row
    assert result.code == "TOOL_FAILED" and "the first row alone is about 120008 bytes" in result.text


def test_a_database_locked_by_a_writer_waits_only_timeout_s_and_says_so(tmp_path: Path) -> None:
    # sqlite3's default busy timeout (5 s) used to outlast timeout_s, and interrupt() does not
    # stop a busy wait; the error then blamed the query ("add a LIMIT").
    db = make_db(tmp_path / "app.db")
    writer = sqlite3.connect(db, isolation_level=None)
    try:
        writer.execute("BEGIN EXCLUSIVE")
        writer.execute("INSERT INTO users (name) VALUES ('mid-write')")
        started = time.monotonic()
        result = query(db, "SELECT count(*) FROM users", timeout_s=0.5)
        elapsed = time.monotonic() - started
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert elapsed < 3
    assert result.code == "TOOL_FAILED"
    assert "the database is locked by another writer" in result.text and "LIMIT" not in result.text


# Runs in a fresh interpreter, whose peak RSS (VmHWM) only this scenario can have raised.
_PEAK_SCRIPT = """
import asyncio, json, sys
from dsh_core.config import compose
from dsh_core.harness import Harness
from dsh_core.plugins import PluginCatalog

def peak():
    with open("/proc/self/status") as status:
        return int(status.read().split("VmHWM:")[1].split()[0]) * 1024

async def main(database, sqls):
    row = {"id": "db", "use": "sqlite-query", "config": {"database": database}}
    harness = await Harness.start(compose([("test", {"plugins": [row]})], env={}),
                                  catalog=PluginCatalog(strict=True))
    try:
        await harness.call("sql_query", {"sql": "SELECT 1"})
        growth, results = [], []
        for sql in sqls:
            before = peak()
            results.append((await harness.call("sql_query", {"sql": sql})).text)
            growth.append(peak() - before)
        return {"growth": growth, "results": results}
    finally:
        await harness.aclose()

print(json.dumps(asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))))
"""


def _nested_max(depth: int, width: int) -> str:
    """max(randomblob(...), ..., max(...)): every argument is held until the call, under any length limit."""
    expression = "randomblob(1000000)"
    for level in range(depth):
        blobs = ", ".join(f"randomblob({1000000 + level * 1000 + i})" for i in range(width - 1))
        expression = f"max({blobs}, {expression})"
    return f"SELECT length({expression}) AS n"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status; the memory cap is RLIMIT_AS")
def test_no_query_makes_the_host_hold_much_more_than_max_bytes(tmp_path: Path) -> None:
    # The length limit bounds one value, not how many a query holds: 300 columns of
    # zeroblob(1000000) raised the host's peak RSS by ~600 MB (with max_bytes = 1 MiB) before
    # "the first row alone is about 400000800 bytes"; a 4 KB SELECT of nested max() holds 100 MB
    # per level and returns one integer. Now a worker process holds it, under memory_mb.
    db = make_db(tmp_path / "app.db")
    wide = "SELECT " + ", ".join(f"zeroblob(1000000) AS c{i}" for i in range(300))
    sqls = [_nested_max(3, 100), wide]  # the smaller peak first: a peak only grows
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    completed = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(db), json.dumps(sqls)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    report = json.loads(completed.stdout)
    assert all(growth < 32 << 20 for growth in report["growth"]), report
    for text in report["results"]:
        assert "more than the 64 MiB of memory it may use" in text, text


def make_docs(path: Path, body_chars: int) -> Path:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, title TEXT, body TEXT)")
        db.executemany("INSERT INTO docs VALUES (?, ?, ?)", [(1, "small", "hello"), (2, "big", "x" * body_chars)])
    db.close()
    return path


@pytest.mark.parametrize(
    ("sql", "rows"),
    [
        ("SELECT id, length(body) FROM docs ORDER BY id", [[1, 5], [2, 3_000_000]]),
        ("SELECT id, substr(body, 1, 3) FROM docs ORDER BY id", [[1, "hel"], [2, "xxx"]]),
        ("SELECT id FROM docs WHERE body LIKE 'h%'", [[1]]),
    ],
)
def test_a_stored_value_larger_than_max_bytes_can_still_be_read_in_part(
    tmp_path: Path, sql: str, rows: list[list[Any]]
) -> None:
    # The length limit was max_bytes, and SQLite applies it to reading stored values too: one
    # 3 MB body made every query touching it fail, although the message advised substr().
    result = query(make_docs(tmp_path / "docs.db", 3_000_000), sql)
    assert result.code is None, result.text
    assert result.value["rows"] == rows


def test_a_stored_value_larger_than_max_bytes_is_not_returned_whole(tmp_path: Path) -> None:
    db = make_docs(tmp_path / "docs.db", 3_000_000)
    alone = query(db, "SELECT id, body FROM docs WHERE id = 2")
    assert alone.code == "TOOL_FAILED"
    assert (
        'the first row alone is about 3000007 bytes (column "body" about 3000002), more than the 1048576-byte limit'
    ) in alone.text and "substr()" in alone.text
    after = query(db, "SELECT id, body FROM docs ORDER BY id")
    assert after.value["rows"] == [[1, "hello"]] and after.value["truncated"] is True


def test_a_value_larger_than_one_value_may_be_is_refused_as_such(tmp_path: Path) -> None:
    # memory_mb = 16: one value, stored or built, may take 2 MiB.
    db = make_docs(tmp_path / "docs.db", 3_000_000)
    for sql in ("SELECT length(body) FROM docs", "SELECT length(zeroblob(3000000))"):
        result = query(db, sql, memory_mb=16)
        assert result.code == "TOOL_FAILED"
        assert "larger than 2097152 bytes, the most one value may take (memory_mb / 8" in result.text, result.text
        assert "a stored value that large cannot be read here" in result.text


@pytest.mark.parametrize(
    "value",
    [
        "plain",
        "",
        "naïve — ☃ 😀",
        'quote " back \\ \x00 \x1f',
        b"",
        b"\x00\xff" * 7,
        NotUtf8(b"\xff"),
        NotUtf8(b"A\xed\xa0\x80"),
        0,
        -7,
        2**63 - 1,
        0.1,
        -0.0,
        1e300,
        float("nan"),
        float("-inf"),
        None,
    ],
)
def test_the_cheap_size_of_a_value_is_never_more_than_its_json(value: object) -> None:
    # A row whose cheap size is past the budget is refused or truncated without being encoded.
    from dsh_sqlite_query._worker import _dumps, _floor_size, _json_value

    exact = len(_dumps(_json_value(value)).encode("utf-8"))
    assert _floor_size(value) <= exact
    if not isinstance(value, str) or "quote" not in value:
        assert _floor_size(value) == exact


def test_workers_are_killed_without_process_kill_which_could_reap_them_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In 3.11 ``Process.kill()`` polls (``waitpid``) first: a worker that had just exited was reaped
    there, and asyncio's child watcher then reported exit status 255 instead of its own."""

    def forbidden(self: asyncio.subprocess.Process) -> None:
        raise AssertionError("Process.kill() may reap the worker before asyncio's child watcher")

    monkeypatch.setattr(asyncio.subprocess.Process, "kill", forbidden)
    for n in range(5):  # the real worker: answers, is reaped, and its status is its own
        assert query(make_db(tmp_path / f"db{n}.db"), "SELECT 1").error is None
    workers = _spawning(monkeypatch, "import time; time.sleep(60)")  # one that must be killed
    result = query(make_db(tmp_path / "app.db"), "SELECT 1", timeout_s=0.2)
    assert "the query ran longer than 0.2 s and was interrupted" in result.text
    assert workers[0].returncode == -9


def _open_temp_files() -> list[str]:
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [name for name in names if "etilqs_" in name]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
def test_a_large_sort_spills_to_memory_under_the_cap_not_to_temp_files(tmp_path: Path) -> None:
    # A sort larger than the page cache used to spill to (unlinked) temporary files: disk the
    # memory cap does not bound, filled for as long as timeout_s allows.
    from dsh_sqlite_query import _worker

    connection = _worker.connect(str(make_db(tmp_path / "app.db")), time.monotonic() + 30)
    try:
        cursor = connection.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 10000) "
            "SELECT i FROM n ORDER BY randomblob(1000) || i"
        )
        assert cursor.fetchone() is not None
        assert _open_temp_files() == []
    finally:
        connection.close()
    result = query(
        tmp_path / "app.db",
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
        "LIMIT 100000) SELECT i FROM n ORDER BY randomblob(1000) || i",
        memory_mb=16,
    )
    assert result.code == "TOOL_FAILED"
    assert "the query needed more than the 16 MiB of memory it may use" in result.text


def test_a_refusal_naming_a_long_column_stays_within_the_message_limit(tmp_path: Path) -> None:
    from dsh_sqlite_query import _worker

    name = "x" * 3000
    result = query(make_db(tmp_path / "app.db"), f'SELECT zeroblob(5000) AS "{name}", 1 AS b', max_bytes=4096)
    assert result.code == "TOOL_FAILED" and result.error is not None
    assert len(result.error.message) <= _worker.MAX_MESSAGE_CHARS
    assert f'column "{"x" * 80}..." about' in result.error.message
    assert "select fewer or shorter columns" in result.error.message


_CRASHING_WRITER = """
import os, signal, sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA cache_size = 1")  # spill: the rollback journal and the file both get written
db.execute("BEGIN")
db.execute("UPDATE users SET name = name || randomblob(500)")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_hot_journal_is_not_blamed_on_the_query(tmp_path: Path) -> None:
    # A writer killed mid-transaction leaves a hot journal that only a read-write connection
    # may roll back: a plain SELECT was told "only read-only queries are allowed".
    db = make_db(tmp_path / "app.db")
    with sqlite3.connect(db) as filler:
        filler.executemany("INSERT INTO users (name) VALUES (?)", [("x" * 500,)] * 2000)
    filler.close()
    subprocess.run([sys.executable, "-c", _CRASHING_WRITER, str(db)], check=False)
    assert (tmp_path / "app.db-journal").exists()
    result = query(db, "SELECT count(*) FROM users")
    assert result.code == "TOOL_FAILED" and result.error is not None
    assert "only read-only queries" not in result.error.message
    assert "SQLITE_READONLY_ROLLBACK" in result.error.message and "the query is not at fault" in result.error.message

"""The git config reader the workspace plugin uses to find core.hooksPath: it reads what git reads."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dsh_plugins import _git_config

CASES = [
    (b"[core]\n\thooksPath = githooks\n", [("core.hookspath", b"githooks")]),
    (b'\xef\xbb\xbf[Core] HooksPath="a b" # c\n\tbare\n', [("core.hookspath", b"a b"), ("core.bare", None)]),
    (
        b'[core "Sub"]\r\n\tx = "q\\"uo\\\\te" ; c\r\n[Core.Sub]\n\tx = 1\\\n2  \n',
        [("core.Sub.x", b'q"uo\\te'), ("core.sub.x", b"12")],
    ),
    (b"; only\n# comments\n\n", []),
    (
        b'[include]\n\tpath = ~/x.cfg\n[includeIf "gitdir:~/w/"]\n\tpath = y\n',
        [("include.path", b"~/x.cfg"), ("includeif.gitdir:~/w/.path", b"y")],
    ),
    # git's isspace (sane_ctype) is space, tab, CR and LF: a form feed or vertical tab is part of the value
    (b"[core]\n\thooksPath = \x0cgh\x0b\n", [("core.hookspath", b"\x0cgh\x0b")]),
    # git's strings end at a NUL: the value git uses is what comes before it
    (b'[core]\n\thooksPath = gh\0junk\n[core "a\0b"]\n\tx = 1\n', [("core.hookspath", b"gh"), ("core.a", b"1")]),
]
BAD = [
    (b'[core]\n\thooksPath = "open\n', 2),
    (b"[core\n", 1),
    (b"[core]\n\tx = a\\q\n", 2),
    (b"=x\n", 1),
    (b"[core]\n\tx y = 1\n", 2),
    (b"\xef\xbbx", 1),
    (b"\x0c[core]\n", 1),
    (b"[core]\n\x0bx = 1\n", 2),
]


@pytest.mark.parametrize(("data", "settings"), CASES)
def test_settings_are_read_as_git_reads_them(data: bytes, settings: list[tuple[str, bytes | None]]) -> None:
    """Case-folded section and key names, quotes, escapes, comments and continued lines, as in config.c."""
    assert _git_config.parse(data) == settings


@pytest.mark.parametrize(("data", "line"), BAD)
def test_what_git_refuses_is_refused_with_its_line(data: bytes, line: int) -> None:
    """A file git would not read ("bad config line N") is not half read: the caller must not guess."""
    with pytest.raises(_git_config.ConfigError) as raised:
        _git_config.parse(data)
    assert raised.value.line == line


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize("data", [case[0] for case in CASES] + [case[0] for case in BAD])
def test_git_agrees(tmp_path: Path, data: bytes) -> None:
    """git itself lists the same settings, or refuses the same line."""
    (tmp_path / "config").write_bytes(data)
    listed = subprocess.run(
        ["git", "config", "-f", str(tmp_path / "config"), "--list", "-z"],
        capture_output=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    try:
        mine = _git_config.parse(data)
    except _git_config.ConfigError as error:
        assert listed.returncode != 0 and f"bad config line {error.line} in".encode() in listed.stderr
        return
    theirs = [
        (key.decode(), value if newline else None)
        for key, newline, value in (item.partition(b"\n") for item in listed.stdout.split(b"\0")[:-1])
    ]
    assert listed.returncode == 0 and theirs == mine

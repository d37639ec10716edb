"""A reader of git's config files, for the settings the workspace plugin must know (``core.hooksPath``).

A port of the parser in git's config.c (``git_parse_source``, ``get_base_var``, ``get_value``,
``parse_value``), byte for byte: a lookalike (``configparser``) would read some files git reads
differently (a value's quotes, escapes and ``#`` comments, ``[core] key = value`` on one line, a
continued line), and a setting it misread is one it misses. What git refuses ("bad config line"),
this refuses too, with the line. (Unquoted whitespace inside a value is kept as written, as current git
does; older versions wrote each as a space.)
"""

from __future__ import annotations

__all__ = ["ConfigError", "parse"]

_BOM = b"\xef\xbb\xbf"
_SPACE = frozenset(b" \t\n\r")  # git's isspace (sane_ctype in ctype.c): not C's, no \v or \f
_KEY = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_ALPHA = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_ESCAPES = {ord("t"): ord("\t"), ord("b"): ord("\b"), ord("n"): ord("\n"), ord("\\"): ord("\\"), ord('"'): ord('"')}
_NL, _CR = ord("\n"), ord("\r")


class ConfigError(ValueError):
    """A config file git itself refuses to read ("bad config line N")."""

    def __init__(self, line: int) -> None:
        super().__init__(f"bad config line {line}")
        self.line = line
        #: The file, where the caller knows it.
        self.filename: str | None = None


class _Source:
    """The characters of a file as git's ``get_next_char`` gives them: CRLF as LF, the end as one more LF."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.line, self.eof = data, 0, 1, False
        self.last = 0

    def next(self) -> int:
        if self.pos >= len(self.data):
            if not self.eof:
                self.eof, self.line = True, self.line + 1
            self.last = _NL
            return _NL
        c = self.data[self.pos]
        self.pos += 1
        if c == _CR and self.data[self.pos : self.pos + 1] == b"\n":
            self.pos += 1
            c = _NL
        if c == _NL:
            self.line += 1
        self.last = c
        return c

    def error(self) -> ConfigError:
        """The error for the line being read (the count is past it once its LF is read)."""
        return ConfigError(self.line - 1 if self.last == _NL else self.line)


def parse(data: bytes) -> list[tuple[str, bytes | None]]:
    """The settings of a git config file, in order, as ``(name, value)``.

    ``name`` is ``section.key`` or ``section.subsection.key``: section and key lower-cased (git
    compares them ignoring case), a quoted subsection as written. ``value`` is ``None`` for a key
    without ``=`` (git reads it as true). Both end at a NUL, as git's C strings do. Raises
    :class:`ConfigError` where git would.
    """
    if data.startswith(_BOM):
        data = data[len(_BOM) :]  # as git, which skips one (Notepad writes it) but refuses part of one
    elif data[:1] == _BOM[:1]:
        raise ConfigError(1)
    source = _Source(data)
    settings: list[tuple[str, bytes | None]] = []
    section = ""
    comment = False
    while True:
        c = source.next()
        if c == _NL:
            if source.eof:
                return settings
            comment = False
        elif comment or c in _SPACE:
            continue
        elif c in b"#;":
            comment = True
        elif c == ord("["):
            section = _section(source)  # a key may follow on the same line: "[core] bare = false"
        elif c in _ALPHA:
            key, value = _variable(source, c)
            # git hands names and values on as C strings: what follows a NUL is not part of them.
            name = (f"{section}.{key}" if section else key).partition("\0")[0]
            settings.append((name, None if value is None else value.partition(b"\0")[0]))
        else:
            raise source.error()


def _lower(c: int) -> int:
    return c | 0x20 if c in _ALPHA else c  # ASCII only, as C's tolower in git's locale


def _section(source: _Source) -> str:
    """The name of a section header, read after its ``[`` (``get_base_var``)."""
    name = bytearray()
    while True:
        c = source.next()
        if source.eof:
            raise ConfigError(source.line)  # git counts the end as a line of its own here
        if c == ord("]"):
            break
        if c in _SPACE:
            name += b"." + _subsection(source, c)
            break
        if c not in _KEY and c != ord("."):
            raise source.error()
        name.append(_lower(c))  # [Core.Sub], the old spelling, is folded whole
    if not name:
        raise source.error()
    return name.decode("utf-8", "surrogateescape")


def _subsection(source: _Source, c: int) -> bytes:
    """The quoted subsection of ``[section "subsection"]``, kept as written (``get_extended_base_var``)."""
    while True:
        if c == _NL:
            raise source.error()
        c = source.next()
        if c not in _SPACE:
            break
    if c != ord('"'):
        raise source.error()
    name = bytearray()
    while True:
        c = source.next()
        if c == _NL:
            raise source.error()
        if c == ord('"'):
            break
        if c == ord("\\"):
            c = source.next()
            if c == _NL:
                raise source.error()
        name.append(c)
    if source.next() != ord("]"):
        raise source.error()
    return bytes(name)


def _variable(source: _Source, first: int) -> tuple[str, bytes | None]:
    """A key (its first character read) and its value (``get_value``)."""
    key = bytearray([_lower(first)])
    while True:
        c = source.next()
        if source.eof or c not in _KEY:
            break
        key.append(_lower(c))
    while c in b" \t":
        c = source.next()
    if c == _NL:
        return key.decode(), None
    if c != ord("="):
        raise source.error()
    return key.decode(), _value(source)


def _value(source: _Source) -> bytes:
    """A value after its ``=``, to the end of its (continued) line (``parse_value``): unquoted
    whitespace around it trimmed, quotes removed, escapes replaced, a ``#`` or ``;`` comment dropped."""
    value = bytearray()
    quoted = comment = False
    trim = 0  # where trailing unquoted whitespace began (0: none, or none kept), as git's trim_len
    while True:
        c = source.next()
        if c == _NL:
            if quoted:
                raise source.error()
            if trim:
                del value[trim:]
            return bytes(value)
        if comment:
            continue
        if c in _SPACE and not quoted:
            if not trim:
                trim = len(value)
            if value:
                value.append(c)
            continue
        if not quoted and c in b"#;":
            comment = True
            continue
        trim = 0
        if c == ord("\\"):
            c = source.next()
            if c == _NL:
                continue  # a continued line
            if c not in _ESCAPES:
                raise source.error()
            value.append(_ESCAPES[c])
        elif c == ord('"'):
            quoted = not quoted
        else:
            value.append(c)

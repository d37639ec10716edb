"""``python -m dsh_core.testing.probe NAME CONFIG_JSON [MARKS]``: import, start and dispose one plugin, silently.

The conformance kit runs this in a fresh interpreter (modules cached by the
test process would hide import-time output) and fails the plugin if anything
reaches stdout. Problems go to stderr with exit status 1.

With ``MARKS`` (a file path), one line ``PHASE OFFSET`` is appended as each
phase begins (``import``, ``start``, ``dispose``, then ``exit`` once all
succeeded): ``OFFSET`` is how many bytes stdout held then (``-`` when stdout
is not a file). The kit cuts stdout at these offsets to say which phase wrote
what, and takes the last phase as the one that failed or hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import IO


def _stdout_offset() -> int | None:
    """Bytes written to file descriptor 1 so far (print()'s buffer flushed first); ``None`` if not a file."""
    for stream in (sys.stdout, sys.__stdout__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    try:
        return os.lseek(1, 0, os.SEEK_CUR)
    except OSError:
        return None  # a pipe or a terminal: no offsets, the kit cannot split the output by phase


def main(argv: list[str]) -> int:
    """Entry point of the probe; returns the exit status."""
    if len(argv) not in (2, 3):
        sys.stderr.write("usage: python -m dsh_core.testing.probe NAME CONFIG_JSON [MARKS]\n")
        return 2
    name, raw_config = argv[:2]
    from dsh_core.errors import DshError
    from dsh_core.testing.loader import load_factory, load_plugin

    marks: IO[str] | None = open(argv[2], "a", encoding="utf-8") if len(argv) == 3 else None  # noqa: SIM115

    def mark(phase: str) -> None:
        if marks is not None:
            offset = _stdout_offset()
            # Flushed at once: a plugin that ends the process (sys.exit, os._exit) must not lose the mark.
            marks.write(f"{phase} {'-' if offset is None else offset}\n")
            marks.flush()

    async def scenario() -> None:
        mark("start")
        loaded = await load_plugin(name, json.loads(raw_config))
        mark("dispose")
        await loaded.dispose()

    try:
        mark("import")
        load_factory(name)  # imports the module; load_plugin then finds it imported
        asyncio.run(scenario())
        mark("exit")
    except DshError as error:
        sys.stderr.write(f"{error.message}\n")
        return 1
    except Exception as error:
        sys.stderr.write(f"{type(error).__name__}: {error}\n")
        return 1
    finally:
        if marks is not None:
            marks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

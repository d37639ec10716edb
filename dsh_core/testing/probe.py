"""``python -m dsh_core.testing.probe NAME CONFIG_JSON``: load, start and dispose one plugin, silently.

The conformance kit runs this in a fresh interpreter (modules cached by the
test process would hide import-time output) and fails the plugin if anything
reaches stdout. Problems go to stderr with exit status 1.
"""

from __future__ import annotations

import asyncio
import json
import sys


def main(argv: list[str]) -> int:
    """Entry point of the probe; returns the exit status."""
    if len(argv) != 2:
        sys.stderr.write("usage: python -m dsh_core.testing.probe NAME CONFIG_JSON\n")
        return 2
    name, raw_config = argv
    from dsh_core.errors import DshError
    from dsh_core.testing.loader import load_plugin

    async def scenario() -> None:
        loaded = await load_plugin(name, json.loads(raw_config))
        await loaded.dispose()

    try:
        asyncio.run(scenario())
    except DshError as error:
        sys.stderr.write(f"{error.message}\n")
        return 1
    except Exception as error:
        sys.stderr.write(f"{type(error).__name__}: {error}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

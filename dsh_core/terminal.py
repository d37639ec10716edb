"""What would drive a terminal rather than show on it, defined once for every command.

Text that models, tools, plugins and config files wrote reaches a person through the CLI
(a run's answer, ``dsh sessions show``, ``dsh config dump``). Such text may carry escape
sequences that clear the screen, set the clipboard or hide what follows, or bidi controls
that reorder a line; each command writes these characters as escapes, in its own notation.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["TERMINAL_CONTROL", "TERMINAL_CONTROL_BUT_LINE_BREAKS", "visible"]

# C1 controls count: ``\x9b`` alone is a CSI to many terminals. Line and paragraph separators
# break a line where none shows; bidi embeddings, overrides and isolates reorder it.
_BEYOND_C0: Final = "\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"

#: Characters that would act on a terminal or reorder a line rather than show.
TERMINAL_CONTROL: Final = re.compile(f"[\x00-\x1f{_BEYOND_C0}]")
#: The same but for newline and tab, which multi-line text keeps.
TERMINAL_CONTROL_BUT_LINE_BREAKS: Final = re.compile(f"[\x00-\x08\x0b-\x1f{_BEYOND_C0}]")


def visible(text: str, *, lines: bool = False) -> str:
    """``text`` with every character that would drive a terminal written as its Python escape.

    For what dsh shows a person of what models and tools wrote (a task, an answer, a
    tool name or its arguments, an error that quotes them). With ``lines``, newlines and
    tabs are kept (for multi-line text); a carriage return is still escaped, as it could
    overwrite what a line showed.
    """
    pattern = TERMINAL_CONTROL_BUT_LINE_BREAKS if lines else TERMINAL_CONTROL
    return pattern.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)

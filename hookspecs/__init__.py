"""dsh hook specifications (import name ``dsh_hookspecs``): the whole extension surface.

One module per stage family: :mod:`.tools` (tool registration),
:mod:`.policy` (the per-call pipeline), :mod:`.prompt` (system-prompt
assembly) and :mod:`.agents` (providers and session stores).

Contract shared by every hook:

* Hooks are synchronous. Where a docstring says so, an implementation may
  return an awaitable instead of a value; the core awaits it.
* Implementations may accept any subset of the documented arguments
  (pluggy's opt-in arguments) and must not declare defaults.
* dsh calls implementations in pluggy's order (``tryfirst`` first, then
  newest registration first, ``trylast`` last) but security never depends on
  that order: votes are aggregated as each docstring states.
* Pluggy wrappers (``wrapper=True``/``hookwrapper=True``) are refused: wrap
  the tool body with :func:`dsh_around_dispatch` middleware instead.
* Per-call hooks are *scope-filtered*: an implementation registered inside
  an agent's scope sees only that agent's calls; deployment-level plugins
  see every call.
* Calls the registry denies deterministically (a model-direct call of a
  native tool under Code Mode, or a nested call naming ``run_code``) reach
  no policy hook: only the result
  observers (:func:`dsh_tool_result`) see their result, as they see every
  call's.
"""

from __future__ import annotations

from typing import Final

import pluggy

#: The pluggy project name of dsh.
PROJECT: Final = "dsh"
#: Marks a function as a hook specification (dsh-internal).
hookspec: Final = pluggy.HookspecMarker(PROJECT)
#: Marks a function or method as a hook implementation (re-exported as ``dsh_core.hookimpl``).
hookimpl: Final = pluggy.HookimplMarker(PROJECT)

__all__ = ["PROJECT", "hookimpl", "hookspec", "SPEC_MODULES"]

#: The spec modules, in registration order.
SPEC_MODULES: Final = ("dsh_hookspecs.tools", "dsh_hookspecs.policy", "dsh_hookspecs.prompt", "dsh_hookspecs.agents")

"""Lazy re-exports for a package's ``__init__`` (PEP 562 module ``__getattr__``).

A package that re-exports names from its modules imports each module the first
time one of its names is read, not when the package is imported: importing
``dsh_core`` (as every ``dsh`` command does, ``dsh --help`` included) then costs
nothing until a name is used. The package still imports its names under
``TYPE_CHECKING`` (what type checkers read) and lists them in ``__all__``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, sources: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, which re-exports ``sources`` (module: names).

    A name read is imported from its module and kept in the package, so later reads
    do not come back here; any other name raises the usual :class:`AttributeError`.
    """
    where = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(
                f"module {package!r} has no attribute {name!r}", name=name, obj=sys.modules.get(package)
            )
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__

"""Draft 2020-12 JSON Schema checks and compiled validators.

Schemas are checked once, at registration, and compiled once per
definition; call-time validation reports every violation with its path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator

from dsh_core.errors import SchemaDefinitionError, Violation
from dsh_core.lossless import find_loss, pointer

__all__ = ["check_schema", "compile_validator", "violations", "format_violations"]


def check_schema(schema: object, *, owner: str) -> None:
    """Raise :class:`SchemaDefinitionError` unless ``schema`` is a valid Draft 2020-12 schema.

    ``owner`` names the culprit in the message, e.g. ``tool "read" parameters``.
    """
    loss = find_loss(schema)
    if loss is not None:
        raise SchemaDefinitionError(f"{owner}: schema is not lossless JSON at {loss.path or '/'}: {loss.reason}")
    if not isinstance(schema, Mapping):
        raise SchemaDefinitionError(f"{owner}: schema must be a JSON object, got {type(schema).__name__}")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as error:
        where = pointer(list(error.absolute_path)) or "/"
        raise SchemaDefinitionError(f"{owner}: invalid JSON Schema at {where}: {error.message}") from None


def compile_validator(schema: Mapping[str, Any]) -> Validator:
    """A reusable Draft 2020-12 validator for an already checked schema."""
    return Draft202012Validator(schema)


def violations(validator: Validator, instance: object) -> list[Violation]:
    """Every violation of ``instance``, sorted by path, each with a JSON pointer."""
    if validator.schema is True or validator.schema == {}:
        return []
    found = [
        Violation(pointer(list(error.absolute_path)) or "/", error.message)
        for error in validator.iter_errors(instance)  # type: ignore[arg-type]
    ]
    found.sort(key=lambda v: (v.path, v.message))
    return found


def format_violations(found: list[Violation]) -> str:
    """``/a: message; /b: message`` for an error message."""
    return "; ".join(str(v) for v in found)

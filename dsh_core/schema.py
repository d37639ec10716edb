"""Draft 2020-12 JSON Schema checks and compiled validators.

Schemas are checked once, at registration, and compiled once per
definition; call-time validation reports every violation with its path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema.protocols import Validator
from jsonschema_specifications import REGISTRY as _BUNDLED_METASCHEMAS  # type: ignore[import-untyped, unused-ignore]
from referencing import Registry
from referencing.exceptions import PointerToNowhere, Unresolvable
from referencing.jsonschema import DRAFT202012

from dsh_core.errors import SchemaDefinitionError, Violation, describe_exception
from dsh_core.lossless import find_loss, pointer
from dsh_core.textcut import left_out_marker

__all__ = [
    "SchemaEvaluationError",
    "check_schema",
    "compile_validator",
    "validation_errors",
    "violations",
    "format_violations",
    "fast_check",
    "MAX_SHOWN_VIOLATIONS",
    "MAX_VIOLATION_CHARS",
]


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
    except RecursionError:  # jsonschema's checks recurse
        raise SchemaDefinitionError(
            f"{owner}: schema nests too deeply to be checked ({_depth(schema)} levels of objects and arrays)"
        ) from None
    _check_references(schema, owner)


def _depth(value: object) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


#: Draft 2020-12 keywords whose value is a subschema, a list of them, or a map of them
#: (the same sets ``referencing`` crawls, so a walk here sees exactly what validation can reach).
_IN_VALUE: Final = frozenset(
    {
        "additionalProperties",
        "contains",
        "contentSchema",
        "else",
        "if",
        "items",
        "not",
        "propertyNames",
        "then",
        "unevaluatedItems",
        "unevaluatedProperties",
    }
)
_IN_ARRAY: Final = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_IN_MAP: Final = frozenset({"$defs", "definitions", "dependentSchemas", "patternProperties", "properties"})

#: An empty registry that never retrieves: only the schema's own resources (and none of the network) resolve.
#: jsonschema's validators combine it with the metaschemas they bundle, so those resolve offline too.
_LOCAL_ONLY: Final[Registry[Any]] = Registry()
#: What a validator compiled with ``_LOCAL_ONLY`` resolves against (jsonschema does this same combine):
#: the check must accept exactly the references validation can follow, and nothing remote.
_OFFLINE: Final[Registry[Any]] = _BUNDLED_METASCHEMAS.combine(_LOCAL_ONLY)


def _check_references(schema: Mapping[str, Any], owner: str) -> None:
    """Resolve every ``$ref``/``$dynamicRef`` offline, or raise naming its pointer.

    A reference may name the schema's own resources or a metaschema jsonschema
    bundles (e.g. ``https://json-schema.org/draft/2020-12/schema``), exactly what
    :func:`compile_validator` can resolve.

    Without this an unresolvable reference passes the metaschema and fails
    every later validation with a raw ``referencing`` error; a remote one would
    make jsonschema fetch it over the network at call time.
    """
    # (referencing exports no public name for its Resolver type.)
    root: Any = _OFFLINE.resolver_with_root(DRAFT202012.create_resource(schema))
    stack: list[tuple[object, list[str | int], Any]] = [(schema, [], root)]
    while stack:
        node, path, resolver = stack.pop()
        if not isinstance(node, Mapping):
            continue
        if isinstance(node.get("$id"), str) and path:
            resolver = resolver.in_subresource(DRAFT202012.create_resource(node))
        for keyword in ("$ref", "$dynamicRef"):
            ref = node.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolver.lookup(ref)
            except PointerToNowhere as error:
                problem = f"{error.ref!r} does not exist in the schema"
            except Unresolvable:
                problem = (
                    "it names no resource of this schema (references must stay inside the schema, e.g. "
                    "'#/$defs/name', or name a bundled JSON Schema metaschema; remote schemas are never "
                    "retrieved)"
                )
            else:
                continue
            where = pointer([*path, keyword])
            raise SchemaDefinitionError(f"{owner}: unresolvable {keyword} {ref!r} at {where}: {problem}")
        for keyword, value in node.items():
            if keyword in _IN_VALUE:
                stack.append((value, [*path, keyword], resolver))
            elif keyword in _IN_ARRAY and isinstance(value, list):
                stack.extend((item, [*path, keyword, index], resolver) for index, item in enumerate(value))
            elif keyword in _IN_MAP and isinstance(value, Mapping):
                stack.extend((item, [*path, keyword, name], resolver) for name, item in value.items())


def compile_validator(schema: Mapping[str, Any]) -> Validator:
    """A reusable Draft 2020-12 validator for an already checked schema; it never retrieves remote references."""
    return Draft202012Validator(schema, registry=_LOCAL_ONLY)


class SchemaEvaluationError(Exception):
    """Validation could not finish: the schema cannot be evaluated against this value.

    The message says why, e.g. ``validation recursed too deeply (...)``.
    """


#: A value at most this deep cannot exhaust the recursion limit by itself: a validation that does
#: is a ``$ref`` cycle in the schema.
_SHALLOW: Final = 50


def validation_errors(validator: Validator, instance: object) -> list[ValidationError]:
    """Every jsonschema error of ``instance``; raise :class:`SchemaEvaluationError` if validation cannot finish.

    jsonschema recurses and resolves references lazily, so a recursive schema
    meeting a deeply nested value, a ``$ref`` cycle that never consumes the
    value, or a reference :func:`check_schema` did not vet would otherwise
    escape as a raw ``RecursionError`` or ``referencing`` exception.
    """
    try:
        return list(validator.iter_errors(instance))  # type: ignore[arg-type]
    except Unresolvable as error:
        # check_schema refuses such schemas; a validator compiled without it must still fail cleanly.
        raise SchemaEvaluationError(f"unresolvable reference ({_brief(error)})") from None
    except RecursionError:
        # The value's depth tells the causes apart: deep means the value (a recursive schema
        # following it down, or jsonschema quoting it in an error message), shallow the schema.
        depth = _depth(instance)
        cause = "the value is too deep to check" if depth > _SHALLOW else "a $ref cycle in the schema"
        raise SchemaEvaluationError(
            f"validation recursed too deeply ({cause}: the value nests {depth} levels of objects and arrays)"
        ) from None
    except ArithmeticError as error:
        # multipleOf divides: a huge int against a float divisor (or a float against a huge int
        # divisor) overflows float conversion. Lossless JSON allows such ints, so this is a value
        # the schema cannot judge: refuse it (fail closed) rather than raise out of the call.
        raise SchemaEvaluationError(f"arithmetic failed ({describe_exception(error)})") from None


def violations(validator: Validator, instance: object) -> list[Violation]:
    """Every violation of ``instance``, sorted by path, each with a JSON pointer."""
    if validator.schema is True or validator.schema == {}:
        return []
    try:
        errors = validation_errors(validator, instance)
    except SchemaEvaluationError as error:
        # An error result, never an exception out of the call.
        return [Violation("/", f"the schema cannot be evaluated: {error}")]
    found = [Violation(pointer(list(error.absolute_path)) or "/", error.message) for error in errors]
    found.sort(key=lambda v: (v.path, v.message))
    return found


def _brief(error: Unresolvable) -> str:
    if isinstance(error, PointerToNowhere):
        return f"{error.ref!r} does not exist"
    return f"{type(error).__name__}: {getattr(error, 'ref', error)}"


#: What :func:`format_violations` shows at most: jsonschema quotes the offending value in its message
#: and reports every offending item, so a huge argument would otherwise come back whole in its error.
MAX_SHOWN_VIOLATIONS: Final = 10
MAX_VIOLATION_CHARS: Final = 300


def _shortened(text: str) -> str:
    if len(text) <= MAX_VIOLATION_CHARS:
        return text
    half = MAX_VIOLATION_CHARS // 2
    # Both ends: the start names the value, the end says what is wrong with it.
    return f"{text[:half]} {left_out_marker(len(text) - 2 * half, 'character')} {text[-half:]}"


def format_violations(found: list[Violation]) -> str:
    """``/a: message; /b: message`` for an error message, kept short.

    At most :data:`MAX_SHOWN_VIOLATIONS` violations are listed (then ``and N more``),
    each cut in its middle to about :data:`MAX_VIOLATION_CHARS` characters.
    """
    shown = "; ".join(_shortened(str(v)) for v in found[:MAX_SHOWN_VIOLATIONS])
    hidden = len(found) - MAX_SHOWN_VIOLATIONS
    return f"{shown}; and {hidden} more" if hidden > 0 else shown


# -- a fast validity check for the schemas tools actually use ------------------------------------------

#: Keywords that never affect validity.
_ANNOTATIONS = frozenset(
    {"description", "title", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$schema", "$id"}
)
_STRUCTURAL = frozenset({"type", "properties", "required", "additionalProperties", "items"})


def _type_test(name: str) -> Callable[[object], bool] | None:
    # Exactly jsonschema's Draft 2020-12 type checker: bools are not numbers, 1.0 is an integer.
    if name == "object":
        return lambda v: isinstance(v, dict)
    if name == "array":
        return lambda v: isinstance(v, list)
    if name == "string":
        return lambda v: isinstance(v, str)
    if name == "boolean":
        return lambda v: isinstance(v, bool)
    if name == "null":
        return lambda v: v is None
    if name == "number":
        return lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    if name == "integer":
        return lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    return None


def fast_check(schema: object) -> Callable[[object], bool] | None:
    """A plain-Python validity predicate equivalent to Draft 2020-12 for a common subset, else ``None``.

    The subset is ``type`` (a name or a list of names), ``properties``, ``required``,
    ``additionalProperties`` (a boolean or a subset schema), ``items`` (a subset
    schema) and annotations. Anything else (``$ref``, ``enum``, ``pattern``,
    ``minimum``, combinators, ...) returns ``None`` and callers use jsonschema.
    The predicate only answers *valid or not*; messages always come from
    jsonschema. The recursion here follows the schema's depth, which
    :func:`check_schema` has already bounded by parsing it.
    """
    if schema is True or schema == {}:
        return lambda value: True
    if schema is False:
        return lambda value: False
    if not isinstance(schema, Mapping):
        return None
    keys = set(schema)
    if not keys <= _STRUCTURAL | _ANNOTATIONS:
        return None
    tests: list[Callable[[object], bool]] = []
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        type_tests = [_type_test(name) for name in names]
        if any(test is None for test in type_tests):
            return None
        checks = tuple(test for test in type_tests if test is not None)
        if len(checks) == 1:
            tests.append(checks[0])
        else:

            def any_type(value: object) -> bool:
                return any(check(value) for check in checks)

            tests.append(any_type)
    properties: dict[str, Callable[[object], bool]] = {}
    for name, sub in (schema.get("properties") or {}).items():
        check = fast_check(sub)
        if check is None:
            return None
        properties[name] = check
    required = tuple(schema.get("required") or ())
    extra = schema.get("additionalProperties", True)
    extra_check: Callable[[object], bool] | None
    if extra is True:
        extra_check = None
    else:
        extra_check = fast_check(extra)
        if extra_check is None:
            return None
    if properties or required or extra_check is not None:

        def object_ok(value: object) -> bool:
            if not isinstance(value, dict):
                return True  # object keywords ignore non-objects
            for name in required:
                if name not in value:
                    return False
            for name, child in value.items():
                check = properties.get(name)
                if check is not None:
                    if not check(child):
                        return False
                elif extra_check is not None and not extra_check(child):
                    return False
            return True

        tests.append(object_ok)
    if "items" in schema:
        item_check = fast_check(schema["items"])
        if item_check is None:
            return None

        def items_ok(value: object) -> bool:
            return not isinstance(value, list) or all(item_check(item) for item in value)

        tests.append(items_ok)
    if not tests:
        return lambda value: True
    if len(tests) == 1:
        return tests[0]
    return lambda value: all(test(value) for test in tests)

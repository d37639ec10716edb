"""The token decoder's previous walk, kept as an oracle: the current one must accept, build and refuse
exactly as it did (``test_wire.py`` compares them on generated token streams, malformed ones included)."""

from __future__ import annotations

from typing import Any

from dsh_core.coderuntime.worker import wire


def decode_walk_before(tokens: object) -> object:
    """``wire._decode_walk`` as it was before it kept the innermost container in locals (``c7c17c1``)."""
    if type(tokens) is not list or not tokens:
        raise wire.WireError("a value must be a non-empty token list")
    total = len(tokens)
    # Frames: [container, keys-or-None, values-collected, remaining-children].
    stack: list[list[Any]] = []
    root: object = None
    frame_for_value: list[Any] | None
    pending = 0  # children claimed by open markers and not yet seen
    for index, token in enumerate(tokens, 1):
        if stack:
            pending -= 1  # this token fills one claimed slot
        kind = type(token)
        if kind in wire._SCALAR:
            if kind is str and not token.isascii() and wire._split_pair(token):
                raise wire.WireError("a str token holds " + wire._pair_error(token)[2:])
            value: object = token
            frame_for_value = None
        elif kind is float:
            if wire._bad_float(token):
                raise wire.WireError("non-finite number or -0.0 in token stream")
            value = token
            frame_for_value = None
        elif kind is dict:
            if len(token) != 1:
                raise wire.WireError("a marker has exactly one field")
            if "a" in token:
                length = token["a"]
                if type(length) is not int or length < 0:
                    raise wire.WireError("array marker length must be an int >= 0")
                value = []
                frame_for_value = [value, None, value, length] if length else None
                pending += length
            elif "o" in token:
                keys = token["o"]
                if type(keys) is not list:
                    raise wire.WireError("object marker keys must be a list")
                for key in keys:
                    if type(key) is not str:
                        raise wire.WireError("object keys must be strings")
                    if not key.isascii() and wire._split_pair(key):
                        raise wire.WireError("an object key holds " + wire._pair_error(key)[2:])
                pending += len(keys)
                if pending > total - index:  # before the set: only keys whose values follow are hashed
                    raise wire.WireError("a marker claims more children than tokens remain")
                if len(set(keys)) != len(keys):
                    raise wire.WireError("duplicate object key")
                value = {}
                frame_for_value = [value, keys, [], len(keys)] if keys else None
            else:
                raise wire.WireError("unknown marker field")
            if pending > total - index:
                raise wire.WireError("a marker claims more children than tokens remain")
        else:
            raise wire.WireError(f"{kind.__name__} is not a valid token")
        if stack:
            frame = stack[-1]
            frame[2].append(value)
            frame[3] -= 1
            if frame_for_value is not None:
                stack.append(frame_for_value)
            else:
                while stack and stack[-1][3] == 0:
                    done = stack.pop()
                    if done[1] is not None:
                        done[0].update(zip(done[1], done[2], strict=True))
        elif index == 1:
            root = value
            if frame_for_value is not None:
                stack.append(frame_for_value)
        else:
            raise wire.WireError("trailing tokens after the root value")
    if stack:
        raise wire.WireError("the token stream ends with open containers")
    return root

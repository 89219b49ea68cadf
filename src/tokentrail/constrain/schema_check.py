"""Checks on a JSON schema before llguidance compiles it: what it cannot refuse by itself.

llguidance compiles a schema whose `$ref`s form a cycle with no way out (an object that
requires a property of its own type): such a grammar has no finite instance, so the
model writes until its token limit and the reply never parses. It also takes bounds no
reply could meet (a `minLength` of a billion). `check_schema` refuses both with a
`ConstraintError` naming the request field, and does so without recursion: the schema
is walked with an explicit stack, so no depth of nesting raises `RecursionError`.

The finite-instance check is a least fixpoint over the schema's subschemas: a subschema
has a finite instance when one of the types it allows has one given what its children
have (an object: every required property's schema; an array: the schemas of its first
`minItems` items), `allOf` needs all of its members, `anyOf`/`oneOf` one, and a `$ref`
what it points to. It is a necessary condition only, so it never refuses a schema that
has an instance: a schema it passes may still be empty for other reasons (llguidance
decides those).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import ConstraintError

__all__ = ["MAX_DEPTH", "MAX_MIN_BOUND", "MAX_NODES", "check_schema"]

#: The largest `minLength`/`minItems`/`minProperties`/`minContains` taken: no reply of a
#: model's context can be longer.
MAX_MIN_BOUND = 100_000
#: How deep a schema document may nest (llguidance's JSON reader stops at 128).
MAX_DEPTH = 100
#: How many subschemas a schema may have.
MAX_NODES = 50_000

_MIN_KEYS = ("minLength", "minItems", "minProperties", "minContains")
_SCHEMA_LIST_KEYS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_KEYS = (
    "items", "additionalProperties", "additionalItems", "contains", "not", "if", "then",
    "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
)


def _too_complex(param: str, message: str) -> ConstraintError:
    from .compiler import TooComplex

    return TooComplex(f"{param}: too complex: {message}", param)


def _children(node: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(pointer suffix, subschema) of `node`'s direct subschemas."""
    for key in _SCHEMA_KEYS:
        if key in node:
            yield f"/{_escape(key)}", node[key]
    for key in _SCHEMA_LIST_KEYS:
        value = node.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield f"/{key}/{i}", sub
    for key in _SCHEMA_MAP_KEYS:
        value = node.get(key)
        if isinstance(value, Mapping):
            for name, sub in value.items():
                yield f"/{key}/{_escape(str(name))}", sub


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _depth(value: Any) -> int:
    """How deep `value` nests (lists and objects), walked without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > MAX_DEPTH:
                return deepest
        if isinstance(item, Mapping):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def check_schema(schema: Any, param: str) -> None:
    """Refuse (`ConstraintError` naming `param`, one line) a schema nested deeper than
    `MAX_DEPTH`, with more than `MAX_NODES` subschemas, with a lower bound over
    `MAX_MIN_BOUND`, or with no finite instance (a `$ref` cycle with no way out)."""
    depth = _depth(schema)
    if depth > MAX_DEPTH:
        raise _too_complex(param, f"the schema nests more than {MAX_DEPTH} levels deep")
    nodes = _walk(schema, param)
    if not _finite(schema, nodes):
        raise ConstraintError(
            f"{param}: the JSON schema has no finite instance: its $ref cycle never ends "
            "(a required property or item refers back to itself with no other way out)",
            param,
        )


def _walk(schema: Any, param: str) -> dict[str, Any]:
    """Every subschema object by its JSON pointer, checking bounds on the way."""
    nodes: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        pointer, node = stack.pop()
        if not isinstance(node, Mapping):
            continue
        nodes[pointer] = node
        if len(nodes) > MAX_NODES:
            raise _too_complex(param, f"the schema has more than {MAX_NODES} subschemas")
        for key in _MIN_KEYS:
            bound = node.get(key)
            if isinstance(bound, int | float) and not isinstance(bound, bool) and (
                bound > MAX_MIN_BOUND
            ):
                at = pointer or "/"
                raise _too_complex(
                    param, f"'{key}' is {bound:g} at {at}; at most {MAX_MIN_BOUND} is taken "
                    "(no reply can be that long)",
                )
        stack.extend((pointer + suffix, sub) for suffix, sub in _children(node))
    return nodes


def _resolve(ref: Any, nodes: Mapping[str, Any]) -> str | None:
    """The pointer of a local `$ref` ("#" or "#/..."), or None (elsewhere, or unknown:
    llguidance reports a dangling one itself)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    pointer = ref[1:]
    return pointer if pointer in nodes else None


def _finite(schema: Any, nodes: Mapping[str, Any]) -> bool:
    """Whether the root has a finite instance (see the module's docstring)."""
    if not isinstance(schema, Mapping):
        return schema is not False
    has: dict[str, bool] = dict.fromkeys(nodes, False)
    order = sorted(nodes, key=len, reverse=True)  # children before their parents
    changed = True
    while changed:
        changed = False
        for pointer in order:
            if not has[pointer] and _has_instance(pointer, nodes[pointer], has, nodes):
                has[pointer] = changed = True
        if has[""]:
            return True
    return has[""]


def _sub(pointer: str, value: Any, has: Mapping[str, bool]) -> bool:
    """Whether a child subschema (at `pointer`) has an instance so far."""
    if isinstance(value, Mapping):
        return has.get(pointer, False)
    return value is not False


def _has_instance(
    pointer: str, node: Mapping[str, Any], has: Mapping[str, bool], nodes: Mapping[str, Any]
) -> bool:
    ref = node.get("$ref")
    if ref is not None:
        target = _resolve(ref, nodes)
        if target is not None and not has[target]:
            return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(
        _sub(f"{pointer}/allOf/{i}", s, has) for i, s in enumerate(all_of)
    ):
        return False
    for key in ("anyOf", "oneOf"):
        options = node.get(key)
        if isinstance(options, list) and options and not any(
            _sub(f"{pointer}/{key}/{i}", s, has) for i, s in enumerate(options)
        ):
            return False
    if "enum" in node or "const" in node:
        return True
    kinds = node.get("type")
    if kinds is None:  # any type: a scalar one is finite
        return True
    if isinstance(kinds, str):
        kinds = [kinds]
    if not isinstance(kinds, list):  # not a type list: llguidance names the mistake
        return True
    return any(_kind_has_instance(k, pointer, node, has) for k in kinds)


def _kind_has_instance(
    kind: Any, pointer: str, node: Mapping[str, Any], has: Mapping[str, bool]
) -> bool:
    if kind == "object":
        props = node.get("properties")
        props = props if isinstance(props, Mapping) else {}
        required = node.get("required")
        names = required if isinstance(required, list) else []
        return all(
            _sub(f"{pointer}/properties/{_escape(str(n))}", props[n], has)
            for n in names if isinstance(n, str) and n in props
        )
    if kind == "array":
        low = node.get("minItems", 0)
        low = int(low) if isinstance(low, int | float) and not isinstance(low, bool) else 0
        if low <= 0:
            return True
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        for i in range(min(low, len(prefix))):
            if not _sub(f"{pointer}/prefixItems/{i}", prefix[i], has):
                return False
        if low > len(prefix):
            items = node.get("items", True)
            return _sub(f"{pointer}/items", items, has)
        return True
    return True

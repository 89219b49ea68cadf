"""Which values a JSON schema allows at one place of a JSON document.

JSON fields give a leaf its allowed values (and, with a scorer, the probability of
each) when the schema pins them down. Schemas written by tools rarely say so in place:
pydantic and the OpenAI SDK put every enum and nested model behind `$defs` + `$ref`,
`Optional[X]` becomes `anyOf: [X, {"type": "null"}]`, and `allOf: [{"$ref": ...}]`
wraps a referenced model. `SchemaValues` walks a schema along a leaf's path (object
keys and array indexes) through all of that:

- `$ref` (and `$dynamicRef` / `$recursiveRef`, taken as plain refs) resolved by the
  `referencing` library, the resolver `jsonschema` uses: local pointers
  (`#/$defs/X`, `#/definitions/X`), `$id`-based refs and anchors inside the document.
  Nothing is fetched: a ref outside the document pins nothing down;
- `allOf` (every branch applies: the values all of them allow), `anyOf` (the values
  any branch allows; `null` is one when a branch allows it), `oneOf` (those exactly one
  branch allows), `not`, `if`/`then`/`else`;
- `properties`, `patternProperties`, `additionalProperties`; `prefixItems`/`items`
  (and the older array form of `items` with `additionalItems`), `maxItems`;
- at the leaf: `enum`, `const`, `type` (`boolean` gives true and false, `null` gives
  null), and the keywords that can rule a listed value out (`type`, `minimum`,
  `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`, `minLength`,
  `maxLength`, `pattern`), so the values given are the ones a validator accepts there.

The answer is a finite list of scalar values (a leaf is a string, number, boolean or
null) or None when the schema does not pin them down: no finite list, a ref that does
not resolve, a recursion that consumes no path, a malformed schema. It never raises.
Values are compared as JSON Schema compares them: `1 == 1.0`, `true != 1`.

Branches are taken independently of the rest of the document (a branch chosen by a
sibling property still counts), so a list can only be too wide in such schemas, never
miss a value a validator accepts.

Each `SchemaValues` keeps its answers per path shape (array indexes past the longest
tuple form are one shape), and `schema_values` keeps the last schemas seen, so a
schema is resolved once per request and each path once, not once per leaf.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from threading import Lock
from typing import Any

__all__ = ["SchemaValues", "rebase_refs", "schema_values"]

log = logging.getLogger(__name__)

Path = tuple[str | int, ...]


def _key(value: Any) -> Any:
    """A hashable key under JSON Schema equality (1 == 1.0, true != 1)."""
    if value is None:
        return ("z",)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", value)
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, Mapping):
        return ("o", frozenset((k, _key(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("a", tuple(_key(v) for v in value))
    return ("?", repr(value))


def _always(_value: Any) -> bool:
    return True


def _never(_value: Any) -> bool:
    return False


#: The kinds of JSON value, as `type` splits them ("number" is integer + fraction).
KINDS = frozenset({"null", "boolean", "string", "integer", "fraction", "object", "array"})


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "fraction"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, Mapping) else "array"


@dataclass(frozen=True, slots=True)
class _Values:
    """What a (sub)schema allows: `values`, a finite list (None: not finite), `check`,
    whether one value is allowed (a finite list's members pass), and `kinds`, the kinds
    of value that may pass (so `allOf` of a string and an integer allows nothing)."""

    values: tuple[Any, ...] | None
    check: Callable[[Any], bool]
    kinds: frozenset[str] = KINDS

    @classmethod
    def finite(cls, values: Iterable[Any]) -> _Values:
        seen: dict[Any, Any] = {}
        for v in values:
            seen.setdefault(_key(v), v)
        keys = frozenset(seen)
        kinds = frozenset(_kind(v) for v in seen.values())
        return cls(tuple(seen.values()), lambda v: _key(v) in keys, kinds)

    @classmethod
    def test(cls, check: Callable[[Any], bool], kinds: frozenset[str] = KINDS) -> _Values:
        """Not a finite list: the values of `kinds` that pass `check` (none: EMPTY)."""
        return cls(None, check, kinds) if kinds else EMPTY


ANY = _Values(None, _always)
EMPTY = _Values((), _never, frozenset())


def _all(parts: list[_Values]) -> _Values:
    """Every part applies: the first finite list, less what another part rules out."""
    parts = [p for p in parts if p is not ANY]
    if not parts:
        return ANY
    if len(parts) == 1:
        return parts[0]
    checks = [p.check for p in parts]
    finite = next((p for p in parts if p.values is not None), None)
    if finite is None:
        kinds = frozenset.intersection(*(p.kinds for p in parts))
        return _Values.test(lambda v: all(c(v) for c in checks), kinds)
    return _Values.finite(v for v in finite.values or () if all(c(v) for c in checks))


def _any(parts: list[_Values]) -> _Values:
    """Some part applies: the union of the finite lists (not finite if one is not)."""
    if any(p is ANY for p in parts):
        return ANY
    parts = [p for p in parts if p.kinds]  # a part that allows nothing adds nothing
    if all(p.values is not None for p in parts):
        return _Values.finite(v for p in parts for v in p.values or ())
    checks = [p.check for p in parts]
    kinds = frozenset.union(*(p.kinds for p in parts))
    return _Values.test(lambda v: any(c(v) for c in checks), kinds)


def _one(parts: list[_Values]) -> _Values:
    """Exactly one part applies."""
    checks = [p.check for p in parts]

    def check(v: Any) -> bool:
        return sum(1 for c in checks if c(v)) == 1

    union = _any(parts)
    if union.values is None:
        return _Values.test(check, union.kinds)
    return _Values.finite(v for v in union.values if check(v))


_TYPES: dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and v.is_integer()),
    "object": lambda v: isinstance(v, Mapping),
    "array": lambda v: isinstance(v, list | tuple),
}


_TYPE_KINDS = {
    "number": frozenset({"integer", "fraction"}),
    **{k: frozenset({k}) for k in KINDS - {"fraction"}},
}


def _types(node: Mapping[str, Any]) -> list[str] | None:
    t = node.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return list(t)
    return None


def _type_values(types: list[str]) -> _Values:
    if set(types) <= {"boolean", "null"}:
        return _Values.finite(
            ([True, False] if "boolean" in types else []) + ([None] if "null" in types else [])
        )
    checks = [_TYPES.get(t, _always) for t in types]
    kinds = frozenset(k for t in types for k in _TYPE_KINDS.get(t, KINDS))
    return _Values.test(lambda v: any(c(v) for c in checks), kinds)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _bounds(node: Mapping[str, Any]) -> list[Callable[[Any], bool]]:
    """Checks of the keywords that can rule a scalar out (each passes other kinds)."""
    out: list[Callable[[Any], bool]] = []
    for word, ok in (
        ("minimum", lambda v, x: v >= x),
        ("maximum", lambda v, x: v <= x),
        ("exclusiveMinimum", lambda v, x: v > x),
        ("exclusiveMaximum", lambda v, x: v < x),
    ):
        x = node.get(word)
        if _is_number(x):
            out.append(lambda v, x=x, ok=ok: not _is_number(v) or ok(v, x))
    m = node.get("multipleOf")
    if _is_number(m) and m > 0:
        out.append(lambda v, m=m: not _is_number(v) or _multiple(v, m))
    for word, ok in (("minLength", lambda n, x: n >= x), ("maxLength", lambda n, x: n <= x)):
        x = node.get(word)
        if isinstance(x, int) and not isinstance(x, bool):
            out.append(lambda v, x=x, ok=ok: not isinstance(v, str) or ok(len(v), x))
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        try:
            rx = re.compile(pattern)
        except re.error:
            pass  # a pattern Python cannot read rules nothing out
        else:
            out.append(lambda v, rx=rx: not isinstance(v, str) or rx.search(v) is not None)
    return out


def _multiple(v: float, m: float) -> bool:
    if isinstance(v, int) and isinstance(m, int):
        return v % m == 0
    q = v / m
    return math.isfinite(q) and abs(q - round(q)) < 1e-9


def _value_at(value: Any, path: Path) -> tuple[bool, Any]:
    """(True, the value at `path` inside `value`) or (False, None) when it has none."""
    for part in path:
        in_object = isinstance(part, str) and isinstance(value, Mapping) and part in value
        in_array = isinstance(part, int) and isinstance(value, list) and 0 <= part < len(value)
        if not (in_object or in_array):
            return False, None
        value = value[part]
    return True, value


def _listed(node: Mapping[str, Any], path: Path) -> _Values | None:
    """What `enum` / `const` allow at `path` (None: neither keyword)."""
    parts: list[_Values] = []
    if isinstance(node.get("enum"), list):
        found = [_value_at(v, path) for v in node["enum"]]
        parts.append(_Values.finite(v for ok, v in found if ok))
    if "const" in node:
        ok, v = _value_at(node["const"], path)
        parts.append(_Values.finite([v] if ok else []))
    return _all(parts) if parts else None


_REFS = ("$ref", "$dynamicRef", "$recursiveRef")


class SchemaValues:
    """The values one JSON schema allows at each path (see the module docstring).

    `allowed(path)` takes a leaf's path (object keys as str, array indexes as int) and
    returns its allowed values, or None."""

    #: Paths kept per schema before the memo starts over (objects with free keys).
    MEMO = 4096
    #: Deeper walks than this (refs within refs) pin nothing down.
    DEPTH = 128

    def __init__(self, schema: Mapping[str, Any] | bool) -> None:
        self.schema = schema
        self._memo: dict[Path, list[Any] | None] = {}
        self._lock = Lock()
        self._spec: Any = None
        self._root: Any = None  # the resolver at the document's root (None: no referencing)
        self._shape = _tuple_limit(schema)
        try:
            from referencing import Registry
            from referencing.jsonschema import DRAFT202012, specification_with
        except ImportError:  # pragma: no cover - referencing comes with tokentrail[constrain]
            log.info("the referencing library is missing: $ref in schemas is not followed")
            return
        try:
            dialect = schema.get("$schema") if isinstance(schema, Mapping) else None
            self._spec = specification_with(dialect or "", default=DRAFT202012)
            resource = self._spec.create_resource(schema)
            uri = resource.id() or ""
            registry = Registry().with_resource(uri, resource)
        except Exception as e:  # a schema referencing cannot read: refs are not followed
            log.info("schema refs not followed: %s", e)
            self._spec = None
            return
        try:  # index the `$id`s and anchors inside the document
            registry = registry.crawl()
        except Exception as e:  # a part the dialect does not expect: pointers still work
            log.info("schema not indexed (refs by $id or anchor not followed): %s", e)
        self._root = registry.resolver(uri)

    def allowed(self, path: Sequence[str | int]) -> list[Any] | None:
        """The scalar values the schema allows at `path`, or None (not pinned down)."""
        shape = tuple(p if isinstance(p, str) else min(p, self._shape) for p in path)
        with self._lock:
            if shape in self._memo:
                return self._memo[shape]
        try:
            found = self._at(self.schema, self._root, tuple(path), set(), 0)
        except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:
            log.info("schema not read at %s: %s", list(path), e)
            found = ANY
        values = None if found.values is None else [v for v in found.values if _scalar(v)]
        out = values or None
        with self._lock:
            if len(self._memo) >= self.MEMO:
                self._memo.clear()
            self._memo[shape] = out
        return None if out is None else list(out)

    # -- the walk --

    def _enter(self, node: Any, resolver: Any) -> Any:
        """The resolver inside `node` (a new base URI where it has an `$id`)."""
        if resolver is None or not isinstance(node, Mapping):
            return resolver
        return resolver.in_subresource(self._spec.create_resource(node))

    def _ref(self, ref: Any, resolver: Any) -> tuple[Any, Any] | None:
        """(the schema `ref` names, its resolver), or None when it does not resolve."""
        if resolver is None or not isinstance(ref, str):
            return None
        from referencing.exceptions import Unresolvable

        try:
            found = resolver.lookup(ref)
        except Unresolvable:
            return None
        return found.contents, found.resolver

    def _at(self, node: Any, resolver: Any, path: Path, stack: set, depth: int) -> _Values:
        """What `node` allows at `path` below it."""
        if node is True:
            return ANY
        if node is False:
            return EMPTY
        if not isinstance(node, Mapping) or depth > self.DEPTH:
            return ANY
        here = (id(node), len(path))
        if here in stack:  # a recursion that consumed no path: pins nothing down
            return ANY
        stack.add(here)
        try:
            resolver = self._enter(node, resolver)
            parts: list[_Values] = []

            def sub(schema: Any, at: Path = path, via: Any = resolver) -> _Values:
                return self._at(schema, self._enter(schema, via), at, stack, depth + 1)

            for word in _REFS:
                if word in node:
                    target = self._ref(node[word], resolver)
                    parts.append(ANY if target is None else sub(target[0], via=target[1]))
            listed = _listed(node, path)
            if listed is not None:
                parts.append(listed)
            if isinstance(node.get("allOf"), list):
                parts += [sub(b) for b in node["allOf"]]
            if isinstance(node.get("anyOf"), list) and node["anyOf"]:
                parts.append(_any([sub(b) for b in node["anyOf"]]))
            if isinstance(node.get("oneOf"), list) and node["oneOf"]:
                branches = [sub(b) for b in node["oneOf"]]
                parts.append(_one(branches) if not path else _any(branches))
            types = _types(node)
            if path:
                if types is not None:
                    kind = "object" if isinstance(path[0], str) else "array"
                    if kind not in types:
                        return EMPTY
                parts.append(self._child(node, path, sub))
                if "if" in node and "then" in node and "else" in node:
                    parts.append(_any([sub(node["then"]), sub(node["else"])]))
            else:
                if types is not None:
                    parts.append(_type_values(types))
                checks = _bounds(node)
                if checks:
                    parts.append(_Values.test(lambda v: all(c(v) for c in checks)))
                if "not" in node:
                    negated = sub(node["not"])
                    parts.append(_Values.test(lambda v: not negated.check(v)))
                if "if" in node and ("then" in node or "else" in node):
                    parts.append(self._if(node, sub))
            return _all(parts)
        finally:
            stack.discard(here)

    @staticmethod
    def _if(node: Mapping[str, Any], sub: Callable[..., _Values]) -> _Values:
        cond = sub(node["if"])
        then = sub(node["then"]) if "then" in node else ANY
        other = sub(node["else"]) if "else" in node else ANY

        def check(v: Any) -> bool:
            return then.check(v) if cond.check(v) else other.check(v)

        union = _any([then, other])
        if union.values is None:
            return _Values.test(check, union.kinds)
        return _Values.finite(v for v in union.values if check(v))

    @staticmethod
    def _child(node: Mapping[str, Any], path: Path, sub: Callable[..., _Values]) -> _Values:
        """What the keywords for children of `node` allow at `path`."""
        part, rest = path[0], path[1:]
        if isinstance(part, str):
            found: list[_Values] = []
            props = node.get("properties")
            matched = isinstance(props, Mapping) and part in props
            if matched:
                found.append(sub(props[part], rest))
            patterns = node.get("patternProperties")
            if isinstance(patterns, Mapping):
                for rx, schema in patterns.items():
                    try:
                        hit = re.search(rx, part) is not None
                    except re.error:
                        continue
                    if hit:
                        matched = True
                        found.append(sub(schema, rest))
            if not matched and "additionalProperties" in node:
                found.append(sub(node["additionalProperties"], rest))
            return _all(found)
        limit = node.get("maxItems")
        if isinstance(limit, int) and not isinstance(limit, bool) and part >= limit:
            return EMPTY
        items = node.get("items")
        prefix = node.get("prefixItems")
        if isinstance(items, list):  # the older tuple form
            prefix, items = items, node.get("additionalItems")
        if isinstance(prefix, list) and part < len(prefix):
            return sub(prefix[part], rest)
        return ANY if items is None else sub(items, rest)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _tuple_limit(schema: Any) -> int:
    """The longest tuple form (`prefixItems`, array `items`) or `maxItems` anywhere in
    the schema: array indexes from there on are all alike."""
    limit = 0
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, Mapping):
            for word in ("prefixItems", "items"):
                if isinstance(node.get(word), list):
                    limit = max(limit, len(node[word]))
            m = node.get("maxItems")
            if isinstance(m, int) and not isinstance(m, bool):
                limit = max(limit, m)
            todo += list(node.values())
        elif isinstance(node, list):
            todo += node
    return limit


_DATA = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


def rebase_refs(schema: Any, at: str) -> Any:
    """A copy of `schema` for use at JSON Pointer `at` of a larger schema: each local
    `$ref` ("#", "#/...") is moved under `at`, so `#/$defs/X` still names the same
    subschema once the schema is embedded (a tool's `parameters` inside the schema of
    a whole call). A subschema with its own `$id` is its own resource: left as is;
    anchors and refs to other documents need no change."""
    if isinstance(schema, list):
        return [rebase_refs(v, at) for v in schema]
    if not isinstance(schema, Mapping) or "$id" in schema:
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA:
            out[key] = value
        elif key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + at + value[1:]
        else:
            out[key] = rebase_refs(value, at)
    return out


_CACHE: OrderedDict[str, SchemaValues] = OrderedDict()
_CACHE_LOCK = Lock()
_CACHE_SIZE = 64


def schema_values(schema: Mapping[str, Any] | bool) -> SchemaValues:
    """The `SchemaValues` of `schema`, shared by the requests that send the same one
    (the last few schemas are kept, by their JSON text)."""
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):  # not JSON (a value json cannot write): not shared
        return SchemaValues(schema)
    with _CACHE_LOCK:
        found = _CACHE.get(text)
        if found is not None:
            _CACHE.move_to_end(text)
            return found
    made = SchemaValues(schema)
    with _CACHE_LOCK:
        _CACHE[text] = made
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return made

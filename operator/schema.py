"""JSON Schema transforms: pydantic's JSON Schema -> a Kubernetes structural schema.

Pydantic emits JSON Schema 2020-12 with ``$ref``/``$defs``, ``anyOf`` for
optionals, numeric ``exclusiveMinimum`` and titles. A CRD needs an OpenAPI
v3.0 *structural* schema: everything inlined, a ``type`` on every node, no
``additionalProperties: false`` (pruning removes unknown fields), boolean
``exclusiveMinimum``. Doing this in one pure function keeps the models the
single source of the CRD (``crd.py`` only wraps the result).

``camelize`` turns a snake_case model's schema (the router's PolicySettings)
into the camelCase shape the RolloutPool exposes, defaults included.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

JSON = dict[str, Any]

_DROP_KEYS = ("title", "$defs", "discriminator")
_INT_OR_STRING = "x-kubernetes-int-or-string"
_PRESERVE = "x-kubernetes-preserve-unknown-fields"


def snake_to_camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def camel_to_snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _resolve(node: Any, defs: Mapping[str, JSON]) -> Any:
    """Inline every ``$ref`` (pydantic's refs point into ``$defs``; models here are not recursive)."""
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        merged = {**_resolve(target, defs), **_resolve(siblings, defs)}
        return merged
    return {k: _resolve(v, defs) for k, v in node.items()}


def _is_null(branch: Any) -> bool:
    return isinstance(branch, dict) and branch.get("type") == "null"


def _structural(node: Any) -> Any:
    if isinstance(node, list):
        return [_structural(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: JSON = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "properties":
            out[key] = {name: _structural(sub) for name, sub in value.items()}
        elif key in ("default", "enum", "required", "x-kubernetes-validations"):
            out[key] = copy.deepcopy(value)
        else:
            out[key] = _structural(value)
    for combiner in ("anyOf", "oneOf", "allOf"):
        branches = out.pop(combiner, None)
        if branches is None:
            continue
        if out.get(_INT_OR_STRING):
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            continue
        kept = [b for b in branches if not _is_null(b)]
        if len(kept) != 1:
            raise ValueError(f"cannot express {combiner} of {len(kept)} types structurally: {node!r}")
        # An optional field: absent means None; the one real branch becomes the node.
        out = {**kept[0], **out}
    if out.get("additionalProperties") is False:
        del out["additionalProperties"]
    if "const" in out:
        out["enum"] = [out.pop("const")]
    for bound, base in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(bound), int | float) and not isinstance(out.get(bound), bool):
            out[base] = out[bound]
            out[bound] = True
    if out.get("default") is None and "default" in out:
        del out["default"]
    if out.get("type") == "array" and out.get("default") == []:
        del out["default"]
    if out.get("type") == "object" and isinstance(out.get("default"), dict):
        # Nested defaults live on the nested fields; {} lets the API server fill them in.
        out["default"] = {}
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out[_PRESERVE] = True
    if out.get("type") == "object" and out.get("additionalProperties") is True:
        del out["additionalProperties"]
        out[_PRESERVE] = True
    return out


def structural(schema: JSON) -> JSON:
    """Pydantic JSON Schema -> Kubernetes structural OpenAPI v3 schema (pure)."""
    defs = schema.get("$defs", {})
    return _structural(_resolve(schema, defs))


def camelize(
    schema: JSON, *, renames: Mapping[str, str] | None = None, dropped: tuple[str, ...] = ()
) -> JSON:
    """Rename every property (and default key) of an already-structural schema to camelCase.

    ``renames``/``dropped`` apply to the top level only (snake names).
    """

    def walk(node: Any, top: bool) -> Any:
        if isinstance(node, list):
            return [walk(v, False) for v in node]
        if not isinstance(node, dict):
            return node
        out: JSON = {}
        for key, value in node.items():
            if key == "properties":
                props = {}
                for name, sub in value.items():
                    if top and name in dropped:
                        continue
                    new = (renames or {}).get(name, snake_to_camel(name)) if top else snake_to_camel(name)
                    props[new] = walk(sub, False)
                out[key] = props
            elif key == "required":
                out[key] = [snake_to_camel(n) for n in value if not (top and n in dropped)]
            elif key == "default":
                out[key] = camel_keys(value)
            else:
                out[key] = walk(value, False)
        return out

    return walk(schema, True)


def camel_keys(value: Any) -> Any:
    """Recursively camelCase the keys of nested dicts (model dumps); other values untouched."""
    if isinstance(value, dict):
        return {snake_to_camel(str(k)): camel_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [camel_keys(v) for v in value]
    return value


def snake_keys(value: Any) -> Any:
    """Recursively snake_case the keys of nested dicts (inverse of ``camel_keys``)."""
    if isinstance(value, dict):
        return {camel_to_snake(str(k)): snake_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snake_keys(v) for v in value]
    return value


def strip_defaults(schema: JSON, keep: frozenset[tuple[str, ...]] = frozenset()) -> JSON:
    """The schema without ``default`` anywhere but at the property paths in ``keep``.

    A default in a CRD is written into every stored object by the API server, so it
    outlives the release that chose it; the operator applies its own defaults instead.
    """

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [walk(v, path) for v in node]
        if not isinstance(node, dict):
            return node
        out: JSON = {}
        for key, value in node.items():
            if key == "default" and path not in keep:
                continue
            if key == "properties":
                out[key] = {name: walk(sub, (*path, name)) for name, sub in value.items()}
            elif key in ("items", "additionalProperties"):
                out[key] = walk(value, (*path, "[]"))
            elif key in ("enum", "required", "x-kubernetes-validations"):
                out[key] = copy.deepcopy(value)
            else:
                out[key] = walk(value, path)
        return out

    return walk(schema, ())

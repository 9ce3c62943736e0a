"""Server-side apply as kube-apiserver does it, for the emulator: field sets, ownership, removal.

kmock's emulator merges every PATCH, so a field left out of an applied manifest would stay and
tests would pass against behaviour no API server has. This models what matters to an operator:

* every write records the fields it set in ``metadata.managedFields`` (``fieldsV1``): a POST or
  merge PATCH as ``operation: Update`` of its field manager, an apply as ``operation: Apply``;
* an apply replaces what its manager owns: a field the manager applied before and leaves out now
  is removed, unless another entry (an ``Update`` of the same name included) still owns it;
* a forced apply takes fields whose values differ from other managers; equal values are shared;
* a write that sets ``managedFields`` itself replaces them as given (how ownership is handed over).

Lists of objects that all have a ``name`` are associative (keyed by name, like containers, env,
volumes); every other list is atomic. Pure functions over plain dicts.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

Path = tuple[str, ...]


def _keyed(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) and "name" in v for v in value)


def _key(item: Mapping[str, Any]) -> str:
    return "k:" + json.dumps({"name": item["name"]}, separators=(",", ":"))


def paths(obj: Mapping[str, Any], prefix: Path = ()) -> Iterator[Path]:
    """The leaf field paths of an object, in ``fieldsV1`` spelling (``f:spec``, ``k:{"name":"x"}``, ``.``)."""
    for key, value in obj.items():
        here = (*prefix, f"f:{key}")
        if isinstance(value, dict) and value:
            yield from paths(value, here)
        elif _keyed(value):
            for item in value:
                item_path = (*here, _key(item))
                yield (*item_path, ".")
                yield from paths(item, item_path)
        else:
            yield here


def to_fields(leaves: set[Path]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for path in leaves:
        node = fields
        for part in path:
            node = node.setdefault(part, {})
    return fields


def from_fields(fields: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    found: set[Path] = set()
    for key, value in fields.items():
        if value:
            found |= from_fields(value, (*prefix, key))
        else:
            found.add((*prefix, key))
    return found


def _remove(obj: dict[str, Any], path: Path) -> None:
    """Delete one field (or, for ``.``, one list item), then containers it left empty."""
    parents: list[tuple[Any, Any]] = []
    node: Any = obj
    for part in path[:-1]:
        if isinstance(node, dict) and part.startswith("f:") and part[2:] in node:
            parents.append((node, part[2:]))
            node = node[part[2:]]
        elif isinstance(node, list) and part.startswith("k:"):
            name = json.loads(part[2:])["name"]
            index = next((i for i, item in enumerate(node) if item.get("name") == name), None)
            if index is None:
                return
            parents.append((node, index))
            node = node[index]
        else:
            return
    last = path[-1]
    if last == ".":
        container, index = parents.pop()
        del container[index]
    elif isinstance(node, dict) and last[2:] in node:
        del node[last[2:]]
    else:
        return
    for container, key in reversed(parents):
        if container[key] in ({}, []):
            del container[key]
        else:
            break


def merge(base: Any, applied: Any) -> Any:
    """``applied`` over ``base``: maps merge, keyed lists merge by name, anything else is replaced."""
    if isinstance(base, dict) and isinstance(applied, dict):
        result = dict(base)
        for key, value in applied.items():
            result[key] = merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return result
    if _keyed(base) and _keyed(applied):
        by_name = {item["name"]: item for item in base}
        return [
            merge(by_name[item["name"]], item) if item["name"] in by_name else item for item in applied
        ] + [item for item in base if item["name"] not in {a["name"] for a in applied}]
    return copy.deepcopy(applied)


def _value(obj: Any, path: Path) -> Any:
    node = obj
    for part in path:
        if part == ".":
            return node
        if part.startswith("f:") and isinstance(node, dict):
            node = node.get(part[2:])
        elif part.startswith("k:") and isinstance(node, list):
            name = json.loads(part[2:])["name"]
            node = next((item for item in node if item.get("name") == name), None)
        else:
            return None
    return node


class ApplyConflict(Exception):
    """A non-forced apply would change fields that other managers own (HTTP 409)."""


IGNORED = {("f:metadata", "f:managedFields"), ("f:metadata", "f:resourceVersion"), ("f:status",)}


def _tracked(leaves: set[Path]) -> set[Path]:
    return {p for p in leaves if not any(p[: len(i)] == i for i in IGNORED)}


def apply(
    current: Mapping[str, Any] | None, applied: Mapping[str, Any], manager: str, force: bool, now: str
) -> dict[str, Any]:
    """The object after ``manager`` applies ``applied`` to ``current`` (None: it does not exist)."""
    obj = copy.deepcopy(dict(current or {}))
    entries = [dict(e) for e in (obj.get("metadata") or {}).get("managedFields") or []]
    mine = next((e for e in entries if e["manager"] == manager and e["operation"] == "Apply"), None)
    owned_before = from_fields(mine["fieldsV1"]) if mine else set()
    wanted = _tracked(set(paths(applied)))
    others = [e for e in entries if e is not mine]
    conflicts = {
        p
        for e in others
        for p in from_fields(e.get("fieldsV1") or {}) & wanted
        if current is not None and _value(current, p) != _value(applied, p)
    }
    if conflicts and not force:
        raise ApplyConflict(f"conflicts with other managers on {sorted(conflicts)}")
    still_owned: set[Path] = set()
    for entry in others:
        kept = from_fields(entry.get("fieldsV1") or {}) - conflicts
        entry["fieldsV1"] = to_fields(kept)
        still_owned |= kept
    for path in sorted(owned_before - wanted - still_owned, key=len, reverse=True):
        _remove(obj, path)
    obj = merge(obj, {k: v for k, v in applied.items() if k != "status"})
    entry = {
        "manager": manager,
        "operation": "Apply",
        "apiVersion": applied.get("apiVersion"),
        "time": now,
        "fieldsType": "FieldsV1",
        "fieldsV1": to_fields(wanted),
    }
    obj["metadata"]["managedFields"] = [e for e in others if e["fieldsV1"]] + [entry]
    return obj


def record_update(
    before: Mapping[str, Any] | None, after: dict[str, Any], manager: str, changed: Sequence[Path], now: str
) -> None:
    """Give ``manager``'s Update entry the fields a POST or PATCH set (others lose them)."""
    meta = after.setdefault("metadata", {})
    entries = [
        dict(e)
        for e in meta.get("managedFields") or (before or {}).get("metadata", {}).get("managedFields") or []
    ]
    taken = {p for p in _tracked(set(changed)) if _value(after, p) is not None}
    for entry in entries:
        entry["fieldsV1"] = to_fields(from_fields(entry.get("fieldsV1") or {}) - taken)
    mine = next((e for e in entries if e["manager"] == manager and e["operation"] == "Update"), None)
    if mine is None:
        mine = {
            "manager": manager,
            "operation": "Update",
            "apiVersion": after.get("apiVersion"),
            "fieldsType": "FieldsV1",
        }
        entries.append(mine)
    mine["fieldsV1"] = to_fields(from_fields(mine.get("fieldsV1") or {}) | taken)
    mine["time"] = now
    meta["managedFields"] = [e for e in entries if e["fieldsV1"]]


def merge_patch(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns ``before`` into ``after`` (None removes a key)."""
    patch: dict[str, Any] = {key: None for key in before if key not in after}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            inner = merge_patch(old, value)
            if inner:
                patch[key] = inner
        elif key not in before or old != value:
            patch[key] = value
    return patch

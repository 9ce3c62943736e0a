"""Field ownership for server-side apply: hand fields an ``Update`` once set over to the apply manager.

An object created with POST (or changed with PATCH/PUT) records its fields under the operator's
name with ``operation: Update``. Server-side apply removes a field left out of an applied manifest
only if no other entry still owns it, so those ``Update`` entries would keep stale fields forever.
This does what client-go's ``csaupgrade`` does for ``kubectl apply --server-side``: merge them into
the operator's ``Apply`` entry, after which the next apply owns, and may remove, every field.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

Fields = dict[str, Any]


def union(a: Mapping[str, Any], b: Mapping[str, Any]) -> Fields:
    """The union of two ``fieldsV1`` sets (nested dicts whose leaves are ``{}``)."""
    result = copy.deepcopy(dict(a))
    for key, value in b.items():
        result[key] = union(result.get(key) or {}, value)
    return result


def upgraded_managed_fields(
    entries: Sequence[Mapping[str, Any]], manager: str
) -> list[dict[str, Any]] | None:
    """``managedFields`` with ``manager``'s Update entries folded into its Apply entry; None if none.

    Only entries of the main resource count (a subresource's, e.g. ``status``, are left as they are).
    """
    updates = [
        e
        for e in entries
        if e.get("manager") == manager and e.get("operation") == "Update" and not e.get("subresource")
    ]
    if not updates:
        return None
    kept = [dict(e) for e in entries if not any(e is u for u in updates)]
    applied = next(
        (
            e
            for e in kept
            if e.get("manager") == manager and e.get("operation") == "Apply" and not e.get("subresource")
        ),
        None,
    )
    if applied is None:
        applied = {
            "manager": manager,
            "operation": "Apply",
            "apiVersion": updates[0].get("apiVersion"),
            "fieldsType": "FieldsV1",
            "fieldsV1": {},
        }
        if "time" in updates[0]:
            applied["time"] = updates[0]["time"]
        kept.append(applied)
    fields = applied.get("fieldsV1") or {}
    for entry in updates:
        fields = union(fields, entry.get("fieldsV1") or {})
    applied["fieldsV1"] = fields
    return kept


def upgrade_patch(obj: Mapping[str, Any], manager: str) -> list[dict[str, Any]] | None:
    """A JSON patch that performs the hand-over on ``obj``, guarded by its resourceVersion; None if
    there is nothing to hand over."""
    meta = obj.get("metadata") or {}
    upgraded = upgraded_managed_fields(meta.get("managedFields") or [], manager)
    if upgraded is None:
        return None
    return [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta.get("resourceVersion")},
        {"op": "replace", "path": "/metadata/managedFields", "value": upgraded},
    ]

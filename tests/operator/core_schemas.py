"""Kubernetes core types (Toleration, Affinity, EnvVar, ...) as CRD structural schemas.

The CRD validates tolerations, affinity, env, volumes and security contexts by the core types'
own schemas instead of preserving unknown fields. Those schemas are derived from the OpenAPI
definitions kubernetes-validate bundles, for one Kubernetes version; a test keeps the CRD's
copies equal to them. ``python -m tests.operator.core_schemas Toleration`` prints one as YAML.

Derivation: ``$ref`` inlined, nullable types reduced to their type, descriptions, formats and the
bundle's own ``x-kubernetes-*`` hints dropped (size; a CRD may not carry unions), ``IntOrString``
as ``x-kubernetes-int-or-string``, ``Quantity`` the same with the API's pattern.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

VERSION = "1.35"
CORE = "io.k8s.api.core.v1."
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
INT_OR_STRING = {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}


@cache
def _definitions() -> dict[str, Any]:
    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = folder / f"v{VERSION}.0-local-strict" / "_definitions.json"
    return json.loads(path.read_text())["$defs"]  # type: ignore[no-any-return]


def structural(node: Any) -> Any:
    """One JSON-schema node of the bundle as a structural CRD schema node."""
    if isinstance(node, list):
        return [structural(n) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        if name.endswith("util.intstr.IntOrString"):
            return dict(INT_OR_STRING)
        if name.endswith("api.resource.Quantity"):
            return {**INT_OR_STRING, "pattern": QUANTITY_PATTERN}
        return structural(_definitions()[name])
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("description", "format") or key.startswith("x-kubernetes-"):
            continue
        if key == "additionalProperties" and not isinstance(value, dict):
            continue  # the bundle's strictness; a CRD prunes (or, with strict field validation, refuses)
        if key == "type" and isinstance(value, list):
            value = next(t for t in value if t != "null")
        out[key] = structural(value) if key != "enum" else [v for v in value if v is not None]
    if "properties" in out:
        out.setdefault("type", "object")
    return out


def core(kind: str) -> dict[str, Any]:
    """The structural schema of ``io.k8s.api.core.v1.<kind>``."""
    return structural({"$ref": f"#/$defs/{CORE}{kind}"})  # type: ignore[no-any-return]


def array_of(kind: str) -> dict[str, Any]:
    return {"type": "array", "items": core(kind)}


if __name__ == "__main__":
    print(yaml.safe_dump(core(sys.argv[1]), sort_keys=True, width=1000))

"""The CRD's openAPIV3Schema as a JSON Schema, as strict as the API server with field validation on."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "speculativedeployment.yaml"


@cache
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def openapi_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def to_json_schema(node: Any) -> Any:
    """Drop x-kubernetes-* keys; close objects that the server would prune (unknown fields → error)."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if "properties" in out:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
    return out


def validator() -> jsonschema.Draft202012Validator:
    schema = to_json_schema(openapi_schema())
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft202012Validator(schema)


def cel_rules(node: Any = None, path: str = "") -> Iterator[tuple[str, dict[str, str]]]:
    """Every x-kubernetes-validations rule in the schema, with the path of the object it sits on."""
    node = openapi_schema() if node is None else node
    if isinstance(node, dict):
        for rule in node.get("x-kubernetes-validations", []):
            yield path, rule
        for key, child in (node.get("properties") or {}).items():
            yield from cel_rules(child, f"{path}.{key}")

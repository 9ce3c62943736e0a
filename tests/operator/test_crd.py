"""The CRD itself: a valid apiextensions object; examples pass its schema; invalid ones are rejected
by the schema or by the operator's twin of each CEL rule (jsonschema cannot run CEL)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from multiguess_operator.names import GROUP, KIND, PLURAL, VERSION
from multiguess_operator.spec import DeploymentSpec, SpecError, check_name, parse_spec

from tests.operator.crd import ROOT, cel_rules, crd, openapi_schema, validator

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))
EXPECT = "multiguess.io/expected-error"


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


def test_crd_is_a_valid_apiextensions_object() -> None:
    kubernetes_validate.validate(crd(), "1.33", strict=True)


def test_crd_names_match_the_operator() -> None:
    spec = crd()["spec"]
    assert (spec["group"], spec["names"]["plural"], spec["names"]["kind"]) == (GROUP, PLURAL, KIND)
    assert spec["names"]["shortNames"] == ["specdeploy"]
    version = spec["versions"][0]
    assert version["name"] == VERSION
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Replicas", "Target", "Draft", "Queue p95", "Age"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_schema_and_operator(path: Path) -> None:
    doc = load(path)
    if doc.get("kind") != KIND:
        pytest.skip(f"{path.name} is not a {KIND}")
    errors = [e.message for e in validator().iter_errors(doc)]
    assert errors == []
    check_name(doc["metadata"]["name"])
    parse_spec(doc["spec"])


def test_invalid_examples_exist_for_every_cel_rule() -> None:
    expected = {load(p)["metadata"]["annotations"][EXPECT] for p in INVALID}
    messages = {rule["message"] for _, rule in cel_rules()}
    assert messages, "the CRD has CEL rules"
    assert messages <= expected, f"CEL rules without an invalid example: {messages - expected}"


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_are_rejected(path: Path) -> None:
    doc = load(path)
    message = doc["metadata"]["annotations"][EXPECT]
    cel_messages = {rule["message"] for _, rule in cel_rules()}
    schema_errors = list(validator().iter_errors(doc))
    if message in cel_messages:
        assert schema_errors == [], "CEL-only cases must pass the structural schema"
    else:
        assert schema_errors, "the structural schema must reject this"
    with pytest.raises(SpecError) as caught:
        parse_spec(doc["spec"])
    assert caught.value.message == message


def _schema_defaults(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    found = {}
    for key, child in (node.get("properties") or {}).items():
        if "default" in child and child["default"] != {}:
            found[prefix + key] = child["default"]
        found.update(_schema_defaults(child, f"{prefix}{key}."))
    return found


def _dataclass_default(path: str) -> Any:
    """The Python default at a CRD path, found by walking the spec dataclasses' type hints."""
    cls: Any = DeploymentSpec
    *parents, leaf = path.split(".")
    for part in parents:
        hint = typing.get_type_hints(cls)[_snake(part)]
        cls = next(a for a in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(a))
    field = {f.name: f for f in dataclasses.fields(cls)}[_snake(leaf)]
    return field.default


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


def test_operator_defaults_equal_crd_defaults() -> None:
    schema_defaults = _schema_defaults(openapi_schema()["properties"]["spec"])
    assert len(schema_defaults) >= 15
    assert {path: _dataclass_default(path) for path in schema_defaults} == schema_defaults

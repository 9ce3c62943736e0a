"""The CRD itself: a valid apiextensions object; examples pass its schema; invalid ones are rejected
by the schema or by the operator's twin of each CEL rule (jsonschema cannot run CEL)."""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from multiguess_operator.names import GROUP, KIND, PLURAL, VERSION
from multiguess_operator.spec import DeploymentSpec, SpecError, check_name, parse_spec, quantity

from tests.operator.core_schemas import array_of, core
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


def _node(path: str) -> dict[str, Any]:
    node = openapi_schema()
    for key in path.strip(".").split("."):
        node = node["items"] if key == "[]" else node["properties"][key]
    return node  # type: ignore[no-any-return]


CORE_TYPED = {
    "spec.tolerations": ("Toleration", 64),
    "spec.draft.tolerations": ("Toleration", 64),
    "spec.affinity": ("Affinity", None),
    "spec.draft.affinity": ("Affinity", None),
    "spec.topologySpreadConstraints": ("TopologySpreadConstraint", 16),
    "spec.draft.topologySpreadConstraints": ("TopologySpreadConstraint", 16),
    "spec.serving.env": ("EnvVar", 64),
    "spec.pod.securityContext": ("PodSecurityContext", None),
    "spec.pod.containerSecurityContext": ("SecurityContext", None),
    "spec.pod.volumes": ("Volume", 32),
    "spec.pod.volumeMounts": ("VolumeMount", 32),
}


@pytest.mark.parametrize("path", CORE_TYPED)
def test_core_typed_fields_use_the_core_types_schemas(path: str) -> None:
    """No preserve-unknown-fields: the CRD carries the core type's own schema (core_schemas.py)."""
    kind, max_items = CORE_TYPED[path]
    expected = core(kind) if max_items is None else {**array_of(kind), "maxItems": max_items}
    assert _node(path) == expected, f"regenerate {path} with tests/operator/core_schemas.py"


def test_nothing_in_the_spec_preserves_unknown_fields() -> None:
    def walk(node: Any, path: str) -> Iterator[str]:
        if isinstance(node, dict):
            if node.get("x-kubernetes-preserve-unknown-fields"):
                yield path
            for key, child in node.items():
                yield from walk(child, f"{path}.{key}")
        elif isinstance(node, list):
            for child in node:
                yield from walk(child, path)

    assert list(walk(openapi_schema()["properties"]["spec"], "spec")) == []


# As Kubernetes' resource.ParseQuantity reads them (non-negative; no sign, no space, no "GB").
QUANTITIES = ["1", "500m", "1.5Gi", "32Gi", "100M", "2e3", ".5", "0", "1.", "128974848"]
NOT_QUANTITIES = ["lots", "32GB", "1.5 Gi", "-1", "+2", "Gi", "", "1Mi1", "0x10", "1,5"]


@pytest.mark.parametrize("text", QUANTITIES + NOT_QUANTITIES)
def test_the_quantity_pattern_and_the_operator_agree_with_the_api_server(text: str) -> None:
    schema = _node("spec.target.resources.limits")["additionalProperties"]
    assert schema["x-kubernetes-int-or-string"] is True and {"type": "integer"} in schema["anyOf"]
    valid = text in QUANTITIES
    assert bool(re.match(schema["pattern"], text)) == valid
    if valid:
        quantity("q", text)
    else:
        with pytest.raises(SpecError):
            quantity("q", text)


def test_cel_rules_name_only_fields_the_schema_has() -> None:
    """jsonschema cannot run CEL (and cel-python has no Kubernetes quantity library): check each
    rule's field references against the schema it sits on, and that iterated maps are bounded
    (the API server refuses rules whose estimated cost is unbounded)."""
    for path, rule in cel_rules():
        node = _node(path) if path else openapi_schema()
        for chain in re.findall(r"self((?:\.[A-Za-z]+)+)", rule["rule"]):
            current = node
            for name in chain.strip(".").split("."):
                if name in ("all", "exists"):
                    break
                assert name in (current.get("properties") or {}), f"{path}: {rule['rule']} names {name}"
                current = current["properties"][name]
            if ".all" in chain or ".exists" in chain:
                assert "maxProperties" in current or "maxItems" in current, f"{path}: unbounded {chain}"
        assert rule["message"] and rule["reason"].startswith("Field")


def test_requests_above_limits_are_compared_as_quantities() -> None:
    (rule,) = _node("spec.target.resources")["x-kubernetes-validations"]
    assert "quantity(" in rule["rule"] and "compareTo" in rule["rule"]
    assert _node("spec.draft.resources") == _node("spec.target.resources")


def test_names_are_dns_1123() -> None:
    for path in ("spec.hfTokenSecret", "spec.modelCache.pvc", "spec.pod.serviceAccountName"):
        pattern = re.compile(_node(path)["pattern"])
        assert pattern.match("hf-token.v2") and not pattern.match("HF_Token") and not pattern.match("-x")

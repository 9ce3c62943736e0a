"""Validate rendered manifests: built-in kinds with kubernetes-validate, custom kinds by CRD schema.

Pure functions over dicts, so the chart, the examples and the e2e values share one validator.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests.packaging.tools import ROOT

CRD_PATH = ROOT / "crds" / "speculativedeployment.yaml"
PEERING_CRD_PATH = ROOT / "crds" / "kopf-peering.yaml"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema bundled.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
# Custom kinds with no schema on this machine (the Prometheus Operator's CRDs are not vendored):
# validated by targeted assertions in the tests instead.
SCHEMALESS_KINDS = {
    "monitoring.coreos.com/v1/ServiceMonitor": "Prometheus Operator CRD schema is not available offline",
    "monitoring.coreos.com/v1/PodMonitor": "Prometheus Operator CRD schema is not available offline",
}


@cache
def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    """The SpeculativeDeployment CRD as a dict."""
    return yaml.safe_load(path.read_text())


@cache
def peering_crds() -> tuple[dict[str, Any], ...]:
    """kopf's ClusterKopfPeering and KopfPeering CRDs (leader election), as the chart ships them."""
    return tuple(doc for doc in yaml.safe_load_all(PEERING_CRD_PATH.read_text()) if doc)


def custom_resource_schemas(crd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`group/version/Kind` -> openAPIV3Schema, for every served version of a CRD."""
    spec = crd["spec"]
    return {
        f"{spec['group']}/{version['name']}/{spec['names']['kind']}": version["schema"]["openAPIV3Schema"]
        for version in spec["versions"]
        if version.get("served")
    }


def validate_custom_resource(obj: dict[str, Any], crd: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError unless `obj` fits the CRD's schema.

    x-kubernetes-* keywords and CEL rules are ignored by jsonschema; the operator mirrors the
    CEL rules in its own spec validation, and the e2e test checks them on a real API server.
    """
    key = f"{obj.get('apiVersion')}/{obj.get('kind')}"
    schemas = custom_resource_schemas(crd)
    if key not in schemas:
        raise jsonschema.ValidationError(f"{key} is not served by CRD {crd['metadata']['name']}")
    if not obj.get("metadata", {}).get("name"):
        raise jsonschema.ValidationError("metadata.name is required")
    jsonschema.Draft7Validator(schemas[key]).validate(obj)


def validate_manifest(obj: dict[str, Any], crd: dict[str, Any]) -> str:
    """Validate one object strictly; return how: 'kubernetes', 'crd' or 'skipped: <reason>'."""
    key = f"{obj.get('apiVersion')}/{obj.get('kind')}"
    for candidate in (crd, *peering_crds()):
        if key in custom_resource_schemas(candidate):
            validate_custom_resource(obj, candidate)
            return "crd"
    if key in SCHEMALESS_KINDS:
        return f"skipped: {SCHEMALESS_KINDS[key]}"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)
    return "kubernetes"

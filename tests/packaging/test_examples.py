"""The example custom resources: valid for the CRD schema and the operator, pinned as documented."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from multiguess_operator.resources import desired_children
from multiguess_operator.spec import SpecError, check_name, parse_spec

from tests.packaging.manifests import load_crd, validate_custom_resource, validate_manifest
from tests.packaging.tools import ROOT

EXAMPLES = ROOT / "examples"
EXAMPLE_FILES = ("speculative.yaml", "separate-draft.yaml")


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _resource(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return {
        "apiVersion": "multiguess.io/v1alpha1",
        "kind": "SpeculativeDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def _all_examples() -> dict[str, dict[str, Any]]:
    """The example files, plus the specs the chart's values and the e2e values install."""
    found = {name: _load(EXAMPLES / name) for name in EXAMPLE_FILES}
    for label, path in (
        ("chart values", ROOT / "charts/multiguess/values.yaml"),
        ("e2e", ROOT / "tests/e2e/values.yaml"),
    ):
        example = _load(path)["example"]
        found[label] = _resource(example["spec"], example["name"])
    return found


ALL = _all_examples()


@pytest.mark.parametrize("name", ALL)
def test_example_is_valid_for_schema_and_operator(name: str) -> None:
    resource = ALL[name]
    validate_custom_resource(resource, load_crd())
    check_name(resource["metadata"]["name"])
    parse_spec(resource["spec"])


def _pods(resource: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Deployment name -> its pod spec, as the operator would create them."""
    children = desired_children(
        resource["metadata"]["name"], "default", parse_spec(resource["spec"]), "image"
    )
    return {
        c["metadata"]["name"]: c["spec"]["template"]["spec"] for c in children if c["kind"] == "Deployment"
    }


@pytest.mark.parametrize("name", ALL)
def test_children_of_every_example_are_valid_kubernetes(name: str) -> None:
    """What the operator would create from each example passes kubernetes-validate --strict."""
    resource = ALL[name]
    spec = parse_spec(resource["spec"])
    children = desired_children(resource["metadata"]["name"], "default", spec, "registry.example.com/s:1")
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= {c["kind"] for c in children}
    for child in children:
        assert validate_manifest(child, load_crd()) == "kubernetes"


def _gpu(pod: dict[str, Any]) -> tuple[str, str]:
    (container,) = pod["containers"]
    return pod["nodeSelector"]["nvidia.com/gpu.product"], str(
        container["resources"]["limits"]["nvidia.com/gpu"]
    )


def test_minimal_example_colocates_the_draft_on_one_a100() -> None:
    pods = _pods(ALL["speculative.yaml"])
    assert set(pods) == {"qwen-7b-target"}
    assert _gpu(pods["qwen-7b-target"]) == ("NVIDIA-A100-SXM4-40GB", "1")


def test_separate_draft_example_pins_target_to_a100_and_draft_to_v100() -> None:
    resource = ALL["separate-draft.yaml"]
    pods = _pods(resource)
    assert _gpu(pods["llama-8b-target"]) == ("NVIDIA-A100-SXM4-40GB", "1")
    assert _gpu(pods["llama-8b-draft"]) == ("Tesla-V100-SXM2-16GB", "1")
    assert resource["spec"]["autoscaling"]["enabled"] is True


def _mutated(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """The minimal example with one field set (or removed when value is ...)."""
    resource = copy.deepcopy(ALL["speculative.yaml"])
    node = resource
    for key in path[:-1]:
        node = node.setdefault(key, {})
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return resource


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "target"), ...),
        (("spec", "target", "gpu"), ...),
        (("spec", "target", "gpu", "count"), 0),
        (("spec", "target", "gpu", "product"), "A100 40GB"),
        (("spec", "target", "dtype"), "int4"),
        (("spec", "draft", "placement"), "sideways"),
        (("spec", "speculation", "numCandidates"), 0),
        (("spec", "replicas"), -1),
        (("spec", "serving", "port"), 80),
        (("apiVersion",), "multiguess.io/v1"),
    ],
)
def test_schema_rejects_invalid_example(path: tuple[str, ...], value: Any) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(_mutated(path, value), load_crd())


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("spec", "draft", "gpu"), {"product": "Tesla-V100-SXM2-16GB"}, "placement: separate"),
        (("spec", "autoscaling"), {"minReplicas": 5, "maxReplicas": 2}, "minReplicas"),
        (("spec", "speculation"), {"depth": 8, "maxNodes": 4}, "maxNodes"),
    ],
)
def test_cel_only_rules_are_rejected_by_the_operator(path: tuple[str, ...], value: Any, message: str) -> None:
    """jsonschema cannot run the CRD's CEL rules; the schema passes, the operator's mirror refuses."""
    resource = _mutated(path, value)
    validate_custom_resource(resource, load_crd())
    with pytest.raises(SpecError, match=message):
        parse_spec(resource["spec"])


@pytest.mark.parametrize("name", ALL)
def test_no_example_runs_bfloat16_on_a_gpu_without_it(name: str) -> None:
    """V100s (and T4s) have no bfloat16: a pool pinned to one must name float16 or float32."""
    resource = ALL[name]
    children = desired_children(
        resource["metadata"]["name"], "default", parse_spec(resource["spec"]), "image"
    )
    for child in children:
        if child["kind"] != "Deployment":
            continue
        pod = child["spec"]["template"]["spec"]
        product = (pod.get("nodeSelector") or {}).get("nvidia.com/gpu.product", "")
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        if "V100" in product or "T4" in product:
            assert env["MULTIGUESS_DTYPE"] in ("float16", "float32"), child["metadata"]["name"]


def test_separate_draft_example_gives_the_draft_pool_its_own_settings() -> None:
    pods = _pods(ALL["separate-draft.yaml"])
    draft = pods["llama-8b-draft"]
    env = {e["name"]: e.get("value") for e in draft["containers"][0]["env"]}
    assert env["MULTIGUESS_DTYPE"] == "float16"
    assert draft["containers"][0]["resources"]["requests"] == {"cpu": "2", "memory": "8Gi"}
    target_env = {e["name"]: e.get("value") for e in pods["llama-8b-target"]["containers"][0]["env"]}
    assert target_env["MULTIGUESS_DTYPE"] == "bfloat16"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "target", "resources"), {"limits": {"memory": "lots"}}),
        (("spec", "target", "resources"), {"requests": {"memory": "32GB"}}),
        (("spec", "target", "resources"), {"requests": {"cpu": "-1"}}),
        (("spec", "hfTokenSecret"), "HF_Token"),
        (("spec", "modelCache"), {"pvc": "Models/Cache"}),
        (("spec", "tolerations"), [{"key": "gpu", "tolerationSeconds": "soon"}]),
        (
            ("spec", "affinity"),
            {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]}},
        ),
        (("spec", "serving", "env"), [{"name": "A", "valueFrom": {"secretKeyRef": {"nam": "x"}}}]),
        (("spec", "pod"), {"serviceAccountName": "Not A Name"}),
        (("spec", "pod"), {"volumes": [{"name": "v", "hostPath": {"path": 1}}]}),
        (("spec", "target", "gpu", "resource"), "not a resource!"),
        (("spec", "speculation", "drafter"), "medusa"),
    ],
)
def test_schema_rejects_what_the_api_server_would_refuse_later(path: tuple[str, ...], value: Any) -> None:
    """Quantities, names and the core types are checked at admission, not found out by a child's 422."""
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(_mutated(path, value), load_crd())


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (
            ("spec", "target", "resources"),
            {"requests": {"cpu": "500m", "memory": "1.5Gi"}, "limits": {"cpu": 2}},
        ),
        (("spec", "target", "gpu"), {"products": ["NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-SXM4-80GB"]}),
        (
            ("spec", "target", "gpu"),
            {"product": "MI300X", "resource": "amd.com/gpu", "productLabel": "amd.com/gpu.product-name"},
        ),
        (
            ("spec", "tolerations"),
            [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}],
        ),
        (
            ("spec", "serving", "env"),
            [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "x", "key": "k"}}}],
        ),
        (
            ("spec", "pod"),
            {
                "imagePullSecrets": [{"name": "regcred"}],
                "volumes": [{"name": "v", "emptyDir": {"medium": "Memory"}}],
            },
        ),
        (("spec", "speculation", "drafter"), "eagle3"),
    ],
)
def test_schema_accepts_the_core_types_and_quantities(path: tuple[str, ...], value: Any) -> None:
    resource = _mutated(path, value)
    validate_custom_resource(resource, load_crd())
    parse_spec(resource["spec"])

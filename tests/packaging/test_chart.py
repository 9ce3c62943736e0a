"""The Helm chart, rendered by real helm: lint, render several value sets, validate every object."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from multiguess_operator.rbac import cluster_role, namespace_role

from tests.packaging.helm import CHART, NAMESPACE, RELEASE, HelmError, by_kind, render, run_helm, value_args
from tests.packaging.manifests import CRD_PATH, PEERING_CRD_PATH, load_crd, peering_crds, validate_manifest
from tests.packaging.tools import ROOT

E2E_VALUES = ROOT / "tests" / "e2e" / "values.yaml"
E2E_GPU_VALUES = ROOT / "tests" / "e2e" / "values-gpu.yaml"
DIGEST = "sha256:" + "ab" * 32

# name -> (values files, --set values). Each set switches on a different part of the chart.
VALUE_SETS: dict[str, tuple[tuple[Path, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "monitoring": (
        (),
        (
            "monitoring.serviceMonitor.enabled=true",
            "monitoring.serviceMonitor.labels.release=prometheus",
            "monitoring.podMonitor.enabled=true",
            "monitoring.podMonitor.interval=30s",
        ),
    ),
    "example": ((), ("example.enabled=true", "example.name=demo")),
    "namespaced": ((), ("operator.namespaces={llm,team-b}", "example.enabled=true")),
    "e2e-cpu": ((E2E_VALUES,), ()),
    "e2e-gpu": ((E2E_VALUES, E2E_GPU_VALUES), ("example.spec.target.gpu.product=NVIDIA-H100-80GB-HBM3",)),
    "custom": (
        (),
        (
            f"image.digest={DIGEST}",
            "servingImage.repository=registry.example.com/mg/server",
            "servingImage.tag=1.2.3-cu128",
            "operator.namespaces={team-a,team-b}",
            "operator.logFormat=json",
            "operator.livenessPort=9090",
            "operator.nodeSelector.pool=system",
            "operator.extraEnv[0].name=EXTRA",
            "operator.extraEnv[0].value=enabled",
            "serviceAccount.create=false",
            "serviceAccount.name=existing-sa",
            "rbac.create=false",
            "networkPolicy.enabled=false",
            "imagePullSecrets[0].name=regcred",
        ),
    ),
}


@pytest.fixture(scope="module")
def rendered(any_helm: Path) -> dict[str, list[dict[str, Any]]]:
    """Every value set rendered once per Helm major (helm is the slow part)."""
    return {name: render(any_helm, files, sets) for name, (files, sets) in VALUE_SETS.items()}


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def _operator(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(objects, "Deployment")
    return deployment


def _operator_env(objects: list[dict[str, Any]]) -> dict[str, str]:
    (container,) = _operator(objects)["spec"]["template"]["spec"]["containers"]
    return _env(container)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict(any_helm: Path, name: str) -> None:
    files, sets = VALUE_SETS[name]
    out = run_helm(any_helm, "lint", "--strict", str(CHART), *value_args(files, sets))
    assert "1 chart(s) linted, 0 chart(s) failed" in out


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_validates(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    objects = rendered[name]
    assert objects, "nothing rendered"
    crd = load_crd()
    how = {f"{o['kind']}/{o['metadata']['name']}": validate_manifest(o, crd) for o in objects}
    skipped = {key: why for key, why in how.items() if why.startswith("skipped")}
    assert set(skipped) <= {
        f"{kind}/{RELEASE}-multiguess-serving" for kind in ("ServiceMonitor", "PodMonitor")
    }
    watched = set(_operator_env(objects)["MULTIGUESS_OPERATOR_NAMESPACES"].split(",")) - {""}
    assert {o["metadata"].get("namespace", NAMESPACE) for o in objects} <= {NAMESPACE} | watched


def test_default_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["default"]
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [
        "ClusterKopfPeering",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "NetworkPolicy",
        "ServiceAccount",
    ]
    deployment = _operator(objects)
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    # Peering elects one active replica, so old and new pods may overlap during a rollout.
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    (peering,) = by_kind(objects, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "multiguess"
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/multiguess/multiguess-operator:0.1.0"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["ports"][0]["containerPort"] == 8080
    assert _env(container) == {
        "MULTIGUESS_OPERATOR_IMAGE": "ghcr.io/multiguess/multiguess-server:0.1.0",
        "MULTIGUESS_OPERATOR_NAMESPACES": "",
        "MULTIGUESS_OPERATOR_LOG_FORMAT": "plain",
        "MULTIGUESS_OPERATOR_LIVENESS_PORT": "8080",
        "MULTIGUESS_OPERATOR_PEERING": "multiguess",
    }
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["serviceAccountName"] == f"{RELEASE}-multiguess"
    (binding,) = by_kind(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{RELEASE}-multiguess", "namespace": NAMESPACE}
    ]
    assert binding["roleRef"]["name"] == by_kind(objects, "ClusterRole")[0]["metadata"]["name"]
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= spec["template"]["metadata"]["labels"].items()
    (policy,) = by_kind(objects, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == selector


def test_custom_values_reach_the_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["custom"]
    assert sorted(o["kind"] for o in objects) == ["Deployment", "KopfPeering", "KopfPeering"]
    assert {o["metadata"]["namespace"] for o in by_kind(objects, "KopfPeering")} == {"team-a", "team-b"}
    pod = _operator(objects)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"ghcr.io/multiguess/multiguess-operator@{DIGEST}"
    env = _env(container)
    assert env["MULTIGUESS_OPERATOR_IMAGE"] == "registry.example.com/mg/server:1.2.3-cu128"
    assert env["MULTIGUESS_OPERATOR_NAMESPACES"] == "team-a,team-b"
    assert env["MULTIGUESS_OPERATOR_LOG_FORMAT"] == "json"
    assert env["MULTIGUESS_OPERATOR_LIVENESS_PORT"] == "9090"
    assert env["EXTRA"] == "enabled"
    assert container["ports"][0]["containerPort"] == 9090
    assert pod["serviceAccountName"] == "existing-sa"
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_monitors_select_the_serving_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The monitors must match the labels and port name the operator gives its target children."""
    resources = pytest.importorskip("multiguess_operator.resources", reason="operator not importable")
    spec = pytest.importorskip("multiguess_operator.spec", reason="operator not importable")
    example = yaml.safe_load((ROOT / "examples" / "speculative.yaml").read_text())
    children = resources.desired_children(
        example["metadata"]["name"], "ns", spec.parse_spec(example["spec"]), "img"
    )
    target = next(
        c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"].endswith("-target")
    )
    service = next(c for c in children if c["kind"] == "Service" and c["metadata"]["name"] == "qwen-7b")
    pod_labels = target["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in target["spec"]["template"]["spec"]["containers"][0]["ports"]}

    (service_monitor,) = by_kind(rendered["monitoring"], "ServiceMonitor")
    (pod_monitor,) = by_kind(rendered["monitoring"], "PodMonitor")
    assert service_monitor["metadata"]["labels"]["release"] == "prometheus"
    assert service_monitor["spec"]["namespaceSelector"] == {"any": True}
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} <= {
        p["name"] for p in service["spec"]["ports"]
    }
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= port_names
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "30s"


def test_example_resource(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (example,) = by_kind(rendered["example"], "SpeculativeDeployment")
    assert example["metadata"] == {
        "name": "demo",
        "namespace": NAMESPACE,
        "labels": {"app.kubernetes.io/part-of": "multiguess", "helm.sh/chart": "multiguess-0.1.0"},
    }
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert example["spec"] == values["example"]["spec"]


def test_e2e_values_point_the_operator_at_the_loaded_images(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["e2e-cpu"]
    (container,) = _operator(objects)["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "multiguess-operator:e2e"
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert _env(container)["MULTIGUESS_OPERATOR_IMAGE"] == "multiguess-server:e2e"
    (example,) = by_kind(objects, "SpeculativeDeployment")
    assert example["metadata"]["name"] == "e2e"


def test_e2e_gpu_overlay_keeps_the_model_and_moves_it_to_the_gpu(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    (cpu,) = by_kind(rendered["e2e-cpu"], "SpeculativeDeployment")
    (gpu,) = by_kind(rendered["e2e-gpu"], "SpeculativeDeployment")
    assert gpu["spec"]["target"]["model"] == cpu["spec"]["target"]["model"]
    assert gpu["spec"]["target"]["gpu"]["product"] == "NVIDIA-H100-80GB-HBM3"
    env = {e["name"]: e["value"] for e in gpu["spec"]["serving"]["env"]}
    cpu_env = {e["name"]: e["value"] for e in cpu["spec"]["serving"]["env"]}
    assert env == {**cpu_env, "MULTIGUESS_DEVICE": "cuda"}


def test_crds_rendered_with_include_crds_are_the_source_of_truth(helm: Path) -> None:
    crds = by_kind(render(helm, include_crds=True), "CustomResourceDefinition")
    by_name = {crd["metadata"]["name"]: crd for crd in crds}
    assert by_name == {crd["metadata"]["name"]: crd for crd in (load_crd(), *peering_crds())}


def test_chart_crds_are_identical_to_the_source_of_truth() -> None:
    """Helm installs charts/multiguess/crds/; it must be byte-for-byte crds/ (copy it when it changes)."""
    for source in (CRD_PATH, PEERING_CRD_PATH):
        copy = CHART / "crds" / source.name
        assert copy.read_bytes() == source.read_bytes(), f"run: cp {source} {copy}"
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(
        [CRD_PATH.name, PEERING_CRD_PATH.name]
    )


def _rule_set(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """Rules as (apiGroup, resource, verb) triples, so grouping and order do not matter."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


@pytest.mark.parametrize(("name", "namespaced"), [("default", False), ("namespaced", True)])
def test_cluster_role_matches_the_operator_rbac(
    rendered: dict[str, list[dict[str, Any]]], name: str, namespaced: bool
) -> None:
    """The chart grants exactly what multiguess_operator.rbac says the operator uses."""
    (role,) = by_kind(rendered[name], "ClusterRole")
    expected = cluster_role(namespaced_mode=namespaced)["rules"]
    assert _rule_set(role["rules"]) == _rule_set(expected)


def test_namespaced_mode_grants_a_role_in_each_watched_namespace(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """With operator.namespaces, the namespaced rules are Roles there, bound to the operator's account."""
    objects = rendered["namespaced"]
    roles = {r["metadata"]["namespace"]: r for r in by_kind(objects, "Role")}
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(objects, "RoleBinding")}
    assert set(roles) == set(bindings) == {"llm", "team-b"}
    for namespace, role in roles.items():
        assert _rule_set(role["rules"]) == _rule_set(namespace_role(namespace)["rules"])
        binding = bindings[namespace]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": f"{RELEASE}-multiguess", "namespace": NAMESPACE}
        ]
    (cluster_role_,) = by_kind(objects, "ClusterRole")
    assert not {r for _, r, _ in _rule_set(cluster_role_["rules"])} & {
        "deployments",
        "secrets",
        "speculativedeployments",
    }
    assert {p["metadata"]["namespace"] for p in by_kind(objects, "KopfPeering")} == {"llm", "team-b"}
    assert not by_kind(objects, "ClusterKopfPeering")
    (example,) = by_kind(objects, "SpeculativeDeployment")
    assert example["metadata"]["namespace"] == "llm", "the example must land where the operator watches"
    assert _operator_env(objects)["MULTIGUESS_OPERATOR_NAMESPACES"] == "llm,team-b"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("operator.logFormat=xml",), "logFormat"),
        (("unknownKey=1",), "unknownKey"),
        (("image.digest=latest",), "digest"),
        (("operator.livenessPort=0",), "livenessPort"),
        (("operator.namespaces={Bad_NS}",), "namespaces"),
        (("operator.extraEnv[0].name=N", "operator.extraEnv[0].value=1"), "extraEnv[./]0[./]value"),
        (("serviceAccount.create=false",), "serviceAccount.name is required"),
        (("example.enabled=true", "example.name=Not_A_DNS_Name"), "example[./]name"),
    ],
)
def test_bad_values_are_rejected_with_a_clear_error(
    any_helm: Path, sets: tuple[str, ...], message: str
) -> None:
    with pytest.raises(HelmError, match=message):
        render(any_helm, set_values=sets)


def test_notes_tell_the_user_what_to_do_next(helm: Path) -> None:
    """Helm 4 only: Helm 3's `install --dry-run=client` still wants a cluster."""
    out = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    notes = out.split("NOTES:", 1)[1]
    assert f"rollout status deployment/{RELEASE}-multiguess" in notes
    assert "kubectl apply -f examples/speculative.yaml" in notes
    assert "kubectl apply --server-side -f multiguess/crds/" in notes
    assert "/generate" in notes
    assert f"kubectl delete specdeploy --all --all-namespaces --wait && helm uninstall {RELEASE}" in notes


def test_package_carries_crd_schema_and_notes(helm: Path, tmp_path: Path) -> None:
    run_helm(helm, "package", str(CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("multiguess-*.tgz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for path in (
        "crds/speculativedeployment.yaml",
        "crds/kopf-peering.yaml",
        "values.schema.json",
        "templates/NOTES.txt",
        "Chart.yaml",
    ):
        assert f"multiguess/{path}" in names


def test_values_schema_is_a_valid_json_schema() -> None:
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    assert set(schema["properties"]) - {"global"} == set(values)

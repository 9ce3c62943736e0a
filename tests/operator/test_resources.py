"""Spec → children (pure): GPU pinning, wiring between target and draft, user overrides; every
manifest produced for every spec tried passes kubernetes-validate --strict."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multiguess_operator.resources import (
    GPU_PRODUCT_LABEL,
    HASH_ANNOTATION,
    desired_children,
    selector_string,
    stamp_hash,
)
from multiguess_operator.spec import parse_spec

IMAGE = "registry.test/multiguess-server:1"
A100, V100 = "NVIDIA-A100-SXM4-40GB", "Tesla-V100-SXM2-16GB"


def children(raw: dict[str, Any], name: str = "demo") -> dict[str, dict[str, Any]]:
    made = desired_children(name, "ns1", parse_spec(raw), IMAGE)
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in made}


def pod(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def env(deployment: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod(deployment)["containers"][0]["env"]}


COLOCATED = {"target": {"model": "org/t", "gpu": {"product": A100, "count": 2}}, "draft": {"model": "org/d"}}
SEPARATE = {
    "target": {"model": "org/t", "gpu": {"product": A100}},
    "draft": {
        "model": "org/d",
        "placement": "separate",
        "gpu": {"product": V100},
        "replicas": 3,
    },
    "replicas": 2,
}


def test_colocated_is_one_pinned_deployment_a_service_and_a_budget() -> None:
    made = children(COLOCATED)
    assert set(made) == {"Deployment/demo-target", "Service/demo", "PodDisruptionBudget/demo-target"}
    target = made["Deployment/demo-target"]
    spec = pod(target)
    assert spec["nodeSelector"] == {GPU_PRODUCT_LABEL: A100}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    container = spec["containers"][0]
    assert container["command"] == ["multiguess", "serve"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 600
    assert env(target)["MULTIGUESS_DRAFT"] == "org/d"
    assert "MULTIGUESS_DRAFT_URL" not in env(target)
    annotations = target["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8000"


def test_separate_draft_gets_its_own_pinned_pods_and_the_target_points_at_them() -> None:
    made = children(SEPARATE)
    draft = made["Deployment/demo-draft"]
    assert draft["spec"]["replicas"] == 3
    assert pod(draft)["nodeSelector"] == {GPU_PRODUCT_LABEL: V100}
    assert pod(draft)["containers"][0]["command"] == ["multiguess", "serve-draft"]
    wanted = {
        "MULTIGUESS_DRAFT": "org/d",
        "MULTIGUESS_DRAFT_QUANTIZATION": "none",
        "MULTIGUESS_PORT": "8001",
        "MULTIGUESS_DEVICE": "cuda",
        "MULTIGUESS_MAX_TREE_NODES": "16",  # max(maxNodes 16, 3 candidates × depth 4)
        "MULTIGUESS_MAX_SESSIONS": "8",  # ceil(2 target pods / 3 draft pods) × a batch of 8
    }
    assert wanted.items() <= env(draft).items()
    service = made["Service/demo-draft"]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "draft"
    assert service["spec"]["ports"][0]["port"] == 8001
    target = made["Deployment/demo-target"]
    assert target["spec"]["replicas"] == 2
    assert env(target)["MULTIGUESS_DRAFT_URL"] == "http://demo-draft:8001"
    assert "PodDisruptionBudget/demo-draft" in made


def test_target_env_carries_the_speculation_settings() -> None:
    raw = {
        **COLOCATED,
        "speculation": {"numCandidates": 5, "depth": 6, "maxNodes": 40},
        "serving": {"port": 9000, "maxQueue": 7, "requestTimeoutSeconds": 2.5},
    }
    got = env(children(raw)["Deployment/demo-target"])
    assert {
        "MULTIGUESS_TARGET": "org/t",
        "MULTIGUESS_NUM_CANDIDATES": "5",
        "MULTIGUESS_DEPTH": "6",
        "MULTIGUESS_MAX_NODES": "40",
        "MULTIGUESS_PORT": "9000",
        "MULTIGUESS_MAX_QUEUE": "7",
        "MULTIGUESS_REQUEST_TIMEOUT": "2.5",
        "MULTIGUESS_DRAFTER": "model",
        "MULTIGUESS_CACHE_DIR": "/models",
        "MULTIGUESS_DEVICE": "auto",
        "HF_HOME": "/models/hf",
    }.items() <= got.items()


def test_ngram_drafter_runs_without_a_draft() -> None:
    raw = {"target": COLOCATED["target"], "speculation": {"drafter": "ngram"}}
    got = env(children(raw)["Deployment/demo-target"])
    assert got["MULTIGUESS_DRAFTER"] == "ngram" and "MULTIGUESS_DRAFT" not in got


def test_user_scheduling_is_merged_but_the_gpu_product_wins() -> None:
    toleration = {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
    affinity = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    raw = {
        **SEPARATE,
        "nodeSelector": {"zone": "a", GPU_PRODUCT_LABEL: "wrong"},
        "tolerations": [toleration],
        "affinity": affinity,
    }
    made = children(raw)
    for name, product in (("demo-target", A100), ("demo-draft", V100)):
        spec = pod(made[f"Deployment/{name}"])
        assert spec["nodeSelector"] == {"zone": "a", GPU_PRODUCT_LABEL: product}
        assert spec["tolerations"][0] == toleration and len(spec["tolerations"]) == 2
        assert spec["affinity"] == affinity


def test_user_env_overrides_by_name_and_token_comes_from_the_secret() -> None:
    raw = {
        **COLOCATED,
        "serving": {
            "env": [{"name": "MULTIGUESS_DTYPE", "value": "float16"}, {"name": "EXTRA", "value": "1"}]
        },
        "hfTokenSecret": "hf",
    }
    got = env(children(raw)["Deployment/demo-target"])
    assert got["MULTIGUESS_DTYPE"] == "float16" and got["EXTRA"] == "1"
    assert got["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    names = [e["name"] for e in pod(children(raw)["Deployment/demo-target"])["containers"][0]["env"]]
    assert len(names) == len(set(names))


def test_model_cache_volume() -> None:
    assert pod(children(COLOCATED)["Deployment/demo-target"])["volumes"] == [
        {"name": "model-cache", "emptyDir": {}}
    ]
    raw = {**COLOCATED, "modelCache": {"pvc": "models"}}
    volumes = pod(children(raw)["Deployment/demo-target"])["volumes"]
    assert volumes == [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}]


def test_cpu_draft_without_gpu_is_not_pinned() -> None:
    raw = {**SEPARATE, "draft": {"model": "org/d", "placement": "separate"}}
    draft = children(raw)["Deployment/demo-draft"]
    assert "nodeSelector" not in pod(draft)
    assert "nvidia.com/gpu" not in str(pod(draft)["containers"][0]["resources"])
    assert env(draft)["MULTIGUESS_DEVICE"] == "cpu"


def test_labels_and_selectors() -> None:
    for child in children(SEPARATE).values():
        labels = child["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "multiguess"
        assert labels["app.kubernetes.io/instance"] == "demo"
        assert labels["app.kubernetes.io/managed-by"] == "multiguess-operator"
        assert labels["app.kubernetes.io/component"] in {"target", "draft"}
        if child["kind"] == "Deployment":
            selector = child["spec"]["selector"]["matchLabels"]
            assert selector.items() <= child["spec"]["template"]["metadata"]["labels"].items()
    assert selector_string("demo") == (
        "app.kubernetes.io/component=target,app.kubernetes.io/instance=demo,app.kubernetes.io/name=multiguess"
    )


def test_hash_changes_with_the_desired_state_only() -> None:
    first = stamp_hash(children(COLOCATED)["Deployment/demo-target"])
    again = stamp_hash(stamp_hash(children(COLOCATED)["Deployment/demo-target"]))
    changed = stamp_hash(children({**COLOCATED, "replicas": 3})["Deployment/demo-target"])
    digest = first["metadata"]["annotations"][HASH_ANNOTATION]
    assert again["metadata"]["annotations"][HASH_ANNOTATION] == digest
    assert changed["metadata"]["annotations"][HASH_ANNOTATION] != digest


gpus = st.fixed_dictionaries(
    {"product": st.sampled_from([A100, V100, "NVIDIA-H100-80GB-HBM3"]), "count": st.integers(1, 8)}
)
specs = st.fixed_dictionaries(
    {
        "target": st.fixed_dictionaries(
            {"model": st.just("org/t"), "gpu": gpus, "dtype": st.sampled_from(["auto", "bfloat16"])}
        ),
        "draft": st.one_of(
            st.fixed_dictionaries({"model": st.just("org/d")}),
            st.fixed_dictionaries(
                {
                    "model": st.just("org/d"),
                    "placement": st.just("separate"),
                    "gpu": gpus,
                    "replicas": st.integers(1, 4),
                }
            ),
        ),
        "replicas": st.integers(0, 50),
        "serving": st.fixed_dictionaries(
            {"port": st.integers(1024, 65535), "requestTimeoutSeconds": st.floats(0.5, 600)}
        ),
        "nodeSelector": st.dictionaries(st.sampled_from(["zone", "pool"]), st.sampled_from(["a", "b"])),
        "modelCache": st.sampled_from([{"pvc": "models"}, {"emptyDir": {"sizeLimit": "100Gi"}}]),
        "hfTokenSecret": st.sampled_from(["hf", "token-secret"]),
    }
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=specs)
def test_every_manifest_passes_strict_validation(raw: dict[str, Any]) -> None:
    for child in children(raw).values():
        kubernetes_validate.validate(stamp_hash(child), "1.33", strict=True)

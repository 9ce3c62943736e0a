"""Spec → children (pure): GPU pinning, wiring between target and draft, user overrides; every
manifest produced for every spec tried passes kubernetes-validate --strict."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multiguess_operator.resources import (
    HASH_ANNOTATION,
    desired_children,
    draft_secret,
    selector_string,
    stamp_hash,
)
from multiguess_operator.spec import GPU_PRODUCT_LABEL, parse_spec

IMAGE = "registry.test/multiguess-server:1"
ROOT = Path(__file__).resolve().parents[2]
# The serving image's user (`USER uid:gid` of the Dockerfile's server stage).
DOCKERFILE_USER = re.findall(r"^USER (\d+):", (ROOT / "Dockerfile").read_text(), re.MULTILINE)[-1]
# `multiguess serve` reads each flag from MULTIGUESS_<FLAG> (server/multiguess/commands/engine_args.py).
SERVE_FLAGS_FROM_ENV = {
    "MULTIGUESS_" + flag.upper().replace("-", "_")
    for flag in re.findall(r'"--([a-z-]+)"', (ROOT / "server/multiguess/commands/serve.py").read_text())
}
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
    spec = pod(children(raw)["Deployment/demo-target"])
    assert spec["nodeSelector"] == {"zone": "a", GPU_PRODUCT_LABEL: A100}
    assert spec["tolerations"][0] == toleration and len(spec["tolerations"]) == 2
    assert spec["affinity"] == affinity


def test_the_draft_pool_has_its_own_settings_and_inherits_none_of_the_targets() -> None:
    draft_toleration = {"key": "v100", "operator": "Exists", "effect": "NoSchedule"}
    raw = {
        **SEPARATE,
        "target": {**SEPARATE["target"], "dtype": "bfloat16"},
        "nodeSelector": {"pool": "a100"},
        "tolerations": [{"key": "a100", "operator": "Exists"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "draft": {
            **SEPARATE["draft"],
            "dtype": "float16",
            "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "12Gi"}},
            "nodeSelector": {"pool": "v100"},
            "tolerations": [draft_toleration],
            "extraArgs": ["--log-level", "debug"],
        },
    }
    made = children(raw)
    draft = made["Deployment/demo-draft"]
    spec = pod(draft)
    assert spec["nodeSelector"] == {"pool": "v100", GPU_PRODUCT_LABEL: V100}
    assert spec["tolerations"] == [
        draft_toleration,
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert "affinity" not in spec
    container = spec["containers"][0]
    assert container["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"},
        "limits": {"memory": "12Gi", "nvidia.com/gpu": "1"},
    }
    assert container["args"] == ["--log-level", "debug"]
    assert env(draft)["MULTIGUESS_DTYPE"] == "float16"
    target = made["Deployment/demo-target"]
    assert env(target)["MULTIGUESS_DTYPE"] == "bfloat16"
    assert pod(target)["nodeSelector"] == {"pool": "a100", GPU_PRODUCT_LABEL: A100}
    assert "args" not in pod(target)["containers"][0]


def test_a_colocated_draft_dtype_reaches_the_target_server() -> None:
    raw = {**COLOCATED, "draft": {"model": "org/d", "dtype": "float16"}}
    got = env(children(raw)["Deployment/demo-target"])
    assert got["MULTIGUESS_DRAFT_DTYPE"] == "float16" and got["MULTIGUESS_DTYPE"] == "auto"
    assert "MULTIGUESS_DRAFT_SECRET" not in got


def test_eagle3_is_a_drafter_like_the_others() -> None:
    raw = {**COLOCATED, "speculation": {"drafter": "eagle3"}}
    got = env(children(raw)["Deployment/demo-target"])
    assert got["MULTIGUESS_DRAFTER"] == "eagle3" and got["MULTIGUESS_DRAFT"] == "org/d"


def test_an_eagle3_head_in_its_own_pods_reads_the_targets_embeddings() -> None:
    """The head's pool runs ``serve-draft --drafter eagle3`` naming the target (its config,
    tokenizer and embeddings); the target pods capture the features and send them there."""
    made = children({**SEPARATE, "speculation": {"drafter": "eagle3"}})
    draft = env(made["Deployment/demo-draft"])
    assert draft["MULTIGUESS_DRAFTER"] == "eagle3" and draft["MULTIGUESS_TARGET"] == "org/t"
    assert draft["MULTIGUESS_DRAFT"] == "org/d"
    target = env(made["Deployment/demo-target"])
    assert target["MULTIGUESS_DRAFTER"] == "eagle3"
    assert target["MULTIGUESS_DRAFT_URL"] == "http://demo-draft:8001"
    model_pool = env(children(SEPARATE)["Deployment/demo-draft"])
    assert model_pool["MULTIGUESS_DRAFTER"] == "model" and "MULTIGUESS_TARGET" not in model_pool


def test_separate_pools_share_the_draft_secret_by_reference() -> None:
    made = children(SEPARATE)
    ref = {"secretKeyRef": {"name": "demo-draft-secret", "key": "secret"}}
    assert env(made["Deployment/demo-target"])["MULTIGUESS_DRAFT_SECRET"] == ref
    assert env(made["Deployment/demo-draft"])["MULTIGUESS_DRAFT_SECRET"] == ref
    secret = draft_secret("demo", "ns1", "s3cret")
    assert secret["metadata"]["name"] == "demo-draft-secret"
    assert base64.b64decode(secret["data"]["secret"]) == b"s3cret"
    kubernetes_validate.validate(secret, "1.33", strict=True)


def test_gpus_by_a_list_of_products_and_any_resource_name() -> None:
    user_term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    raw = {
        **COLOCATED,
        "target": {
            "model": "org/t",
            "gpu": {"products": [A100, "NVIDIA-A100-SXM4-80GB"], "resource": "nvidia.com/mig-3g.20gb"},
        },
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [user_term]}
            }
        },
        "nodeSelector": {GPU_PRODUCT_LABEL: "wrong"},
    }
    spec = pod(children(raw)["Deployment/demo-target"])
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"] == [
        user_term["matchExpressions"][0],
        {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": [A100, "NVIDIA-A100-SXM4-80GB"]},
    ]
    assert "nodeSelector" not in spec
    assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-3g.20gb": "1"}
    amd = {
        **COLOCATED,
        "target": {
            "model": "org/t",
            "gpu": {
                "product": "MI300X",
                "resource": "amd.com/gpu",
                "productLabel": "amd.com/gpu.product-name",
            },
        },
    }
    spec = pod(children(amd)["Deployment/demo-target"])
    assert spec["nodeSelector"] == {"amd.com/gpu.product-name": "MI300X"}
    assert spec["containers"][0]["resources"]["limits"] == {"amd.com/gpu": "1"}
    assert {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_pods_meet_pod_security_restricted_with_writable_scratch() -> None:
    """The "restricted" profile's rules, and a read-only root with emptyDirs where servers write."""
    for name, deployment in children(SEPARATE).items():
        if not name.startswith("Deployment/"):
            continue
        spec = pod(deployment)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001 == int(DOCKERFILE_USER)
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = spec["containers"]
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        for path in ("/tmp", "/models", "/home/multiguess/.cache"):
            assert "emptyDir" in volumes[mounts[path]]
        cache_env = {
            k: v for k, v in env(deployment).items() if k in ("XDG_CACHE_HOME", "TRITON_CACHE_DIR", "HF_HOME")
        }
        assert len(cache_env) == 3 and all(
            any(str(v).startswith(m) for m in mounts) for v in cache_env.values()
        )
        # restricted allows only these volume types
        allowed = {
            "configMap",
            "csi",
            "downwardAPI",
            "emptyDir",
            "ephemeral",
            "persistentVolumeClaim",
            "projected",
            "secret",
        }
        assert all(set(v) - {"name"} <= allowed for v in spec["volumes"])
        assert "hostNetwork" not in spec and "hostPID" not in spec


def test_the_open_pod_template() -> None:
    settings = {
        "annotations": {"team": "llm", "prometheus.io/port": "1"},
        "labels": {"team": "llm", "app.kubernetes.io/component": "mine"},
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccountName": "serving",
        "runtimeClassName": "nvidia",
        "priorityClassName": "inference",
        "securityContext": {"runAsUser": 2000, "fsGroup": 2000},
        "containerSecurityContext": {"readOnlyRootFilesystem": False},
        "volumes": [{"name": "certs", "secret": {"secretName": "certs"}}],
        "volumeMounts": [{"name": "certs", "mountPath": "/certs", "readOnly": True}],
    }
    spread = [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    ]
    raw = {
        **COLOCATED,
        "pod": settings,
        "topologySpreadConstraints": spread,
        "target": {**COLOCATED["target"], "extraArgs": ["--max-batch", "4"]},
    }
    target = children(raw)["Deployment/demo-target"]
    meta = target["spec"]["template"]["metadata"]
    assert meta["labels"]["team"] == "llm" and meta["labels"]["app.kubernetes.io/component"] == "target"
    assert meta["annotations"]["team"] == "llm" and meta["annotations"]["prometheus.io/port"] == "8000"
    spec = pod(target)
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert (spec["serviceAccountName"], spec["runtimeClassName"], spec["priorityClassName"]) == (
        "serving",
        "nvidia",
        "inference",
    )
    assert spec["securityContext"]["runAsUser"] == 2000 and spec["securityContext"]["runAsNonRoot"] is True
    assert spec["topologySpreadConstraints"] == spread
    container = spec["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "certs", "mountPath": "/certs", "readOnly": True} in container["volumeMounts"]
    assert {"name": "certs", "secret": {"secretName": "certs"}} in spec["volumes"]
    assert container["args"] == ["--max-batch", "4"]
    kubernetes_validate.validate(stamp_hash(target), "1.33", strict=True)


def test_shutdown_drains_within_the_grace_period_and_rollouts_outwait_model_loads() -> None:
    raw = {
        **SEPARATE,
        "serving": {"requestTimeoutSeconds": 120.5, "preStopSeconds": 15, "startupTimeoutSeconds": 1800},
        "rollout": {"maxSurge": "25%", "maxUnavailable": 1},
    }
    made = children(raw)
    for name in ("demo-target", "demo-draft"):
        deployment = made[f"Deployment/{name}"]
        spec = pod(deployment)
        (container,) = spec["containers"]
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "15"]
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
        assert (
            deployment["spec"]["progressDeadlineSeconds"]
            > startup["periodSeconds"] * startup["failureThreshold"]
        )
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 1}
    target = made["Deployment/demo-target"]
    drain = int(env(target)["MULTIGUESS_SHUTDOWN_GRACE"])
    assert drain >= 120.5  # an in-flight request may take the whole request timeout
    assert pod(target)["terminationGracePeriodSeconds"] > 15 + drain
    assert "MULTIGUESS_SHUTDOWN_GRACE" in SERVE_FLAGS_FROM_ENV


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
    def cache(raw: dict[str, Any]) -> dict[str, Any]:
        return next(
            v for v in pod(children(raw)["Deployment/demo-target"])["volumes"] if v["name"] == "model-cache"
        )

    assert cache(COLOCATED) == {"name": "model-cache", "emptyDir": {}}
    pvc = cache({**COLOCATED, "modelCache": {"pvc": "models"}})
    assert pvc == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}


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


PRODUCTS = [A100, V100, "NVIDIA-H100-80GB-HBM3"]
gpus = st.one_of(
    st.fixed_dictionaries({"product": st.sampled_from(PRODUCTS), "count": st.integers(1, 8)}),
    st.fixed_dictionaries(
        {
            "products": st.lists(st.sampled_from(PRODUCTS), min_size=1, max_size=3, unique=True),
            "resource": st.sampled_from(["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "amd.com/gpu"]),
        }
    ),
)
quantities = st.dictionaries(st.sampled_from(["cpu", "memory"]), st.sampled_from(["500m", "2", "8Gi", 4]))
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
                    "dtype": st.sampled_from(["auto", "float16"]),
                    "resources": st.fixed_dictionaries({"requests": quantities}),
                    "nodeSelector": st.dictionaries(st.just("pool"), st.sampled_from(["v100", "cpu"])),
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
        "pod": st.fixed_dictionaries(
            {},
            optional={
                "labels": st.dictionaries(st.sampled_from(["team", "tier"]), st.sampled_from(["a", "b"])),
                "imagePullSecrets": st.just([{"name": "regcred"}]),
                "serviceAccountName": st.just("serving"),
                "priorityClassName": st.just("inference"),
            },
        ),
        "rollout": st.fixed_dictionaries(
            {"maxSurge": st.sampled_from([1, "25%"]), "maxUnavailable": st.sampled_from([0, 1])}
        ),
    }
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=specs)
def test_every_manifest_passes_strict_validation(raw: dict[str, Any]) -> None:
    for child in children(raw).values():
        kubernetes_validate.validate(stamp_hash(child), "1.33", strict=True)

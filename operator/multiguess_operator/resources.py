"""Spec → desired children (pure). Everything the operator creates is decided here and nowhere else."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from multiguess_operator.names import INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER
from multiguess_operator.spec import DeploymentSpec, DraftSpec, GpuSpec

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
DRAFT_PORT = 8001
CACHE_DIR = "/models"
HASH_ANNOTATION = "multiguess.io/desired-hash"
HF_TOKEN_KEY = "token"
HF_HOME = f"{CACHE_DIR}/hf"

Manifest = dict[str, Any]


def labels(name: str, component: str | None = None) -> dict[str, str]:
    """The recommended labels every child carries; ``component`` narrows to target or draft pods."""
    result = {
        "app.kubernetes.io/name": "multiguess",
        INSTANCE_LABEL: name,
        MANAGED_BY_LABEL: MANAGER,
    }
    if component is not None:
        result["app.kubernetes.io/component"] = component
    return result


def selector(name: str, component: str) -> dict[str, str]:
    """Pod selector of one component; immutable on Deployments, so it never includes mutable labels."""
    return {
        "app.kubernetes.io/name": "multiguess",
        INSTANCE_LABEL: name,
        "app.kubernetes.io/component": component,
    }


def selector_string(name: str) -> str:
    """The target pods' selector as the scale subresource reports it (``status.selector``)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector(name, "target").items()))


def endpoint(name: str, namespace: str, spec: DeploymentSpec) -> str:
    return f"http://{name}.{namespace}.svc:{spec.serving.port}"


def desired_children(name: str, namespace: str, spec: DeploymentSpec, default_image: str) -> list[Manifest]:
    """All children of one SpeculativeDeployment, in creation order."""
    image = spec.serving.image or default_image
    children = [target_deployment(name, namespace, spec, image), api_service(name, namespace, spec)]
    children.append(disruption_budget(name, namespace, "target"))
    draft = spec.separate_draft
    if draft is not None:
        children += [
            draft_deployment(name, namespace, spec, draft, image),
            draft_service(name, namespace),
            disruption_budget(name, namespace, "draft"),
        ]
    return children


def stamp_hash(manifest: Manifest) -> Manifest:
    """Record a digest of the manifest on itself: a changed digest means the desired state changed."""
    annotations = manifest["metadata"].setdefault("annotations", {})
    annotations.pop(HASH_ANNOTATION, None)
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    annotations[HASH_ANNOTATION] = digest
    return manifest


def _meta(name: str, namespace: str, owner: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(owner, component)}


def target_deployment(name: str, namespace: str, spec: DeploymentSpec, image: str) -> Manifest:
    """The serving pods: target (and a co-located draft), pinned to the target's GPU product."""
    env = _target_env(name, spec)
    container = _container("target", image, ["multiguess", "serve"], spec.serving.port, env, spec)
    container["resources"] = _resources(
        spec.target.resources.limits, spec.target.resources.requests, spec.target.gpu
    )
    pod = _pod_spec(spec, container, spec.target.gpu)
    pod["terminationGracePeriodSeconds"] = int(spec.serving.request_timeout_seconds) + 10
    return _deployment(name, namespace, f"{name}-target", "target", spec.replicas, pod, spec.serving.port)


TARGET_MAX_BATCH = 8  # the serving image's default --max-batch


def draft_sessions(spec: DeploymentSpec, draft: DraftSpec) -> int:
    """Sequences one draft pod may hold: its share of the most target pods, each a full batch. An
    autoscaled draft pool is sized at its fewest pods, so scaling it never changes the pod template."""
    targets = spec.autoscaling.max_replicas if spec.autoscaling.enabled else spec.replicas
    drafts = draft.autoscaling.min_replicas if draft.autoscaling.enabled else draft.replicas
    return -(-targets // drafts) * TARGET_MAX_BATCH


def draft_deployment(
    name: str, namespace: str, spec: DeploymentSpec, draft: DraftSpec, image: str
) -> Manifest:
    """Draft pods of ``placement: separate``, pinned to the draft's GPU product when it names one."""
    s = spec.speculation
    env = [
        {"name": "MULTIGUESS_DRAFT", "value": draft.model},
        {"name": "MULTIGUESS_DRAFT_QUANTIZATION", "value": draft.quantization},
        {"name": "MULTIGUESS_DTYPE", "value": spec.target.dtype},
        {"name": "MULTIGUESS_DEVICE", "value": "cuda" if draft.gpu is not None else "cpu"},
        {"name": "MULTIGUESS_PORT", "value": str(DRAFT_PORT)},
        # The draft server refuses trees larger than this; the target asks for up to these.
        {"name": "MULTIGUESS_MAX_TREE_NODES", "value": str(max(s.max_nodes, s.num_candidates * s.depth))},
        # One session per running sequence of every target pod this draft pod may serve.
        {"name": "MULTIGUESS_MAX_SESSIONS", "value": str(draft_sessions(spec, draft))},
        {"name": "MULTIGUESS_CACHE_DIR", "value": CACHE_DIR},
    ]
    container = _container("draft", image, ["multiguess", "serve-draft"], DRAFT_PORT, env, spec)
    container["resources"] = _resources({}, {}, draft.gpu)
    pod = _pod_spec(spec, container, draft.gpu)
    return _deployment(name, namespace, f"{name}-draft", "draft", draft.replicas, pod, DRAFT_PORT)


def api_service(name: str, namespace: str, spec: DeploymentSpec) -> Manifest:
    return _service(name, namespace, name, "target", spec.serving.port)


def draft_service(name: str, namespace: str) -> Manifest:
    return _service(name, namespace, f"{name}-draft", "draft", DRAFT_PORT)


def disruption_budget(name: str, namespace: str, component: str) -> Manifest:
    """At most one pod of a component evicted at a time: a drained GPU node never empties a service."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(f"{name}-{component}", namespace, name, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name, component)}},
    }


def _service(owner: str, namespace: str, name: str, component: str, port: int) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, owner, component),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(owner, component),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _deployment(
    owner: str, namespace: str, name: str, component: str, replicas: int, pod: Manifest, port: int
) -> Manifest:
    # maxUnavailable 0: a rollout never drops serving capacity; it needs room for one extra pod.
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, owner, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(owner, component)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": labels(owner, component),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod,
            },
        },
    }


def _target_env(name: str, spec: DeploymentSpec) -> list[dict[str, Any]]:
    s = spec.speculation
    values: dict[str, str] = {
        "MULTIGUESS_TARGET": spec.target.model,
        "MULTIGUESS_MODEL_NAME": spec.target.model,
        "MULTIGUESS_DTYPE": spec.target.dtype,
        "MULTIGUESS_DEVICE": "auto",  # the GPU the pod is pinned to, when the image's torch has CUDA
        "MULTIGUESS_DRAFTER": s.drafter,
        "MULTIGUESS_NUM_CANDIDATES": str(s.num_candidates),
        "MULTIGUESS_DEPTH": str(s.depth),
        "MULTIGUESS_MAX_NODES": str(s.max_nodes),
        "MULTIGUESS_PORT": str(spec.serving.port),
        "MULTIGUESS_MAX_QUEUE": str(spec.serving.max_queue),
        "MULTIGUESS_REQUEST_TIMEOUT": _number(spec.serving.request_timeout_seconds),
        "MULTIGUESS_CACHE_DIR": CACHE_DIR,
    }
    if spec.draft is not None:
        values["MULTIGUESS_DRAFT"] = spec.draft.model
        values["MULTIGUESS_DRAFT_QUANTIZATION"] = spec.draft.quantization
        if spec.separate_draft is not None:
            values["MULTIGUESS_DRAFT_URL"] = f"http://{name}-draft:{DRAFT_PORT}"
    return [{"name": k, "value": v} for k, v in values.items()]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _container(
    role: str, image: str, command: list[str], port: int, env: list[dict[str, Any]], spec: DeploymentSpec
) -> Manifest:
    """A serving container; the user's ``serving.env`` overrides ours by name, then the HF token."""
    merged = {e["name"]: e for e in env}
    # Hub downloads land in the mounted cache whatever the image's own default.
    merged["HF_HOME"] = {"name": "HF_HOME", "value": HF_HOME}
    merged.update({e["name"]: dict(e) for e in spec.serving.env})
    if spec.hf_token_secret:
        merged["HF_TOKEN"] = {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": spec.hf_token_secret, "key": HF_TOKEN_KEY}},
        }
    http_get = {"port": "http"}
    return {
        "name": role,
        "image": image,
        "command": command,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": list(merged.values()),
        "volumeMounts": [{"name": "model-cache", "mountPath": CACHE_DIR}],
        # Model loading can take minutes: the startup probe holds liveness off until the pod is ready.
        "startupProbe": {
            "httpGet": {"path": "/health/ready", **http_get},
            "periodSeconds": 10,
            "failureThreshold": 90,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health/live", **http_get},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {"path": "/health/ready", **http_get},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "securityContext": {"allowPrivilegeEscalation": False},
    }


def _resources(limits: Mapping[str, Any], requests: Mapping[str, Any], gpu: GpuSpec | None) -> Manifest:
    """User CPU/memory resources plus the GPU count; extended resources are set as limits only."""
    result: dict[str, Any] = {}
    merged_limits = dict(limits)
    if gpu is not None:
        merged_limits[GPU_RESOURCE] = str(gpu.count)
    if merged_limits:
        result["limits"] = merged_limits
    if requests:
        result["requests"] = dict(requests)
    return result


def _pod_spec(spec: DeploymentSpec, container: Manifest, gpu: GpuSpec | None) -> Manifest:
    """User scheduling constraints merged with GPU pinning; the GPU product always wins."""
    node_selector = dict(spec.node_selector)
    tolerations = [dict(t) for t in spec.tolerations]
    if gpu is not None:
        node_selector[GPU_PRODUCT_LABEL] = gpu.product
        gpu_toleration = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        if gpu_toleration not in tolerations:
            tolerations.append(gpu_toleration)
    pod: dict[str, Any] = {"containers": [container], "volumes": [_cache_volume(spec)]}
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    if spec.affinity:
        pod["affinity"] = dict(spec.affinity)
    return pod


def _cache_volume(spec: DeploymentSpec) -> Manifest:
    cache = spec.model_cache
    if cache is not None and cache.pvc is not None:
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.pvc}}
    empty_dir = dict(cache.empty_dir) if cache is not None and cache.empty_dir is not None else {}
    return {"name": "model-cache", "emptyDir": empty_dir}

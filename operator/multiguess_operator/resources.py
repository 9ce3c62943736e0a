"""Spec → desired children (pure). Everything the operator creates is decided here and nowhere else."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from multiguess_operator.names import INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER
from multiguess_operator.spec import (
    DRAFT_SERVER_READS_TARGET,
    DeploymentSpec,
    DraftSpec,
    GpuSpec,
    ResourceSpec,
)

DRAFT_PORT = 8001
CACHE_DIR = "/models"
HASH_ANNOTATION = "multiguess.io/desired-hash"
HF_TOKEN_KEY = "token"
HF_HOME = f"{CACHE_DIR}/hf"
# The root filesystem is read-only: these are the writable places besides the model cache.
TMP_DIR = "/tmp"
USER_CACHE_DIR = "/home/multiguess/.cache"  # the image's user (uid 10001) home, for libraries' caches
RUN_AS = 10001  # the Dockerfile's user and group
DRAFT_SECRET_KEY = "secret"
DRAFT_SHUTDOWN_SECONDS = 30  # the draft server's drain: its sessions end with the target's requests
STARTUP_PERIOD_SECONDS = 10  # the startup probe's period; serving.startupTimeoutSeconds sets its count
PROGRESS_MARGIN_SECONDS = 120  # a Deployment's progress deadline beyond the startup probe's budget
SHUTDOWN_MARGIN_SECONDS = 10  # grace beyond preStop + drain, so the kubelet never kills a draining server

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


def draft_secret_name(name: str) -> str:
    """The Secret holding the shared secret of the target↔draft protocol."""
    return f"{name}-draft-secret"


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


def draft_secret(name: str, namespace: str, value: str) -> Manifest:
    """The draft protocol's shared secret; created once (``value`` is random) and never rewritten."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(draft_secret_name(name), namespace, name, "draft"),
        "type": "Opaque",
        "data": {DRAFT_SECRET_KEY: base64.b64encode(value.encode()).decode()},
    }


def target_deployment(name: str, namespace: str, spec: DeploymentSpec, image: str) -> Manifest:
    """The serving pods: target (and a co-located draft), pinned to the target's GPU products."""
    env = _target_env(name, spec)
    drain = math.ceil(spec.serving.request_timeout_seconds)  # in-flight requests may run this long
    env.append({"name": "MULTIGUESS_SHUTDOWN_GRACE", "value": str(drain)})
    role = Role("target", ["multiguess", "serve"], spec.serving.port, spec.target.extra_args)
    container = _container(role, image, env, spec, drain)
    container["resources"] = _resources(spec.target.resources, spec.target.gpu)
    pool = Pool(spec.node_selector, spec.tolerations, spec.affinity, spec.topology_spread_constraints)
    pod = _pod_spec(spec, container, spec.target.gpu, pool, drain)
    return _deployment(name, namespace, f"{name}-target", "target", spec.replicas, pod, spec)


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
    """Draft pods of ``placement: separate``: the draft's own dtype, resources and scheduling. An
    EAGLE-3 head's pods also name the target: they read its config, tokenizer and embeddings."""
    s = spec.speculation
    head = (
        [{"name": "MULTIGUESS_TARGET", "value": spec.target.model}]
        if s.drafter in DRAFT_SERVER_READS_TARGET
        else []
    )
    env = [
        {"name": "MULTIGUESS_DRAFTER", "value": s.drafter},
        *head,
        {"name": "MULTIGUESS_DRAFT", "value": draft.model},
        {"name": "MULTIGUESS_DRAFT_QUANTIZATION", "value": draft.quantization},
        {"name": "MULTIGUESS_DTYPE", "value": draft.dtype},
        {"name": "MULTIGUESS_DEVICE", "value": "cuda" if draft.gpu is not None else "cpu"},
        {"name": "MULTIGUESS_PORT", "value": str(DRAFT_PORT)},
        # The draft server refuses trees larger than this; the target asks for up to these.
        {"name": "MULTIGUESS_MAX_TREE_NODES", "value": str(max(s.max_nodes, s.num_candidates * s.depth))},
        # One session per running sequence of every target pod this draft pod may serve.
        {"name": "MULTIGUESS_MAX_SESSIONS", "value": str(draft_sessions(spec, draft))},
        {"name": "MULTIGUESS_CACHE_DIR", "value": CACHE_DIR},
        _draft_secret_env(name),
    ]
    role = Role("draft", ["multiguess", "serve-draft"], DRAFT_PORT, draft.extra_args)
    container = _container(role, image, env, spec, DRAFT_SHUTDOWN_SECONDS)
    container["resources"] = _resources(draft.resources, draft.gpu)
    pool = Pool(draft.node_selector, draft.tolerations, draft.affinity, draft.topology_spread_constraints)
    pod = _pod_spec(spec, container, draft.gpu, pool, DRAFT_SHUTDOWN_SECONDS)
    return _deployment(name, namespace, f"{name}-draft", "draft", draft.replicas, pod, spec)


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


def startup_budget_seconds(spec: DeploymentSpec) -> int:
    """How long the startup probe lets a pod load its model (period × failure threshold)."""
    return STARTUP_PERIOD_SECONDS * _startup_failures(spec)


def _startup_failures(spec: DeploymentSpec) -> int:
    return max(1, math.ceil(spec.serving.startup_timeout_seconds / STARTUP_PERIOD_SECONDS))


def _deployment(
    owner: str, namespace: str, name: str, component: str, replicas: int, pod: Manifest, spec: DeploymentSpec
) -> Manifest:
    port = pod["containers"][0]["ports"][0]["containerPort"]
    annotations = {
        **spec.pod.annotations,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    rollout = spec.rollout
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, owner, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(owner, component)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": rollout.max_surge, "maxUnavailable": rollout.max_unavailable},
            },
            # Longer than a model load may take, so a slow start is progress, not a failed rollout.
            "progressDeadlineSeconds": startup_budget_seconds(spec) + PROGRESS_MARGIN_SECONDS,
            "template": {
                "metadata": {
                    "labels": {**spec.pod.labels, **labels(owner, component)},
                    "annotations": annotations,
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
    env: list[dict[str, Any]] = []
    if spec.draft is not None:
        values["MULTIGUESS_DRAFT"] = spec.draft.model
        values["MULTIGUESS_DRAFT_QUANTIZATION"] = spec.draft.quantization
        if spec.separate_draft is not None:
            values["MULTIGUESS_DRAFT_URL"] = f"http://{name}-draft:{DRAFT_PORT}"
            env.append(_draft_secret_env(name))
        else:
            values["MULTIGUESS_DRAFT_DTYPE"] = spec.draft.dtype
    return [{"name": k, "value": v} for k, v in values.items()] + env


def _draft_secret_env(name: str) -> dict[str, Any]:
    ref = {"name": draft_secret_name(name), "key": DRAFT_SECRET_KEY}
    return {"name": "MULTIGUESS_DRAFT_SECRET", "valueFrom": {"secretKeyRef": ref}}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


@dataclass(frozen=True)
class Role:
    """What differs between the target and the draft container."""

    name: str
    command: list[str]
    port: int
    extra_args: tuple[str, ...]


@dataclass(frozen=True)
class Pool:
    """One pool's scheduling: the target's from the spec's top level, the draft's from spec.draft."""

    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]
    topology_spread_constraints: tuple[Mapping[str, Any], ...]


# Pod Security "restricted": what every serving pod and container runs with unless the spec overrides.
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS,
    "runAsGroup": RUN_AS,
    "fsGroup": RUN_AS,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def _container(
    role: Role, image: str, env: list[dict[str, Any]], spec: DeploymentSpec, drain_seconds: int
) -> Manifest:
    """A serving container; the user's ``serving.env`` overrides ours by name, then the HF token."""
    merged = {e["name"]: e for e in env}
    # Hub downloads land in the mounted cache whatever the image's own default.
    merged["HF_HOME"] = {"name": "HF_HOME", "value": HF_HOME}
    # Libraries' caches go to the writable emptyDir (the root filesystem is read-only); Triton
    # ignores XDG_CACHE_HOME and would write under $HOME/.triton.
    merged["XDG_CACHE_HOME"] = {"name": "XDG_CACHE_HOME", "value": USER_CACHE_DIR}
    merged["TRITON_CACHE_DIR"] = {"name": "TRITON_CACHE_DIR", "value": f"{USER_CACHE_DIR}/triton"}
    merged.update({e["name"]: dict(e) for e in spec.serving.env})
    if spec.hf_token_secret:
        merged["HF_TOKEN"] = {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": spec.hf_token_secret, "key": HF_TOKEN_KEY}},
        }
    http_get = {"port": "http"}
    container: Manifest = {
        "name": role.name,
        "image": image,
        "command": role.command,
        "ports": [{"name": "http", "containerPort": role.port, "protocol": "TCP"}],
        "env": list(merged.values()),
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": TMP_DIR},
            {"name": "user-cache", "mountPath": USER_CACHE_DIR},
            *(dict(m) for m in spec.pod.volume_mounts),
        ],
        # Model loading can take minutes: the startup probe holds liveness off until the pod is ready.
        "startupProbe": {
            "httpGet": {"path": "/health/ready", **http_get},
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "failureThreshold": _startup_failures(spec),
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
        # Endpoints drop the pod before SIGTERM, so no new request reaches a draining server.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(spec.serving.pre_stop_seconds)]}}},
        "securityContext": _merged(CONTAINER_SECURITY, spec.pod.container_security_context),
    }
    if role.extra_args:
        container["args"] = list(role.extra_args)
    return container


def _merged(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` with the user's keys replacing ours one by one."""
    return {**copy.deepcopy(dict(defaults)), **copy.deepcopy(dict(overrides))}


def _resources(resources: ResourceSpec, gpu: GpuSpec | None) -> Manifest:
    """User CPU/memory resources plus the GPU count; extended resources are set as limits only."""
    result: dict[str, Any] = {}
    merged_limits = dict(resources.limits)
    if gpu is not None:
        merged_limits[gpu.resource] = str(gpu.count)
    if merged_limits:
        result["limits"] = merged_limits
    if resources.requests:
        result["requests"] = dict(resources.requests)
    return result


def _pod_spec(
    spec: DeploymentSpec, container: Manifest, gpu: GpuSpec | None, pool: Pool, drain: int
) -> Manifest:
    """One pool's scheduling merged with GPU pinning (the GPU products always win), hardened."""
    node_selector = dict(pool.node_selector)
    tolerations = [dict(t) for t in pool.tolerations]
    affinity = copy.deepcopy(dict(pool.affinity))
    if gpu is not None:
        node_selector.pop(gpu.product_label, None)
        if gpu.product:
            node_selector[gpu.product_label] = gpu.product
        else:
            affinity = _require_node_label(affinity, gpu.product_label, gpu.products)
        vendor = gpu.resource.split("/")[0]
        gpu_toleration = {"key": f"{vendor}/gpu", "operator": "Exists", "effect": "NoSchedule"}
        if gpu_toleration not in tolerations:
            tolerations.append(gpu_toleration)
    settings = spec.pod
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            _cache_volume(spec),
            {"name": "tmp", "emptyDir": {}},
            {"name": "user-cache", "emptyDir": {}},
            *(dict(v) for v in settings.volumes),
        ],
        "securityContext": _merged(POD_SECURITY, settings.security_context),
        # preStop, then the server's drain, then a margin: the kubelet never cuts a request short.
        "terminationGracePeriodSeconds": spec.serving.pre_stop_seconds + drain + SHUTDOWN_MARGIN_SECONDS,
    }
    optional = {
        "nodeSelector": node_selector,
        "tolerations": tolerations,
        "affinity": affinity,
        "topologySpreadConstraints": [dict(t) for t in pool.topology_spread_constraints],
        "imagePullSecrets": [dict(s) for s in settings.image_pull_secrets],
        "serviceAccountName": settings.service_account_name,
        "runtimeClassName": settings.runtime_class_name,
        "priorityClassName": settings.priority_class_name,
    }
    pod.update({key: value for key, value in optional.items() if value})
    return pod


def _require_node_label(affinity: dict[str, Any], label: str, values: tuple[str, ...]) -> dict[str, Any]:
    """Add ``label In values`` to every required node-selector term (terms are ORed, so each needs it)."""
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    expression = {"key": label, "operator": "In", "values": list(values)}
    required["nodeSelectorTerms"] = [
        {**term, "matchExpressions": [*term.get("matchExpressions", []), expression]} for term in terms
    ]
    return affinity


def _cache_volume(spec: DeploymentSpec) -> Manifest:
    cache = spec.model_cache
    if cache is not None and cache.pvc is not None:
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.pvc}}
    empty_dir = dict(cache.empty_dir) if cache is not None and cache.empty_dir is not None else {}
    return {"name": "model-cache", "emptyDir": empty_dir}

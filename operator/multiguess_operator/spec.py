"""The SpeculativeDeployment spec as typed, defaulted values, and the rules the CRD schema states in CEL.

The API server applies the CRD's defaults and CEL rules; the operator re-applies both because it must
not trust that it runs behind one (and the emulator used in tests has neither). Every CEL rule in the
CRD has a twin here so that a spec that slips through is reported as ``Ready=False``, not crashed on.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from kubernetes.utils import parse_quantity

# A Service is named <name>-draft, and Service names are DNS-1035 labels of at most 63 characters.
MAX_NAME_LENGTH = 63 - len("-draft")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# The server's drafters (its registry, ``multiguess.drafting.KINDS``), which the operator does
# not import: tests/operator/test_drafters.py fails when these, or the CRD's enum and rules, differ.
Drafter = Literal["model", "eagle3", "ngram", "suffix", "none"]
READS_DRAFT = ("model", "eagle3")  # drafters that read a checkpoint: ``spec.draft``
DRAFT_SERVER_READS_TARGET = ("eagle3",)  # whose draft pods read the target (config, tokenizer, embeddings)
IntOrString = int | str


class SpecError(ValueError):
    """The spec cannot be turned into children; ``reason`` is the condition's machine-readable reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class GpuSpec:
    """GPUs per pod: any of the named products (a node label's values), counted as ``resource``."""

    product: str | None = None
    products: tuple[str, ...] = ()
    count: int = 1
    resource: str = GPU_RESOURCE
    product_label: str = GPU_PRODUCT_LABEL

    @property
    def allowed_products(self) -> tuple[str, ...]:
        return (self.product,) if self.product else self.products


@dataclass(frozen=True)
class ResourceSpec:
    limits: Mapping[str, IntOrString] = field(default_factory=dict)
    requests: Mapping[str, IntOrString] = field(default_factory=dict)


@dataclass(frozen=True)
class TargetSpec:
    model: str
    gpu: GpuSpec
    dtype: Dtype = "auto"
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class DraftAutoscalingSpec:
    """The draft pool's own autoscaling (``placement: separate``): the targets' policy, on the draft
    servers' busy time and step latency and on the targets' fallbacks to plain decoding."""

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_busy_fraction: float = 0.7
    target_step_latency_seconds: float = 0.05
    target_fallback_fraction: float = 0.02
    interval_seconds: int = 15
    scale_down_stabilization_seconds: int = 300
    max_scale_up_factor: float = 2.0


@dataclass(frozen=True)
class DraftSpec:
    """The draft model; with ``placement: separate`` also its own pool's pod settings (never the target's)."""

    model: str
    placement: Literal["colocated", "separate"] = "colocated"
    gpu: GpuSpec | None = None
    quantization: Literal["none", "int8"] = "none"
    replicas: int = 1
    autoscaling: DraftAutoscalingSpec = field(default_factory=DraftAutoscalingSpec)
    dtype: Dtype = "auto"
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    extra_args: tuple[str, ...] = ()

    @property
    def has_pool_settings(self) -> bool:
        """Whether settings that only a separate draft pool can use are set."""
        r = self.resources
        pool = (r.limits, r.requests, self.node_selector, self.tolerations, self.affinity)
        return any(pool) or bool(self.topology_spread_constraints)


@dataclass(frozen=True)
class SpeculationSpec:
    num_candidates: int = 3
    depth: int = 4
    max_nodes: int = 16
    drafter: Drafter = "model"

    @property
    def needs_draft(self) -> bool:
        """Whether the drafter reads a draft checkpoint (``spec.draft.model``)."""
        return self.drafter in READS_DRAFT


@dataclass(frozen=True)
class ServingSpec:
    image: str | None = None
    port: int = 8000
    max_queue: int = 64
    request_timeout_seconds: float = 60.0
    env: tuple[Mapping[str, Any], ...] = ()
    pre_stop_seconds: int = 10
    startup_timeout_seconds: int = 900


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    metric: Literal["queueLatencyP95", "queueLatencyMean", "requestsWaiting"] = "queueLatencyP95"
    target_queue_latency_seconds: float = 0.5
    target_waiting_requests: float = 4.0
    interval_seconds: int = 15
    scale_down_stabilization_seconds: int = 300
    max_scale_up_factor: float = 2.0


@dataclass(frozen=True)
class ModelCacheSpec:
    pvc: str | None = None
    empty_dir: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PodSettings:
    """Pod-level settings every pool's pods get (scheduling is per pool)."""

    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    image_pull_secrets: tuple[Mapping[str, Any], ...] = ()
    service_account_name: str | None = None
    runtime_class_name: str | None = None
    priority_class_name: str | None = None
    security_context: Mapping[str, Any] = field(default_factory=dict)
    container_security_context: Mapping[str, Any] = field(default_factory=dict)
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class RolloutSpec:
    """The Deployments' rolling update; the default never drops capacity and needs one spare pod."""

    max_surge: IntOrString = 1
    max_unavailable: IntOrString = 0


@dataclass(frozen=True)
class DeploymentSpec:
    target: TargetSpec
    draft: DraftSpec | None = None
    speculation: SpeculationSpec = field(default_factory=SpeculationSpec)
    serving: ServingSpec = field(default_factory=ServingSpec)
    replicas: int = 1
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    model_cache: ModelCacheSpec | None = None
    hf_token_secret: str | None = None
    pod: PodSettings = field(default_factory=PodSettings)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)

    @property
    def separate_draft(self) -> DraftSpec | None:
        """The draft when it runs in its own pods, else None."""
        if self.draft is not None and self.draft.placement == "separate":
            return self.draft
        return None


def camel(name: str) -> str:
    """``max_nodes`` → ``maxNodes``: the CRD spells fields in camelCase."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def parse_spec(raw: Mapping[str, Any]) -> DeploymentSpec:
    """Turn a raw ``.spec`` into typed values with defaults; raise SpecError on anything invalid."""
    spec = _build(DeploymentSpec, raw, "spec")
    check_rules(spec)
    return spec


def check_name(name: str) -> None:
    """Children are named after the resource, so its name must fit a Service name."""
    if len(name) > MAX_NAME_LENGTH or not _DNS1035.match(name):
        raise SpecError(
            "InvalidName",
            f"metadata.name {name!r} must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters "
            "(lower case letters, digits and '-', starting with a letter): Services are named after it",
        )


def check_rules(spec: DeploymentSpec) -> None:
    """The CRD's x-kubernetes-validations rules, one by one, in the same words."""
    needs_draft = spec.speculation.needs_draft
    if spec.draft is not None and not needs_draft:
        raise SpecError("InvalidSpec", "draft is only used with speculation.drafter: model or eagle3")
    if needs_draft and spec.draft is None:
        raise SpecError("InvalidSpec", "speculation.drafter: model and eagle3 need a draft model")
    if spec.draft is not None and spec.draft.placement != "separate":
        if spec.draft.gpu is not None:
            raise SpecError("InvalidSpec", "draft.gpu is only allowed with placement: separate")
        if spec.draft.replicas != 1:
            raise SpecError("InvalidSpec", "draft.replicas is only allowed with placement: separate")
        if spec.draft.has_pool_settings:
            raise SpecError("InvalidSpec", DRAFT_POOL_MESSAGE)
    draft = spec.draft
    for gpu in (spec.target.gpu, draft.gpu if draft is not None else None):
        if gpu is not None and bool(gpu.product) == bool(gpu.products):
            raise SpecError("InvalidSpec", "gpu needs exactly one of product or products")
    check_resources("spec.target.resources", spec.target.resources)
    check_tolerations("spec.tolerations", spec.tolerations)
    if draft is not None:
        check_resources("spec.draft.resources", draft.resources)
        check_tolerations("spec.draft.tolerations", draft.tolerations)
    check_object_names(spec)
    size_limit = (spec.model_cache.empty_dir or {}).get("sizeLimit") if spec.model_cache else None
    if size_limit is not None:
        quantity("spec.modelCache.emptyDir.sizeLimit", size_limit)
    if draft is not None and draft.quantization == "int8" and draft.gpu is not None:
        raise SpecError(
            "InvalidSpec",
            "draft.quantization int8 runs on CPUs only: not with draft.gpu",
        )
    if spec.speculation.max_nodes < spec.speculation.depth:
        raise SpecError("InvalidSpec", "speculation.maxNodes must be at least speculation.depth")
    if spec.autoscaling.min_replicas > spec.autoscaling.max_replicas:
        raise SpecError("InvalidSpec", "autoscaling.minReplicas must not exceed autoscaling.maxReplicas")
    scaling = spec.draft.autoscaling if spec.draft is not None else None
    if scaling is not None and scaling.enabled and spec.separate_draft is None:
        raise SpecError("InvalidSpec", "draft.autoscaling is only allowed with placement: separate")
    if scaling is not None and scaling.min_replicas > scaling.max_replicas:
        raise SpecError(
            "InvalidSpec", "draft.autoscaling.minReplicas must not exceed draft.autoscaling.maxReplicas"
        )
    if scaling is not None and scaling.target_busy_fraction > 1:
        raise SpecError("InvalidSpec", "draft.autoscaling.targetBusyFraction must be at most 1")
    cache = spec.model_cache
    if cache is not None and (cache.pvc is None) == (cache.empty_dir is None):
        raise SpecError("InvalidSpec", "modelCache needs exactly one of pvc or emptyDir")


DRAFT_POOL_MESSAGE = (
    "draft resources, nodeSelector, tolerations, affinity and topologySpreadConstraints "
    "are only allowed with placement: separate"
)


# The unsigned form of the API server's quantity syntax (the CRD's pattern).
_QUANTITY = re.compile(
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def quantity(path: str, value: Any) -> Decimal:
    """A Kubernetes quantity (``500m``, ``32Gi``, ``2``) as a number; negative or malformed is an error."""
    malformed = SpecError(
        "InvalidSpec", f"{path}: {value!r} is not a Kubernetes quantity (e.g. 500m, 2, 32Gi)"
    )
    if isinstance(value, str) and not _QUANTITY.match(value.lstrip("-")):
        raise malformed  # stricter than the client's parser, which takes "1.5 Gi"; as the API server
    try:
        number = parse_quantity(value)
    except ValueError:
        raise malformed from None
    if number < 0:
        raise SpecError("InvalidSpec", "a quantity must not be negative")
    return number


_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
TOLERATION_FIELDS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def check_object_names(spec: DeploymentSpec) -> None:
    """Names of other objects the pods refer to (Secrets, PVCs, accounts, classes): DNS-1123."""
    pod = spec.pod
    names = {
        "spec.hfTokenSecret": spec.hf_token_secret,
        "spec.modelCache.pvc": spec.model_cache.pvc if spec.model_cache else None,
        "spec.pod.serviceAccountName": pod.service_account_name,
        "spec.pod.runtimeClassName": pod.runtime_class_name,
        "spec.pod.priorityClassName": pod.priority_class_name,
    }
    names.update(
        {f"spec.pod.imagePullSecrets[{i}].name": s.get("name") for i, s in enumerate(pod.image_pull_secrets)}
    )
    for path, value in names.items():
        if value is not None and (len(str(value)) > 253 or not _DNS1123_SUBDOMAIN.match(str(value))):
            raise SpecError(
                "InvalidSpec",
                f"{path}: {value!r} is not a DNS-1123 name (lower case letters, digits, '-' and '.')",
            )


def check_tolerations(path: str, tolerations: tuple[Mapping[str, Any], ...]) -> None:
    """The core Toleration's fields only (the CRD checks the full type)."""
    for i, toleration in enumerate(tolerations):
        unknown = sorted(set(toleration) - TOLERATION_FIELDS)
        if unknown:
            raise SpecError("InvalidSpec", f"{path}[{i}]: unknown field(s) {', '.join(unknown)}")


def check_resources(path: str, resources: ResourceSpec) -> None:
    """Valid quantities, and no request above its limit (the API server refuses such a pod)."""
    limits = {k: quantity(f"{path}.limits.{k}", v) for k, v in resources.limits.items()}
    for key, value in resources.requests.items():
        if key in limits and quantity(f"{path}.requests.{key}", value) > limits[key]:
            raise SpecError("InvalidSpec", "resources.requests must not exceed resources.limits")


def _build(cls: type, raw: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a camelCase mapping, checking every value's type."""
    if not isinstance(raw, Mapping):
        raise SpecError("InvalidSpec", f"{path}: expected an object, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {camel(f.name): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise SpecError("InvalidSpec", f"{path}: unknown field(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for key, f in fields.items():
        if key in raw:
            values[f.name] = _convert(hints[f.name], raw[key], f"{path}.{key}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SpecError("InvalidSpec", f"{path}.{key} is required")
    return cls(**values)


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        for alternative in inner[:-1]:
            try:
                return _convert(alternative, value, path)
            except SpecError:
                continue
        return _convert(inner[-1], value, path)
    if origin is Literal:
        if value not in args:
            raise SpecError("InvalidSpec", f"{path}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)  # type: ignore[arg-type]
    if origin is tuple:
        if args[0] is str:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise SpecError("InvalidSpec", f"{path}: expected a list of strings")
            return tuple(value)
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            raise SpecError("InvalidSpec", f"{path}: expected a list of objects")
        return tuple(value)
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise SpecError("InvalidSpec", f"{path}: expected an object, got {type(value).__name__}")
        if args[1] is str and not all(isinstance(v, str) for v in value.values()):
            raise SpecError("InvalidSpec", f"{path}: every value must be a string")
        if args[1] == IntOrString:  # quantities: checked as such by check_resources
            bad = [k for k, v in value.items() if isinstance(v, bool) or not isinstance(v, int | str)]
            if bad:
                raise SpecError(
                    "InvalidSpec", f"{path}.{bad[0]}: expected a quantity (an integer or a string)"
                )
        return dict(value)
    return _scalar(hint, value, path)


def _scalar(hint: type, value: Any, path: str) -> Any:
    # bool is an int in Python but not in JSON; a float is only accepted where numbers are.
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str) and value != "",
    }[hint]
    if not ok:
        expected = {bool: "a boolean", int: "an integer", float: "a number", str: "a non-empty string"}[hint]
        raise SpecError("InvalidSpec", f"{path}: expected {expected}, got {value!r}")
    if (hint is int and value < 0) or (hint is float and value <= 0):
        raise SpecError("InvalidSpec", f"{path}: must be positive, got {value!r}")
    return float(value) if hint is float else value

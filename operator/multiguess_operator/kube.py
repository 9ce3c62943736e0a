"""A thin, synchronous Kubernetes REST layer over the official client's transport and credentials.

Plain dicts in and out: the operator reasons about manifests as data (resources.py), so it talks to
the API in the same terms, with one generic code path for every kind it touches.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes.client

from multiguess_operator.names import GROUP, MANAGER, PLURAL, VERSION

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the REST API (``namespace`` is ignored for cluster-scoped kinds)."""

    api_version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        scope = ["namespaces", namespace] if self.namespaced else []
        parts = [root, *scope, self.plural, name, subresource]
        return "/".join(p for p in parts if p)


DEPLOYMENTS = Kind("apps/v1", "deployments")
SERVICES = Kind("v1", "services")
PDBS = Kind("policy/v1", "poddisruptionbudgets")
PODS = Kind("v1", "pods")
SECRETS = Kind("v1", "secrets")
NODES = Kind("v1", "nodes", namespaced=False)
SPECDEPLOYS = Kind(f"{GROUP}/{VERSION}", PLURAL)
CHILD_KINDS = {"Deployment": DEPLOYMENTS, "Service": SERVICES, "PodDisruptionBudget": PDBS}


class ApiError(RuntimeError):
    """An HTTP error from the API server, with its status code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Kube:
    """The handful of verbs the operator uses; every call is one HTTP request."""

    def __init__(self, api_client: kubernetes.client.ApiClient | None = None) -> None:
        self._api = api_client or kubernetes.client.ApiClient()

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", kind.path(namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: Kind, namespace: str, label_selector: Mapping[str, str]) -> list[dict[str, Any]]:
        """Objects matching every label (filtered here too, in case a server ignores the selector)."""
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in label_selector.items())}
        items = self._call("GET", kind.path(namespace), query=query).get("items", [])
        return [o for o in items if _has_labels(o, label_selector)]

    def labels_of(self, kind: Kind, label: str) -> list[str]:
        """The values of one label on every object of a cluster-scoped kind that carries it."""
        items = self._call("GET", kind.path(None), query={"labelSelector": label}).get("items", [])
        return [o["metadata"]["labels"][label] for o in items if label in (o["metadata"].get("labels") or {})]

    def create(self, kind: Kind, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """POST: only for what must be created once and never rewritten (409 if it exists)."""
        namespace = manifest["metadata"]["namespace"]
        return self._call("POST", kind.path(namespace), body=manifest, query={"fieldManager": MANAGER})

    def json_patch(
        self, kind: Kind, namespace: str, name: str, operations: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return self._call("PATCH", kind.path(namespace, name), body=operations, content_type=JSON_PATCH)

    def apply(self, kind: Kind, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply, forced: the applied manifest is the whole of what the operator owns,
        so a field left out of it is removed, and fields others changed are put back."""
        meta = manifest["metadata"]
        return self._call(
            "PATCH",
            kind.path(meta["namespace"], meta["name"]),
            body=manifest,
            content_type=APPLY,
            query={"fieldManager": MANAGER, "force": "true"},
        )

    def merge_patch(
        self, kind: Kind, namespace: str, name: str, patch: Mapping[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        return self._call("PATCH", kind.path(namespace, name, subresource), body=patch, content_type=MERGE)

    def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        """Delete in the background; False if it was already gone."""
        try:
            self._call("DELETE", kind.path(namespace, name), body={"propagationPolicy": "Background"})
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        m, url, headers, data, _ = self._api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self._api.call_api(m, url, header_params=headers, body=data, _request_timeout=30)
        except kubernetes.client.ApiException as e:
            raise ApiError(e.status or 0, str(e.reason)) from e
        raw = response.read()
        if response.status >= 400:
            raise ApiError(response.status, _message(raw))
        return json.loads(raw) if raw else {}


def _message(raw: bytes | None) -> str:
    try:
        return str(json.loads(raw or b"{}").get("message", raw))
    except ValueError:
        return repr(raw)


def _has_labels(obj: Mapping[str, Any], wanted: Mapping[str, str]) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    return all(have.get(k) == v for k, v in wanted.items())

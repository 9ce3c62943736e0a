"""Operator settings, read once from the environment (12-factor: the chart sets them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_IMAGE = "ghcr.io/multiguess/multiguess-server:0.1.0"
LOG_FORMATS = ("plain", "full", "json")


class SettingsError(ValueError):
    """An environment variable holds a value the operator cannot use."""


@dataclass(frozen=True)
class Settings:
    """What the operator needs to know about its own deployment."""

    image: str = DEFAULT_IMAGE
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    log_format: str = "plain"
    liveness_port: int = 8080
    peering: str = ""  # a KopfPeering name: replicas elect one active operator; empty: standalone
    priority: int | None = None  # among peers the highest runs; None: a random one per process

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Parse ``MULTIGUESS_OPERATOR_*``; unset variables keep the defaults."""
        env = os.environ if env is None else env
        image = env.get("MULTIGUESS_OPERATOR_IMAGE", "").strip() or DEFAULT_IMAGE
        namespaces = tuple(
            ns.strip() for ns in env.get("MULTIGUESS_OPERATOR_NAMESPACES", "").split(",") if ns.strip()
        )
        log_format = env.get("MULTIGUESS_OPERATOR_LOG_FORMAT", "plain").strip().lower() or "plain"
        if log_format not in LOG_FORMATS:
            raise SettingsError(
                f"MULTIGUESS_OPERATOR_LOG_FORMAT={log_format!r}: expected one of {', '.join(LOG_FORMATS)}"
            )
        raw_port = env.get("MULTIGUESS_OPERATOR_LIVENESS_PORT", "8080").strip()
        if not raw_port.isdigit() or not 1 <= int(raw_port) <= 65535:
            raise SettingsError(f"MULTIGUESS_OPERATOR_LIVENESS_PORT={raw_port!r}: expected a TCP port")
        peering = env.get("MULTIGUESS_OPERATOR_PEERING", "").strip()
        raw_priority = env.get("MULTIGUESS_OPERATOR_PRIORITY", "").strip()
        if raw_priority and not raw_priority.isdigit():
            raise SettingsError(f"MULTIGUESS_OPERATOR_PRIORITY={raw_priority!r}: expected a whole number")
        return cls(
            image=image,
            namespaces=namespaces,
            log_format=log_format,
            liveness_port=int(raw_port),
            peering=peering,
            priority=int(raw_priority) if raw_priority else None,
        )

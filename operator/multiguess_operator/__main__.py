"""``python -m multiguess_operator``: run the operator with settings from the environment."""

from __future__ import annotations

import asyncio
import secrets

import kopf

from multiguess_operator import handlers as _handlers  # noqa: F401 - registers the handlers
from multiguess_operator.settings import Settings

_LOG_FORMATS = {"plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}


def main() -> None:
    settings = Settings.from_env()
    kopf.configure(log_format=_LOG_FORMATS[settings.log_format])
    # Leader election by kopf peering: every replica gets a distinct priority, the highest one
    # works and the others pause until it stops renewing its peering entry (equal ones all pause).
    priority = settings.priority if settings.priority is not None else 1 + secrets.randbelow(2**31)
    asyncio.run(
        kopf.operator(
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            liveness_endpoint=f"http://0.0.0.0:{settings.liveness_port}/healthz",
            standalone=not settings.peering,
            peering_name=settings.peering or None,
            priority=priority,
        )
    )


if __name__ == "__main__":
    main()

"""``python -m multiguess_operator``: run the operator with settings from the environment."""

from __future__ import annotations

import asyncio

import kopf

from multiguess_operator import handlers as _handlers  # noqa: F401 - registers the handlers
from multiguess_operator.settings import Settings

_LOG_FORMATS = {"plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}


def main() -> None:
    settings = Settings.from_env()
    kopf.configure(log_format=_LOG_FORMATS[settings.log_format])
    asyncio.run(
        kopf.operator(
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            liveness_endpoint=f"http://0.0.0.0:{settings.liveness_port}/healthz",
        )
    )


if __name__ == "__main__":
    main()

"""The HTTP face of the server: OpenAI-compatible endpoints, health, metrics (``create_app``)."""

from multiguess.api.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]

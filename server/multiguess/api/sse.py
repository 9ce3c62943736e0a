"""Server-sent events as OpenAI streams them: ``data: <json>`` frames, then ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def frame(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

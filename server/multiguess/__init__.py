"""multiguess: lossless multi-candidate (tree) speculative decoding.

The public names load lazily, so light users of the package (the CLI's help, the operator's
tests) do not pay for importing torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiguess.llm import LLM
    from multiguess.outputs import CompletionOutput, RequestOutput
    from multiguess.params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
_HOMES = {
    "LLM": "multiguess.llm",
    "CompletionOutput": "multiguess.outputs",
    "RequestOutput": "multiguess.outputs",
    "SamplingParams": "multiguess.params",
    "StructuredOutputsParams": "multiguess.params",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'multiguess' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)

"""Property-based fuzzing of the server's own OpenAPI document: no input yields a 5xx, and
every answer is one the document lists, in the shape and content type it lists.

Schemathesis generates valid and invalid requests for every operation the document lists.
The fuzzed server has a 48-token context, so whatever it accepts it finishes in a few
tiny-model steps. (Schemathesis' pytest loader does not run under pytest 9, so the
operations are parametrized here and driven through hypothesis directly.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from multiguess.engine.config import EngineConfig
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation.modes import GenerationMode

from tests.api.conftest import LiveServer, tiny_loader

EXAMPLES = 25
OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/generate"),
    ("GET", "/v1/models"),
    ("GET", "/health/live"),
    ("GET", "/health/ready"),
    ("GET", "/metrics"),
]


@pytest.fixture(scope="module")
def api_schema(
    start_server: Callable[..., LiveServer], tiny_llama: Path, tiny_llama_draft: Path
) -> schemathesis.BaseSchema:
    config = EngineConfig(num_candidates=2, depth=3, max_nodes=6, max_batch=4, max_model_len=48)
    live = start_server(tiny_loader(tiny_llama, tiny_llama_draft, config), max_queue=64, request_timeout=30)
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json")


def test_the_document_lists_every_operation(api_schema: schemathesis.BaseSchema) -> None:
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


def test_the_document_lists_the_error_statuses(api_schema: schemathesis.BaseSchema) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        statuses = set(api_schema.raw_schema["paths"][path]["post"]["responses"])
        assert {"400", "401", "413", "415", "422", "429", "503", "504"} <= statuses, path
        # Validation errors are 400s here: 422 is only a grammar that failed during generation,
        # in the error shape, never FastAPI's validation error.
        listed = api_schema.raw_schema["paths"][path]["post"]["responses"]["422"]
        assert listed["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse"), path


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Invalid input exists only for operations that take some: the POST bodies.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_no_input_yields_a_server_error(
    api_schema: schemathesis.BaseSchema, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=CHECKS, timeout=60)

    check()

"""The running service fuzzed against its own OpenAPI description (schemathesis).

Every operation of GET /openapi.json gets valid and invalid requests, generated from the document
the app serves, sent to the real app (in process, through WSGI) with a real Redis server, a migrated
SQLite database and a real Celery worker serving stories260k (the service stack of conftest.py).
Each answer must hold to: no 5xx, no traceback in any body, every 4xx in the OpenAI error shape, the
documented status codes, content types and response schemas, and invalid input refused.

Why the service tier and not tests/api: a waiting /v1/completions (and every stream) ends only when
a worker ends the request, and only a real worker can fail on a body the web process accepted
(which must then be a 4xx from the web process, never a 500 from the worker).

Bounded and reproducible: a fixed number of examples per operation, derandomized (the same cases on
every run), no shrinking; max_tokens above 4 is lowered to 4 (still valid), so a fuzzed body cannot
hold the worker for hundreds of tokens. A string "model" is the served model's name, so bodies get
past the model check. Random ids name nothing, so hypothesis also picks cases in which the ids
(file, batch, request) name real objects made by the fixture.
"""
from __future__ import annotations

import io
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from app.openapi import openapi_document
from tests.service.conftest import MODEL_NAME

EXAMPLES_PER_OPERATION = 50
MAX_FUZZED_TOKENS = 4
OPERATIONS = [(method, path) for path, item in openapi_document()["paths"].items() for method in item]

# This branch has no API keys, and a server without keys is open by design: schemathesis would
# otherwise send requests without the documented bearer token and expect a 401.
CONFIG = "[generation]\nwith-security-parameters = false\n"


@pytest.fixture(scope="module")
def fuzz_schema(stack):
    return schemathesis.openapi.from_wsgi("/openapi.json", stack.app, config=SchemathesisConfig.from_str(CONFIG))


@pytest.fixture()
def known_ids(stack) -> dict[str, str]:
    """Real objects for one operation's fuzzed requests to name (fresh for each operation, so a DELETE
    of the file does not leave the next operation only 404s): a batch input file, a batch made from a
    second one, a request."""
    client = stack.app.test_client()
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 2}}

    def upload() -> str:
        content = io.BytesIO(json.dumps(line).encode())
        return client.post("/v1/files", data={"purpose": "batch", "file": (content, "in.jsonl")}).get_json()["id"]

    file_id, input_file_id = upload(), upload()
    batch_id = client.post("/v1/batches", json={"input_file_id": input_file_id, "endpoint": "/v1/completions",
                                                "completion_window": "24h"}).get_json()["id"]
    request_id = client.post("/v1/requests", json={"model": MODEL_NAME, "prompt": "Once", "max_tokens": 2}
                             ).get_json()["id"]
    return {"model_id": MODEL_NAME, "file_id": file_id, "input_file_id": input_file_id, "batch_id": batch_id,
            "after": batch_id, "request_id": request_id}


def no_traceback(ctx, response, case):
    assert "Traceback" not in response.text, "a traceback reached the client"


def openai_error_shape(ctx, response, case):
    """Every error answer is {"error": {"message", "type", "param", "code"}} with a message that says something."""
    if response.status_code < 400:
        return
    content_type = response.headers.get("content-type", [""])[0]  # schemathesis keeps headers as lowercase lists
    assert content_type.startswith("application/json"), f"an error answered as {content_type!r}"
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and (error["param"] is None or isinstance(error["param"], str)), body


CHECKS = [not_a_server_error, no_traceback, openai_error_shape, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]


def use_known_ids(case, ids: dict[str, str]) -> None:
    """Replace the generated ids with real ones. Only non-empty strings: an invalid id (a number, an
    empty input_file_id) stays as generated, so an invalid case stays invalid."""
    for params in (case.path_parameters, case.query):
        for name, value in (params or {}).items():
            if name in ids and isinstance(value, str) and value:
                params[name] = ids[name]
    if isinstance(case.body, dict) and isinstance(case.body.get("input_file_id"), str) and case.body["input_file_id"]:
        case.body["input_file_id"] = ids["input_file_id"]


def serve_and_bound(case) -> None:
    """A string model becomes the served one (any other is one 404, tested in tests/api), so bodies
    reach the validators and the worker; max_tokens is lowered to MAX_FUZZED_TOKENS."""
    if isinstance(case.body, dict):
        if isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL_NAME
        for field in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_FUZZED_TOKENS:
                case.body[field] = MAX_FUZZED_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("method, path", OPERATIONS, ids=[f"{m.upper()} {p}" for m, p in OPERATIONS])
def test_operation_holds_to_its_openapi_description(fuzz_schema, known_ids, method, path):
    operation = fuzz_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases, name_real_objects=st.booleans())
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(case, name_real_objects):
        if name_real_objects:
            use_known_ids(case, known_ids)
        serve_and_bound(case)
        case.call_and_validate(checks=CHECKS)

    fuzz()

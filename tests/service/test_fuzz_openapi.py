"""The running service fuzzed against its own OpenAPI description (schemathesis).

Every operation of GET /openapi.json gets valid and invalid requests, generated from the document
the app serves, sent to the real app (in process, through WSGI) with a real Redis server, a migrated
SQLite database and a real Celery worker serving the project-made test model (the service stack of conftest.py).
Each answer must hold to: no 5xx, no traceback in any body, every 4xx in the OpenAI error shape, the
documented status codes, content types and response schemas, invalid input refused, and a request
accepted with 202 never failing in the worker as the server's error.

Why the service tier and not tests/api: a waiting /v1/completions (and every stream) ends only when
a worker ends the request, and only a real worker can fail on a body the web process accepted. It
did: top_p 5e-324 (a boundary value of the coverage phase) made the sampler raise, and the worker
answered 500 for every request in its batch.

Bounded and reproducible (about 90 s on 2 cores): per operation, schemathesis's boundary values
("coverage" phase) plus EXAMPLES_PER_OPERATION random cases, derandomized (the same cases on every
run), no shrinking. max_tokens is at most MAX_FUZZED_TOKENS (still valid), so a fuzzed body cannot
hold the worker for hundreds of tokens. A string "model" is the served model's name, so bodies get
past the model check. Random ids name nothing, so every other case names real objects instead.

schemathesis's pytest plugin cannot load a schema from a fixture under pytest 9 (its lazy loader
sets Node._nodeid), so each operation's hypothesis test is built with create_test, as the plugin does.
"""
from __future__ import annotations

import io
import itertools
import json
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.hypothesis.builder import HypothesisTestConfig, HypothesisTestMode, create_test
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from app.openapi import openapi_document
from tests.service.conftest import MODEL_NAME

EXAMPLES_PER_OPERATION = 50
MAX_FUZZED_TOKENS = 4
REQUEST_END_TIMEOUT = 30  # seconds; a fuzzed request makes at most MAX_FUZZED_TOKENS tokens per choice
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


def accepted_request_does_not_fail_in_the_worker(ctx, response, case):
    """A 202 from POST /v1/requests hides what the worker does with the body: follow the request to
    its end. A body the web process accepted must never fail there as the server's error."""
    if case.operation.path != "/v1/requests" or response.status_code != 202:
        return
    client, request_id = case.operation.app.test_client(), response.json()["id"]
    deadline = time.monotonic() + REQUEST_END_TIMEOUT
    while (request := client.get(f"/v1/requests/{request_id}").get_json())["status"] not in ("completed", "failed",
                                                                                             "cancelled"):
        assert time.monotonic() < deadline, f"request {request_id} still {request['status']}"
        time.sleep(0.05)
    assert (request["error"] or {}).get("code") != "server_error", f"the worker failed {request_id}: {request['error']}"


CHECKS = [not_a_server_error, no_traceback, openai_error_shape, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection, accepted_request_does_not_fail_in_the_worker]


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
    reach the validators and the worker. max_tokens is lowered to MAX_FUZZED_TOKENS, or set to it
    where neither it nor max_completion_tokens is given (the default is 16)."""
    if not isinstance(case.body, dict) or not ("prompt" in case.body or "messages" in case.body):
        return
    if isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL_NAME
    if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
        case.body["max_tokens"] = MAX_FUZZED_TOKENS
    for field in ("max_tokens", "max_completion_tokens"):
        value = case.body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_FUZZED_TOKENS:
            case.body[field] = MAX_FUZZED_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("method, path", OPERATIONS, ids=[f"{m.upper()} {p}" for m, p in OPERATIONS])
def test_operation_holds_to_its_openapi_description(fuzz_schema, known_ids, method, path):
    operation = fuzz_schema[path][method]
    sent = itertools.count()

    def fuzz(case):
        if next(sent) % 2:  # every other case names real objects
            use_known_ids(case, known_ids)
        serve_and_bound(case)
        case.call_and_validate(checks=CHECKS)

    # Explicit examples, boundary values ("coverage") and random cases. POST /v1/requests takes either
    # body, whose boundary values the two completion operations already send: random cases only.
    modes = list(HypothesisTestMode)
    if path == "/v1/requests":
        modes.remove(HypothesisTestMode.COVERAGE)
    config = HypothesisTestConfig(
        project=fuzz_schema.config, modes=modes,
        settings=settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck)))
    create_test(operation=operation, test_func=fuzz, config=config)()

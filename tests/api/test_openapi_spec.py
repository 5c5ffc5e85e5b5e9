"""GET /openapi.json: a valid OpenAPI 3.1 document that describes every route the app has.

A new endpoint without an entry in app/openapi.py fails here. The fuzz test that holds the running
service to this document is tests/service/test_fuzz_openapi.py.
"""
from __future__ import annotations

import copy
import re
import shutil

import pytest
from openapi_spec_validator import OpenAPIV31SpecValidator

from app import create_app
from llmq.settings import Settings
from tests.conftest import STORIES_DIR

HTTP_METHODS = {"get", "post", "put", "patch", "delete"}
PUBLIC_OPERATIONS = {("/health", "get"), ("/metrics", "get")}


@pytest.fixture(scope="module")
def app(tmp_path_factory, redis_url, migrated_db):
    # Like every endpoint but health, the document goes through the key check (the database) and the
    # rate limits (Redis): an open install here, with no keys.
    home = tmp_path_factory.mktemp("home")
    shutil.copy(migrated_db, home / "llmq.db")
    settings = Settings(home=home, database_url=f"sqlite:///{home / 'llmq.db'}", redis_url=redis_url,
                        model_path=str(STORIES_DIR), model_name="some-model")
    return create_app(settings)


@pytest.fixture(scope="module")
def document(app) -> dict:
    resp = app.test_client().get("/openapi.json")
    assert resp.status_code == 200 and resp.mimetype == "application/json"
    return resp.get_json()


def openapi_path(flask_rule: str) -> str:
    """/v1/models/<path:model_id> -> /v1/models/{model_id}"""
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", flask_rule)


def operations(document: dict):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method in HTTP_METHODS:
                yield path, method, operation


def test_document_is_valid_openapi_3_1(document):
    assert document["openapi"].startswith("3.1")
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in OpenAPIV31SpecValidator(document).iter_errors()]
    assert errors == []
    broken = copy.deepcopy(document)  # the validator is no rubber stamp: a bad schema type is caught
    broken["components"]["schemas"]["Usage"]["type"] = "objekt"
    assert list(OpenAPIV31SpecValidator(broken).iter_errors())


def test_every_route_is_described_with_its_methods(app, document):
    # The dashboard's pages are for people (HTML), not part of the API the document describes.
    routes = {(openapi_path(rule.rule), method.lower())
              for rule in app.url_map.iter_rules() if rule.endpoint != "static" and not rule.endpoint.startswith("dashboard.")
              for method in rule.methods - {"HEAD", "OPTIONS"}}
    described = {(path, method) for path, method, _ in operations(document)}
    assert routes - described == set(), "routes without an OpenAPI description (add them to app/openapi.py)"
    assert described - routes == set(), "described operations the app does not have"


def test_openapi_path_conversion():
    assert openapi_path("/v1/models/<path:model_id>") == "/v1/models/{model_id}"
    assert openapi_path("/v1/batches/<batch_id>/cancel") == "/v1/batches/{batch_id}/cancel"


def test_every_error_answer_is_the_openai_error_object(document):
    responses = document["components"]["responses"]
    for path, method, operation in operations(document):
        for status, response in operation["responses"].items():
            if status.startswith(("4", "5")):
                response = responses[response["$ref"].rsplit("/", 1)[1]] if "$ref" in response else response
                assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}, \
                    f"{method.upper()} {path} {status}"
    error = document["components"]["schemas"]["Error"]["properties"]["error"]
    assert error["required"] == ["message", "type", "param", "code"]


def test_keys_rate_limits_and_idempotency_are_documented(document):
    assert document["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "description": "an llmq API key"}
    assert document["security"] == [{"bearerAuth": []}]
    assert "Retry-After" in document["components"]["responses"]["RateLimited"]["headers"]
    for path, method, operation in operations(document):
        label = f"{method.upper()} {path}"
        if (path, method) in PUBLIC_OPERATIONS:
            assert operation["security"] == [] and "401" not in operation["responses"], label
            continue
        assert {"401", "429"} <= set(operation["responses"]), label
        params = [p.get("$ref") for p in operation.get("parameters", [])]
        assert ("#/components/parameters/IdempotencyKey" in params) == (method == "post"), label


def test_request_bodies_carry_the_validators_limits(document):
    schemas = document["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["minimum"] == 1
    assert completion["logprobs"]["maximum"] == 20 and completion["n"]["maximum"] == 128
    assert completion["top_p"]["exclusiveMinimum"] == 0 and completion["stop"]["anyOf"][1]["maxItems"] == 4
    assert schemas["BatchCreateRequest"]["properties"]["metadata"]["maxProperties"] == 16
    limit = next(p for p in document["paths"]["/v1/batches"]["get"]["parameters"] if p["name"] == "limit")
    assert (limit["schema"]["minimum"], limit["schema"]["maximum"]) == (1, 100)

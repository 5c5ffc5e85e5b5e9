"""Hostile input, every operation of the OpenAPI description against the running server (the session
stack's real server, worker and Redis): bodies nested past any parser's limit, lone surrogates,
numbers that are not finite, and headers that are too long, malformed or in odd encodings (what
gunicorn refuses itself, framing errors among them, is test_gunicorn_errors.py's). No answer
is a 5xx or carries a traceback, every refusal is in the OpenAI error shape, and the server serves on.
The schemathesis fuzz (test_fuzz_openapi.py) covers the documented shapes; these are what a parser,
not a schema, must survive."""
from __future__ import annotations

import json

import httpx
import pytest

from app.openapi import openapi_document
from tests.service.conftest import MODEL_NAME

DOCUMENT = openapi_document()
JSON_POSTS = [path for path, item in DOCUMENT["paths"].items()
              if "application/json" in item.get("post", {}).get("requestBody", {}).get("content", {})]
OPERATIONS = [(method.upper(), path) for path, item in DOCUMENT["paths"].items() for method in item]
DEPTH = 100_000


def completion(**fields) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": "Once", "max_tokens": 2, **fields}).encode()


HOSTILE_BODIES = {
    "arrays nested 100,000 deep": b'{"model": ' + b"[" * DEPTH + b"]" * DEPTH + b"}",
    "objects nested 100,000 deep": b'{"prompt": ' + b'{"a":' * DEPTH + b"1" + b"}" * DEPTH + b"}",
    "a lone surrogate in the prompt": completion().replace(b'"Once"', b'"\\ud800"'),
    "a lone surrogate in a key": completion().replace(b'"prompt"', b'"\\udfff"'),
    "a lone surrogate in the model": completion().replace(f'"{MODEL_NAME}"'.encode(), b'"\\ud83d"'),
    "Infinity": completion().replace(b'"max_tokens": 2', b'"temperature": Infinity, "max_tokens": 2'),
    "-Infinity": completion().replace(b'"max_tokens": 2', b'"top_p": -Infinity, "max_tokens": 2'),
    "NaN": completion().replace(b'"max_tokens": 2', b'"presence_penalty": NaN, "max_tokens": 2'),
    "1e309": completion().replace(b'"max_tokens": 2', b'"temperature": 1e309, "max_tokens": 2'),
    "a max_tokens of 1e309": completion().replace(b'"max_tokens": 2', b'"max_tokens": 1e309'),
    "an integer of 5,000 digits": completion().replace(b'"max_tokens": 2', b'"max_tokens": ' + b"9" * 5000),
    "invalid UTF-8": completion().replace(b"Once", b"\xff\xfe"),
    "a NUL byte outside a string": completion() + b"\x00",
    "two documents": completion() + completion(),
    "an empty body": b"",
}


def assert_openai_error(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    assert "Traceback" not in response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"], error


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("path", JSON_POSTS)
@pytest.mark.parametrize("case", sorted(HOSTILE_BODIES))
def test_a_hostile_body_is_refused_in_the_openai_shape(client, path, case):
    response = client.post(path, content=HOSTILE_BODIES[case], headers={"Content-Type": "application/json"})
    assert_openai_error(response)
    assert response.status_code == 400, (case, response.text[:300])


def concrete(path: str) -> str:
    return path.replace("{model_id}", MODEL_NAME).replace("{", "").replace("}", "")


HOSTILE_HEADERS = {
    "a 6,000-character Authorization": {"Authorization": "Bearer " + "x" * 6000},
    "an Authorization of odd bytes": {"Authorization": "Bearer \x7f\x01llmq-\xe9"},
    "a 6,000-character Idempotency-Key": {"Idempotency-Key": "k" * 6000},
    "an Idempotency-Key of control characters": {"Idempotency-Key": "\x01\x02\x03"},
    "a Last-Event-ID past any id": {"Last-Event-ID": "9" * 400 + "-0"},
    "a Last-Event-ID of Latin-1 bytes": {"Last-Event-ID": "0-\xe9\xff"},
    "a Content-Type with a bad charset": {"Content-Type": "application/json; charset=x-klingon"},
}


@pytest.mark.parametrize("method, path", OPERATIONS)
@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_headers_never_make_a_5xx(client, method, path, case):
    body = completion() if method == "POST" else None
    headers = {name: value.encode("latin-1") for name, value in HOSTILE_HEADERS[case].items()}
    assert_openai_error(client.request(method, concrete(path), content=body, headers=headers))


def test_the_server_serves_on_after_all_that(client):
    response = client.post("/v1/completions", content=completion(temperature=0),
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2

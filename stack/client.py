"""The llmq service's HTTP API, as the `llmq` command calls it: a small typed client over httpx.

    with LlmqClient("http://127.0.0.1:8000", api_key=None) as client:
        batch = client.create_batch(client.upload_batch_file(Path("in.jsonl"))["id"])
        for event in client.request_events("cmpl-...", last_event_id="0-12"): ...

Every answer outside 2xx raises ServiceError, with the API's error object (OpenAI's shape:
{"error": {"message", "type", "param", "code"}}) taken apart. A service that cannot be reached raises
ServiceUnreachable, a connection that breaks mid-answer ConnectionLost: callers need not know httpx.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from stack.client_config import ConfigError
from stack.sse_reader import SSEEvent, SSEReader

USER_AGENT = "llmq-cli"
TIMEOUT = httpx.Timeout(60.0, connect=10.0)
# The service sends a heartbeat comment about every second on its streams, so this long a silence
# means the connection is dead, not that the request is slow.
STREAM_TIMEOUT = httpx.Timeout(60.0, connect=10.0, read=30.0)
# A waiting completion takes as long as its tokens take; Ctrl-C ends the wait.
COMPLETION_TIMEOUT = httpx.Timeout(60.0, connect=10.0, read=None)


class ServiceError(Exception):
    """The API answered with an error: its HTTP status and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, code: str | None = None, error_type: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.error_type, self.param = status, message, code, error_type, param

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}" if self.code else f"{self.status}: {self.message}"


class ServiceUnreachable(Exception):
    """No answer at all: nothing listens at the URL, or the network is in the way."""


class ConnectionLost(ServiceUnreachable):
    """The connection broke (or went silent) before the answer was whole."""


class LlmqClient:
    def __init__(self, url: str, api_key: str | None = None, transport: httpx.BaseTransport | None = None):
        """`url`: the service's root, e.g. http://127.0.0.1:8000 (stack.client_config.service_root)."""
        self.url = url
        headers = {"User-Agent": USER_AGENT}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT, transport=transport)

    def __enter__(self) -> "LlmqClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # ---- models and completions ------------------------------------------------------------

    def models(self) -> list[dict]:
        return self._json("GET", "/v1/models")["data"]

    def served_model(self) -> str:
        """The id of the model the service serves (the first of GET /v1/models)."""
        models = self.models()
        if not models:
            raise ServiceError(404, f"the service at {self.url} lists no model (GET /v1/models)", "model_not_found")
        return models[0]["id"]

    def complete(self, body: dict) -> dict:
        """POST /v1/completions, waiting for the whole completion object."""
        return self._json("POST", "/v1/completions", json={**body, "stream": False}, timeout=COMPLETION_TIMEOUT)

    def stream_completion(self, body: dict) -> Iterator[dict]:
        """POST /v1/completions with stream: true: each chunk (or an {"error": ...} object) as it comes,
        until [DONE]. A stream that ends without [DONE] raises ConnectionLost."""
        with self._stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            for event in SSEReader().events(response.iter_bytes()):
                if event.data == "[DONE]":
                    return
                yield _decode(event.data)
        raise ConnectionLost(f"the completion stream from {self.url} ended before its [DONE]")

    # ---- single requests -------------------------------------------------------------------

    def submit_request(self, body: dict) -> dict:
        return self._json("POST", "/v1/requests", json=body)

    def request(self, request_id: str) -> dict:
        return self._json("GET", f"/v1/requests/{request_id}")

    def cancel_request(self, request_id: str) -> dict:
        return self._json("POST", f"/v1/requests/{request_id}/cancel")

    def request_events(self, request_id: str, last_event_id: str | None = None) -> Iterator[SSEEvent]:
        """GET /v1/requests/{id}/events from just after `last_event_id` (the start if None): each
        event with its id, until the service ends the stream. Yields nothing when the service answers
        204 (the caller already had the last event)."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        with self._stream("GET", f"/v1/requests/{request_id}/events", headers=headers) as response:
            if response.status_code == 204:
                return
            yield from SSEReader().events(response.iter_bytes())

    # ---- files and batches -----------------------------------------------------------------

    def upload_batch_file(self, path: Path) -> dict:
        with path.open("rb") as content:
            return self._json("POST", "/v1/files", data={"purpose": "batch"},
                              files={"file": (path.name, content, "application/jsonl")})

    def file_content(self, file_id: str) -> Iterator[bytes]:
        """A file's bytes in chunks, as they download (batch outputs can be large)."""
        with self._stream("GET", f"/v1/files/{file_id}/content") as response:
            yield from response.iter_bytes()

    def create_batch(self, input_file_id: str, endpoint: str = "/v1/completions", completion_window: str = "24h",
                     metadata: dict[str, str] | None = None) -> dict:
        body = {"input_file_id": input_file_id, "endpoint": endpoint, "completion_window": completion_window}
        if metadata:
            body["metadata"] = metadata
        return self._json("POST", "/v1/batches", json=body)

    def batch(self, batch_id: str) -> dict:
        return self._json("GET", f"/v1/batches/{batch_id}")

    def list_batches(self, limit: int = 20, after: str | None = None) -> dict:
        params = {"limit": limit, **({"after": after} if after else {})}
        return self._json("GET", "/v1/batches", params=params)

    def cancel_batch(self, batch_id: str) -> dict:
        return self._json("POST", f"/v1/batches/{batch_id}/cancel")

    # ---- the wire --------------------------------------------------------------------------

    def _json(self, method: str, path: str, **kwargs) -> dict:
        with self._errors_in_words():
            response = self._http.request(method, path, **kwargs)
        _raise_for_error(response)
        return _decode(response.text)

    @contextmanager
    def _stream(self, method: str, path: str, **kwargs):
        with self._errors_in_words(), self._http.stream(method, path, timeout=STREAM_TIMEOUT, **kwargs) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for_error(response)
            yield response

    @contextmanager
    def _errors_in_words(self):
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:
            raise ServiceUnreachable(f"cannot reach the llmq service at {self.url} ({err or type(err).__name__}). "
                                     "Is it running? Point --url or LLMQ_URL at it") from None
        except httpx.TimeoutException as err:
            raise ConnectionLost(f"the service at {self.url} stopped answering ({type(err).__name__})") from None
        except httpx.TransportError as err:
            raise ConnectionLost(f"the connection to {self.url} was lost ({err or type(err).__name__})") from None
        except httpx.InvalidURL as err:
            raise ConfigError(f"{self.url} is not a URL httpx can use: {err}") from None


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        error = response.json()["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):  # not the service's JSON (a proxy's page, say)
        text = " ".join(response.text.split())
        raise ServiceError(response.status_code, (text[:200] + "...") if len(text) > 200 else
                           text or response.reason_phrase) from None
    raise ServiceError(response.status_code, message, error.get("code"), error.get("type"), error.get("param"))


def _decode(text: str) -> dict:
    try:
        return json.loads(text)
    except ValueError:
        raise ConnectionLost(f"the service sent something that is not JSON: {text[:200]!r}") from None

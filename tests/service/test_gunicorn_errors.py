"""What gunicorn refuses before the app sees it is answered in the OpenAI error shape, as the app's own
errors are (app/gunicorn_worker.py): raw HTTP on a socket to the Procfile's web server."""
from __future__ import annotations

import json
import socket

import pytest

from stack.local import LocalStack
from tests.service.conftest import MODEL_NAME


@pytest.fixture(scope="module")
def gunicorn_port(served_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("gunicorn-home")
    env = {"LLMQ_HOME": str(home), "DATABASE_URL": f"sqlite:///{home / 'llmq.db'}",
           "MODEL_PATH": str(served_model_dir), "MODEL_NAME": MODEL_NAME,
           "LLMQ_MAX_UPLOAD_BYTES": "1000"}
    with LocalStack(env, start_redis=True, workers=0, log_dir=home, web="gunicorn") as stack:
        yield int(stack.base_url.rsplit(":", 1)[1])


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except TimeoutError:
            raise AssertionError(f"the server did not close the connection; it sent {reply[:500]!r}") from None
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    return int(status_line.split()[1]), headers, body


BODY = b'{"model": "m", "prompt": "hi"}'
CASES = {
    "bad chunk size": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n" + BODY + b"\r\n0\r\n\r\n", 400),
    "oversized header": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n", 431),
    "too many headers": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200))
                         + b"\r\n", 431),
    "oversized URL": (b"GET /v1/models?q=" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    "NUL in a header": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Nul: a\x00b\r\n\r\n", 400),
    "a Content-Length that is not a number": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n"
                                              + BODY, 400),
    "Content-Length with chunked": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 30\r\n"
                                    b"Transfer-Encoding: chunked\r\n\r\n1e\r\n" + BODY + b"\r\n0\r\n\r\n", 400),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_gunicorn_refuses_is_an_openai_error(gunicorn_port, case):
    raw, expected_status = CASES[case]
    status, headers, body = exchange(gunicorn_port, raw)
    assert status == expected_status, body[:300]
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"] and len(error["message"]) < 400


def test_a_413_closes_the_connection_and_says_so(gunicorn_port):
    """The body is not read, so the connection cannot carry another request: gunicorn must say close."""
    raw = (b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
           b"Content-Length: 500000\r\n\r\n" + b"x" * 2000)  # over the limit and its multipart allowance
    status, headers, body = exchange(gunicorn_port, raw)  # reads until the server closes the connection
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_the_server_goes_on_serving(gunicorn_port):
    exchange(gunicorn_port, CASES["bad chunk size"][0])
    status, headers, body = exchange(gunicorn_port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL_NAME

"""gunicorn's threaded worker, answering the requests gunicorn itself refuses in the OpenAI error shape.

gunicorn refuses some requests before the app sees them: a bad chunk size, a header or URL over its
limits, a NUL in a header, Content-Length together with chunked encoding. It answers those with an
HTML page of its own, which an OpenAI client cannot read. gunicorn has no hook for that page; its one
writer is `gunicorn.util.write_error`, called from nowhere else than the worker's error handler, so
this worker class (the Procfile's `--worker-class`) puts a writer of the same status, as an OpenAI
error body, in its place when the worker process starts.

It also keeps the app's word on the connection: gunicorn drops a response's `Connection` header and
says keep-alive of its own accord, so a 413 (the body left unread: the connection cannot carry
another request) went out saying keep-alive and then closed. A response whose app says
`Connection: close` closes the connection, and says so.
"""
from __future__ import annotations

import json

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker

from app.errors import excerpt

_CODES = {400: "invalid_request", 403: "forbidden", 414: "uri_too_long", 417: "expectation_failed",
          431: "request_header_fields_too_large", 501: "not_implemented"}


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn.util.write_error's signature and status line; an OpenAI error body instead of HTML."""
    error = {"message": f"{reason}: {excerpt(mesg, 200)}" if mesg else reason,
             "type": "invalid_request_error" if status_int < 500 else "server_error", "param": None,
             "code": _CODES.get(status_int, "server_error" if status_int >= 500 else "invalid_request")}
    body = json.dumps({"error": error}).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    util.write_nonblock(sock, head.encode("latin1") + body)


def honour_connection_close(wsgi_app):
    """The app as gunicorn calls it, closing the connection after a response that says
    `Connection: close` (gunicorn's response object is the one whose start_response it is handed)."""
    def app(environ, start_response):
        def starting(status, headers, exc_info=None):
            response = getattr(start_response, "__self__", None)
            if response is not None and any(name.lower() == "connection" and value.lower() == "close"
                                            for name, value in headers):
                response.force_close()
            return start_response(status, headers, exc_info)
        return wsgi_app(environ, starting)
    return app


class OpenAIErrorsThreadWorker(ThreadWorker):
    def init_process(self) -> None:
        util.write_error = write_json_error
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.wsgi = honour_connection_close(self.wsgi)

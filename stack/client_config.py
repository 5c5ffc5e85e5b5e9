"""Where the `llmq` client commands find the service, and with which API key.

The service's own settings live in llmq/settings.py; these are the client's, read from the environment
the command was started with (passed in, so the order below is tested without touching os.environ).

    URL:  --url  >  LLMQ_URL  >  OPENAI_BASE_URL  >  http://127.0.0.1:$PORT (PORT defaults to 8000)
    key:  --api-key  >  LLMQ_API_KEY  >  OPENAI_API_KEY  >  none (an open install needs none)

llmq's own names win over the OpenAI ones, so a shell that exports OPENAI_* for another tool can still
point llmq elsewhere. A URL may name the service's root or its /v1 (OPENAI_BASE_URL usually ends in
/v1, as the openai client wants it): both mean the same service. An empty variable counts as unset.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
URL_SOURCES = ("LLMQ_URL", "OPENAI_BASE_URL")
KEY_SOURCES = ("LLMQ_API_KEY", "OPENAI_API_KEY")


class ConfigError(ValueError):
    """A URL or port the client cannot use; the message says which setting gave it."""


@dataclass(frozen=True)
class ClientConfig:
    url: str  # the service's root, without /v1 and without a trailing slash
    api_key: str | None
    url_source: str  # "--url", "LLMQ_URL", "OPENAI_BASE_URL" or "PORT", for error messages


def resolve_client_config(url_flag: str | None, key_flag: str | None, environ: Mapping[str, str]) -> ClientConfig:
    url, url_source = _first((("--url", url_flag), *((name, environ.get(name)) for name in URL_SOURCES)))
    if url is None:
        url, url_source = f"http://{DEFAULT_HOST}:{_port(environ.get('PORT'))}", "PORT"
    api_key, _ = _first((("--api-key", key_flag), *((name, environ.get(name)) for name in KEY_SOURCES)))
    return ClientConfig(service_root(url, url_source), api_key, url_source)


def service_root(url: str, source: str = "--url") -> str:
    """`http://host:8000`, `http://host:8000/`, `http://host:8000/v1` and `.../v1/` all name the same
    service: its root, without the trailing slash or /v1 (the client adds /v1/... to every path)."""
    root = url.strip().rstrip("/")
    if not root.startswith(("http://", "https://")) or root in ("http:/", "https:/", "http:", "https:"):
        raise ConfigError(f"{source} must be an http:// or https:// URL such as http://127.0.0.1:8000, got {url!r}")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def _first(candidates) -> tuple[str | None, str | None]:
    for source, value in candidates:
        if value:
            return value, source
    return None, None


def _port(raw: str | None) -> int:
    if not raw:
        return DEFAULT_PORT
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ConfigError(f"PORT must be a port number (1-65535), got {raw!r}; or set LLMQ_URL")
    return port

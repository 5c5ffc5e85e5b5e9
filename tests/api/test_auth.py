"""API keys: an open install until the first key; then every endpoint but health needs a valid, unrevoked Bearer key (401 in the OpenAI shape otherwise); `llmq keys create | list | revoke`.

Real Redis, a real migrated SQLite database, the real app; the endpoints are read from the app's
url_map, so a new endpoint is covered without touching this file.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from urllib.parse import unquote_plus

import pytest
from sqlalchemy import select

from app import create_app
from llmq.settings import Settings
from llmq.store.models import ApiKey, File
from stack import cli
from tests.conftest import STORIES_DIR

PUBLIC_BLUEPRINTS = ("health", "metrics")  # load balancers' health checks, Prometheus's scrapes
PUBLIC_ENDPOINTS = ("dashboard.login", "dashboard.static")  # where a person enters a key, and its style


def routes(public: bool, blueprint: str | None = None) -> list[tuple[str, str]]:
    """(method, path) of every route of the app (of the API, or of one blueprint), its arguments
    filled with an id that exists nowhere."""
    flask_app = create_app(Settings(home=None, database_url="sqlite://", redis_url="redis://127.0.0.1:1/0",
                                    model_path=str(STORIES_DIR), model_name="unused", secret_key="unused"))  # nothing is connected
    found = []
    for rule in flask_app.url_map.iter_rules():
        is_public = rule.endpoint.partition(".")[0] in PUBLIC_BLUEPRINTS or rule.endpoint in PUBLIC_ENDPOINTS
        in_part = (rule.endpoint.partition(".")[0] == blueprint) if blueprint else not rule.endpoint.startswith("dashboard.")
        if is_public is public and in_part:
            path = re.sub(r"<(?:[^:>]+:)?[^>]+>", "nope-123", rule.rule)
            found += [(method, path) for method in sorted(rule.methods - {"HEAD", "OPTIONS"})]
    return found


API_ROUTES = routes(public=False)
PUBLIC_ROUTES = routes(public=True)
DASHBOARD_ROUTES = routes(public=False, blueprint="dashboard")


def test_the_route_lists_are_real():
    # Guards the parametrization below: an empty list would make every test there pass vacuously.
    assert ("POST", "/v1/completions") in API_ROUTES and ("GET", "/v1/files/nope-123/content") in API_ROUTES
    assert ("GET", "/health") in PUBLIC_ROUTES and ("GET", "/openapi.json") in API_ROUTES
    assert all(path != "/health" for _, path in API_ROUTES)
    assert ("GET", "/dashboard/batches") in DASHBOARD_ROUTES and ("POST", "/dashboard/batches") in DASHBOARD_ROUTES
    assert all(not path.startswith("/dashboard/login") for _, path in DASHBOARD_ROUTES)


def assert_unauthorized(response, words: str) -> None:
    assert response.status_code == 401, response.get_data(as_text=True)
    assert response.get_json() == {"error": {"message": response.get_json()["error"]["message"],
                                             "type": "invalid_request_error", "param": None,
                                             "code": "invalid_api_key"}}
    assert words in response.get_json()["error"]["message"]
    assert response.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_fresh_install_is_open_and_runs_as_tenant_default(app, client):
    assert client.get("/v1/models").status_code == 200
    uploaded = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(b"{}\n"), "a.jsonl")})
    assert uploaded.status_code == 200
    with app.extensions["llmq"].db.session() as session:
        assert session.get(File, uploaded.get_json()["id"]).tenant == "default"
    # A key sent to an open install is not looked at: there is nothing to check it against.
    assert client.get("/v1/models", headers={"Authorization": "Bearer whatever"}).status_code == 200


def test_the_first_key_closes_a_running_server_at_once(app, client, new_key):
    assert client.get("/v1/models").status_code == 200
    _, headers = new_key(app, "acme")
    assert_unauthorized(client.get("/v1/models"), "didn't provide an API key")
    assert client.get("/v1/models", headers=headers).status_code == 200


@pytest.fixture
def revoked(app, new_key) -> dict:
    """On a server with a valid key: the headers of another key of the tenant, revoked."""
    new_key(app, "acme")
    revoked_id, headers = new_key(app, "acme")
    with app.extensions["llmq"].db.session() as session:
        session.get(ApiKey, revoked_id).revoked_at = 1.0
    return headers


@pytest.mark.parametrize("method,path", API_ROUTES)
def test_every_endpoint_refuses_missing_malformed_unknown_and_revoked_keys(client, revoked, method, path):
    unknown_secret = "llmq-" + "A" * 43
    cases = [({}, "didn't provide an API key"),
             ({"Authorization": "Basic dXNlcjpwYXNz"}, "Malformed Authorization header"),
             ({"Authorization": "Bearer"}, "Malformed Authorization header"),
             ({"Authorization": "Bearer sk-not-an-llmq-key"}, "Malformed API key"),
             ({"Authorization": f"Bearer {unknown_secret}"}, "Incorrect API key provided"),
             (revoked, "has been revoked")]
    for headers, words in cases:
        assert_unauthorized(client.open(path, method=method, headers=headers, json={}), words)


@pytest.mark.parametrize("method,path", DASHBOARD_ROUTES)
def test_every_dashboard_page_leads_a_caller_without_a_valid_key_to_the_log_in(client, revoked, method, path):
    for headers, problem in [({}, None), (revoked, "has been revoked")]:
        answer = client.open(path, method=method, headers=headers)
        location = unquote_plus(answer.headers.get("Location", ""))
        assert answer.status_code == 302 and location.startswith("/dashboard/login?next="), path
        assert (problem in location) if problem else ("problem=" not in location)


@pytest.mark.parametrize("method,path", PUBLIC_ROUTES)
def test_health_stays_open_with_keys(app, client, new_key, method, path):
    new_key(app, "acme")
    assert client.open(path, method=method).status_code == 200


def test_revoking_every_key_does_not_open_the_server(app, client, new_key):
    key_id, headers = new_key(app, "acme")
    assert client.get("/v1/files", headers=headers).status_code == 200
    with app.extensions["llmq"].db.session() as session:
        session.get(ApiKey, key_id).revoked_at = 1.0
    assert_unauthorized(client.get("/v1/files", headers=headers), "has been revoked")
    assert_unauthorized(client.get("/v1/files"), "didn't provide an API key")


def test_cli_create_list_revoke_round_trip(app, client, tmp_path, monkeypatch, capsys):
    database_url = app.extensions["llmq"].settings.database_url
    monkeypatch.setenv("DATABASE_URL", database_url)
    assert cli.main(["keys", "create", "--tenant", "acme", "--name", "ci", "--rpm", "7", "--max-tokens", "64"]) == 0
    out, err = capsys.readouterr()
    secret = out.strip()
    assert re.fullmatch(r"llmq-[A-Za-z0-9_-]{43}", secret), out
    assert "shown only now" in err

    with app.extensions["llmq"].db.session() as session:
        key = session.scalars(select(ApiKey)).one()
        assert key.key_hash == hashlib.sha256(secret.encode()).hexdigest()
        assert (key.tenant, key.name, key.rate_limit_rpm, key.max_tokens, key.rate_limit_tpm) == ("acme", "ci", 7, 64, None)
        assert secret.startswith(key.display_prefix) and len(key.display_prefix) < 16
    database_files = [path for path in tmp_path.iterdir() if path.name.startswith("access.db")]
    assert database_files and all(secret.encode() not in path.read_bytes() for path in database_files)

    headers = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/models", headers=headers).status_code == 200

    assert cli.main(["keys", "list"]) == 0
    listing = capsys.readouterr().out
    assert key.id in listing and "acme" in listing and key.display_prefix in listing and "active" in listing
    assert secret not in listing and key.key_hash not in listing
    assert cli.main(["keys", "list", "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert listed == [{"id": key.id, "tenant": "acme", "name": "ci", "prefix": key.display_prefix,
                       "created_at": key.created_at, "revoked_at": None,
                       "limits": {"rate_limit_rpm": 7, "max_tokens": 64}}]

    assert cli.main(["keys", "revoke", key.id]) == 0
    assert key.id in capsys.readouterr().out
    assert_unauthorized(client.get("/v1/models", headers=headers), "has been revoked")
    assert cli.main(["keys", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["revoked_at"] is not None

    assert cli.main(["keys", "revoke", "key_nope"]) == 1
    assert "no API key has id 'key_nope'" in capsys.readouterr().err
    assert cli.main(["keys", "create", "--tenant", "not:allowed"]) == 2
    assert "tenant must be" in capsys.readouterr().err


def test_cli_says_to_migrate_an_unmigrated_database(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'empty.db'}")
    assert cli.main(["keys", "list"]) == 2
    assert "alembic upgrade head" in capsys.readouterr().err


def test_access_modules_and_the_keys_command_do_not_import_torch(tmp_path):
    import subprocess
    import sys

    code = ("import sys, app.auth, llmq.store.api_keys, app.limits, app.idempotency, stack.keys_cli; "
            "from stack import cli; cli.main(['keys', 'list']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                          env={"DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr

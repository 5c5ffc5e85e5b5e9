"""The API tier's shared parts: a real Redis server and a database migrated with Alembic."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.embedded_redis import start_redis_server, wait_for_redis
from app.local_stack import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    port = free_port()
    server = start_redis_server(tmp_path_factory.mktemp("redis"), port, daemonize=False)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for_redis(url)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory) -> Path:
    """Migrated once with Alembic (as deployments are); tests copy it."""
    path = tmp_path_factory.mktemp("db") / "template.db"
    done = subprocess.run([sys.executable, "-m", "alembic", "-x", f"url=sqlite:///{path}", "upgrade", "head"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return path

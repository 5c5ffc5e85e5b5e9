"""PostgreSQL works by setting DATABASE_URL: the migrations build the same schema there, and a batch
and a completion run through a real worker against a real PostgreSQL server.

Skipped, saying why, where no PostgreSQL server binaries or no psycopg driver are installed."""
from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from stack.local import LocalStack, free_port, migrate
from tests.service.conftest import MODEL_NAME, wait_until


def _pg_bin(name: str) -> str | None:
    return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))), None)


@pytest.fixture(scope="module")
def postgres_url():
    pytest.importorskip("psycopg", reason="the psycopg driver is not installed (pip install 'psycopg[binary]')")
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    run_as: list[str] = []
    # Not under pytest's tmp_path: its parent is private to root, and the server may run as another user.
    data = Path(tempfile.mkdtemp(prefix="llmq-pg-"))
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as")
        shutil.chown(data, user.pw_uid, user.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    subprocess.run(run_as + [initdb, "-D", str(data / "db"), "-A", "trust", "-U", "llmq"], check=True,
                   capture_output=True)
    subprocess.run(run_as + [pg_ctl, "-D", str(data / "db"), "-l", str(data / "log"), "-w", "-o",
                             f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start"], check=True,
                   capture_output=True)
    try:
        yield f"postgresql+psycopg://llmq@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(run_as + [pg_ctl, "-D", str(data / "db"), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


def test_migrations_build_the_models_schema_on_postgres(postgres_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import create_engine

    from llmq.store.models import Base

    migrate(postgres_url)
    engine = create_engine(postgres_url)
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
    engine.dispose()


def test_batch_and_completion_on_postgres(postgres_url, served_model_dir, tmp_path):
    env = {"LLMQ_HOME": str(tmp_path), "DATABASE_URL": postgres_url, "MODEL_PATH": str(served_model_dir),
           "MODEL_NAME": MODEL_NAME, "LLMQ_MAX_NUM_SEQS": "8", "LLMQ_HEARTBEAT_SECONDS": "1"}
    lines = [json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}})
             for i, prompt in enumerate(["Once upon a time", "The sun was", "Lily wanted to"])]
    lines.append("not json")
    with LocalStack(env, start_redis=True, log_dir=tmp_path) as stack, \
            httpx.Client(base_url=stack.base_url, timeout=60) as api:
        completion = api.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once upon a time",
                                                       "max_tokens": 12, "temperature": 0}).json()
        assert completion["usage"]["completion_tokens"] == 12
        file_id = api.post("/v1/files", files={"file": ("in.jsonl", "\n".join(lines).encode())},
                           data={"purpose": "batch"}).json()["id"]
        batch_id = api.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                 "completion_window": "24h"}).json()["id"]
        batch = wait_until(lambda: (b := api.get(f"/v1/batches/{batch_id}").json())["status"] == "completed" and b)
        assert batch["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
        rows = [json.loads(x) for x in api.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()]
        texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in rows}
        assert texts["p0"] == completion["choices"][0]["text"]

"""The Alembic migrations: one head, and `upgrade head` builds exactly the schema llmq.store.models declares
(autogenerate finds nothing to add), and the whole history runs down and up again."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect

from llmq.store.models import Base

REPO_ROOT = Path(__file__).resolve().parents[1]


def alembic(url: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "alembic", "-x", f"url={url}", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"alembic {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def schema_differences(url: str) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True,
                                                                   "compare_server_default": True})
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()


def current_revision(url: str) -> str | None:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


@pytest.fixture()
def script() -> ScriptDirectory:
    return ScriptDirectory.from_config(Config(str(REPO_ROOT / "alembic.ini")))


def test_one_head(script):
    heads = script.get_heads()
    assert len(heads) == 1, f"the migrations have {len(heads)} heads {heads}: merge them (alembic merge heads)"


def test_upgrade_head_matches_the_models(tmp_path, script):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    alembic(url, "upgrade", "head")
    assert current_revision(url) == script.get_current_head()
    differences = schema_differences(url)
    assert differences == [], ("the models and the migrations disagree; write a migration "
                               f"(alembic revision --autogenerate):\n{differences}")


def test_downgrade_base_then_upgrade_head(tmp_path, script):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    alembic(url, "upgrade", "head")
    alembic(url, "downgrade", "base")
    engine = create_engine(url)
    try:
        left = set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()
    assert left == set(), f"downgrade base left tables behind: {sorted(left)}"
    assert current_revision(url) is None
    alembic(url, "upgrade", "head")
    assert current_revision(url) == script.get_current_head()
    assert schema_differences(url) == []

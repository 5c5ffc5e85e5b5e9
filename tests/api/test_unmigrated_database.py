"""A web process whose database has not been migrated (started before the Procfile's release step)
answers every request with a 503 that says what to run, and serves once the database is migrated."""
from app import create_app
from llmq.settings import Settings
from stack.local import migrate


def test_an_unmigrated_database_gets_a_503_that_says_what_to_run(tmp_path, redis_url):
    database_url = f"sqlite:///{tmp_path / 'empty.db'}"
    flask_app = create_app(Settings(home=tmp_path, database_url=database_url, redis_url=redis_url,
                                    model_path=None, model_name="m"))
    try:
        client = flask_app.test_client()
        response = client.get("/v1/models")
        assert response.status_code == 503
        error = response.get_json()["error"]
        assert error["code"] == "database_not_migrated"
        assert error["type"] == "server_error"
        assert "python -m alembic upgrade head" in error["message"]

        migrate(database_url)
        response = client.get("/v1/models")
        assert response.status_code == 200
        assert [model["id"] for model in response.get_json()["data"]] == ["m"]
    finally:
        flask_app.extensions["llmq"].celery.close()
        flask_app.extensions["llmq"].db.engine.dispose()

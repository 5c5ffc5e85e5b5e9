"""The llmq web application: HTTP in, rows and tasks out. Stands on llmq; never imports torch or workers."""
from __future__ import annotations

import logging

from celery import Celery
from flask import Flask

from app.limits import MULTIPART_ALLOWANCE_BYTES
from app.services import EXTENSION, WebServices
from app.stream_hub import StreamHub
from app.strict_json import StrictJSONProvider
from llmq.bootstrap import bootstrap
from llmq.celery_config import celery_config
from llmq.model.tokenizer import Tokenizer
from llmq.protocol.prepare import ServedModel
from llmq.redis_client import redis_client
from llmq.settings import Settings
from llmq.store.database import Database


def create_app(settings: Settings | None = None) -> Flask:
    """Application factory: settings (bootstrapped: the embedded Redis and the default model where
    none is given), the services the handlers use, access (keys, limits, idempotency), blueprints,
    error handlers."""
    settings = bootstrap(settings)
    app = Flask(__name__)
    app.json = StrictJSONProvider(app)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app.config.update(MAX_CONTENT_LENGTH=settings.max_upload_bytes + MULTIPART_ALLOWANCE_BYTES)
    client = redis_client(settings.redis_url, settings.redis_retry_seconds)
    app.extensions[EXTENSION] = WebServices(
        settings=settings, db=Database(settings.database_url), redis=client, stream_hub=StreamHub(client),
        celery=_celery_app(app.name, settings), tokenizer=Tokenizer.from_folder(settings.model_path),
        model=ServedModel.of_settings(settings))

    from app import auth, idempotency, limits, web_session
    from app.api import register_blueprints
    from app.dashboard import blueprint as dashboard
    from app.errors import register_error_handlers

    web_session.init_app(app, settings)

    # In this order, before every request: who is calling (g.tenant; 401 without a valid key once keys
    # exist), then the key's request rate (429), then a retried POST's first answer (Idempotency-Key).
    app.before_request(auth.authenticate)
    app.before_request(limits.limit_request_rate)
    idempotency.init_app(app)
    register_blueprints(app)
    app.register_blueprint(dashboard)
    register_error_handlers(app)
    return app


def _celery_app(name: str, settings: Settings) -> Celery:
    """The web's Celery app: it only sends tasks, by name, to the workers' queues (it registers none)."""
    celery_app = Celery(name, set_as_current=False)
    celery_app.config_from_object(celery_config(settings))
    return celery_app

"""What every blueprint needs: the database, Redis, settings, the served model, task submission, and
the caller's own rows (tenancy)."""
from __future__ import annotations

from typing import Any

import redis
from flask import request
from sqlalchemy.orm import Session

from app.auth import current_tenant
from app.errors import APIError, excerpt, not_found
from app.services import services
from app.stream_hub import StreamHub
from llmq import fleet
from llmq.model.tokenizer import Tokenizer
from llmq.protocol.openai import check_text
from llmq.settings import Settings, queue_name
from llmq.store.database import Database


def settings() -> Settings:
    return services().settings


def db() -> Database:
    return services().db


def redis_client() -> redis.Redis:
    return services().redis


def stream_hub() -> StreamHub:
    return services().stream_hub


def tokenizer() -> Tokenizer:
    return services().tokenizer


def served_model() -> str:
    """The model id this deployment serves (what clients pass as "model")."""
    return services().model.name


def check_model(model: Any, required: bool = True) -> str:
    """The served model's name; 404 in the OpenAI shape for any other (400 if missing and required)."""
    served = served_model()
    if model is None and not required:
        return served
    if model is None:
        raise APIError(400, "you must provide a model parameter", param="model", code="missing_model")
    if not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {type(model).__name__}", param="model",
                       code="invalid_request")
    check_text(model, "model")  # a lone surrogate: 400, not an echo of it in a 404
    if model != served:
        raise APIError(404, f"The model '{excerpt(model)}' does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")
    return served


def heartbeat_stale_after() -> float:
    return settings().heartbeat_stale_after


def check_served(model: str) -> None:
    """503 in the OpenAI shape if no worker serves `model` (or is starting to) and no autoscaler can
    start one: the request would wait in the queue for ever."""
    if not fleet.is_served(redis_client(), model, heartbeat_stale_after()):
        raise APIError(503, f"no worker serves the model '{model}' and no autoscaler can start one: start a worker "
                            "(celery -A workers.celery_app worker) or the autoscaler (llmq autoscale), then try again",
                       param="model", code="model_not_served")


def json_body() -> dict:
    """The request's JSON object, or a 400 saying what is wrong with it."""
    body = request.get_json(silent=True)
    if body is None:
        raise APIError(400, "the request body must be valid JSON (Content-Type: application/json)",
                       code="invalid_json")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def enqueue(task_name: str, args: list, model: str) -> None:
    """Send a task to the model's queue by name, so the web process never imports the workers' code."""
    services().celery.send_task(task_name, args=args, queue=queue_name(model))


def owns(row) -> bool:
    """Whether the caller's tenant owns this request, file or batch row."""
    return row.tenant == current_tenant()


def owned(session: Session, model, object_id: str, kind: str, options: tuple = ()):
    """The row with this id if the caller's tenant owns it. Otherwise exactly the 404 an unknown id
    gets, so another tenant's ids reveal nothing, not even that they exist."""
    row = session.get(model, object_id, options=list(options))
    if row is None or not owns(row):
        raise not_found(kind, object_id)
    return row

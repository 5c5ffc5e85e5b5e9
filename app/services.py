"""WebServices: what the web's handlers use, built once by the application factory and bound to the
app (`current_app.extensions["llmq"]`), not found through module globals or filled in by handlers."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import redis
from celery import Celery
from flask import current_app

from app.stream_hub import StreamHub
from llmq.model.tokenizer import Tokenizer
from llmq.protocol.prepare import ServedModel
from llmq.settings import Settings
from llmq.store.database import Database

EXTENSION = "llmq"


@dataclass(frozen=True)
class WebServices:
    settings: Settings  # bootstrapped
    db: Database
    redis: redis.Redis
    stream_hub: StreamHub  # this web process's reader of request streams (app/stream_hub.py)
    celery: Celery  # sends tasks by name; the web registers none
    tokenizer: Tokenizer  # the served model's (torch-free)
    model: ServedModel  # what requests are prepared for
    # Set once an API key exists (keys are never deleted): from then on every request needs one.
    keys_seen: threading.Event = field(default_factory=threading.Event)


def services() -> WebServices:
    return current_app.extensions[EXTENSION]

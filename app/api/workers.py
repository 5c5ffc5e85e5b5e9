"""GET /v1/workers: the workers' latest heartbeats (model, running, waiting, free and total KV blocks, how
the model is held: quantization, tensor_parallel_size, pipeline_parallel_size, and the engine loop's
totals since the worker started: steps, busy_seconds, tokens), and how many of each
worker's task threads the caller's tenant holds (`tenant_threads`: other tenants are not shown)."""
import json
import time

from flask import Blueprint

from app.api.common import redis_client, settings
from app.auth import current_tenant
from llmq.events import WORKERS_KEY

blueprint = Blueprint("workers", __name__, url_prefix="/v1")


@blueprint.get("/workers")
def list_workers():
    stale_after = 3 * settings().heartbeat_seconds + 5
    now = time.time()
    workers = []
    for name, raw in sorted(redis_client().hgetall(WORKERS_KEY).items()):
        beat = json.loads(raw)
        if now - beat.get("at", 0) <= stale_after:
            threads = beat.pop("tenant_threads", {})
            workers.append({"name": name.decode() if isinstance(name, bytes) else name, **beat,
                            "tenant_threads": threads.get(current_tenant(), 0)})
    return {"object": "list", "data": workers}

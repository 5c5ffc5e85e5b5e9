"""GET /v1/workers: every live worker's latest heartbeat (llmq/fleet.py says what one holds: its
model and state (starting, ready, draining), its engine's load and capacity (running, waiting, free
and total KV blocks, max_num_seqs, how many more requests it takes now, tokens per second), how it
holds the model (dtype, quantization, tensor_parallel_size, pipeline_parallel_size) and the engine loop's
totals since it started), with how many of its task threads the caller's tenant holds
(`tenant_threads`: other tenants are not shown)."""
from flask import Blueprint

from app.api.common import heartbeat_stale_after, redis_client
from app.auth import current_tenant
from llmq import fleet

blueprint = Blueprint("workers", __name__, url_prefix="/v1")


@blueprint.get("/workers")
def list_workers():
    workers = []
    for beat in fleet.live_workers(redis_client(), heartbeat_stale_after()):
        threads = beat.pop("tenant_threads", {})
        beat.pop("metrics", None)  # /metrics shows those
        workers.append({**beat, "tenant_threads": threads.get(current_tenant(), 0)})
    return {"object": "list", "data": workers}

"""The workers page: each live worker's model, how it holds it, its load and KV cache, its speed and
state; the autoscaler's desired against actual count; the queue over the last hour."""
from __future__ import annotations

import time

from flask import render_template

from app.api.common import heartbeat_stale_after, redis_client, served_model
from app.dashboard.blueprint import blueprint
from app.dashboard.chart import HEIGHT, WIDTH, chart
from llmq import fleet, fleet_history


@blueprint.get("/workers")
def workers():
    return render_template("dashboard/workers.html", **_fleet())


@blueprint.get("/workers/fleet")
def workers_fleet():
    return render_template("dashboard/_workers.html", **_fleet())


def _fleet() -> dict:
    client, stale_after, now = redis_client(), heartbeat_stale_after(), time.time()
    beats = fleet.live_workers(client, stale_after, now=now)
    models = sorted({served_model(), *(b["model"] for b in beats if "model" in b)})
    decisions = fleet.autoscalers(client, stale_after, now=now)
    return {
        "workers": [{**beat, "kv_used": kv_used(beat)} for beat in beats],
        "models": [{"name": model, "queued": sum(fleet.queue_depth(client, model).values()),
                    "serving": sum(1 for b in beats if b.get("model") == model and b.get("state") != "draining"),
                    "autoscaler": decisions.get(model),
                    "chart": chart(fleet_history.history(client, model, now), now)} for model in models],
        "chart_width": WIDTH, "chart_height": HEIGHT, "live": True,
    }


def kv_used(beat: dict) -> float | None:
    """The share of the worker's KV cache in use, 0 to 1 (None before its engine reports)."""
    total = beat.get("total_blocks")
    if not total:
        return None
    return 1 - beat.get("free_blocks", 0) / total

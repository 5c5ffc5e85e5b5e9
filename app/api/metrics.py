"""GET /metrics: the whole fleet in Prometheus's text format (app/fleet_metrics.py; the names are
llmq/metrics.py's). No key needed, like /health: it is for the operators' scrapers, and says how busy
the service is, never what anyone asked it."""
from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from app.api.common import db, heartbeat_stale_after, redis_client, served_model
from app.fleet_metrics import FleetCollector

blueprint = Blueprint("metrics", __name__)


@blueprint.get("/metrics")
def metrics():
    registry = CollectorRegistry(auto_describe=False)  # a fresh one per scrape: no state in this process
    registry.register(FleetCollector(redis_client(), db(), [served_model()], heartbeat_stale_after()))
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)

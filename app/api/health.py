"""GET /health: liveness for load balancers (no key needed, touches nothing heavy)."""
from flask import Blueprint

blueprint = Blueprint("health", __name__)


@blueprint.get("/health")
def health():
    return {"status": "ok"}

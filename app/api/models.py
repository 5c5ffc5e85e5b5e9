"""GET /v1/models."""
from flask import Blueprint

from app.api.common import served_model

blueprint = Blueprint("models", __name__, url_prefix="/v1")


@blueprint.get("/models")
def list_models():
    return {"object": "list", "data": [{"id": served_model(), "object": "model", "created": 0, "owned_by": "llmq"}]}


@blueprint.get("/models/<path:model_id>")
def get_model(model_id: str):
    from app.api.common import check_model

    check_model(model_id)
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "llmq"}

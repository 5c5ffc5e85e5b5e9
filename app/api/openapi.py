"""GET /openapi.json: the OpenAPI 3.1 description of this API (app/openapi.py). Public, like /health:
a client needs it to learn how to authenticate."""
from flask import Blueprint, jsonify

from app.openapi import openapi_document

blueprint = Blueprint("openapi", __name__)


@blueprint.get("/openapi.json")
def openapi():
    return jsonify(openapi_document())

"""One blueprint per resource."""
from flask import Flask


def register_blueprints(app: Flask) -> None:
    from app.api import batches, completions, files, health, metrics, models, openapi, requests, workers

    for module in (health, metrics, openapi, models, completions, files, batches, requests, workers):
        app.register_blueprint(module.blueprint)

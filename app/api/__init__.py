"""One blueprint per resource."""
from flask import Flask


def register_blueprints(app: Flask) -> None:
    from app.api import batches, completions, files, health, models, openapi, requests, workers

    for module in (health, openapi, models, completions, files, batches, requests, workers):
        app.register_blueprint(module.blueprint)

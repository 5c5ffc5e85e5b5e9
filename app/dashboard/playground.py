"""The playground: a prompt and sampling settings; the page's script submits it to POST /v1/requests,
streams its tokens from the request's SSE events, and cancels it (static/dashboard.js)."""
from __future__ import annotations

from flask import render_template

from app.api.common import served_model
from app.dashboard.blueprint import blueprint


@blueprint.get("/playground")
def playground():
    return render_template("dashboard/playground.html", model=served_model())

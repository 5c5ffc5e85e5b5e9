"""The dashboard's blueprint: its templates and static files, the CSRF check on every form, and
errors as pages a person can act on (a missing or bad key leads to the log-in page)."""
from __future__ import annotations

import logging

from flask import Blueprint, g, redirect, render_template, request, url_for
from werkzeug.exceptions import HTTPException

from app import web_session
from app.auth import NO_KEY_MESSAGE
from app.errors import APIError

log = logging.getLogger(__name__)

blueprint = Blueprint("dashboard", __name__, url_prefix="/dashboard", template_folder="templates",
                      static_folder="static")


@blueprint.before_request
def check_csrf() -> None:
    """Every form here changes something (log in, upload, cancel): each carries the session's token,
    on an open install too, where a page on another site could otherwise post to a local llmq."""
    problem = web_session.csrf_error()
    if problem:
        raise APIError(400, f"{problem} The form was older than your session: reload the page and try again.",
                       code="csrf_failed")


@blueprint.context_processor
def caller() -> dict:
    key = g.get("api_key")
    return {"tenant": g.get("tenant"), "key": key}


@blueprint.errorhandler(APIError)
def api_error(err: APIError):
    if err.status == 401:  # to the log-in, saying what was wrong with the key (nothing, when none came)
        problem = None if err.message == NO_KEY_MESSAGE else err.message
        return redirect(url_for("dashboard.login", next=request.full_path, problem=problem))
    return render_template("dashboard/error.html", status=err.status, message=err.message, code=err.code), err.status


@blueprint.errorhandler(HTTPException)
def http_error(err: HTTPException):
    messages = {404: "There is no such page.",
                413: f"The file is larger than this server accepts from you ({g.get('upload_limit')} bytes)."}
    return render_template("dashboard/error.html", status=err.code, message=messages.get(err.code, err.description),
                           code=None), err.code

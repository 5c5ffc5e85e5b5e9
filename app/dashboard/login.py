"""Log in with an API key (kept in the browser's session), log out."""
from __future__ import annotations

from urllib.parse import urlsplit

from flask import redirect, render_template, request, url_for

from app import web_session
from app.auth import key_for_secret, keys_in_use
from app.dashboard.blueprint import blueprint
from app.errors import APIError
from app.services import services


@blueprint.get("/")
def home():
    return redirect(url_for("dashboard.batches"))


@blueprint.route("/login", methods=["GET", "POST"])
def login():
    next_page = _local(request.values.get("next"))
    problem = request.args.get("problem")
    if request.method == "POST":
        secret = (request.form.get("api_key") or "").strip()
        try:
            key = key_for_secret(services().db, secret)
        except APIError as err:
            problem = err.message
        else:
            web_session.log_in(key)
            return redirect(next_page)
    return render_template("dashboard/login.html", problem=problem, next_page=next_page,
                           open_install=not keys_in_use()), 401 if problem else 200


@blueprint.post("/logout")
def logout():
    web_session.log_out()
    return redirect(url_for("dashboard.login"))


def _local(target: str | None) -> str:
    """Where to go after logging in: a path on this server only (never another site)."""
    if target and target.startswith("/") and not target.startswith("//") and not urlsplit(target).netloc:
        return target
    return url_for("dashboard.batches")

"""The browser's session, for the dashboard: the API key a person entered once, kept in a signed
cookie, and the CSRF token that every state-changing request made with that cookie must carry.

The cookie holds the key's id, never its secret: it is signed (Flask's session, with
LLMQ_SECRET_KEY), HttpOnly, SameSite=Lax, and Secure when the request came over HTTPS (or always,
with LLMQ_SECURE_COOKIES=1). Each request made with it looks the key up again, so revoking a key
ends its sessions at once. The CSRF token is Flask-WTF's: bound to the session and signed, sent by
the dashboard's forms as `csrf_token` and by its scripts as the X-CSRFToken header.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from flask import Flask, request, session
from flask.sessions import SecureCookieSessionInterface
from flask_wtf.csrf import generate_csrf, validate_csrf
from wtforms.validators import ValidationError

from llmq.settings import Settings
from llmq.store.models import ApiKey

KEY_ID = "key_id"
CSRF_HEADER = "X-CSRFToken"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
SECRET_FILE = "web-secret-key"


class _SessionInterface(SecureCookieSessionInterface):
    """Flask's signed-cookie session, marked Secure per request: over HTTPS always, over plain HTTP
    (a local install) only if LLMQ_SECURE_COOKIES says so, since a browser would not send it back."""

    def get_cookie_secure(self, app: Flask) -> bool:
        return bool(app.config["SESSION_COOKIE_SECURE"]) or request.is_secure


def init_app(app: Flask, settings: Settings) -> None:
    app.config.update(SECRET_KEY=settings.secret_key or _machine_secret(settings.home),
                      SESSION_COOKIE_NAME="llmq_session", SESSION_COOKIE_HTTPONLY=True,
                      SESSION_COOKIE_SAMESITE="Lax", SESSION_COOKIE_SECURE=bool(settings.secure_cookies),
                      WTF_CSRF_TIME_LIMIT=None)  # valid as long as the session is
    app.session_interface = _SessionInterface()
    app.jinja_env.globals["csrf_token"] = generate_csrf


def _machine_secret(home: Path) -> str:
    """A signing key made once under `home` and shared by the web processes of this machine. Several
    machines behind one address need one LLMQ_SECRET_KEY, or a session made on one fails on another."""
    path = home / SECRET_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    home.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # two processes starting at once: one makes it
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(48))
    return path.read_text().strip()


def log_in(key: ApiKey) -> None:
    session.clear()  # a new session on every log-in: nothing from before it carries over
    session[KEY_ID] = key.id


def log_out() -> None:
    session.clear()


def session_key_id() -> str | None:
    return session.get(KEY_ID)


def csrf_error() -> str | None:
    """Why this request's CSRF token is refused, or None when it is valid (or the method is safe)."""
    if request.method in SAFE_METHODS:
        return None
    token = request.headers.get(CSRF_HEADER) or request.form.get("csrf_token")
    try:
        validate_csrf(token)
    except ValidationError as err:
        return str(err)
    return None

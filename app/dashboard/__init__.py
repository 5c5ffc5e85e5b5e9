"""The dashboard, /dashboard: what a person looks at. Batches with live progress, one batch's lines,
the workers and the queue over the last hour, and a playground that streams a completion.

Server-rendered with Jinja; a small script of our own (static/dashboard.js, no build step, nothing
fetched from elsewhere) refreshes the live parts from their fragment routes and runs the playground
against the API (/v1/requests and its SSE events). Behind the same keys and tenancy as the API: a
key entered once is kept in the browser's session (app/web_session.py).
"""
from app.dashboard import batches, formatting, login, playground, workers  # noqa: F401  (their routes and filters)
from app.dashboard.blueprint import blueprint

__all__ = ["blueprint"]

"""`llmq serve`: the whole service on this machine until Ctrl-C, to use it and look at it: a Redis
server (REDIS_URL, else the auto-started one), the database migrated, Celery workers, the web
server as the Procfile runs it (gunicorn) on PORT; the API under /v1, the dashboard at /dashboard.
Each part logs to a file of its own under LLMQ_HOME/serve."""
from __future__ import annotations

import signal
import threading

from llmq.settings import Settings
from stack.local import LocalStack


def serve(workers: int, port: int | None) -> int:
    settings = Settings.from_env()
    log_dir = settings.home / "serve"
    log_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"starting llmq: Redis, the database (migrated), {workers} worker(s), the web server ...", flush=True)
    with LocalStack(workers=workers, log_dir=log_dir, web="gunicorn", web_port=port or settings.port) as stack:
        model = stack.settings.resolved_model_name()
        print(f"serving {model} at {stack.base_url}\n"
              f"  the API:       {stack.base_url}/v1 (OpenAI-compatible; README's \"The API\")\n"
              f"  the dashboard: {stack.base_url}/dashboard\n"
              f"  logs:          {log_dir}\n"
              "Ctrl-C stops it all.", flush=True)
        stop.wait()
        print("stopping: the workers hand their requests back ...", flush=True)
    return 0

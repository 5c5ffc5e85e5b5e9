"""Everything llmq runs, on one machine, as real processes: Redis, migrations, a Celery worker, and
the web server. Used by `llmq demo`, by the service tests and by the service benchmark.

    with LocalStack(env) as stack:          # env: DATABASE_URL, REDIS_URL, MODEL_PATH ... (or none)
        requests.post(stack.base_url + "/v1/completions", ...)
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from llmq.bootstrap import bootstrap
from llmq.embedded_redis import start_redis_server, wait_for_redis
from llmq.events import WORKERS_KEY
from llmq.settings import Settings
from llmq.store.api_keys import create_key
from llmq.store.database import Database
from stack.worker_backends import celery_worker_command

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def migrate(database_url: str) -> None:
    """alembic upgrade head, as the Procfile's release step does."""
    subprocess.run([sys.executable, "-m", "alembic", "-x", f"url={database_url}", "upgrade", "head"],
                   cwd=REPO_ROOT, check=True, capture_output=True)


class LocalStack:
    def __init__(self, env: dict[str, str] | None = None, start_redis: bool = False, workers: int = 1,
                 log_dir: Path | None = None, web: str = "thread", web_port: int | None = None):
        """`env` overrides the environment for every process. With start_redis, a private
        redis-server on a free port is started (and stopped) by the stack. `web`: "thread" serves the
        app from a thread of this process (tests reach `stack.app`), "gunicorn" runs the web server as
        the Procfile does (gunicorn's threaded worker), as its own process: one process of 128 threads.
        `web_port`: where the web server listens (default: a free port)."""
        self.env = {**os.environ, **(env or {})}
        self.start_redis = start_redis
        self.num_workers = workers
        self.log_dir = log_dir
        self.redis_process: subprocess.Popen | None = None
        self.redis_dir: Path | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.web = web
        self.web_port = web_port
        self.server = None
        self.web_process: subprocess.Popen | None = None
        self.base_url = ""

    # ---- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> "LocalStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.start_redis:
            port = free_port()
            home = Path(self.env.get("LLMQ_HOME") or Settings.from_env().home)
            self.redis_dir = home / f"redis-{port}"
            self.redis_process = start_redis_server(self.redis_dir, port, daemonize=False)
            self.env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        # Bootstrapped once here (the embedded Redis, the default model), so the processes started
        # below are handed both rather than each making them.
        self.settings = bootstrap(self._settings())
        self.redis_url = self.settings.redis_url
        self.env["REDIS_URL"], self.env["MODEL_PATH"] = self.redis_url, self.settings.model_path
        wait_for_redis(self.redis_url)
        migrate(self.settings.database_url)
        for i in range(self.num_workers):
            self.start_worker(f"w{i}")
        self.wait_for_workers(self.num_workers)
        self._start_web()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
        if self.web_process is not None:
            self._terminate(self.web_process)
        for process in self.workers.values():
            self._terminate(process)
        if self.redis_process is not None:
            self._terminate(self.redis_process)

    # ---- parts ---------------------------------------------------------------------------

    def start_worker(self, name: str) -> subprocess.Popen:
        """A real Celery worker process (threads pool, the engine loaded before it consumes)."""
        out = open(self.log_dir / f"worker-{name}.log", "a") if self.log_dir else subprocess.DEVNULL
        process = subprocess.Popen(celery_worker_command(name), cwd=REPO_ROOT, env=self.env, stdout=out,
                                   stderr=subprocess.STDOUT)
        self.workers[name] = process
        return process

    # ---- faults (the reliability tests and the soak script use these) --------------------

    def kill_worker(self, name: str, sig: int = signal.SIGKILL, timeout: float = 60.0) -> int:
        """Send `sig` to a worker and wait for it to exit; returns its exit code."""
        process = self.workers.pop(name)
        process.send_signal(sig)
        return process.wait(timeout)

    def restart_redis(self, down_s: float = 1.0) -> None:
        """Stop the stack's own Redis (SIGTERM: it writes its append-only file), wait, start it again
        on the same port and data folder."""
        if self.redis_process is None:
            raise RuntimeError("restart_redis needs LocalStack(start_redis=True)")
        port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        self._terminate(self.redis_process)
        time.sleep(down_s)
        self.redis_process = start_redis_server(self.redis_dir, port, daemonize=False)
        wait_for_redis(self.redis_url)

    def restart_web(self) -> None:
        """Kill the gunicorn web server, master and workers at once (SIGKILL to its process group: no
        goodbye to its clients, as when its machine dies), and start it again on the same port."""
        if self.web_process is None:
            raise RuntimeError("restart_web needs LocalStack(web='gunicorn')")
        os.killpg(self.web_process.pid, signal.SIGKILL)
        self.web_process.wait()
        port = int(self.base_url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the old workers' listening socket is gone too
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                time.sleep(0.05)
            except OSError:
                break
        self._start_gunicorn(port)

    def wait_for_workers(self, count: int, timeout: float = 180.0) -> list[dict]:
        """Until `count` workers report ready (their engines loaded and warm)."""
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fresh = [json.loads(v) for v in client.hgetall(WORKERS_KEY).values()]
            fresh = [b for b in fresh if time.time() - b["at"] < 10 and b.get("state") == "ready"]
            if len(fresh) >= count:
                return fresh
            dead = [p for p in self.workers.values() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a worker exited with code {dead[0].returncode} while starting"
                                   + (f"; see {self.log_dir}" if self.log_dir else ""))
            time.sleep(0.2)
        raise RuntimeError(f"{count} worker(s) did not report within {timeout:.0f} s")

    def key_headers(self, *tenants: str) -> dict[str, dict[str, str]]:
        """A new API key for each tenant, made in the stack's database as `llmq keys create` makes
        one (the first key closes an open install): the request headers that carry it, by tenant."""
        db = Database(self.settings.database_url)
        headers = {}
        for tenant in tenants:
            with db.session() as session:
                headers[tenant] = {"Authorization": f"Bearer {create_key(session, tenant)[1]}"}
        return headers

    def _settings(self) -> Settings:
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env)
        try:
            return Settings.from_env()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def _start_web(self) -> None:
        if self.web == "gunicorn":
            return self._start_gunicorn()
        from werkzeug.serving import make_server

        from app import create_app

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no access log line per poll
        port = self.web_port or free_port()
        flask_app = create_app(self.settings)
        self.app = flask_app
        self.server = make_server("127.0.0.1", port, flask_app, threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True, name="llmq-web").start()
        self.base_url = f"http://127.0.0.1:{port}"

    def _start_gunicorn(self, port: int | None = None) -> None:
        port = port or self.web_port or free_port()
        out = open(self.log_dir / "web.log", "a") if self.log_dir else subprocess.DEVNULL
        self.web_process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--worker-class", "app.gunicorn_worker.OpenAIErrorsThreadWorker",
             "--workers", "1", "--threads", "128",
             "--bind", f"127.0.0.1:{port}", "app:create_app()"],
            cwd=REPO_ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                if self.web_process.poll() is not None:
                    raise RuntimeError(f"gunicorn exited with code {self.web_process.returncode}") from None
                time.sleep(0.1)
        raise RuntimeError("gunicorn did not start listening within 60 s")

    @staticmethod
    def _terminate(process: subprocess.Popen, timeout: float = 15.0) -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

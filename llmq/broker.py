"""The Redis broker transport llmq uses: kombu's, with two behaviours changed for a Redis restart.

When the connection to Redis is lost, Celery closes the channel and reconnects, while the tasks that
were running carry on. kombu 5.7 then does two things that stop the worker instead:
- closing the channel pushes its unacknowledged messages back onto the queue. For llmq that is wrong
  twice over: their tasks are still running here, so requeueing them only makes duplicates (they
  wait on the requests' leases); and that runs while Redis is down, where it can fail with an
  AttributeError (the connection's client is already gone) that Celery takes for an unrecoverable
  error and stops the worker;
- a task that finishes after the reconnect acknowledges its message on the closed channel, which
  fails the same way (AttributeError, not a connection error), again stopping the worker.
So a closing channel restores nothing, and a closed channel answers with a connection error, which
Celery logs ("Couldn't ack") and goes on. A message left unacknowledged is redelivered after the
visibility timeout, as after a crash, and finds its work done; a worker that is stopping hands its
requests back explicitly (workers/tasks.py rejects them with requeue).

A third change saves a little CPU: kombu builds a new `redis.Redis` for every command it sends
without a client of its own (each publish, acknowledgement and task event), and building one fills a
table of about 200 reply callbacks (80 µs of CPU here; a batch of 64 lines built 402 of them in the
worker). A `redis.Redis` on a connection pool is safe to share between threads (each command takes a
connection from the pool), so the channel keeps one per pool.
"""
from __future__ import annotations

from contextlib import contextmanager

import redis
from kombu.transport import redis as kombu_redis


class QoS(kombu_redis.QoS):
    restore_at_shutdown = False


class Channel(kombu_redis.Channel):
    QoS = QoS
    _shared_client = None

    def _create_client(self, asynchronous=False):
        if asynchronous:  # kombu makes this one once (Channel.client)
            return super()._create_client(asynchronous=True)
        pool = self.pool  # a new pool after a reconnect gets a new client
        client = self._shared_client
        if client is None or client.connection_pool is not pool:
            client = self._shared_client = super()._create_client()
        return client

    @contextmanager
    def conn_or_acquire(self, client=None):
        if client is None and getattr(self.connection, "client", None) is None:
            raise redis.ConnectionError("this broker channel was closed when the connection to Redis was lost")
        with super().conn_or_acquire(client) as connection:
            yield connection


class Transport(kombu_redis.Transport):
    Channel = Channel

"""Token deltas -> Redis (stream + pub/sub, see app/streams.py); results -> the database."""
from __future__ import annotations


import redis

from app.streams import EventWrite, publish_events, write_events
from workers.engine.outputs import RequestDelta


class StreamPublisher:
    def __init__(self, client: redis.Redis, maxlen: int, ttl: int):
        self.client, self.maxlen, self.ttl = client, maxlen, ttl

    @staticmethod
    def delta_event(index: int, delta: RequestDelta, t: float) -> dict:
        logprobs = None
        if delta.logprobs is not None:
            logprobs = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(pair) for pair in lp.top]}
                        for lp in delta.logprobs]
        return {"type": "delta", "index": index, "text": delta.text, "token_ids": list(delta.token_ids),
                "logprobs": logprobs, "finish_reason": delta.finish_reason, "t": t}

    @staticmethod
    def done_event(prompt_tokens: int, completion_tokens: int, t: float) -> dict:
        return {"type": "done", "t": t, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                                  "total_tokens": prompt_tokens + completion_tokens}}

    @staticmethod
    def error_event(code: str, message: str, t: float, param: str | None = None) -> dict:
        return {"type": "error", "error": {"code": code, "message": message, "param": param}, "t": t}

    def publish(self, events: dict[str, tuple[int, list[dict]]], finished: list[str] = ()) -> None:
        """All of one step's events, every request, in one atomic script call: request id -> (the
        number of its first event here, its events). A retried call (after a dropped connection)
        writes nothing twice: the streams are the requests' checkpoints."""
        write_events(self.client, [EventWrite(request_id, request_events, first_number,
                                              self.ttl if request_id in finished else None)
                                   for request_id, (first_number, request_events) in events.items()], self.maxlen)

    def publish_one(self, request_id: str, event: dict, finished: bool = False) -> None:
        """One event after the request's last (the error that ends a request outside the engine loop)."""
        publish_events(self.client, request_id, [event], self.maxlen, self.ttl if finished else None)

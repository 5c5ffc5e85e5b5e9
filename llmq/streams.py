"""Request streams in Redis: writing a step's events (one atomic, idempotent script call), reading a
request's events back (its checkpoint), and cancel flags. Key names and the events' format are
llmq/events.py's."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import redis

from llmq import events
from llmq.events import CANCEL_CHANNEL, STEPS_CHANNEL, Event, StreamProgress, cancel_key, stream_key, tokens_channel

# Appends each request's events under ids "0-<n>", n = the event's number in the request (1, 2, ...).
# Redis refuses an XADD id at or below the stream's last, so an event whose number the stream already
# holds is skipped (and not published again): writing is idempotent. A call retried after a dropped
# connection (Redis restarted after running it, before answering) writes nothing twice, and neither
# does a worker that resumes a request. n = 0 for the first event means "after the last one".
# KEYS: per request, its stream and its channel. ARGV, per request: the number of its first event,
# the TTL to set (0: none), the stream's cap (MAXLEN ~; 0: none), the count of its events, the events.
# One call for a whole engine step, published whole on STEPS_CHANNEL at its end (after the entries are
# in their streams): a web process's stream reader gets the step's events in one message. (Redis before
# 7.2 answers an XREAD blocked on many streams with one stream's entries only.)
_APPEND_EVENTS = """
local a = 1
local step = {}
for k = 1, #KEYS, 2 do
  local first, ttl, maxlen, count = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  if first == 0 then
    local top = redis.call('XREVRANGE', KEYS[k], '+', '-', 'COUNT', 1)
    first = 1
    if #top > 0 then first = (tonumber(string.match(top[1][1], '^0%-(%d+)$')) or 0) + 1 end
  end
  for i = 1, count do
    local data = ARGV[a + 3 + i]
    local added
    if maxlen > 0 then
      added = redis.pcall('XADD', KEYS[k], 'MAXLEN', '~', maxlen, '0-' .. (first + i - 1), 'data', data)
    else
      added = redis.pcall('XADD', KEYS[k], '0-' .. (first + i - 1), 'data', data)
    end
    if type(added) == 'table' and added.err then
      if not string.find(added.err, 'equal or smaller', 1, true) then return added end
    else
      redis.call('PUBLISH', KEYS[k + 1], data)
      step[#step + 1] = '[' .. cjson.encode(KEYS[k]) .. ',' .. string.format('%d', first + i - 1) .. ',' .. data .. ']'
    end
  end
  if ttl > 0 then redis.call('EXPIRE', KEYS[k], ttl) end
  a = a + 4 + count
end
if #step > 0 then redis.call('PUBLISH', '""" + STEPS_CHANNEL + """', '[' .. table.concat(step, ',') .. ']') end
return #KEYS / 2
"""
_APPEND_EVENTS_SHA = hashlib.sha1(_APPEND_EVENTS.encode()).hexdigest()


@dataclass(frozen=True)
class EventWrite:
    """Events to append to one request's stream, numbered from `first_number` (0: after its last)."""

    request_id: str
    events: list[Event]
    first_number: int = 0
    ttl: int | None = None  # set when the request ended: the stream expires this long after
    # The stream's cap (MAXLEN ~), never less than the request's own events can number, since the
    # stream is the request's checkpoint and its replay; None: the call's `maxlen`.
    maxlen: int | None = None


# A script call blocks every other Redis client while it runs: a step's write is split into calls of
# at most this many events (an ordinary step is one call; a request of 1,000 prompts x 128 samples
# made 128,000 events a step, one call of over 5 s).
MAX_EVENTS_PER_CALL = 512


def write_events(client: redis.Redis, writes: list[EventWrite], maxlen: int | None = None,
                 max_events_per_call: int = MAX_EVENTS_PER_CALL) -> None:
    """Append and publish every write, in script calls of at most `max_events_per_call` events (a
    worker makes one per engine step, more for a very large step), each call atomic; `maxlen` caps the
    streams of writes that bring no cap of their own (None: no cap). The script runs by its SHA; a
    Redis that lacks it (new, or restarted) gets it loaded and the call sent again, which is safe
    since the writes are idempotent."""
    for call in _calls(writes, max_events_per_call):
        keys, args = [], []
        for write in call:
            cap = write.maxlen if write.maxlen is not None else maxlen
            keys += [stream_key(write.request_id), tokens_channel(write.request_id)]
            args += [write.first_number, write.ttl or 0, cap or 0, len(write.events), *map(events.encode, write.events)]
        _run_script(client, keys, args)


def _calls(writes: list[EventWrite], limit: int):
    """The writes, in order, grouped into calls of at most `limit` events. A write with more is split
    into parts numbered on from its first (parts of one that appends after the last append after the
    part before); only its last part sets its TTL."""
    if sum(len(write.events) for write in writes) <= limit:  # an ordinary step: one call, as it came
        if writes:
            yield writes
        return
    call, size = [], 0
    for write in writes:
        remaining, first = list(write.events), write.first_number
        while True:
            part, remaining = remaining[:limit - size], remaining[limit - size:]
            call.append(replace(write, events=part, first_number=first, ttl=None if remaining else write.ttl))
            size += len(part)
            first = first + len(part) if first else 0
            if size >= limit:
                yield call
                call, size = [], 0
            if not remaining:
                break
    if call:
        yield call


def _run_script(client: redis.Redis, keys: list, args: list) -> None:
    for attempt in range(2):
        try:
            client.evalsha(_APPEND_EVENTS_SHA, len(keys), *keys, *args)
            return
        except redis.exceptions.NoScriptError:
            if attempt:
                raise
            client.script_load(_APPEND_EVENTS)


def publish_events(client: redis.Redis, request_id: str, request_events: list[Event], maxlen: int | None = None,
                   ttl: int | None = None) -> None:
    """Append events after the request's last one and publish them, in one round trip."""
    write_events(client, [EventWrite(request_id, request_events, ttl=ttl)], maxlen)


def entry_id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("<ms>-<seq>", or "<ms>") as a tuple that sorts as Redis orders ids."""
    milliseconds, _, sequence = entry_id.partition("-")
    return int(milliseconds), int(sequence or 0)


def stream_entry(entry) -> tuple[str, bytes]:
    """A stream entry as redis-py gives it, (id, {field: value}), as (its id as text, its event's JSON):
    the client may decode replies or not."""
    entry_id, fields = entry
    return (entry_id.decode() if isinstance(entry_id, bytes) else entry_id), (fields.get(b"data") or fields.get("data"))


def event_number(entry_id: str) -> int:
    """The number of the event a stream entry id ("0-<n>") stands for."""
    return int(entry_id.split("-")[1])


def request_cancel(client: redis.Redis, request_id: str, ttl: int) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.set(cancel_key(request_id), "1", ex=ttl)
    pipe.publish(CANCEL_CHANNEL, request_id)
    pipe.execute()


def is_cancelled(client: redis.Redis, request_id: str) -> bool:
    return bool(client.exists(cancel_key(request_id)))


def read_progress(client: redis.Redis, request_id: str) -> StreamProgress:
    """Every event of the request's stream so far, joined (empty for a request not started)."""
    progress = StreamProgress()
    for entry_id, data in map(stream_entry, client.xrange(stream_key(request_id))):
        progress.add(events.decode(data), event_number(entry_id))
    return progress

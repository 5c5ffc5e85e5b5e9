"""Server-Sent Events, read: bytes as they arrive (in chunks cut anywhere) -> events with their ids.

The parsing rules are the WHATWG HTML standard's (section "Event stream interpretation"), which the
web's encoder (app/sse.py) writes to: lines end in CRLF, LF or CR; a blank line dispatches the event;
`data` lines join with newlines; a line starting with ":" is a comment (the service's heartbeats);
`id` sets the last event id, which then stays with later events until another `id` changes it; an
event with no data is not dispatched; a half-received event at the end of the stream is dropped.
That last rule is what makes resuming exact: an event counts as received only once its blank line
has come, so reconnecting with the last dispatched id never skips or repeats one.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class SSEEvent:
    event: str  # "message" unless the stream named it
    data: str
    id: str | None  # the last event id when this event was dispatched (None: the stream never set one)


class SSEReader:
    """Feed it bytes in any chunks; it hands back each event once its blank line has arrived."""

    def __init__(self) -> None:
        self.last_event_id: str | None = None
        self._pending = b""  # the start of a line whose end has not come yet
        self._after_cr = False  # the last chunk ended in CR: a LF first in the next one ends no second line
        self._started = False  # a byte order mark is skipped only at the very start of the stream
        self._event_type = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if not chunk:
            return []
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = False
        data = self._pending + chunk
        if not self._started:
            if len(data) < len(_BOM) and _BOM.startswith(data):
                self._pending = data  # perhaps a BOM cut in two: wait for more
                return []
            self._started = True
            if data.startswith(_BOM):
                data = data[len(_BOM):]
        events: list[SSEEvent] = []
        start = 0
        for match in _LINE_END.finditer(data):
            event = self._line(data[start:match.start()].decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
            start = match.end()
            if match.group() == b"\r" and start == len(data):
                self._after_cr = True  # its LF, if any, comes in the next chunk
        self._pending = data[start:]
        return events

    def events(self, chunks: Iterable[bytes]) -> Iterator[SSEEvent]:
        for chunk in chunks:
            yield from self.feed(chunk)

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment: the service's keep-alive
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event_type = value
        elif field == "id" and "\0" not in value:
            self.last_event_id = value or None  # an empty id resets it
        # "retry" and unknown fields: nothing this client uses
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event_type = self._data, self._event_type
        self._data, self._event_type = [], ""
        if not data:
            return None
        return SSEEvent(event_type or "message", "\n".join(data), self.last_event_id)

"""The web's JSON provider: request bodies are parsed as llmq/protocol/openai.py's `loads` parses a
batch line, so NaN, Infinity, 1e309 and nesting too deep for the parser are a 400 (invalid_json), as
any other malformed body is, never a value let through or a 500."""
from __future__ import annotations

from flask.json.provider import DefaultJSONProvider

from llmq.protocol import openai


class StrictJSONProvider(DefaultJSONProvider):
    def loads(self, s: str | bytes, **kwargs):
        return openai.loads(s)

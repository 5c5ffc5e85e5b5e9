"""Errors every layer shares (the engine raises them, the web answers them in the OpenAI shape)."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request llmq refuses: the client's to fix. `param` names the offending field and `code` says
    what is wrong, as OpenAI's error object does."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code

    def __reduce__(self):  # pickles whole (the engine process hands it back as it was raised)
        return type(self), (str(self), self.param, self.code)

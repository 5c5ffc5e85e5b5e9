"""EngineClient: what a worker's tasks need of its engine, whether it runs in the worker's own
process (workers/service.py, EngineService) or in a process of its own (workers/engine_process.py,
EngineProcess, the default)."""
from __future__ import annotations

from typing import Protocol

from llmq.model.tokenizer import Tokenizer
from workers.job import Job
from workers.messages import EngineRequest


class EngineClient(Protocol):
    tokenizer: Tokenizer

    def start(self) -> None:
        """Returns once the engine is loaded and warm; raises if loading failed."""

    def stop(self, timeout: float = 5.0) -> None: ...

    def run(self, request: EngineRequest, timeout: float | None = None) -> Job:
        """Generate, publishing tokens as they come; returns the finished job once every sample has
        ended. Raises InvalidRequest (the engine refuses it), HandedBack (this worker is stopping or
        another has taken the request over) or EngineFailure."""

    def cancel(self, request_id: str) -> None:
        """Abort at the engine's next step (unknown or finished ids are ignored)."""

    def hand_back(self, request_id: str | None = None) -> None:
        """End every request in flight (or just this one) with HandedBack."""

    def stats(self) -> dict:
        """The engine's load now and the loop's totals since the worker started."""

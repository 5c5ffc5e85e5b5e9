"""Work: a task as llmq sends it again (its name, its one argument, its broker priority), the unit that
the tenant intake parks (workers/tenant_intake.py) and a worker's held work records
(workers/held_work.py)."""
from __future__ import annotations

from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class Work:
    task: str
    arg: str | int
    priority: int = 0

    @property
    def key(self) -> str:
        """`task:arg`, the same for every delivery of one task."""
        return f"{self.task}:{self.arg}"

    def encode(self) -> bytes:
        return orjson.dumps([self.task, self.arg, self.priority])

    @classmethod
    def decode(cls, raw: bytes) -> "Work":
        task, arg, priority = orjson.loads(raw)
        return cls(task, arg, priority)

"""A prepared request through the engine: its token ids in, the OpenAI response object out."""
from __future__ import annotations

import time

from llmq.events import DoneEvent, StreamProgress, Usage
from llmq.protocol.prepare import PreparedRequest
from llmq.protocol.responses import response_object
from workers.engine_client import EngineClient
from workers.messages import EngineRequest, EngineResult


def execute(engine: EngineClient, request_id: str, prepared: PreparedRequest, model: str,
            created: int | None = None, resume_from: StreamProgress | None = None,
            priority: int = 0, tenant: str = "", weight: float = 1.0) -> tuple[dict, EngineResult]:
    """Run a request to the end (publishing its tokens as they come), going on from `resume_from` if
    an earlier run was interrupted. Raises InvalidRequest, HandedBack or EngineFailure."""
    result = engine.run(EngineRequest(request_id, prepared.prompt_token_ids, prepared.params, resume_from, priority,
                                      tenant, weight))
    spec = prepared.response_spec(request_id, model, created or int(time.time()))
    return response_object(spec, progress_of(result), engine.tokenizer.token_text), result


def progress_of(result: EngineResult) -> StreamProgress:
    """A finished result as the events of its stream join up: the answer is built the same way."""
    choices = {}
    for outputs in result.outputs:
        for output in outputs:
            choices[len(choices)] = output
    return StreamProgress(choices, DoneEvent(Usage(result.prompt_tokens, result.completion_tokens)))

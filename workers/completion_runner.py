"""One request row through the engine: body -> prompts and params -> EngineService -> response object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.streams import StreamProgress
from workers.engine.config import InvalidRequest, SamplingParams
from workers.model.tokenizer import Tokenizer, TokenizerError
from workers.openai_protocol import (chat_choice, completion_choice, completion_object,
                                     parse_chat_request, parse_completion_request, usage_object)
from workers.job import Job

if TYPE_CHECKING:
    from workers.engine_process import EngineProcess
    from workers.service import EngineService


@dataclass(frozen=True)
class PreparedRequest:
    prompts: list
    params: SamplingParams
    echo: bool = False


def prepare(kind: str, body: dict, tokenizer: Tokenizer) -> PreparedRequest:
    """Validate and turn a stored body into engine input. Raises InvalidRequest."""
    if kind == "chat":
        chat = parse_chat_request(body)
        try:
            rendered = tokenizer.apply_chat_template(chat.messages, add_generation_prompt=True)
        except TokenizerError as err:  # no template, or one that refuses these messages
            raise InvalidRequest(str(err), "messages") from None
        # Templates write their own BOS, as in transformers' apply_chat_template(tokenize=True).
        return PreparedRequest([tokenizer.encode(rendered, add_special_tokens=False)], chat.params)
    completion = parse_completion_request(body)
    return PreparedRequest(completion.prompts, completion.params, completion.echo)


def response_body(kind: str, completion_id: str, model: str, job: Job, prepared: PreparedRequest,
                  tokenizer: Tokenizer, created: int | None = None) -> dict:
    """The OpenAI completion (or chat.completion) object of a finished job."""
    usage = usage_object(job.prompt_tokens, job.completion_tokens)
    samples = [(k, output) for k, outputs in enumerate(job.outputs) for output in outputs]
    if kind == "chat":
        choices = [chat_choice(i, output, tokenizer.token_text) for i, (_, output) in enumerate(samples)]
        return completion_object(completion_id, model, choices, usage, created, object_type="chat.completion")
    echoes = [tokenizer.decode(ids) if prepared.echo else "" for ids in job.prompt_token_ids]
    choices = [completion_choice(i, output, tokenizer.token_text, echoes[k]) for i, (k, output) in enumerate(samples)]
    return completion_object(completion_id, model, choices, usage, created)


def execute(service: EngineService | EngineProcess, request_id: str, kind: str, body: dict, model: str,
            created: int | None = None, resume_from: StreamProgress | None = None,
            priority: int = 0) -> tuple[dict, Job]:
    """Run a request to the end (publishing its tokens as they come), going on from `resume_from` if
    an earlier run was interrupted. Raises InvalidRequest, or HandedBack if the worker is stopping."""
    tokenizer = service.tokenizer
    prepared = prepare(kind, body, tokenizer)
    job = service.run(request_id, prepared.prompts, prepared.params, resume_from=resume_from, priority=priority)
    return response_body(kind, request_id, model, job, prepared, tokenizer, created), job

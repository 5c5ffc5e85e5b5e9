"""One request preparation: an OpenAI body becomes a PreparedRequest once, at intake (the web's, or a
batch file's expansion, or the offline runner's), and is stored with its row. The worker hands its
token ids to the engine and builds the answer from its response spec; nothing parses the body again.

Preparation refuses what the engine would surely refuse later, in the same words (llmq/limits.py):
a prompt and its max_tokens that do not fit the model's context, a token id outside its vocabulary,
more samples than the server runs at once. The engine's own context can be shorter still (a small
KV cache); it says so in the request's error event.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from llmq.errors import InvalidRequest
from llmq.limits import check_fits, check_request_size, check_samples, check_token_ids
from llmq.model.model_config import ModelConfig
from llmq.model.tokenizer import Tokenizer, TokenizerError
from llmq.protocol.openai import parse_chat_request, parse_completion_request
from llmq.protocol.responses import ResponseSpec
from llmq.sampling_params import SamplingParams
from llmq.settings import Settings

COMPLETION, CHAT = "completion", "chat"


@dataclass(frozen=True)
class ServedModel:
    """What a request is prepared for: the served model's name, context and vocabulary, and how many
    sequences the server's engine runs at once."""

    name: str
    context_len: int
    vocab_size: int
    max_num_seqs: int

    @classmethod
    def of(cls, name: str, config: ModelConfig, max_num_seqs: int) -> "ServedModel":
        context = min(config.max_position_embeddings, config.sliding_window or config.max_position_embeddings)
        return cls(name, context, config.vocab_size, max_num_seqs)

    @classmethod
    def of_settings(cls, settings: Settings) -> "ServedModel":
        """The model bootstrapped settings serve, as the web and the workers both prepare for it."""
        return cls.of(settings.resolved_model_name(), ModelConfig.from_folder(settings.model_path),
                      settings.max_num_seqs)


@dataclass(frozen=True)
class PreparedRequest:
    """A validated completion or chat request, as the engine and the answer need it."""

    kind: str  # COMPLETION | CHAT
    prompt_token_ids: tuple[tuple[int, ...], ...]
    params: SamplingParams
    echo_prefixes: tuple[str, ...] = ()  # per prompt, its decoded text, when a completion asks for echo
    stream: bool = False
    include_usage: bool = False

    @property
    def num_choices(self) -> int:
        return len(self.prompt_token_ids) * self.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)

    @property
    def num_requested_tokens(self) -> int:
        """What the request may use: its prompt tokens and every choice's max_tokens."""
        return self.num_prompt_tokens + self.params.max_tokens * self.num_choices

    def check_size(self, max_choices: int, max_tokens: int) -> None:
        """Raises InvalidRequest (request_too_large) past either limit (0: none)."""
        check_request_size(self.num_choices, self.num_requested_tokens, max_choices, max_tokens)

    def response_spec(self, request_id: str, model: str, created: int) -> ResponseSpec:
        return ResponseSpec(id=request_id, kind=self.kind, model=model, created=created,
                            num_choices=self.num_choices, n=self.params.n, logprobs=self.params.logprobs is not None,
                            echo_prefixes=self.echo_prefixes, include_usage=self.include_usage)

    def to_json(self) -> dict:
        """As stored with its row (a JSON column)."""
        return {"kind": self.kind, "prompt_token_ids": [list(ids) for ids in self.prompt_token_ids],
                "params": asdict(self.params), "echo_prefixes": list(self.echo_prefixes),
                "stream": self.stream, "include_usage": self.include_usage}

    @classmethod
    def from_json(cls, obj: dict) -> "PreparedRequest":
        return cls(kind=obj["kind"], prompt_token_ids=tuple(tuple(ids) for ids in obj["prompt_token_ids"]),
                   params=SamplingParams(**obj["params"]), echo_prefixes=tuple(obj.get("echo_prefixes", ())),
                   stream=obj.get("stream", False), include_usage=obj.get("include_usage", False))


def prepare(kind: str, body: dict, tokenizer: Tokenizer, model: ServedModel) -> PreparedRequest:
    """Validate a /v1/completions (kind COMPLETION) or /v1/chat/completions (CHAT) body and turn it into
    the engine's input. Raises InvalidRequest naming the field."""
    if kind == CHAT:
        chat = parse_chat_request(body)
        params, stream, include_usage = chat.params, chat.stream, chat.include_usage
        prompts, echo = [chat_prompt_ids(tokenizer, chat.messages, model)], False
    else:
        completion = parse_completion_request(body)
        params, stream, include_usage, echo = (completion.params, completion.stream, completion.include_usage,
                                               completion.echo)
        prompts = [_encode(tokenizer, p, model, "prompt") if isinstance(p, str) else p for p in completion.prompts]
    check_samples(params.n, model.max_num_seqs)
    for ids in prompts:
        check_token_ids(ids, model.vocab_size)
        check_fits(len(ids), params.max_tokens, model.context_len)
    return PreparedRequest(kind, tuple(tuple(ids) for ids in prompts), params,
                           tuple(tokenizer.decode(ids) for ids in prompts) if echo else (), stream, include_usage)


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], model: ServedModel) -> list[int]:
    """The rendered chat prompt's token ids. Templates write their own BOS, as in transformers'
    apply_chat_template(tokenize=True)."""
    if tokenizer.chat_template is None:
        raise InvalidRequest(f"model {model.name} has no chat template, so it cannot serve /v1/chat/completions; use "
                             "/v1/completions with a plain prompt, or serve a model whose tokenizer_config.json "
                             "(or chat_template.jinja) has a chat_template", "model", code="no_chat_template")
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except TokenizerError as err:  # e.g. the template raises on a role order it does not support
        raise InvalidRequest(f"the model's chat template rejected the messages: {err}", "messages") from None
    return _encode(tokenizer, rendered, model, "messages", add_special_tokens=False)


def _encode(tokenizer: Tokenizer, text: str, model: ServedModel, param: str, add_special_tokens: bool = True) -> list[int]:
    """The text's token ids; a text too long for the context whatever its tokens (more characters than
    the context's tokens can spell) is refused before it is encoded, which would cost a 10 MB prompt
    seconds of the web's CPU."""
    limit = model.context_len * tokenizer.max_token_chars
    if len(text) > limit:
        raise InvalidRequest(f"{param} is {len(text)} characters, more than this model's context of "
                             f"{model.context_len} tokens can hold (at most {limit})", param)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)

"""One request preparation (llmq/protocol/prepare.py): a body becomes token ids, sampling parameters
and what the answer needs, checked against the served model, and round-trips through its row."""
from __future__ import annotations

import pytest

from llmq.errors import InvalidRequest
from llmq.model.model_config import ModelConfig
from llmq.model.tokenizer import Tokenizer
from llmq.protocol.prepare import CHAT, COMPLETION, PreparedRequest, ServedModel, prepare
from llmq.sampling_params import SamplingParams
from tests.conftest import STORIES_DIR

TOKENIZER = Tokenizer.from_folder(STORIES_DIR)
MODEL = ServedModel.of("stories", ModelConfig.from_folder(STORIES_DIR), max_num_seqs=4)


def test_a_completion_becomes_token_ids_and_params_once():
    prepared = prepare(COMPLETION, {"prompt": ["Once upon a time", [1, 2, 3]], "max_tokens": 5, "n": 2,
                                    "temperature": 0, "echo": True, "stream": True,
                                    "stream_options": {"include_usage": True}}, TOKENIZER, MODEL)
    assert prepared.prompt_token_ids == (tuple(TOKENIZER.encode("Once upon a time")), (1, 2, 3))
    assert prepared.params == SamplingParams(n=2, temperature=0, max_tokens=5)
    assert prepared.echo_prefixes == (TOKENIZER.decode(TOKENIZER.encode("Once upon a time")), TOKENIZER.decode([1, 2, 3]))
    assert (prepared.stream, prepared.include_usage, prepared.num_choices) == (True, True, 4)
    spec = prepared.response_spec("cmpl-1", "stories", 100)
    assert (spec.num_choices, spec.n, spec.prefix(3), spec.logprobs) == (4, 2, prepared.echo_prefixes[1], False)


def test_it_round_trips_through_its_row():
    prepared = prepare(COMPLETION, {"prompt": "Hi", "stop": ["\n"], "stop_token_ids": [2], "logprobs": 2,
                                    "seed": 7}, TOKENIZER, MODEL)
    assert PreparedRequest.from_json(prepared.to_json()) == prepared


def test_a_chat_is_rendered_by_its_template_without_a_second_bos():
    tokenizer = Tokenizer.from_folder(STORIES_DIR)
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    prepared = prepare(CHAT, {"messages": [{"role": "user", "content": "Once"}]}, tokenizer, MODEL)
    assert prepared.prompt_token_ids == (tuple(tokenizer.encode("<s>Once", add_special_tokens=False)),)
    assert prepared.kind == CHAT and prepared.echo_prefixes == ()


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": "x", "max_tokens": 600}, "max_tokens", "invalid_request"),  # beyond the 512-token context
    ({"prompt": [1, 9999]}, "prompt", "invalid_request"),  # outside the vocabulary
    ({"prompt": "x", "n": 5}, "n", "invalid_request"),  # more than the server's 4 sequences
])
def test_what_the_engine_would_refuse_is_refused_at_intake(body, param, code):
    with pytest.raises(InvalidRequest) as refused:
        prepare(COMPLETION, body, TOKENIZER, MODEL)
    assert (refused.value.param, refused.value.code) == (param, code)


def test_a_model_without_a_chat_template_says_so():
    with pytest.raises(InvalidRequest) as refused:
        prepare(CHAT, {"messages": [{"role": "user", "content": "hi"}]}, TOKENIZER, MODEL)
    assert (refused.value.param, refused.value.code) == ("model", "no_chat_template")
    assert "model stories has no chat template" in str(refused.value)


def test_a_prompt_longer_than_any_context_is_refused_before_it_is_encoded():
    limit = MODEL.context_len * TOKENIZER.max_token_chars
    assert TOKENIZER.max_token_chars >= max(len(TOKENIZER.token_text(i)) for i in range(TOKENIZER.vocab_size))
    with pytest.raises(InvalidRequest) as refused:
        prepare(COMPLETION, {"prompt": "a" * (limit + 1)}, TOKENIZER, MODEL)
    assert refused.value.param == "prompt" and f"{limit + 1} characters" in str(refused.value)
    with pytest.raises(InvalidRequest) as refused:  # at the bound it is encoded, and refused for its tokens
        prepare(COMPLETION, {"prompt": "a" * limit}, TOKENIZER, MODEL)
    assert refused.value.param == "prompt" and "tokens" in str(refused.value)
    assert "characters" not in str(refused.value)


def test_a_requests_size_is_its_choices_and_the_tokens_it_may_use():
    prepared = prepare(COMPLETION, {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 10}, TOKENIZER, MODEL)
    assert (prepared.num_choices, prepared.num_requested_tokens) == (4, 5 + 10 * 4)
    prepared.check_size(4, 45)  # exactly at both limits
    prepared.check_size(0, 0)  # none
    for limits, param in (((3, 0), "n"), ((0, 44), "max_tokens")):
        with pytest.raises(InvalidRequest) as refused:
            prepared.check_size(*limits)
        assert (refused.value.param, refused.value.code) == (param, "request_too_large")

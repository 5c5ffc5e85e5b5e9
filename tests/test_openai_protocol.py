"""The OpenAI request/response shapes: parsing is exact and every refusal names its field."""
import json

import pytest

from llmq.errors import InvalidRequest
from llmq.protocol.openai import (
    BadJSON,
    BatchLineError,
    batch_error_line,
    batch_output_line,
    jsonl_lines,
    loads,
    parse_batch_line,
    parse_chat_request,
    parse_completion_request,
)


def test_defaults_follow_openai():
    request = parse_completion_request({"model": "m", "prompt": "hi"})
    assert request.prompts == ["hi"]
    assert request.params.max_tokens == 16 and request.params.temperature == 1.0 and request.params.n == 1
    assert not request.stream and not request.echo and request.params.logprobs is None


@pytest.mark.parametrize("prompt, expected", [
    ("a", ["a"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    (["a", [5, 6]], ["a", [5, 6]]),
])
def test_prompt_forms(prompt, expected):
    assert parse_completion_request({"prompt": prompt}).prompts == expected


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": {"x": 1}}, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "a", "temperature": -0.5}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "logprobs": 50}, "logprobs"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "model": 7}, "model"),
    # Found by the OpenAPI fuzz test: these were accepted (a list counted as include_usage: true).
    ({"prompt": "a", "user": 5}, "user"),
    ({"prompt": "a", "stream_options": {"include_usage": [1]}}, "stream_options.include_usage"),
    # Found by the OpenAPI fuzz test: any of 0, {} and "" passed as neutral for every unsupported field.
    ({"prompt": "a", "suffix": {}}, "suffix"),
    ({"prompt": "a", "logit_bias": ""}, "logit_bias"),
    ({"prompt": "a", "presence_penalty": False}, "presence_penalty"),
    ({"prompt": "a", "stream_options": False}, "stream_options"),  # was read as no options
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(InvalidRequest) as err:
        parse_completion_request(body)
    assert err.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "user": True}, "user"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": {}}, "top_logprobs"),  # ignored without logprobs
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    # A text part's text was passed through str(): {} became the text "{}".
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    # max_completion_tokens wins, and max_tokens beside it went unchecked.
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "max_tokens": "x"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
])
def test_bad_chat_envelope_fields_are_named(body, param):
    with pytest.raises(InvalidRequest) as err:
        parse_chat_request(body)
    assert err.value.param == param


def test_unsupported_fields_at_their_neutral_value_are_accepted():
    body = {"prompt": "a", "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}, "suffix": ""}
    assert parse_completion_request(body).prompts == ["a"]


def test_chat_text_parts_are_joined():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert parse_chat_request(body).messages == [{"role": "user", "content": "ab"}]


def test_extensions_and_stream_options():
    request = parse_completion_request({"prompt": "a", "top_k": 5, "ignore_eos": True, "stop": "x", "stream": True,
                                        "stream_options": {"include_usage": True}, "seed": 3})
    assert request.params.top_k == 5 and request.params.ignore_eos and request.params.stop == ("x",)
    assert request.stream and request.include_usage and request.params.seed == 3


def test_batch_line_parsing_and_errors():
    good = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
    line = parse_batch_line(good, 3)
    assert (line.custom_id, line.line, line.body) == ("a", 3, {"prompt": "x"})
    cases = [("{not json", "invalid_json", None),
             ('["a"]', "invalid_request", None),
             ('{"method": "POST", "url": "/v1/completions", "body": {}}', "missing_custom_id", None),
             ('{"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}', "invalid_method", "b"),
             ('{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {}}', "invalid_url", "c"),
             ('{"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": "x"}', "invalid_body", "d")]
    for text, code, custom_id in cases:
        with pytest.raises(BatchLineError) as err:
            parse_batch_line(text, 7)
        assert (err.value.code, err.value.line, err.value.custom_id) == (code, 7, custom_id)
        assert "line 7" in str(err.value)


def test_batch_output_and_error_line_shapes():
    out = batch_output_line("x", {"id": "cmpl-1", "object": "text_completion"})
    assert out["custom_id"] == "x" and out["error"] is None and out["id"].startswith("batch_req_")
    assert out["response"] == {"status_code": 200, "request_id": "cmpl-1",
                               "body": {"id": "cmpl-1", "object": "text_completion"}}
    err = batch_error_line("y", "invalid_request", "bad", line=4)
    assert err["response"] is None and err["error"] == {"code": "invalid_request", "message": "bad", "line": 4}


# ---- JSON in: what Python's parser takes and a client's document must not hold -------------------

@pytest.mark.parametrize("text, says", [
    ('{"temperature": NaN}', "NaN"), ('{"temperature": Infinity}', "Infinity"), ('{"t": -Infinity}', "-Infinity"),
    ('{"temperature": 1e309}', "too large"), ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ', "Expecting value"),
])
def test_loads_refuses_what_is_not_json_or_breaks_the_parser(text, says):
    with pytest.raises(BadJSON, match=says):
        loads(text)


def test_loads_takes_ordinary_json():
    assert loads('{"temperature": 0.5, "n": 2, "stop": ["\\u2028"]}') == {"temperature": 0.5, "n": 2, "stop": ["\u2028"]}


def test_jsonl_lines_end_at_newlines_only():
    prompt = "a\u2028b\u2029c\u0085d\x1ce\x0bf"  # legal, unescaped, inside a JSON string
    lines = [json.dumps({"custom_id": "x", "prompt": prompt}, ensure_ascii=False), "", "  ", '{"custom_id": "y"}\r']
    numbered = jsonl_lines("\n".join(lines) + "\n")
    assert [n for n, _ in numbered] == [1, 4]
    assert json.loads(numbered[0][1])["prompt"] == prompt and numbered[1][1] == '{"custom_id": "y"}'


def test_a_deeply_nested_batch_line_is_one_error_line():
    with pytest.raises(BatchLineError) as refused:
        parse_batch_line('{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}", 7)
    assert (refused.value.code, refused.value.line) == ("invalid_json", 7)
    assert "nested too deeply" in str(refused.value)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": ["fine", "\udfff"]}, "prompt"),
    ({"prompt": "x", "stop": ["\ud800"]}, "stop"),
])
def test_a_lone_surrogate_is_refused_naming_its_field(body, param):
    with pytest.raises(InvalidRequest) as refused:
        parse_completion_request({"model": "m", **body})
    assert refused.value.param == param and "lone surrogate" in str(refused.value)


@pytest.mark.parametrize("message, param", [({"role": "user", "content": "\ud800"}, "messages[0].content"),
                                            ({"role": "us\udc00er", "content": "hi"}, "messages[0].role")])
def test_a_lone_surrogate_in_a_message_is_refused_naming_it(message, param):
    with pytest.raises(InvalidRequest) as refused:
        parse_chat_request({"model": "m", "messages": [message]})
    assert refused.value.param == param


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -float("inf")])
def test_sampling_numbers_must_be_finite_however_they_arrive(field, value):
    with pytest.raises(InvalidRequest) as refused:
        parse_completion_request({"model": "m", "prompt": "hi", field: value})
    assert refused.value.param == field

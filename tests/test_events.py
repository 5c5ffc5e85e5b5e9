"""The stream events' one codec and one accumulator (llmq/events.py), exactly."""
from __future__ import annotations

import orjson
import pytest

from llmq import events
from llmq.events import DeltaEvent, DoneEvent, ErrorEvent, StreamProgress, Usage, accumulate
from llmq.outputs import TokenLogprob

DELTA = DeltaEvent(3, " once", (17, 18), (TokenLogprob(17, -0.25, ((17, -0.25), (9, -1.5))),
                                          TokenLogprob(18, -0.5, ())), None, 12.5)


def test_each_event_is_the_json_object_the_readme_documents():
    assert orjson.loads(events.encode(DELTA)) == {
        "type": "delta", "index": 3, "text": " once", "token_ids": [17, 18],
        "logprobs": [{"token_id": 17, "logprob": -0.25, "top": [[17, -0.25], [9, -1.5]]},
                     {"token_id": 18, "logprob": -0.5, "top": []}],
        "finish_reason": None, "t": 12.5}
    assert orjson.loads(events.encode(DoneEvent(Usage(4, 6), 1.0))) == {
        "type": "done", "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}, "t": 1.0}
    assert orjson.loads(events.encode(ErrorEvent("invalid_request", "too long", "max_tokens", 2.0))) == {
        "type": "error", "error": {"code": "invalid_request", "message": "too long", "param": "max_tokens"}, "t": 2.0}


@pytest.mark.parametrize("event", [DELTA, DeltaEvent(0, "", (), None, "stop"), DoneEvent(Usage(1, 2), 3.0),
                                   ErrorEvent("cancelled", "gone", None, 4.0)])
def test_decode_gives_back_what_was_encoded(event):
    assert events.decode(events.encode(event)) == event


def test_a_reader_of_plain_json_is_refused_what_is_not_an_event():
    with pytest.raises(ValueError, match="not an llmq stream event"):
        events.from_dict({"type": "token"})


def test_the_accumulator_joins_each_choice_and_keeps_the_end():
    progress = accumulate([
        DeltaEvent(1, "Tom", (5,)),
        DeltaEvent(0, " was", (6,), (TokenLogprob(6, -0.1),)),
        DeltaEvent(0, " happy", (7,), (TokenLogprob(7, -0.2),), "stop"),
        DeltaEvent(1, " ran", (8,), None, "length"),
        DoneEvent(Usage(4, 4)),
    ])
    assert sorted(progress.choices) == [0, 1]
    first, second = progress.choices[0], progress.choices[1]
    assert (first.text, first.token_ids, first.finish_reason) == (" was happy", [6, 7], "stop")
    assert [lp.token_id for lp in first.logprobs] == [6, 7] and second.logprobs is None
    assert (second.text, second.token_ids, second.finish_reason) == ("Tom ran", [5, 8], "length")
    assert progress.usage == Usage(4, 4) and progress.error is None
    assert progress.num_events == 5 and progress.num_tokens == 4


def test_numbered_events_set_the_position_a_resumed_run_writes_after():
    progress = StreamProgress()
    progress.add(DeltaEvent(0, "a", (1,)), number=7)
    progress.add(ErrorEvent("server_error", "broke"), number=8)
    assert progress.num_events == 8 and progress.error.code == "server_error" and progress.usage is None

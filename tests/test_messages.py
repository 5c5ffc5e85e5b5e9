"""What crosses the engine process's pipe (workers/messages.py) pickles whole, errors included, and
the statuses are the strings the API and the database hold."""
from __future__ import annotations

import pickle

import pytest

from llmq.errors import InvalidRequest
from llmq.events import DeltaEvent, StreamProgress
from llmq.outputs import CompletionOutput
from llmq.sampling_params import SamplingParams
from llmq.store.models import (
    TERMINAL_ITEM_STATES,
    TERMINAL_REQUEST_STATES,
    UNFINISHED_ITEM_STATES,
    BatchStatus,
    ItemStatus,
    RequestStatus,
)
from workers.messages import EngineFailure, EngineRequest, EngineResult, Finished, HandedBack, Run


@pytest.mark.parametrize("error", [InvalidRequest("too long", "max_tokens"),
                                   InvalidRequest("no template", "model", code="no_chat_template"),
                                   EngineFailure("the device fell over"), HandedBack("stopping")])
def test_errors_cross_the_pipe_as_the_same_type_with_their_fields(error):
    back = pickle.loads(pickle.dumps(Finished(3, None, error))).error
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "param", None) == getattr(error, "param", None)
    assert getattr(back, "code", None) == getattr(error, "code", None)


def test_a_request_and_a_result_cross_as_they_are():
    progress = StreamProgress()
    progress.add(DeltaEvent(0, "Once", (5,)), number=1)
    request = EngineRequest("r1", [[1, 2], [3]], SamplingParams(n=2, seed=1), progress, priority=1)
    assert request.prompts == ((1, 2), (3,))  # immutable however it was given
    assert pickle.loads(pickle.dumps(Run(7, request))) == Run(7, request)
    result = EngineResult(((CompletionOutput(0, "a", [4], None, "stop"), CompletionOutput(1, "", [], None, "abort")),),
                          ((1, 2),), 5.0)
    assert (result.prompt_tokens, result.completion_tokens, result.cancelled) == (2, 1, True)
    assert pickle.loads(pickle.dumps(result)) == result


def test_statuses_and_which_are_terminal():
    assert [s.value for s in RequestStatus] == ["queued", "running", "completed", "failed", "cancelled"]
    assert [s.value for s in ItemStatus] == ["pending", "running", "completed", "failed", "cancelled"]
    assert [s for s in BatchStatus if s.terminal] == [BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED,
                                                      BatchStatus.CANCELLED]
    assert TERMINAL_REQUEST_STATES == ("completed", "failed", "cancelled") == TERMINAL_ITEM_STATES
    assert UNFINISHED_ITEM_STATES == ("pending", "running")

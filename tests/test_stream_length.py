"""A request's stream holds every event it made, however small LLMQ_STREAM_MAXLEN: the engine
service sizes each stream's cap from its request (n choices x max_tokens), so a replay from the start
(or an Idempotency-Key retry) gives back the whole answer."""
from __future__ import annotations

from llmq.engine.config import EngineConfig
from llmq.events import stream_key
from llmq.sampling_params import SamplingParams
from llmq.streams import read_progress
from workers.messages import EngineRequest
from workers.publisher import StreamPublisher
from workers.service import EngineService, load_and_warm


def test_a_request_with_more_events_than_the_cap_keeps_them_all(stories_dir, redis_db):
    # 4 choices x 60 tokens: 241 events, past a cap of 5 by more than one of Redis's 100-entry nodes.
    service = EngineService(lambda: load_and_warm(EngineConfig(str(stories_dir), dtype="float32", max_num_seqs=8)),
                            StreamPublisher(redis_db, maxlen=5, ttl=60))
    service.start()
    try:
        params = SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=60, ignore_eos=True)
        result = service.run(EngineRequest("many", [service.tokenizer.encode("Once upon a time")], params))
    finally:
        service.stop()
    progress = read_progress(redis_db, "many")
    assert redis_db.xlen(stream_key("many")) == progress.num_events == 4 * 60 + 1
    assert [progress.choices[i].token_ids for i in range(4)] == [o.token_ids for o in result.outputs[0]]
    assert progress.usage is not None and progress.usage.completion_tokens == 240

"""Fair share between tenants, with real processes: one tenant floods a worker with API requests (the
same priority as the other's), and the other tenant's small completion is still served at once: it
finds a thread (the flood's excess is parked, workers/tenant_intake.py) and a slot in the engine
(the flood's newest sequence gives way, llmq/engine/scheduler.py). First come first served, it would
wait for the flood's requests queued before it."""
from __future__ import annotations

import threading

import httpx
import pytest

from llmq.model.checkpoint import byte_level_tokenizer_json, default_tokenizer_config, write_llama_checkpoint
from stack.local import LocalStack
from tests.service.conftest import MODEL_NAME, SERVED_MODEL_CONFIG, wait_until

SLOTS = 8  # LLMQ_MAX_NUM_SEQS: the engine runs 8 sequences; a worker has 16 threads, 8 a tenant
FLOOD = 24  # A's requests, 2 samples each: 6 waves of the engine, 16 of them parked at first
# Each wave of the flood must outlast a few heartbeats (which report the state the test waits for) on
# however fast a machine: the served model's context is too short for that, so this module serves the
# same model with a longer one, and the flood's requests are long.
CONTEXT = 2048
FLOOD_TOKENS = 1500


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("models") / MODEL_NAME,
                                  {**SERVED_MODEL_CONFIG, "max_position_embeddings": CONTEXT}, seed=0,
                                  tokenizer_json=byte_level_tokenizer_json(),
                                  tokenizer_config={**default_tokenizer_config(), "model_max_length": CONTEXT})


@pytest.fixture(scope="module")
def tenants_stack(long_context_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("fair-home")
    env = {"LLMQ_HOME": str(home), "DATABASE_URL": f"sqlite:///{home / 'llmq.db'}",
           "MODEL_PATH": str(long_context_model_dir),
           "MODEL_NAME": MODEL_NAME, "LLMQ_MAX_NUM_SEQS": str(SLOTS), "LLMQ_HEARTBEAT_SECONDS": "1"}
    with LocalStack(env, start_redis=True, log_dir=home) as stack:
        yield stack, stack.key_headers("flood", "small")


def test_a_small_tenant_is_served_while_another_floods_the_worker(tenants_stack):
    stack, headers = tenants_stack
    done: list[int] = []
    statuses: list[int] = []

    def flood_request(client: httpx.Client) -> None:
        response = client.post("/v1/completions", headers=headers["flood"], json={
            "model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": FLOOD_TOKENS, "n": 2, "temperature": 0,
            "ignore_eos": True})
        statuses.append(response.status_code)
        done.append(1)

    with httpx.Client(base_url=stack.base_url, timeout=300) as client:
        senders = [threading.Thread(target=flood_request, args=(client,), daemon=True) for _ in range(FLOOD)]
        for sender in senders:
            sender.start()

        def flood_holds_its_share():
            workers = client.get("/v1/workers", headers=headers["flood"]).json()["data"]
            return workers and workers[0]["tenant_threads"] == SLOTS and workers[0]["running"] == SLOTS
        wait_until(flood_holds_its_share, timeout=120, interval=0.1)

        before = len(done)
        response = client.post("/v1/completions", headers=headers["small"], json={
            "model": MODEL_NAME, "prompt": "The little dog", "max_tokens": 4, "temperature": 0})
        during = len(done) - before
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        # First come first served, the small request would wait for the 16 flood requests queued before
        # it, SLOTS / 2 at a time in the engine; fairly, it runs beside the first of them.
        assert during < SLOTS // 2, f"{during} flood requests finished while the small one waited"
        assert before == 0, "the flood finished too fast for this test to tell anything"

        for sender in senders:
            sender.join(timeout=300)
    assert statuses == [200] * FLOOD  # parked and sent again, every one of the flood's requests is served

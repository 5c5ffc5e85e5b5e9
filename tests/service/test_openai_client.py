"""The official openai client, unchanged, against llmq: completions, streaming, chat, a whole batch."""
import io
import json

import openai
import pytest

from llmq.engine.llm import LLM
from llmq.model.tokenizer import Tokenizer
from llmq.sampling_params import SamplingParams
from tests.service.conftest import MODEL_NAME, wait_until


@pytest.fixture()
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="not-needed", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def greedy(served_model_dir):
    llm = LLM(str(served_model_dir), dtype="float32")
    return lambda prompt, n: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0].text


def test_models_and_completion(client, greedy, served_model_dir):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    completion = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=20, temperature=0)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == greedy("Once upon a time", 20)
    prompt_tokens = len(Tokenizer.from_folder(served_model_dir).encode("Once upon a time"))
    assert completion.usage.completion_tokens == 20 and completion.usage.prompt_tokens == prompt_tokens


def test_streaming_completion(client, greedy):
    stream = client.completions.create(model=MODEL_NAME, prompt="The little dog", max_tokens=25, temperature=0,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == greedy("The little dog", 25)


def test_chat_completion_and_stream(client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    text = chat.choices[0].message.content
    assert text and chat.usage.completion_tokens <= 20
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_errors_are_openai_errors(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_batch_lifecycle(client, greedy):
    prompts = ["Once upon a time", "The sun was", "Lily wanted to"]
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL_NAME, "prompt": p, "max_tokens": 16, "temperature": 0}})
             for i, p in enumerate(prompts)]
    uploaded = client.files.create(file=("batch.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.status in ("validating", "in_progress")
    done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b)
    assert done.status == "completed" and done.request_counts.completed == 3 and done.request_counts.failed == 0
    rows = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in rows} == \
        {f"c{i}": greedy(p, 16) for i, p in enumerate(prompts)}
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    assert client.files.delete(uploaded.id).deleted

"""LLMEngine / LLM end to end on the real stories260k Llama (CPU, float32).

No model output is typed in by hand: every expectation comes from a reference run of the same
engine code (greedy requests one at a time on an engine with prefix caching off and a roomy KV
cache), and the tests check that batching, preemption, prefix caching, chunked prefill, stop
conditions, n > 1, abort and the streaming interface all reproduce it exactly.

The model folder comes from tests/conftest.py's `stories_dir` (the test skips without it). Engines
are cheap to build (the model has 260K parameters); the reference and prefix-caching ones are built
once per module and shared; a test that leaves requests in flight on a shared engine would
poison later tests, so `drive` aborts its own requests when it fails.
"""
from __future__ import annotations

import itertools
import json
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmq.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from llmq.engine.llm import LLM, LLMEngine
from llmq.engine.sequence import Sequence
from llmq.errors import InvalidRequest
from llmq.outputs import CompletionOutput, RequestDelta, TokenLogprob
from llmq.sampling_params import SamplingParams

ROOMY_KV_BYTES = 4 << 20  # ~400 blocks of 8 tokens: everything in this file fits at once
BLOCK_SIZE = 8

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball. She wanted to play with it, but it was too high. "
         "Lily's mom said, \"Lily, let's go to the park.\" Lily was happy and ran to the swings. ")

# Mixed lengths: short prompts, and long ones made by repeating the story (about 100 to 300 tokens).
BATCH_PROMPTS = [
    "Once upon a time",
    STORY * 3 + "Then",
    "The cat sat on the mat. It was a sunny day and the cat was",
    STORY + "Tom had a big dog named Max.",
    "Tom and Sam were best friends.",
    STORY * 2 + "Lily's brother Ben",
    "One day, a little bird",
    STORY + STORY[:120],
    "Sara liked to draw. She drew a",
    STORY * 2 + "The sun was hot, so",
    "Max the dog",
    STORY * 3,
]
# Different lengths so that requests finish at different steps and the batch keeps changing.
BATCH_MAX_TOKENS = [40, 30, 48, 36, 44, 24, 40, 32, 48, 28, 40, 36]

SHARED_PREFIX_SUFFIXES = [
    "Tom had a big dog.",
    "The bird sang a song.",
    "Mom made a cake for Lily.",
    "Ben found a shiny stone",
    "It started to rain, so",
    "The little cat was sad because",
]

_request_ids = itertools.count()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


# ---- driving the streaming interface -------------------------------------------------------------


@dataclass
class Run:
    """What `drive` saw: the joined outputs and raw deltas per (request id, sample index)."""

    outputs: dict[tuple[str, int], CompletionOutput] = field(default_factory=dict)
    deltas: dict[tuple[str, int], list[RequestDelta]] = field(default_factory=lambda: defaultdict(list))
    seqs: dict[str, Sequence] = field(default_factory=dict)
    peak_used_blocks: int = 0
    steps: int = 0

    def output(self, request_id: str, index: int = 0) -> CompletionOutput:
        return self.outputs[(request_id, index)]


def used_blocks(engine: LLMEngine) -> int:
    stats = engine.stats()
    return stats["total_blocks"] - stats["free_blocks"]


def new_id(tag: str = "r") -> str:
    return f"{tag}-{next(_request_ids)}"


def submit(engine: LLMEngine, requests, run: Run | None = None, ids: list[str] | None = None) -> tuple[Run, list[str]]:
    """Adds [(prompt, params)] under fresh request ids, appended to `ids` as they are accepted."""
    run = run if run is not None else Run()
    ids = ids if ids is not None else []
    for prompt, params in requests:
        request_id = new_id()
        run.seqs[request_id] = engine.add_request(request_id, prompt, params)
        ids.append(request_id)
    return run, ids


def record(run: Run, deltas: list[RequestDelta]) -> None:
    for delta in deltas:
        key = (delta.request_id, delta.index)
        assert not (run.deltas[key] and run.deltas[key][-1].finished), f"delta after the finished one for {key}"
        run.deltas[key].append(delta)
        run.outputs.setdefault(key, CompletionOutput(delta.index)).add(delta)


def step_until_done(engine: LLMEngine, run: Run, max_steps: int = 5000) -> Run:
    while engine.has_unfinished():
        record(run, engine.step())
        run.steps += 1
        run.peak_used_blocks = max(run.peak_used_blocks, used_blocks(engine))
        assert run.steps < max_steps, f"no end after {max_steps} steps: {engine.stats()}"
    return run


def drive(engine: LLMEngine, requests, max_steps: int = 5000) -> tuple[Run, list[str]]:
    """Submits [(prompt, params)] together and steps the engine until all are finished. Checks the
    streaming contract on the way: one finished delta per sample, and it is the sample's last."""
    assert not engine.has_unfinished(), "a previous test left requests in flight on this engine"
    run, ids = Run(), []
    try:
        submit(engine, requests, run, ids)
        step_until_done(engine, run, max_steps)
    except BaseException:
        try:  # leave a shared engine clean for the next test, if it still can be
            for request_id in ids:
                engine.abort(request_id)
            engine.step()
        except Exception:
            pass
        raise
    for request_id, (_, params) in zip(ids, requests):
        for index in range(params.n):
            stream = run.deltas[(request_id, index)]
            assert sum(d.finished for d in stream) == 1 and stream[-1].finished, (request_id, index)
    return run, ids


def drive_one(engine: LLMEngine, prompt, params: SamplingParams) -> CompletionOutput:
    run, (request_id,) = drive(engine, [(prompt, params)])
    return run.output(request_id)


# ---- engines ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_config(stories_dir) -> dict:
    return json.loads((stories_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def block_bytes(model_config) -> int:
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"]
    return 2 * model_config["num_hidden_layers"] * BLOCK_SIZE * model_config["num_key_value_heads"] * head_dim * 4


_SCHEDULING: dict = {}  # the engine option `scheduling` sets for the pass of the module under way


@pytest.fixture(scope="module", autouse=True, params=[False, True], ids=["sync", "async"])
def scheduling(request) -> bool:
    """Every test here runs twice: with the plain loop, and with async scheduling (step n+1 launched
    before step n's tokens are read, and its pending tokens read on the device). The engine fixtures
    depend on this one, so each pass builds its own."""
    _SCHEDULING["async_scheduling"] = request.param
    yield request.param
    _SCHEDULING.clear()


def make_llm(folder: Path, **options) -> LLM:
    # One intra-op thread: for a model this small, more threads only add synchronisation, and on a
    # busy 2-core machine OpenMP's spinning makes a step ten times slower.
    options = {"kv_cache_bytes": ROOMY_KV_BYTES, "block_size": BLOCK_SIZE, "num_threads": 1, "dtype": "float32",
               **_SCHEDULING, **options}
    llm = LLM(str(folder), **options)
    assert llm.engine.async_scheduling is options["async_scheduling"]
    return llm


@pytest.fixture(scope="module")
def reference(stories_dir, scheduling) -> LLMEngine:
    """The reference: prefix caching off, room for everything. Used for one-request-at-a-time runs."""
    return make_llm(stories_dir, enable_prefix_caching=False).engine


@pytest.fixture(scope="module")
def cached(stories_dir, scheduling) -> LLMEngine:
    return make_llm(stories_dir, enable_prefix_caching=True).engine


@pytest.fixture(scope="module")
def tokenizer(reference):
    return reference.tokenizer


@pytest.fixture(scope="module")
def batch_prompt_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(p) for p in BATCH_PROMPTS]
    lengths = sorted(len(i) for i in ids)
    assert lengths[0] < 10 and lengths[-1] > 250 and sum(n > 100 for n in lengths) >= 4, lengths
    return ids


@pytest.fixture(scope="module")
def batch_requests() -> list[tuple[str, SamplingParams]]:
    return [(p, greedy(m)) for p, m in zip(BATCH_PROMPTS, BATCH_MAX_TOKENS)]


@pytest.fixture(scope="module")
def batch_expected(reference, batch_requests) -> list[list[int]]:
    """Greedy token ids of each batch prompt generated alone (separate generate calls)."""
    expected = []
    for prompt, params in batch_requests:
        output = drive_one(reference, prompt, params)
        assert output.finish_reason == "length" and len(output.token_ids) == params.max_tokens
        expected.append(output.token_ids)
    return expected


@pytest.fixture(scope="module")
def shared_prefix_requests(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    """Token-id prompts sharing the story's 99-ish tokens exactly, then each its own ending."""
    prefix = tokenizer.encode(STORY)
    assert len(prefix) >= 64
    return [(prefix + tokenizer.encode(s, add_special_tokens=False), greedy(24 + 4 * i))
            for i, s in enumerate(SHARED_PREFIX_SUFFIXES)]


@pytest.fixture(scope="module")
def shared_prefix_expected(reference, shared_prefix_requests) -> list[list[int]]:
    return [drive_one(reference, prompt, params).token_ids for prompt, params in shared_prefix_requests]


def tokens_by_request(run: Run, ids: list[str]) -> list[list[int]]:
    return [run.output(i).token_ids for i in ids]


def first_mismatch(got: list[list[int]], want: list[list[int]]) -> str:
    for n, (g, w) in enumerate(zip(got, want)):
        if g != w:
            at = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            return f"request {n}: first difference at output token {at}: got {g[at:at + 5]}, want {w[at:at + 5]}"
    return "equal"


# ---- batch invariance ---------------------------------------------------------------------------


@pytest.mark.parametrize("engine_name", ["reference", "cached"])
def test_continuous_batching_matches_one_at_a_time(request, engine_name, batch_requests, batch_expected):
    engine = request.getfixturevalue(engine_name)
    run, ids = drive(engine, batch_requests)
    got = tokens_by_request(run, ids)
    assert got == batch_expected, first_mismatch(got, batch_expected)
    assert all(run.output(i).finish_reason == "length" for i in ids)
    # It really was batched: far fewer steps than running the requests back to back.
    assert run.steps < sum(params.max_tokens for _, params in batch_requests) / 2


def test_the_kv_cache_takes_kv_cache_bytes_else_the_cpu_default(stories_dir, model_config, block_bytes):
    given = make_llm(stories_dir, kv_cache_bytes=10 * block_bytes + 1).engine
    assert given.block_manager.num_blocks == 10
    # Not given: DEFAULT_CPU_KV_CACHE_BYTES, capped at what max_num_seqs full-length sequences can use.
    default = make_llm(stories_dir, kv_cache_bytes=None, max_num_seqs=4).engine
    full_length = -(-model_config["max_position_embeddings"] // BLOCK_SIZE)
    assert default.block_manager.num_blocks == min(4 * full_length, DEFAULT_CPU_KV_CACHE_BYTES // block_bytes)
    with pytest.raises(ValueError, match="kv_cache_bytes must be a positive integer"):
        EngineConfig(model=str(stories_dir), kv_cache_bytes=0)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_preemption_under_a_tiny_kv_cache_keeps_greedy_outputs(stories_dir, block_bytes, batch_prompt_ids,
                                                               batch_requests, batch_expected, prefix_caching):
    need = [-(-(len(ids) + params.max_tokens) // BLOCK_SIZE) for ids, (_, params) in zip(batch_prompt_ids, batch_requests)]
    num_blocks = max(need) + 3  # any one request fits on its own ...
    assert sum(need) > 2 * num_blocks  # ... but far from all of them at once
    engine = make_llm(stories_dir, kv_cache_bytes=num_blocks * block_bytes,
                      enable_prefix_caching=prefix_caching).engine
    assert engine.stats()["total_blocks"] == num_blocks

    run, ids = drive(engine, batch_requests)
    got = tokens_by_request(run, ids)
    assert got == batch_expected, first_mismatch(got, batch_expected)
    assert any(run.seqs[i].num_preemptions > 0 for i in ids), "the KV budget never forced a preemption"
    assert run.peak_used_blocks <= num_blocks
    assert engine.stats()["free_blocks"] == num_blocks
    # Each request's text still streams whole: the joined deltas equal the text of its tokens alone.
    for i in ids:
        assert "".join(d.text for d in run.deltas[(i, 0)]) == run.output(i).text


def test_preemption_keeps_seeded_sampling_reproducible(stories_dir, block_bytes, reference, batch_requests):
    """A preempted sampled request is recomputed, and its generator carries on where it stopped."""
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=321, max_tokens=48)
    alone = drive_one(reference, STORY * 2, sampled).token_ids
    engine = make_llm(stories_dir, kv_cache_bytes=48 * block_bytes).engine
    requests = [(STORY * 2, sampled)] + [(p, SamplingParams(temperature=1.0, seed=n, max_tokens=params.max_tokens))
                                         for n, (p, params) in enumerate(batch_requests)]
    run, ids = drive(engine, requests)
    assert any(run.seqs[i].num_preemptions > 0 for i in ids)
    assert run.output(ids[0]).token_ids == alone


@pytest.mark.parametrize("engine_name", ["reference", "cached"])
def test_shared_prefix_batch_matches_one_at_a_time(request, engine_name, shared_prefix_requests,
                                                   shared_prefix_expected):
    engine = request.getfixturevalue(engine_name)
    run, ids = drive(engine, shared_prefix_requests)
    got = tokens_by_request(run, ids)
    assert got == shared_prefix_expected, first_mismatch(got, shared_prefix_expected)
    cached_tokens = [run.seqs[i].num_cached_tokens for i in ids]
    if engine_name == "cached":
        assert max(cached_tokens) > 0, "prefix caching never served a block"
    else:
        assert cached_tokens == [0] * len(ids)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_chunked_prefill_matches_one_at_a_time(stories_dir, batch_requests, batch_expected, shared_prefix_requests,
                                               shared_prefix_expected, prefix_caching):
    engine = make_llm(stories_dir, max_num_batched_tokens=32, enable_prefix_caching=prefix_caching).engine
    step_sizes = []
    launch = engine.model_runner.launch

    def recording_launch(batch):
        step_sizes.append(batch.num_tokens)
        return launch(batch)

    engine.model_runner.launch = recording_launch
    run, ids = drive(engine, batch_requests)
    got = tokens_by_request(run, ids)
    assert got == batch_expected, first_mismatch(got, batch_expected)
    # No step computed more than 32 tokens, so the ~300-token prompts were prefilled in chunks.
    assert max(step_sizes) == 32
    assert max(len(s.prompt_token_ids) for s in run.seqs.values()) > 250

    run, ids = drive(engine, shared_prefix_requests)
    got = tokens_by_request(run, ids)
    assert got == shared_prefix_expected, first_mismatch(got, shared_prefix_expected)
    assert max(step_sizes) == 32


# ---- prefix caching -----------------------------------------------------------------------------


@pytest.mark.parametrize("together", [False, True], ids=["one-after-the-other", "same-batch"])
@pytest.mark.parametrize("engine_name", ["cached", "reference"])
def test_prefix_cache_reuses_a_shared_64_token_prefix(request, engine_name, together, tokenizer):
    engine = request.getfixturevalue(engine_name)
    # A prefix no other test (or parametrization) uses, exactly 8 blocks long.
    opening = f"A {'green' if together else 'brown'} frog jumped{' high' if engine_name == 'cached' else ''}. "
    prefix = tokenizer.encode(opening + STORY * 2)[:64]
    first = prefix + tokenizer.encode("The frog was green and happy.", add_special_tokens=False)
    second = prefix + tokenizer.encode("Suddenly a big storm came.", add_special_tokens=False)
    assert first[64] != second[64]
    params = greedy(12)
    if together:
        run, ids = drive(engine, [(first, params), (second, params)])
        outputs = tokens_by_request(run, ids)
        second_seq = run.seqs[ids[1]]
    else:
        outputs = [drive_one(engine, first, params).token_ids]
        run, (second_id,) = drive(engine, [(second, params)])
        outputs.append(run.output(second_id).token_ids)
        second_seq = run.seqs[second_id]
    if engine_name == "cached":
        assert second_seq.num_cached_tokens == 64  # all 8 prefix blocks, and nothing after them
    else:
        assert second_seq.num_cached_tokens == 0
    # Served from the cache or not, the outputs are the reference's.
    reference = request.getfixturevalue("reference")
    assert outputs == [drive_one(reference, p, params).token_ids for p in (first, second)]


# ---- seeded sampling ----------------------------------------------------------------------------


SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123, max_tokens=48)


def test_seeded_request_samples_the_same_alone_and_batched(cached):
    prompt = "Once upon a time"
    alone = drive_one(cached, prompt, SEEDED)
    others = [(p, SamplingParams(temperature=1.0, top_p=0.95, seed=1000 + n, max_tokens=m))
              for n, (p, m) in enumerate(zip(BATCH_PROMPTS[1:7], BATCH_MAX_TOKENS))]
    others.append(("Max the dog", SamplingParams(temperature=1.2, max_tokens=40)))  # engine-seeded
    run, ids = drive(cached, others[:3] + [(prompt, SEEDED)] + others[3:])
    batched = run.output(ids[3])
    assert batched.token_ids == alone.token_ids
    assert batched.text == alone.text
    assert len(alone.token_ids) == SEEDED.max_tokens


def test_different_seeds_sample_differently(cached):
    a = drive_one(cached, "Once upon a time", SEEDED).token_ids
    b = drive_one(cached, "Once upon a time", SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=124,
                                                             max_tokens=48)).token_ids
    assert a != b


def test_unseeded_sampling_runs(cached):
    output = drive_one(cached, "Once upon a time", SamplingParams(temperature=1.0, max_tokens=24))
    assert 1 <= len(output.token_ids) <= 24
    assert output.finish_reason in ("stop", "length")
    assert all(0 <= t < 512 for t in output.token_ids)


# ---- stop conditions ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def once_upon(reference) -> CompletionOutput:
    """The unconstrained greedy continuation that the stop tests cut."""
    output = drive_one(reference, "Once upon a time", greedy(60))
    assert output.finish_reason == "length" and len(output.token_ids) == 60
    return output


def test_stop_string_cuts_before_its_first_occurrence(reference, once_upon):
    text = once_upon.text
    middle = len(text) // 2
    stop = text[middle:middle + 5]
    cut = text.find(stop)
    assert cut > 0
    run, (request_id,) = drive(reference, [("Once upon a time", greedy(60, stop=["no such words", stop]))])
    output = run.output(request_id)
    assert output.text == text[:cut]
    assert output.finish_reason == "stop"
    assert output.stop_reason == stop
    assert output.token_ids == once_upon.token_ids[:len(output.token_ids)]
    assert len(output.token_ids) < len(once_upon.token_ids)
    # Streamed: the deltas never showed the stop string, and join to the final text.
    deltas = run.deltas[(request_id, 0)]
    assert "".join(d.text for d in deltas) == output.text
    assert all(stop not in d.text for d in deltas)


def test_stop_string_split_across_tokens_streams_correctly(reference, once_upon):
    """A longer stop string that spans several tokens is held back, then dropped, never half-shown."""
    text = once_upon.text
    start = text.find(" ", len(text) // 3)
    stop = text[start:start + 12]
    cut = text.find(stop)
    run, (request_id,) = drive(reference, [("Once upon a time", greedy(60, stop=stop))])
    output = run.output(request_id)
    assert output.text == text[:cut]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop)
    assert "".join(d.text for d in run.deltas[(request_id, 0)]) == output.text


def test_stop_token_id_ends_the_output_before_it(reference, once_upon):
    tokens = once_upon.token_ids
    stop_id = tokens[12]
    at = tokens.index(stop_id)  # its first occurrence
    assert at > 0
    before = drive_one(reference, "Once upon a time", greedy(at))  # the text of the tokens before it
    output = drive_one(reference, "Once upon a time", greedy(60, stop_token_ids=[stop_id]))
    assert output.finish_reason == "stop"
    assert output.stop_reason == stop_id
    assert output.text == before.text
    # As in vLLM, the stop token is the last token id, but its text is not in the output.
    assert output.token_ids == tokens[:at + 1]


def test_max_tokens_finishes_with_length(reference, once_upon):
    output = drive_one(reference, "Once upon a time", greedy(7))
    assert output.finish_reason == "length"
    assert output.stop_reason is None
    assert output.token_ids == once_upon.token_ids[:7]


@pytest.fixture(scope="module")
def eos_model(stories_dir, tmp_path_factory, once_upon) -> tuple[Path, int, int]:
    """stories260k never emits </s> (llama2.c trained without it), so this copy of the folder declares
    a token of the greedy continuation an extra EOS in generation_config.json, as models with several
    EOS ids (Llama 3) do."""
    folder = tmp_path_factory.mktemp("stories260k-eos")
    for path in stories_dir.iterdir():
        if path.is_file():
            shutil.copyfile(path, folder / path.name)
    eos_id = once_upon.token_ids[20]
    at = once_upon.token_ids.index(eos_id)
    generation = json.loads((stories_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, eos_id]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder, eos_id, at


def test_eos_finishes_with_stop_unless_ignored(eos_model, reference, once_upon):
    folder, eos_id, at = eos_model
    engine = make_llm(folder, enable_prefix_caching=False).engine
    assert eos_id in engine.eos_token_ids
    output = drive_one(engine, "Once upon a time", greedy(60))
    assert output.finish_reason == "stop"
    assert output.stop_reason is None
    assert output.token_ids == once_upon.token_ids[:at + 1]
    assert output.text == drive_one(reference, "Once upon a time", greedy(at)).text

    ignored = drive_one(engine, "Once upon a time", greedy(60, ignore_eos=True))
    assert ignored.finish_reason == "length"
    assert ignored.token_ids == once_upon.token_ids
    assert ignored.text == once_upon.text


# ---- n > 1 --------------------------------------------------------------------------------------


def test_n_samples_share_the_prompt_blocks(reference):
    prompt = STORY  # ~100 tokens: 13 blocks that n = 4 samples share and 4 requests would not
    sampled = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=24)
    assert used_blocks(reference) == 0
    run, (request_id,) = drive(reference, [(prompt, sampled)])
    samples = [run.output(request_id, i) for i in range(4)]
    assert set(run.outputs) == {(request_id, i) for i in range(4)}
    assert all(len(s.token_ids) == 24 and s.finish_reason == "length" for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1, "4 samples at temperature 1 all came out the same"

    separate = [(prompt, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=24)) for i in range(4)]
    separate_run, ids = drive(reference, separate)
    assert separate_run.peak_used_blocks > run.peak_used_blocks, (separate_run.peak_used_blocks,
                                                                  run.peak_used_blocks)
    # Sample i draws from a generator seeded with seed + i, so it equals a separate request with that seed.
    assert [s.token_ids for s in samples] == tokens_by_request(separate_run, ids)
    assert used_blocks(reference) == 0


def test_greedy_n_samples_all_equal_the_greedy_output(reference, cached, once_upon):
    for engine in (reference, cached):
        run, (request_id,) = drive(engine, [("Once upon a time", greedy(60, n=3))])
        assert [run.output(request_id, i).token_ids for i in range(3)] == [once_upon.token_ids] * 3
        assert [run.output(request_id, i).text for i in range(3)] == [once_upon.text] * 3


def test_samples_beyond_max_num_seqs_wait_and_sample_as_if_forked(stories_dir, reference):
    """With 4 slots, one of them held by another request, an n = 4 request runs 3 samples and the
    fourth waits with the prompt alone (the prefix cache keeps its blocks). Each sample still draws
    from its own seeded generator, so the outputs are those of a roomy engine."""
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=16)
    roomy, (roomy_id,) = drive(reference, [(STORY, params)])
    engine = make_llm(stories_dir, max_num_seqs=4).engine
    narrow_params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=16)
    other = engine.add_request("other", "Once upon a time", greedy(40))  # holds slots while STORY's samples run
    engine.add_request("narrow", STORY, narrow_params)
    run = step_until_done(engine, Run())
    assert other.finish_reason == "length"
    assert [run.output("narrow", i).token_ids for i in range(4)] == [roomy.output(roomy_id, i).token_ids
                                                                     for i in range(4)]
    assert engine.stats()["free_blocks"] == engine.stats()["total_blocks"]


def test_tenants_share_an_engine_and_each_gets_what_it_would_alone(stories_dir, batch_requests, batch_expected):
    """Fair share reorders work, never changes it: a flooding tenant and a small one, weighted 3 to 1,
    on a narrow engine, get the greedy outputs of one request at a time."""
    engine = make_llm(stories_dir, max_num_seqs=3, max_num_batched_tokens=64).engine
    ids = []
    for i, (prompt, params) in enumerate(batch_requests):
        tenant, weight = ("flood", 3.0) if i % 4 else ("small", 1.0)
        request_id = new_id(tenant)
        engine.add_request(request_id, prompt, params, tenant=tenant, weight=weight)
        ids.append(request_id)
    run = step_until_done(engine, Run())
    assert tokens_by_request(run, ids) == batch_expected


def test_a_tenant_weight_must_be_a_positive_number(cached):
    for weight in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="weight"):
            cached.add_request(new_id(), "Once upon a time", greedy(2), tenant="t", weight=weight)
    assert not cached.has_unfinished()


# ---- abort --------------------------------------------------------------------------------------


ABORT_PROMPTS = ["Once upon a time", STORY, "Tom and Sam were best friends.", STORY * 2 + "Then"]


@pytest.fixture(scope="module")
def abort_expected(reference) -> list[CompletionOutput]:
    return [drive_one(reference, p, greedy(40)) for p in ABORT_PROMPTS]


def test_abort_frees_blocks_and_leaves_the_others_undisturbed(stories_dir, abort_expected):
    engine = make_llm(stories_dir, enable_prefix_caching=False).engine
    total = engine.stats()["total_blocks"]
    run, ids = submit(engine, [(p, greedy(40)) for p in ABORT_PROMPTS])
    for _ in range(3):
        record(run, engine.step())
    victim = ids[1]
    victim_seq = run.seqs[victim]
    held = len(victim_seq.block_table)
    assert held > 0 and engine.stats()["running"] == len(ids)
    free_before = engine.stats()["free_blocks"]

    assert engine.abort(victim) is True
    assert victim_seq.block_table == []
    assert engine.stats()["free_blocks"] == free_before + held
    assert engine.abort(victim) is False  # already gone

    deltas = engine.step()
    record(run, deltas)
    mine = [d for d in deltas if d.request_id == victim]
    assert len(mine) == 1 and mine[0].finished and mine[0].finish_reason == "abort"
    assert {d.request_id for d in deltas} == set(ids)  # the others advanced in the same step

    step_until_done(engine, run)
    assert engine.stats()["free_blocks"] == total
    for request_id, expected in zip(ids, abort_expected):
        got = run.output(request_id)
        if request_id == victim:
            assert got.finish_reason == "abort"
            assert 0 < len(got.token_ids) < len(expected.token_ids)
            assert got.token_ids == expected.token_ids[:len(got.token_ids)]
            assert expected.text.startswith(got.text)
        else:
            assert got.token_ids == expected.token_ids
            assert got.text == expected.text
            assert got.finish_reason == "length"
    assert engine.abort(ids[0]) is False  # finished requests cannot be aborted


def test_aborting_everything_frees_every_block(stories_dir):
    engine = make_llm(stories_dir, max_num_batched_tokens=64).engine  # prefix caching on, chunked prefill
    total = engine.stats()["total_blocks"]
    requests = [(p, greedy(40)) for p in ABORT_PROMPTS] + [
        (STORY, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40))]
    run, ids = submit(engine, requests)
    for _ in range(4):
        record(run, engine.step())
    assert engine.stats()["free_blocks"] < total
    assert all(engine.abort(i) for i in ids)
    assert engine.stats()["free_blocks"] == total
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0
    record(run, engine.step())
    assert not engine.has_unfinished()
    for request_id, (_, params) in zip(ids, requests):
        for index in range(params.n):
            stream = run.deltas[(request_id, index)]
            assert stream and stream[-1].finished, (request_id, index)
    # The engine serves new work afterwards.
    assert drive_one(engine, "Once upon a time", greedy(5)).finish_reason == "length"


def test_abort_before_the_prompt_is_done_finishes_every_sample(reference):
    """An n = 3 request aborted while its prompt is still waiting must still end all 3 samples: a
    streaming client waits for a finished delta per sample."""
    request_id = new_id("abort-n")
    reference.add_request(request_id, STORY, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    try:
        assert reference.abort(request_id)
        deltas = reference.step()
    finally:
        while reference.has_unfinished():
            reference.step()
    finished = sorted(d.index for d in deltas if d.request_id == request_id and d.finished)
    assert all(d.finish_reason == "abort" for d in deltas)
    assert finished == [0, 1, 2]


# ---- logprobs -----------------------------------------------------------------------------------


def check_logprobs(output: CompletionOutput, k: int) -> None:
    assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
    for token_id, lp in zip(output.token_ids, output.logprobs):
        assert isinstance(lp, TokenLogprob)
        assert lp.token_id == token_id
        assert lp.logprob <= 0
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        assert len({t for t, _ in lp.top}) == k
        assert lp.logprob <= values[0] + 1e-6


def test_logprobs_greedy(reference, once_upon):
    output = drive_one(reference, "Once upon a time", greedy(30, logprobs=3))
    assert output.token_ids == once_upon.token_ids[:30]  # asking for logprobs changes nothing else
    check_logprobs(output, 3)
    for lp in output.logprobs:
        top_id, top_value = lp.top[0]
        assert top_id == lp.token_id
        assert lp.logprob == pytest.approx(top_value, abs=1e-6)


def test_logprobs_sampled(reference):
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=30, logprobs=3)
    output = drive_one(reference, "Once upon a time", params)
    check_logprobs(output, 3)
    # Logprobs are reported, not sampled: the tokens equal the same seed's run without them.
    plain = drive_one(reference, "Once upon a time", SamplingParams(temperature=1.0, seed=99, max_tokens=30))
    assert output.token_ids == plain.token_ids


# ---- the streaming interface --------------------------------------------------------------------


def test_joined_deltas_equal_llm_generate(stories_dir, tokenizer):
    llm = make_llm(stories_dir)
    requests = [
        ("Once upon a time", greedy(40)),
        (STORY, greedy(30, stop=[" the ", "."])),
        ("Tom and Sam were best friends.", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30)),
        ("Sara liked to draw. She drew a", SamplingParams(temperature=0.7, top_k=20, seed=4, max_tokens=25,
                                                          logprobs=2)),
        (tokenizer.encode("Max the dog"), greedy(20, stop_token_ids=[tokenizer.encode(".")[-1]])),
    ]
    generated = llm.generate([p for p, _ in requests], [params for _, params in requests], use_tqdm=False)
    run, ids = drive(llm.engine, requests)
    for result, request_id, (_, params) in zip(generated, ids, requests):
        assert len(result.outputs) == params.n
        for index, expected in enumerate(result.outputs):
            stream = run.deltas[(request_id, index)]
            assert [d.finished for d in stream].count(True) == 1 and stream[-1].finished
            assert "".join(d.text for d in stream) == expected.text
            assert [t for d in stream for t in d.token_ids] == expected.token_ids
            assert stream[-1].finish_reason == expected.finish_reason
            assert all(d.index == index for d in stream)


# ---- bad input ----------------------------------------------------------------------------------


LONG_TEXT = STORY * 6  # over 512 tokens

# (name, the field InvalidRequest must name, a request: (prompt, SamplingParams built lazily)).
BAD_REQUESTS = [
    ("prompt-over-context-text", "prompt", lambda: (LONG_TEXT, SamplingParams(max_tokens=1))),
    ("prompt-fills-context-ids", "prompt", lambda: ([1] + [403] * 511, SamplingParams(max_tokens=1))),
    ("empty-prompt", "prompt", lambda: ("", SamplingParams())),
    ("empty-token-list", "prompt", lambda: ([], SamplingParams())),
    ("token-outside-vocab", "prompt", lambda: ([1, 403, 512], SamplingParams())),
    ("prompt-plus-max-tokens-over-context", "max_tokens",
     lambda: ([1] + [403] * 499, SamplingParams(max_tokens=13))),
    ("max-tokens-0", "max_tokens", lambda: ("Once upon a time", SamplingParams(max_tokens=0))),
    ("temperature-negative", "temperature", lambda: ("Once upon a time", SamplingParams(temperature=-1))),
    ("top-p-0", "top_p", lambda: ("Once upon a time", SamplingParams(top_p=0))),
    ("top-p-1.5", "top_p", lambda: ("Once upon a time", SamplingParams(top_p=1.5))),
    ("stop-int", "stop", lambda: ("Once upon a time", SamplingParams(stop=5))),
]


@pytest.mark.parametrize(("param", "make"), [(param, make) for _, param, make in BAD_REQUESTS],
                         ids=[name for name, _, _ in BAD_REQUESTS])
def test_bad_request_is_refused_and_the_engine_keeps_serving(param, make, cached, tokenizer, once_upon):
    assert len(tokenizer.encode(LONG_TEXT)) > cached.max_model_len == 512
    # A good request is in flight while the bad one comes in.
    run, (good_id,) = submit(cached, [("Once upon a time", greedy(20))])
    record(run, cached.step())
    try:
        with pytest.raises(InvalidRequest) as caught:
            prompt, params = make()
            cached.add_request(new_id("bad"), prompt, params)
        assert isinstance(caught.value, ValueError)
        assert caught.value.param == param
    finally:
        step_until_done(cached, run)
    assert run.output(good_id).token_ids == once_upon.token_ids[:20]
    assert run.output(good_id).finish_reason == "length"
    # Nothing of the bad request stayed behind, and a new request is served correctly.
    assert not cached.has_unfinished()
    assert cached.stats()["free_blocks"] == cached.stats()["total_blocks"]
    assert drive_one(cached, "Once upon a time", greedy(20)).token_ids == once_upon.token_ids[:20]


def test_a_prompt_that_just_fits_the_context_is_served(cached):
    output = drive_one(cached, [1] + [403] * 510, greedy(1))
    assert len(output.token_ids) == 1 and output.finish_reason == "length"


def test_duplicate_request_id_in_flight_is_refused(cached, once_upon):
    request_id = new_id("dup")
    cached.add_request(request_id, "Once upon a time", greedy(5))
    try:
        with pytest.raises(InvalidRequest) as caught:
            cached.add_request(request_id, "Tom and Sam", greedy(5))
        assert caught.value.param == "request_id"
        run = step_until_done(cached, Run())
    finally:
        cached.abort(request_id)
        while cached.has_unfinished():
            cached.step()
    assert run.output(request_id).token_ids == once_upon.token_ids[:5]
    assert set(run.outputs) == {(request_id, 0)}


def test_more_samples_than_max_num_seqs_is_refused_or_served(stories_dir):
    """n = 3 on an engine that runs at most 2 sequences can never be admitted (the scheduler admits a
    request only with room for all its samples). It must be refused up front, naming "n", or be
    served; it must not sit in the waiting queue forever while step() returns nothing."""
    engine = make_llm(stories_dir, max_num_seqs=2).engine
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=4)
    try:
        run, (request_id,) = drive(engine, [("Once upon a time", params)], max_steps=200)
    except InvalidRequest as error:
        assert error.param == "n"
    else:
        assert sorted(run.outputs) == [(request_id, i) for i in range(3)]
    assert not engine.has_unfinished()
    assert drive_one(engine, "Once upon a time", greedy(4)).finish_reason == "length"


@pytest.mark.parametrize(("seed", "n"), [(2**64, 1), (2**64 - 1, 2), (-2**63 - 1, 1)],
                         ids=["2**64", "2**64-1-with-n-2", "-2**63-1"])
def test_out_of_range_seed_is_refused_or_served_reproducibly(stories_dir, once_upon, seed, n):
    """torch generators take seeds in [-2**63, 2**64); sample i of a request uses seed + i. A seed
    outside that range must be refused as InvalidRequest("seed"), or served like any other seed:
    never an exception out of step() that fails every request in the batch."""
    cached = make_llm(stories_dir).engine
    params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=8)
    good = ("Once upon a time", greedy(8))
    try:
        first, ids = drive(cached, [good, ("Tom and Sam", params)])
    except InvalidRequest as error:
        assert error.param == "seed"
        assert drive_one(cached, *good).token_ids == once_upon.token_ids[:8]
        return
    assert first.output(ids[0]).token_ids == once_upon.token_ids[:8]
    second, again = drive(cached, [("Tom and Sam", params)])
    assert [second.output(again[0], i).token_ids for i in range(n)] == [first.output(ids[1], i).token_ids
                                                                       for i in range(n)]


# ---- resuming an interrupted sample (a crashed or preempted worker's checkpoint) -------------------


def interrupt_after(engine: LLMEngine, prompt, params: SamplingParams, num_tokens: int) -> tuple[list[int], str]:
    """Run a request until its deltas have carried `num_tokens` tokens (one a step), then abort it: the
    tokens and text its deltas had carried."""
    request_id = new_id("interrupted")
    engine.add_request(request_id, prompt, params)
    tokens, text = [], ""
    while len(tokens) < num_tokens:
        for delta in engine.step():
            assert not delta.finished, "the request ended before the interruption: pick fewer steps"
            tokens += delta.token_ids
            text += delta.text
    engine.abort(request_id)
    for delta in engine.step():  # the abort delta: what it held back never reached a client
        assert delta.finish_reason == "abort"
        tokens += delta.token_ids
    assert not engine.has_unfinished()
    return tokens, text


@pytest.mark.parametrize("num_tokens", [1, 2, 17, 40])
def test_a_resumed_sample_goes_on_exactly_where_it_stopped(reference, cached, once_upon, num_tokens):
    """Interrupted on one engine, resumed on another from its tokens: the joined text and tokens equal
    an undisturbed run's, and the resumed deltas carry only what came after the checkpoint."""
    from llmq.engine.config import ResumePoint

    tokens, text = interrupt_after(cached, "Once upon a time", greedy(60), num_tokens)
    assert len(tokens) == num_tokens
    run, request_id = Run(), new_id("resumed")
    run.seqs[request_id] = reference.add_request(request_id, "Once upon a time", greedy(60),
                                                 resume=ResumePoint(tuple(tokens), len(text)))
    step_until_done(reference, run)
    resumed = run.output(request_id)
    assert tokens + resumed.token_ids == once_upon.token_ids
    assert text + resumed.text == once_upon.text
    assert resumed.finish_reason == "length"


def test_a_resumed_sample_emits_the_text_held_back_for_a_stop_string(reference, cached, once_upon):
    """The interruption falls while a possible stop string's start is held back: the resumed run
    emits that text (it was no stop string) or cuts it (it was), exactly as an undisturbed run does."""
    from llmq.engine.config import ResumePoint

    text = once_upon.text
    start = text.find(" ", len(text) // 3)
    stop = text[start:start + 12]
    never = "x" * 14  # never occurs: only holds text back
    for stops, want in (([never], text), ([stop], text[:text.find(stop)])):
        params = greedy(60, stop=stops)
        tokens, streamed = interrupt_after(cached, "Once upon a time", params, 20)
        decoded = cached.tokenizer.decode(tokens)
        assert len(streamed) < len(decoded), "nothing was held back at the interruption"
        request_id = new_id("resumed")
        run = Run()
        run.seqs[request_id] = reference.add_request(request_id, "Once upon a time", params,
                                                     resume=ResumePoint(tuple(tokens), len(streamed)))
        step_until_done(reference, run)
        assert streamed + run.output(request_id).text == want


def test_a_resume_point_needs_one_sample_and_room_to_go_on(cached, once_upon):
    from llmq.engine.config import ResumePoint

    with pytest.raises(InvalidRequest) as err:
        cached.add_request(new_id(), "Once upon a time", greedy(10, n=2), resume=ResumePoint((1, 2)))
    assert err.value.param == "n"
    with pytest.raises(InvalidRequest) as err:
        cached.add_request(new_id(), "Once upon a time", greedy(3), resume=ResumePoint(tuple(once_upon.token_ids[:3])))
    assert err.value.param == "max_tokens"
    assert not cached.has_unfinished()

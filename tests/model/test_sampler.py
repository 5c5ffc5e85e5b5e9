"""The sampler's greedy path equals torch.argmax exactly, ties included; any valid sampling
parameters sample (a step that raised would fail every request in the batch)."""
import pytest
import torch

from llmq.engine.sequence import Sequence
from llmq.model.sampler import greedy_argmax, sample
from llmq.sampling_params import SamplingParams


@pytest.mark.parametrize("vocab", [1, 7, 256, 512, 32000, 32001, 128256])
def test_greedy_argmax_equals_torch_argmax(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(33, vocab, generator=generator)
    logits[0] = 0.0  # all tied: the first index wins
    if vocab > 300:
        logits[1, 5] = logits[1, 300] = logits[1].max() + 1  # a tie across chunks
        logits[2, 257] = logits[2, 258] = logits[2].max() + 1  # a tie inside a chunk
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))


# Found by the OpenAPI fuzz test: each of these made the engine step raise, and the worker then
# failed every request in flight with a 500.
@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1e-300), 1),  # float32 rounds it to 0: logits / 0; now greedy in effect
    (SamplingParams(temperature=5e-324), 1),
    (SamplingParams(top_p=1e-300), 1),  # float32 rounds it to 0: every token was dropped; now the top one stays
    (SamplingParams(temperature=1e300, top_p=5e-324), None),  # a flat distribution: any one token
    (SamplingParams(top_k=10**30), None),  # too large for a torch integer tensor; now "no top-k"
])
def test_extreme_valid_params_sample_a_token(params, expected):
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    tokens, _ = sample(logits, [Sequence("r", [1], params, sampling_seed=7)])
    assert 0 <= tokens[0] < 4
    if expected is not None:
        assert tokens == [expected]

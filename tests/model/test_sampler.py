"""The sampler's greedy path equals torch.argmax exactly, ties included."""
import pytest
import torch

from workers.model.sampler import greedy_argmax


@pytest.mark.parametrize("vocab", [1, 7, 256, 512, 32000, 32001, 128256])
def test_greedy_argmax_equals_torch_argmax(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(33, vocab, generator=generator)
    logits[0] = 0.0  # all tied: the first index wins
    if vocab > 300:
        logits[1, 5] = logits[1, 300] = logits[1].max() + 1  # a tie across chunks
        logits[2, 257] = logits[2, 258] = logits[2].max() + 1  # a tie inside a chunk
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))

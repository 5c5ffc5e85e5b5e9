"""The row counts a CPU step is padded to (llmq/model/row_buckets.py), exactly, and a model whose rows
are padded computing what it computes unpadded."""
from __future__ import annotations

import pytest
import torch

from llmq.engine.step_input import DecodeGroupInput, StepInput
from llmq.model.loader import load_model
from llmq.model.row_buckets import buckets_up_to, padded_rows


@pytest.mark.parametrize("rows, padded", [(0, 0), (1, 8), (8, 8), (9, 16), (255, 256), (256, 256), (257, 320),
                                          (320, 320), (321, 384), (2048, 2048), (2049, 2112)])
def test_padded_rows(rows, padded):
    assert padded_rows(rows) == padded


def test_padding_is_bounded_and_never_shrinks():
    for rows in range(1, 3000):
        padded = padded_rows(rows)
        assert padded >= rows and (padded - rows < 8 if rows <= 256 else padded - rows < 64)


def test_buckets_up_to():
    assert buckets_up_to(1) == [8]
    assert buckets_up_to(64) == [8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets_up_to(300) == [*range(8, 257, 8), 320]


def test_a_padded_model_computes_what_the_unpadded_one_does(stories_dir):
    """Decodes of three sequences (three rows, padded to eight): the same hidden states and the same
    keys and values written to the cache, and nothing written for the padding rows."""
    model = load_model(stories_dir, "cpu", torch.float32, max_positions=64)
    config, block_size, num_blocks = model.config, 4, 16
    step = StepInput([5, 9, 300], [3, 0, 6], [15, 20, 38], [DecodeGroupInput(0, [[3, 0], [5, 0], [8, 9]], [4, 1, 7])],
                     [], [], [])
    results = []
    for pad in (False, True):
        model.pad_rows = pad
        ids, positions, meta = step.to_tensors("cpu", config.num_key_value_heads, num_blocks, block_size, None)
        caches = [(torch.zeros(config.num_key_value_heads, num_blocks * block_size, config.head_dim),
                   torch.zeros(config.num_key_value_heads, num_blocks * block_size, config.head_dim))
                  for _ in range(config.num_hidden_layers)]
        with torch.inference_mode():
            hidden = model(ids, positions, caches, meta)
        results.append((hidden, caches))
    (plain, plain_caches), (padded, padded_caches) = results
    assert padded.shape == plain.shape == (3, config.hidden_size)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    for (k0, v0), (k1, v1) in zip(plain_caches, padded_caches):
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
        assert int((k1.abs().sum(-1) > 0).sum()) == 3 * config.num_key_value_heads  # the three tokens' slots only

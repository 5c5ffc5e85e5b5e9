"""Sampler: logits -> next tokens, per sequence parameters, reproducible per request.

Every non-greedy sequence draws from its own torch.Generator (seeded from the request's seed, or
from the engine's seed stream), so a seeded request samples the same tokens whatever else shares
its batch. Greedy rows take the argmax.
"""
from __future__ import annotations

import torch

from llmq.engine.sequence import Sequence
from llmq.outputs import TokenLogprob

MIN_TEMPERATURE = 1e-5  # float32 logits / 1e-5 stay finite, and sampling at it is greedy in effect


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits float32 [S, vocab], row i for seqs[i]. Returns the token ids and, for sequences that
    asked for them, the chosen token's log-probability with the top alternatives (of the model's
    raw distribution, before temperature or truncation, as vLLM and OpenAI report them)."""
    token_ids = greedy_argmax(logits)
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _truncated_probs(logits[rows], [seqs[i].params for i in random_rows])
        for j, i in enumerate(random_rows):
            token_ids[i] = torch.multinomial(probs[j], 1, generator=_generator(seqs[i], logits.device))[0]
    chosen = token_ids.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if wanted:
        all_logprobs = torch.log_softmax(logits[wanted], dim=-1)
        k = max(seqs[i].params.logprobs for i in wanted)
        top_values, top_ids = all_logprobs.topk(k, dim=-1) if k else (None, None)
        for j, i in enumerate(wanted):
            n = seqs[i].params.logprobs
            top = tuple(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist())) if n else ()
            logprobs[i] = TokenLogprob(chosen[i], all_logprobs[j, chosen[i]].item(), top)
    return chosen, logprobs


def greedy_argmax(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """logits.argmax(-1), the first index on ties, in two vectorized passes: the max of each chunk of
    the vocabulary, then the argmax inside the winning chunk. torch's argmax over a long row is a
    scalar loop on CPU: 2.7 ms for 64 x 32000 on 2 cores, against 0.45 ms this way."""
    rows, vocab = logits.shape
    pad = (-vocab) % chunk
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    chunks = logits.view(rows, -1, chunk)  # [S, vocab / chunk, chunk]
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # the first chunk holding the maximum
    within = chunks[torch.arange(rows, device=logits.device), best_chunk].argmax(dim=-1)
    return best_chunk * chunk + within


def _truncated_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, then top-k, then top-p; each row independent of the others."""
    device = logits.device
    # Any valid request must sample, never fail the step (which fails the whole batch): a temperature
    # that float32 rounds to 0 (1e-300) would divide by zero, so it is raised to MIN_TEMPERATURE,
    # which is already greedy in effect; a top_k past the vocabulary (1e30) means no top-k.
    temperature = torch.tensor([max(p.temperature, MIN_TEMPERATURE) for p in params], device=device,
                               dtype=logits.dtype)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    if (top_k < vocab).any() or (top_p < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Keep the smallest set of tokens whose mass reaches top_p, and always the first: a top_p that
        # float32 rounds to 0 (1e-300) would otherwise drop every token.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= (mass_before >= top_p[:, None]) & (ranks > 0)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.softmax(logits, dim=-1)


def _generator(seq: Sequence, device) -> torch.Generator:
    if seq.generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seq.sampling_seed % (1 << 64))  # any integer seed; torch takes 64 bits
        seq.generator = generator
    return seq.generator

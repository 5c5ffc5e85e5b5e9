"""Sampler: logits -> next tokens, per sequence parameters, reproducible per request.

Every non-greedy sequence draws from its own torch.Generator (seeded from the request's seed, or
from the engine's seed stream), so a seeded request samples the same tokens whatever else shares
its batch. Greedy rows take the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmq.engine.sequence import Sequence
from llmq.model.cpu_kernels import fast_argmax
from llmq.model.device_copy import to_device
from llmq.outputs import TokenLogprob

MIN_TEMPERATURE = 1e-5  # float32 logits / 1e-5 stay finite, and sampling at it is greedy in effect


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [S, vocab] (float32 or the model's dtype), row i for seqs[i]. Returns the token ids and,
    for sequences that asked for them, the chosen token's log-probability with the top alternatives
    (of the model's raw distribution, before temperature or truncation, as vLLM and OpenAI report them)."""
    return SampledStep.launch(logits, seqs).result()


@dataclass
class SampledStep:
    """A step's sampled tokens: on the device at once (`token_ids`, which the next step can read
    there), on the host once `result()` has waited for their copy, the step's only wait for the device.
    Logprobs, where asked for, come back in the same copy."""

    token_ids: torch.Tensor  # [S] on the logits' device
    _host: torch.Tensor  # [S, 2 + 2k] float64: token id, its logprob, k top logprobs, k top ids
    _logprobs_wanted: list[int | None]  # top alternatives asked for, per row (None: no logprobs)
    _top_k: int  # the most top alternatives any row asked for
    _copied: object | None  # the CUDA event after the copy to the host; None where there is nothing to wait for

    @classmethod
    def launch(cls, logits: torch.Tensor, seqs: list[Sequence]) -> "SampledStep":
        """Samples on the logits' device and starts the copy to the host; waits for nothing."""
        token_ids = sample_tokens(logits, seqs)
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        k = max((seqs[i].params.logprobs for i in wanted), default=0)
        # float64 holds every token id and float32 logprob exactly.
        packed = torch.zeros(len(seqs), 2 + 2 * k if wanted else 1, dtype=torch.float64, device=logits.device)
        packed[:, 0] = token_ids
        if wanted:
            rows = to_device(wanted, logits.device)
            all_logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
            top_values, top_ids = all_logprobs.topk(k, dim=-1)
            chosen = all_logprobs.gather(1, token_ids[rows, None])
            packed[rows, 1:] = torch.cat([chosen, top_values, top_ids.to(top_values.dtype)], dim=1).to(torch.float64)
        copied = None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host = packed
        return cls(token_ids, host, [s.params.logprobs for s in seqs], k, copied)

    @classmethod
    def of_tokens(cls, token_ids: torch.Tensor) -> "SampledStep":
        """A step whose tokens are already chosen, on the host, with no logprobs asked for (the greedy
        argmax the model took in its LM head: ModelRunner.launch)."""
        return cls(token_ids, token_ids.to(torch.float64)[:, None], [None] * len(token_ids), 0, None)

    def result(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """Waits for the copy; the token ids and logprobs, one per sampled sequence."""
        if self._copied is not None:
            self._copied.synchronize()
        rows = self._host.tolist()
        chosen = [int(row[0]) for row in rows]
        k = self._top_k
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        for i, (row, n) in enumerate(zip(rows, self._logprobs_wanted)):
            if n is not None:
                logprobs[i] = TokenLogprob(chosen[i], row[1], tuple(zip((int(t) for t in row[2 + k: 2 + k + n]),
                                                                        row[2: 2 + n])))
        return chosen, logprobs


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The next token of every row [S], left on the logits' device: nothing here waits for the device,
    so on a GPU the host can go on while it samples."""
    token_ids = greedy_argmax(logits)
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        rows = to_device(random_rows, logits.device)
        probs = _truncated_probs(logits[rows].float(), [seqs[i].params for i in random_rows])
        for j, i in enumerate(random_rows):
            token_ids[i] = torch.multinomial(probs[j], 1, generator=_generator(seqs[i], logits.device))[0]
    return token_ids


def greedy_argmax(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """logits.argmax(-1), the first index on ties: on a CPU in one pass of the fused kernels where
    they are loaded (cpu_kernels.fast_argmax), else in two vectorized passes: the max of each chunk of
    the vocabulary, then the argmax inside the winning chunk. torch's argmax over a long row is a
    scalar loop on CPU, several times slower than either."""
    fast = fast_argmax(logits)
    if fast is not None:
        return fast
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
    temperature = to_device([max(p.temperature, MIN_TEMPERATURE) for p in params], device, logits.dtype)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    if any(k < vocab for k in top_ks) or any(p.top_p < 1 for p in params):  # decided on the host: no wait
        top_k = to_device(top_ks, device)
        top_p = to_device([p.top_p for p in params], device, logits.dtype)
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

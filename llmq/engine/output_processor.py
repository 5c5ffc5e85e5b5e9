"""OutputProcessor: new tokens -> text deltas, with stop conditions (EOS, stop ids, stop strings, length).

Text that could be the start of a stop string is held back until it is known not to be one, so the
deltas a client joins always equal the final text (which never contains the stop string).
"""
from __future__ import annotations

from dataclasses import dataclass

from llmq.engine.sequence import Sequence
from llmq.model.tokenizer import IncrementalDetokenizer, Tokenizer
from llmq.outputs import RequestDelta, TokenLogprob


@dataclass
class _SampleState:
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._states: dict[int, _SampleState] = {}  # by seq_id

    def process(self, seqs: list[Sequence], logprobs: list[TokenLogprob | None]) -> list[tuple[Sequence, RequestDelta]]:
        """For each sequence that got a token this step: its delta. A delta with `finished` set means
        the caller must finish the sequence with the delta's finish_reason."""
        deltas = []
        for seq, token_logprob in zip(seqs, logprobs):
            state = self._states.get(seq.seq_id)
            if state is None:
                state = self._states[seq.seq_id] = _SampleState(
                    IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens))
            deltas.append((seq, self._advance(seq, state, token_logprob)))
        return deltas

    def resume(self, seq: Sequence, num_emitted_chars: int) -> None:
        """Rebuild the text state of a sequence that arrives with generated tokens (a resumed sample):
        the same detokenizer fed the same tokens gives the same text, so the text another engine held
        back (a possible stop string's start) is emitted by the next delta, and nothing twice."""
        state = _SampleState(IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens))
        for token_id in seq.output_token_ids:
            state.text += state.detokenizer.add(token_id)
        state.num_emitted_chars = min(num_emitted_chars, len(state.text))
        state.num_emitted_tokens = seq.num_output_tokens
        self._states[seq.seq_id] = state

    def aborted(self, seq: Sequence) -> RequestDelta:
        """The last delta of a sequence stopped from outside: whatever text it had withheld."""
        state = self._states.pop(seq.seq_id, None)
        text = state.text[state.num_emitted_chars:] if state else ""
        tokens = tuple(seq.output_token_ids[state.num_emitted_tokens:]) if state else tuple(seq.output_token_ids)
        return RequestDelta(seq.request_id, seq.index, text, tokens, None, True, "abort")

    def _advance(self, seq: Sequence, state: _SampleState, token_logprob: TokenLogprob | None) -> RequestDelta:
        params = seq.params
        token_id = seq.token_ids[-1]
        finish_reason = stop_reason = None
        if token_id in params.stop_token_ids:
            finish_reason, stop_reason = "stop", token_id
        elif token_id in self.eos_token_ids and not params.ignore_eos:
            finish_reason = "stop"
        else:  # a stop token's own text never reaches the output
            checked = len(state.text)
            state.text += state.detokenizer.add(token_id)
            stop_string, cut = _find_stop(state.text, checked, params.stop) if params.stop else (None, 0)
            if stop_string is not None:
                state.text = state.text[:cut]
                finish_reason, stop_reason = "stop", stop_string
        if finish_reason is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            finish_reason = "length"
            state.text += state.detokenizer.flush()

        if finish_reason is not None:
            end = len(state.text)
            del self._states[seq.seq_id]
        elif params.stop:  # what could be the start of a stop string waits
            holdback = max(len(s) - 1 for s in params.stop)
            end = max(state.num_emitted_chars, len(state.text) - holdback)
        else:
            end = len(state.text)
        text = state.text[state.num_emitted_chars:end]
        state.num_emitted_chars = end
        tokens = tuple(seq.token_ids[seq.num_prompt_tokens + state.num_emitted_tokens:])  # not a copy of all output
        state.num_emitted_tokens += len(tokens)
        logprobs = (token_logprob,) if token_logprob is not None else None
        return RequestDelta(seq.request_id, seq.index, text, tokens, logprobs,
                            finish_reason is not None, finish_reason, stop_reason)


def _find_stop(text: str, checked: int, stops: tuple[str, ...]) -> tuple[str | None, int]:
    """The earliest stop string that ends in the new part of `text` (after `checked` chars)."""
    best, best_at = None, len(text) + 1
    for stop in stops:
        at = text.find(stop, max(0, checked - len(stop) + 1))
        if at != -1 and at < best_at:
            best, best_at = stop, at
    return best, best_at

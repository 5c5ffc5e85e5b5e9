"""LLMEngine (the streaming interface: add_request, abort, step) and LLM (offline generate)."""
from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf

from llmq.engine.block_manager import BlockManager
from llmq.engine.config import EngineConfig, ResumePoint
from llmq.engine.model_runner import ModelRunner
from llmq.engine.output_processor import OutputProcessor
from llmq.engine.scheduler import ScheduledBatch, Scheduler
from llmq.engine.sequence import Sequence
from llmq.errors import InvalidRequest
from llmq.limits import check_fits, check_samples, check_token_ids
from llmq.model.model_config import ModelConfig
from llmq.model.sampler import SampledStep
from llmq.model.tokenizer import Tokenizer
from llmq.outputs import CompletionOutput, RequestDelta, RequestOutput
from llmq.sampling_params import SamplingParams

log = logging.getLogger(__name__)

PromptInput = str | list[int] | dict


class LLMEngine:
    """One model on one device, many requests in flight. Not thread-safe: one thread drives it."""

    def __init__(self, config: EngineConfig):
        started = time.perf_counter()
        self.config = config
        ModelConfig.from_folder(config.model)  # the folder's config is checked before anything heavy
        self.tokenizer = Tokenizer.from_folder(config.model)
        self.model_runner = ModelRunner(config)
        self.max_model_len = self.model_runner.max_model_len
        model_config = self.model_runner.model_config
        self.eos_token_ids = self.tokenizer.eos_token_ids or model_config.eos_token_ids
        self.block_manager = BlockManager(self.model_runner.budget.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self._requests: dict[str, list[Sequence]] = {}
        self._pending: list[RequestDelta] = []  # abort deltas, handed out by the next step()
        self._seed_stream = random.Random(config.seed)
        self.counters = self.scheduler.counters  # tokens, prefix cache, preemptions (llmq/engine/counters.py)
        self.started: list[str] = []  # the requests that the last step() scheduled for the first time
        self.async_scheduling = config.uses_async_scheduling
        self._in_flight: tuple[ScheduledBatch, SampledStep | None] | None = None  # launched, tokens not yet read
        log.info("engine ready: %s (%s layers) on %s in %.1f s; async scheduling %s", config.model,
                 model_config.num_hidden_layers, config.device, time.perf_counter() - started,
                 "on" if self.async_scheduling else "off")

    # ---- intake ----------------------------------------------------------------------------

    def tokenize(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", "prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            check_token_ids(prompt, self.model_runner.model_config.vocab_size)
            return list(prompt)
        raise InvalidRequest("prompt must be a string or a list of token ids", "prompt")

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    priority: int = 0, resume: ResumePoint | None = None, tenant: str = "",
                    weight: float = 1.0) -> Sequence:
        """Queue a request. Raises InvalidRequest (naming the field) for a request that cannot run;
        nothing else in the engine is affected. `tenant` and `weight`: whose work it is, and that tenant's
        weight in the scheduler's fair share (see llmq/engine/scheduler.py); `priority` orders requests
        within a tenant. With `resume` (one sample, n == 1), the request goes on
        from the tokens another engine had generated: its deltas carry only what comes after them."""
        params = params or SamplingParams()
        if resume is not None and params.n != 1:
            raise InvalidRequest("a resumed request is one sample: n must be 1", "n")
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in flight", "request_id")
        check_samples(params.n, self.config.max_num_seqs)
        token_ids = self.tokenize(prompt)
        check_fits(len(token_ids), params.max_tokens, self.max_model_len)
        seed = params.seed if params.seed is not None else self._seed_stream.getrandbits(63)
        generated = self.tokenize(list(resume.output_token_ids)) if resume and resume.output_token_ids else []
        if len(generated) >= params.max_tokens:
            raise InvalidRequest(f"the resumed sample already has {len(generated)} tokens, max_tokens is "
                                 f"{params.max_tokens}", "max_tokens")
        if not 0 < weight < float("inf"):
            raise ValueError(f"a tenant's weight must be a positive number, got {weight!r}")
        seq = Sequence(request_id, token_ids + generated, params, priority=priority, tenant=tenant, weight=weight,
                       sampling_seed=seed, num_prompt_tokens=len(token_ids))
        if resume is not None:
            self.output_processor.resume(seq, resume.num_emitted_chars)
        self._requests[request_id] = [seq]
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. Its last deltas (finish_reason "abort") come out of
        the next step(). Returns False for an unknown or finished request."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            if not seq.is_finished:
                unforked = range(seq.params.n - seq.forks_pending, seq.params.n)  # n > 1, prompt not done yet
                self.scheduler.finish(seq, "abort")
                self._pending.append(self.output_processor.aborted(seq))
                self._pending.extend(RequestDelta(request_id, i, "", (), None, True, "abort") for i in unforked)
        return True

    # ---- the loop --------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._in_flight is not None

    def step(self) -> list[RequestDelta]:
        """Run one iteration: every running sequence advances; returns the deltas it produced.

        With async scheduling (EngineConfig.async_scheduling) this step is launched before the last
        one's tokens are read, and the deltas returned are the last step's: the host schedules step
        n+1 and turns step n's tokens into text while the device computes step n+1. A sequence that
        step n finishes has computed one token more in step n+1, which is discarded."""
        batch = self.scheduler.schedule()
        self.started = [seq.request_id for seq in batch.started]
        for seq in batch.forked + batch.deferred:  # the request's other samples: aborted with it
            self._requests[seq.request_id].append(seq)
        launched = None
        if batch:
            launched = (batch, self.model_runner.launch(batch))
            self.scheduler.launched(batch)
        if self.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        return self._finish(self._complete(*launched) if launched else [])

    def _complete(self, batch: ScheduledBatch, sampled: SampledStep | None):
        """A launched step's tokens, read from the device, appended and turned into deltas."""
        token_ids, logprobs = sampled.result() if sampled else ([], [])
        taken = self.scheduler.append_tokens(batch, token_ids)
        return self.output_processor.process([batch.samplers[i] for i in taken], [logprobs[i] for i in taken])

    def _finish(self, deltas) -> list[RequestDelta]:
        out, self._pending = self._pending, []
        for seq, delta in deltas:
            family = self._requests.get(seq.request_id)
            if delta.finished:
                self.scheduler.finish(seq, delta.finish_reason, delta.stop_reason)
                if family is not None and all(s.is_finished for s in family) and len(family) == seq.params.n:
                    del self._requests[seq.request_id]
            out.append(delta)
        return out

    # ---- figures ---------------------------------------------------------------------------

    def stats(self) -> dict:
        """The load (running, waiting, KV blocks) and how the model is held and run (dtype, quantization,
        ranks, async scheduling)."""
        return {"running": len(self.scheduler.running), "waiting": self.scheduler.num_waiting,
                "free_blocks": self.block_manager.num_free_blocks, "total_blocks": self.block_manager.num_blocks,
                "dtype": self.model_runner.dtype_choice.name, "quantization": self.model_runner.budget.quantization,
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "pipeline_parallel_size": self.config.pipeline_parallel_size, "async_scheduling": self.async_scheduling}

    def close(self) -> None:
        """Stop the other ranks of a parallel engine (nothing to do on one device)."""
        self.model_runner.close()


class LLM:
    """Offline batch generation: `LLM(model=folder).generate(prompts, params)`."""

    def __init__(self, model: str | None = None, **engine_options):
        if model is None:  # the project's own default model, as the service would serve it
            from llmq.model.checkpoint import ensure_default_model
            from llmq.settings import Settings
            model = str(ensure_default_model(Settings.from_env().home / "models"))
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the other ranks of a parallel engine. `with LLM(...) as llm:` does it on the way out."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: PromptInput | Iterable[PromptInput],
                 params: SamplingParams | SequenceOf[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given. A single prompt (string, or dict) may be
        passed bare; a list of ints is one prompt of token ids."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, params):
            request_id = f"gen-{next(self._ids)}"
            seq = self.engine.add_request(request_id, prompt, p)
            results[request_id] = RequestOutput(request_id, seq.prompt_token_ids,
                                                [CompletionOutput(i) for i in range(p.n)])
        self._run(results, use_tqdm)
        return list(results.values())

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        from tqdm import tqdm

        progress = tqdm(total=len(results), desc="generate", unit="req", disable=not use_tqdm or len(results) < 2)
        generated = 0
        started = time.perf_counter()
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                result = results[delta.request_id]
                result.outputs[delta.index].add(delta)
                generated += len(delta.token_ids)
                if delta.finished and result.finished:
                    progress.update(1)
                    progress.set_postfix(tok_s=f"{generated / (time.perf_counter() - started):.0f}")
        progress.close()

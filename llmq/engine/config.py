"""Engine configuration and resume points: frozen dataclasses, validated on creation. No torch here."""
from __future__ import annotations

from dataclasses import dataclass

# Weight-only quantization at load (llmq/model/quantization); a GPTQ / AWQ checkpoint needs none.
QUANTIZATION_METHODS = ("int8", "int4")
# How decodes and prompt chunks attend (llmq/model/attention.py): auto = the Triton
# kernels on CUDA where Triton is installed, the C++ kernel ("cpu") on a CPU where the CPU kernels are in
# use, else torch.
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
# The KV cache on a CPU when kv_cache_bytes is not given: the machine's memory is not the engine's alone.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ResumePoint:
    """Where an interrupted sample stopped, so another engine can carry it on: the tokens it had
    generated and how much of their text was already streamed (text that could start a stop string is
    held back, so that can be less than the tokens' text). The engine recomputes the KV of prompt +
    tokens in one prefill, exactly as after a preemption, and generates on from there."""

    output_token_ids: tuple[int, ...]
    num_emitted_chars: int = 0


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. `model` is a Hugging Face model folder.

    KV cache size: `kv_cache_bytes` where given, on either device; else on CUDA `gpu_memory_utilization`
    of device memory minus weights and the measured activation peak, on CPU DEFAULT_CPU_KV_CACHE_BYTES.
    Either way capped at what max_num_seqs full-length sequences can use.
    """

    model: str
    device: str = "cpu"
    dtype: str = "auto"  # or float32, float16, bfloat16; "auto" as llmq/engine/dtype.py chooses
    # Tokens a KV cache block holds. A decode step reads every sequence's blocks wherever they lie, and on a
    # CPU longer blocks read faster (README, "Using the engine directly").
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # CPU intra-op threads (per rank); None: torch's default, shared among ranks
    tensor_parallel_size: int = 1  # ranks that split every layer (llmq/model/tensor_parallel.py)
    pipeline_parallel_size: int = 1  # ranks that each hold a run of layers (llmq/model/pipeline_parallel.py)
    pipeline_micro_batches: int | None = None  # a pipeline step's micro-batches; None: one per stage
    seed: int = 0  # seeds the generators of requests that give no seed of their own
    # Quantize the decoder projections at load: "int8" (per output channel, symmetric) or "int4"
    # (groups of quantization_group_size input columns). Embeddings, lm_head and norms stay as they are.
    quantization: str | None = None
    quantization_group_size: int = 128
    # On a CPU, pack the float weight matrices once for oneDNN's products (llmq/model/cpu_prepack.py).
    prepack_weights: bool = True
    # On a CPU with AVX512-VNNI, greedy steps' tokens through an int8 copy of the LM head that rules out
    # most columns before the head multiplies the rest: the same tokens (llmq/model/greedy_screen.py).
    screen_greedy_head: bool = True
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    # On a CPU, the fused C++ kernels for norms, rotary, SiLU and decode attention (llmq/model/cpu_kernels.py),
    # built at first use. None: where they build (a C++ compiler and ninja), else plain PyTorch with a
    # warning; True: they must build; False: plain PyTorch.
    cpu_kernels: bool | None = None
    # On CUDA (one device, no parallelism), replay decode-only steps from CUDA graphs captured at start,
    # one per batch-size bucket (llmq/engine/decode_graphs.py). False: every step eager.
    cuda_graphs: bool = True
    # Schedule step n+1 while the device computes step n, the tokens step n samples read on the device
    # (llmq/engine/llm.py). None: on for one CUDA device, where the host's work then hides behind the
    # device's; off on a CPU, where host and "device" are the same cores and it would only delay tokens.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes",
                     "tensor_parallel_size", "pipeline_parallel_size", "quantization_group_size"):
            value = getattr(self, name)
            if (value is not None or name != "kv_cache_bytes") and (not _is_int(value) or value < 1):
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"EngineConfig.max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.pipeline_micro_batches is not None and (not _is_int(self.pipeline_micro_batches)
                                                        or self.pipeline_micro_batches < 1):
            raise ValueError(f"EngineConfig.pipeline_micro_batches must be a positive integer or None, "
                             f"got {self.pipeline_micro_batches!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"EngineConfig.dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"EngineConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineConfig.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.async_scheduling and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("EngineConfig.async_scheduling runs on one device: it cannot be combined with "
                             "tensor or pipeline parallelism")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"EngineConfig.quantization must be None or one of {', '.join(QUANTIZATION_METHODS)}, "
                             f"got {self.quantization!r}")

    @property
    def uses_async_scheduling(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda") and self.tensor_parallel_size * self.pipeline_parallel_size == 1

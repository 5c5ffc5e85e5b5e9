"""The small operations of a step, two ways: plain PyTorch, and fused C++ for a CPU.

A decode step of a small model on a CPU spends most of its time outside the matrix products: RMSNorm,
rotary, SiLU, the residual adds and decode attention are each several PyTorch operators, and each
operator allocates, forks the thread pool and walks memory once more. `csrc/cpu_kernels.cpp` does each
in one pass (decode attention reads the paged cache in place, through the block tables). It is built
at first use with torch's extension machinery (a C++ compiler and ninja) and cached by torch
(TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions) under a name that includes this CPU's
instruction set, since it is compiled for it; later loads take well under a second.

`TorchKernels` is the plain path, the exact operators llama.py always ran; `NativeKernels` the fused
one, which rounds a half dtype once where PyTorch rounds after every operator. The model calls one of
the two through the same methods, so they are held side by side in tests/model/test_cpu_kernels.py.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llmq.model.rope import apply_rope

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
HEADERS = sorted(SOURCE.parent.glob("*.h"))  # included by SOURCE: part of what the build's name is hashed from
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
# ATen's vector types (at::vec) take their width from the instruction set ATen itself runs with here.
_VECTOR_WIDTHS = ("AVX512", "AVX2")


class TorchKernels:
    """The plain-PyTorch operators, on any device."""

    name = "torch"
    tiled_products: str | None = None  # bfloat16 products over weights in tiles: the fused kernels' (NativeKernels)
    panel_products: str | None = None  # products over float32 or bfloat16 weights in panels: the same
    panel_dtypes: tuple[torch.dtype, ...] = ()  # the weights' dtypes that go in panels: the same

    @staticmethod
    def takes_prompt(head_dim: int, dtype: torch.dtype) -> bool:
        """Whether a prompt kernel takes long prompt chunks in the paged attention call: none here."""
        return False

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; bit-identical to the steps below
            return F.rms_norm(x, weight.shape, weight, eps)
        # Normalise in float32 whatever the weights' dtype, then scale in the weights' dtype, as transformers does.
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        total = residual + x
        return cls.rms_norm(total, weight, eps), total

    @staticmethod
    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, Dh]; a new tensor (x is left as it was)."""
        return apply_rope(x, cos, sin)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def silu_and_mul_of(self, gate_up_proj, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(gate_up_proj(x)): the MLP's gate and up projections and their product."""
        return self.silu_and_mul(gate_up_proj(x))

    def decoder_layer(self, layer, hidden, residual, cos, sin, kv_cache, meta):
        """A whole LlamaDecoderLayer.forward in one call, where a path has it; None: run the layer's own."""
        return None

    def decoder_layers(self, layers, hidden, cos, sin, kv_caches, meta):
        """Every one of a model's `layers` in turn, as decoder_layer would take each, without the Python
        between them; returns the stream after the last (its output plus residual). None: run the layers
        one by one."""
        return None

    @staticmethod
    def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """k, v [T, KVH, Dh] into their slots of the caches [KVH, slots, Dh]."""
        k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))


class NativeKernels(TorchKernels):
    """The fused C++ kernels for CPU tensors; anything else takes the plain operators."""

    name = "cpu"

    def __init__(self, module):
        self._ops = module
        # What multiplies bfloat16 weights laid out in tiles here (csrc/tiled_linear.h): "amx" (the CPU's
        # matrix units), "avx512-bf16" (its vector dot products) or "avx512-widened" (the tiles widened to
        # float32 on its multiply-adds, where those run the faster); None where none, and cpu_prepack.py
        # then packs bfloat16 weights for oneDNN instead of in tiles for tiled_linear.
        self.tiled_products = module.tiled_products() or None
        # What multiplies weights laid out in panels here (csrc/panel_linear.h): "avx512" or "avx2" (their
        # fused multiply-adds); None on a CPU with neither, where they are packed for oneDNN (or in tiles).
        self.panel_products = module.panel_products() or None
        # The weights' dtypes that go in panels: float32, and on an AVX2 CPU without AVX-512 bfloat16 too
        # (widened as it is read: that CPU has no bfloat16 arithmetic). With AVX-512, bfloat16 weights go
        # in tiles where the CPU has AVX512-BF16, else to oneDNN, whose product they have not been
        # measured against.
        self.panel_dtypes = {"avx2": (torch.float32, torch.bfloat16), "avx512": (torch.float32,)}.get(
            self.panel_products, ())
        # Whether a greedy step's argmax can come through an int8 screen of the LM head (csrc/greedy_screen.h,
        # greedy_screen.add_greedy_screen): on a CPU with AVX512-VNNI.
        self.screens_greedy_head = bool(module.screens_greedy_head())

    def rms_norm(self, x, weight, eps):
        if x.is_cpu and x.dim() == 2 and x.stride(1) == 1:
            return self._ops.rms_norm(x, weight, eps)
        return TorchKernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if x.is_cpu and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
            return tuple(self._ops.add_rms_norm(x, residual, weight, eps))
        return TorchKernels.add_rms_norm(x, residual, weight, eps)

    def rotary(self, x, cos, sin):
        """In place: x (a view into the qkv projection's output) is rotated and returned."""
        if x.is_cpu and x.stride(-1) == 1:
            self._ops.rotary_(x, cos.contiguous(), sin.contiguous())
            return x
        return TorchKernels.rotary(x, cos, sin)

    def silu_and_mul(self, gate_up):
        if gate_up.is_cpu and gate_up.is_contiguous():
            return self._ops.silu_and_mul(gate_up)
        return TorchKernels.silu_and_mul(gate_up)

    def silu_and_mul_of(self, gate_up_proj, x):
        """In one pass where the projection's weight is laid out paired in tiles (cpu_prepack.tile_gate_up),
        or in panels with gate and up each whole panels: the [T, 2 I] product is never stored."""
        weight = getattr(gate_up_proj, "weight", None)
        if weight is not None and is_paired(weight):
            return self._ops.tiled_silu_and_mul(x, weight, gate_up_proj.bias)
        if weight is not None and is_paneled(weight) and weight.shape[0] % 2 == 0 and x.is_cpu:
            return self._ops.panel_silu_and_mul(x, weight, gate_up_proj.bias)
        return TorchKernels.silu_and_mul_of(self, gate_up_proj, x)

    def decoder_layer(self, layer, hidden, residual, cos, sin, kv_cache, meta):
        """The layer in one C++ call (cpu_kernels.cpp's decoder_layer: the same kernels, without the Python
        between them) where every weight is prepacked (in tiles, or all for oneDNN) and every token is
        the paged attention kernel's (no SDPA span; padding rows past them may follow); else None."""
        if not self._fuses(hidden, meta):
            return None
        weights = self._layer_weights(layer)
        if weights is None:
            return None
        return tuple(self._run_layer(weights, hidden, residual, cos, sin, kv_cache, meta))

    def decoder_layers(self, layers, hidden, cos, sin, kv_caches, meta):
        """Every layer through decoder_layer's C++ call, where decoder_layer would take each: a decode
        step's Python around its layers (a module call, the checks and the weights' lookup per layer)
        costs about as much as one of the layers' operations."""
        if len(layers) == 0 or not self._fuses(hidden, meta):
            return None
        weights = self._stack_weights(layers)
        if weights is None:
            return None
        output, residual = hidden, None
        # Each layer's down projection asks for the keys and values the next layer's attention will read
        # (csrc/paged_prefetch.h, KvWarmup).
        for layer_weights, kv_cache, next_cache in zip(weights, kv_caches, [*kv_caches[1:], None]):
            output, residual = self._run_layer(layer_weights, output, residual, cos, sin, kv_cache, meta, next_cache)
        return residual + output

    def layer_rows_at_once(self, layer) -> int | None:
        """The rows decoder_layer takes through `layer` at a time (a longer step's in groups of this many),
        or None where it does not take the layer: more where its products run in tiles, on the matrix units
        or in AVX512-BF16's dot products (csrc/cpu_kernels.cpp, kTiledLayerRowsAtOnce)."""
        weights = self._layer_weights(layer)
        return None if weights is None else self._ops.layer_rows_at_once(weights)

    @staticmethod
    def _fuses(hidden, meta) -> bool:
        """Whether the step is one decoder_layer takes: every token row the paged kernel's."""
        decodes = meta.paged_decodes
        return (decodes is not None and decodes.kernel == "cpu" and not meta.decodes and not meta.prefills
                and decodes.num_tokens == meta.slot_mapping.shape[0] and hidden.shape[0] >= decodes.num_tokens)

    def _run_layer(self, weights, hidden, residual, cos, sin, kv_cache, meta, next_cache=None):
        decodes = meta.paged_decodes
        k_cache, v_cache = kv_cache
        next_k, next_v = next_cache if next_cache is not None else (None, None)
        return self._ops.decoder_layer(weights, hidden, residual, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                       decodes.block_tables, decodes.context_lens, decodes.query_tables,
                                       meta.block_size, next_k, next_v)

    def _stack_weights(self, layers):
        """_layer_weights of every layer, kept on the layers' list while the products' weights stay the same
        tensors; None where a layer has none. The check reads each product's own parameter dict, a dict
        lookup where `module.weight` is a call of nn.Module.__getattr__."""
        cached = layers.__dict__.get("_fused_stack")
        if cached is not None and all(params.get("weight") is weight for params, weight in cached[0]):
            return cached[1]
        weights = [self._layer_weights(layer) for layer in layers]
        checks = tuple((p._parameters, p._parameters.get("weight")) for layer in layers for p in _products(layer))
        layers.__dict__["_fused_stack"] = (checks, None if any(w is None for w in weights) else weights)
        return layers.__dict__["_fused_stack"][1]

    def _layer_weights(self, layer):
        """The layer's weights gathered for decoder_layer, kept on the layer while its weights stay the
        same tensors; None where they are not all prepacked one way (in tiles, in panels, or for oneDNN;
        not quantized, tensor-parallel or dense)."""
        attention = layer.self_attn
        projections = _products(layer)
        matrices = tuple(getattr(p, "weight", None) for p in projections)
        cached = layer.__dict__.get("_fused_weights")
        if cached is not None and all(a is b for a, b in zip(cached[0], matrices)):
            return cached[1]
        weights = None
        tiled = (all(m is not None and is_tiled(m) for m in matrices) and is_paired(matrices[2])
                 and not any(is_paired(m) for m in matrices[:2] + matrices[3:]))
        if (tiled or all(m is not None and m.is_mkldnn for m in matrices)
                or all(m is not None and is_paneled(m) for m in matrices)):
            weights = self._ops.LayerWeights(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *matrices,
                *(p.bias for p in projections), layer.input_layernorm.eps, attention.num_heads,
                attention.num_kv_heads, attention.head_dim, attention.scale)
        layer.__dict__["_fused_weights"] = (matrices, weights)
        return weights

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping):
        if k_cache.is_cpu and k.stride(-1) == 1 and v.stride(-1) == 1 and slot_mapping.dtype == torch.long:
            self._ops.write_kv(k_cache, v_cache, k, v, slot_mapping)
        else:
            TorchKernels.write_kv(k_cache, v_cache, k, v, slot_mapping)

    def decode_attention_path(self, dtype: torch.dtype, head_dim: int, query_heads_per_kv_head: int = 1) -> str:
        """Which code `paged_decode_attention` runs: "amx" (bfloat16 on the matrix units, where 8 to 16 query
        heads share a KV head, csrc/decode_attention_amx.h), "avx512-bf16" (bfloat16 on a CPU with
        AVX512-BF16, csrc/decode_attention_bf16.h), "avx512-widened" (the same, widened to float32 where the
        CPU's bfloat16 dot products are the slower: csrc/bf16_widening.h) or "vector" (float32 arithmetic on
        ATen's vector types)."""
        return self._ops.decode_attention_path(str(dtype).removeprefix("torch."), head_dim, query_heads_per_kv_head)

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                               scale: float, out: torch.Tensor, query_tables: torch.Tensor | None = None) -> None:
        """Each query token of q [N, H, Dh] as a decode against caches [KVH, slots, Dh], into out
        [N, H * Dh]: query n reads int32 block_tables [rows, max_blocks] row query_tables[n] (int32 [N];
        row n where None) over its context_lens[n] positions (itself included). A prompt chunk's tokens
        share their sequence's row, each with its own length; where `takes_prompt(Dh, dtype)`, a long
        chunk's go to the prompt kernel in this call (csrc/prompt_attention_amx.h and prompt_attention.h
        say which)."""
        self._ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, out,
                                         query_tables)

    def takes_prompt(self, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether this build has a prompt kernel for heads of `head_dim` in `dtype`: on the matrix units
        for bfloat16 (csrc/prompt_attention_amx.h), on the panel products' AVX2 multiply-adds for every
        dtype (csrc/prompt_attention.h). Then `paged_decode_attention` takes a long prompt chunk in it,
        and every chunk's attention is that call's."""
        return self._ops.prompt_attention_supported(head_dim, str(dtype).removeprefix("torch."))

    def prompt_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_cached: int,
                         scale: float) -> torch.Tensor:
        """The prompt kernel on its own (tests, benchmarks): a prompt chunk's causal attention, q [n, H, Dh]
        over keys and values [KVH, num_cached + n, Dh] (its context, its own tokens last) -> [n, H * Dh],
        where `takes_prompt(Dh, q.dtype)`; the twin of attention.py's SDPA prefill."""
        return self._ops.prompt_attention(q, keys, values, num_cached, scale)


TORCH_KERNELS = TorchKernels()


def fast_argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's argmax (the first of equals) in one call of the fused kernels, for CPU logits
    [S, V] in float32 or bfloat16 with contiguous rows; None where they are not loaded (this does not
    build them) or do not take these logits, and the caller computes it another way."""
    if (_loaded is None or not hasattr(_loaded._ops, "argmax_rows") or not logits.is_cpu or logits.dim() != 2
            or logits.stride(1) != 1 or logits.dtype not in (torch.float32, torch.bfloat16)):
        return None
    return _loaded._ops.argmax_rows(logits)


def _products(layer) -> tuple:
    """A decoder layer's four matrix products' modules: qkv, o, gate/up, down."""
    attention, mlp = layer.self_attn, layer.mlp
    return attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj


def is_tiled(weight: torch.Tensor) -> bool:
    """Whether a weight was laid out in tiles for tiled_linear: [N/16, K/32, 16, 32] by
    cpu_prepack.tile_weight, or paired [N/32, 2, K/32, 16, 32] by cpu_prepack.tile_gate_up (no dense
    weight of a Linear has four or five dimensions)."""
    return not weight.is_mkldnn and weight.dim() in (4, 5)


def is_paneled(weight: torch.Tensor) -> bool:
    """Whether a weight was laid out in panels for panel_linear: [N/16, K, 16] by cpu_prepack.panel_weight
    (no dense weight of a Linear has three dimensions)."""
    return not weight.is_mkldnn and weight.dim() == 3


def is_paired(weight: torch.Tensor) -> bool:
    """Whether a gate/up weight was laid out paired by cpu_prepack.tile_gate_up."""
    return not weight.is_mkldnn and weight.dim() == 5


def tiled_linear(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) in bfloat16, for W laid out in tiles by cpu_prepack, which does so only where
    native_kernels().tiled_products: on the CPU's matrix units (AMX), or its AVX512-BF16 dot products."""
    return _loaded._ops.tiled_linear(x, tiles, bias)


def tiled_argmax(x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equals) of x @ W.T in bfloat16, for W laid out in tiles (not
    paired): what argmax_rows of tiled_linear(x, tiles, None) gives, without storing the product."""
    return _loaded._ops.tiled_argmax(x, tiles)


def panel_argmax(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equals) of x @ W.T, for W laid out in panels: what argmax_rows of
    panel_linear(x, panels, None) gives, without storing the product."""
    return _loaded._ops.panel_argmax(x, panels)


def screened_argmax(x: torch.Tensor, head: torch.Tensor, screen: torch.Tensor, terms: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    """What tiled_argmax or panel_argmax (float32) of x and the LM head `head` gives, each row's candidates
    found by the head's int8 screen (greedy_screen.screen_weight: `screen`, `terms`) and only they
    multiplied by `head` itself (csrc/greedy_screen.h). Adds to counts (int64 [3]) the rows, the blocks
    of 16 columns multiplied again, and the rows the screen left to the whole product."""
    if is_paneled(head):
        return _loaded._ops.screened_panel_argmax(x, head, screen, terms, counts)
    return _loaded._ops.screened_tiled_argmax(x, head, screen, terms, counts)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) summed in float32 (float32, or bfloat16 rounded once), for W laid out in panels by
    cpu_prepack, which does so only where native_kernels().panel_products: on a CPU's AVX2 or AVX-512
    fused multiply-adds."""
    return _loaded._ops.panel_linear(x, panels, bias)


_lock = threading.Lock()
_loaded: NativeKernels | None = None
_failure: str | None = None


def native_kernels() -> NativeKernels | None:
    """The C++ kernels, built on first call (once per process; the build itself is cached across
    processes). None where they cannot be built here (no compiler, no ninja), with the reason logged
    once and kept in `native_kernels_failure()`."""
    global _loaded, _failure
    with _lock:
        if _loaded is None and _failure is None:
            try:
                _loaded = NativeKernels(_build())
            except Exception as err:  # a missing compiler surfaces as several kinds of error
                _failure = _first_error(err)
                log.warning("the fused CPU kernels could not be built (%s); the plain PyTorch operators run "
                            "instead", _failure)
        return _loaded


def native_kernels_failure() -> str | None:
    """Why native_kernels() returned None, if it did."""
    return _failure


def _first_error(err: Exception) -> str:
    """The line of a build's output that says what went wrong (a compiler's first error), else its last."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and not line.startswith("Error building")]
    said = errors[0] if errors else (lines[-1] if lines else "")
    return f"{type(err).__name__}: {said}"


def _build():
    from torch.utils.cpp_extension import load  # imported here: it pulls in setuptools

    capability = torch.backends.cpu.get_cpu_capability()
    flags = _FLAGS + ([f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
                      if capability in _VECTOR_WIDTHS else [])
    sources = b"".join(path.read_bytes() for path in [SOURCE, *HEADERS])
    digest = hashlib.sha256(sources + " ".join(flags).encode() + _instruction_set().encode()
                            + torch.__version__.encode()).hexdigest()[:12]
    started = time.perf_counter()
    module = load(name=f"llmq_cpu_kernels_{digest}", sources=[str(SOURCE)], extra_cflags=flags,
                  extra_ldflags=["-fopenmp"], verbose=False)
    log.info("fused CPU kernels ready in %.1f s", time.perf_counter() - started)
    return module


def _instruction_set() -> str:
    """This CPU's model and flags: the build targets them (-march=native)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))

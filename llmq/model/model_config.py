"""ModelConfig: the parts of a Hugging Face config.json the Llama-family model needs, checked on load."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """A model folder llmq cannot serve; the message names the file and field."""


class ModelLoadError(ValueError):
    """The folder's weights do not fit the model; the message names the file and tensor."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE; else {"rope_type": ..., factors}
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{path} not found: a model folder needs a Hugging Face config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ModelConfigError(f"{path} is not valid JSON: {err}") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        def need(key: str):
            if key not in raw:
                raise ModelConfigError(f"{source}: required field '{key}' is missing")
            return raw[key]

        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise ModelConfigError(
                f"{source}: field 'architectures' is {architectures!r}; llmq serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        model_type = raw.get("model_type", SUPPORTED_ARCHITECTURES[architecture])
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        is_qwen2 = model_type == "qwen2"
        attention_bias = bool(raw.get("attention_bias", False))
        rope_theta, rope_scaling = _rope(raw, source)
        eos = raw.get("eos_token_id")
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
        )


def _rope(raw: dict, source: str) -> tuple[float, dict | None]:
    """RoPE theta and scaling, from `rope_theta` + `rope_scaling` (older transformers) or
    `rope_parameters` (newer transformers write theta inside it)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: rope type '{rope_type}' is not supported (llmq supports {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), None
    params["rope_type"] = rope_type
    return float(theta), params

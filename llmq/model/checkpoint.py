"""Writes small Llama-format checkpoints, so llmq runs on a machine that has no model.

The default model (random weights plus a byte-fallback tokenizer) is made once under the models
folder and reused; benchmarks use the same writer for a "bench" model that both llmq and
transformers load. Everything here is deterministic: the same seed and config give the same bytes.
This module must not import transformers, which is only a test dependency, nor torch: the weights
are drawn and written with numpy, so the web server can make the default model and stay torch-free.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "llmq-tiny-random"
TOKENIZER_VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2, as in Llama 2

# Role-tagged turns; each turn ends with </s>, so the model's EOS also ends an assistant turn.
# The template renders bos_token itself: by Hugging Face convention a rendered chat is encoded
# without adding special tokens again.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# The merges of the default tokenizer are learned from this text, trained line by line.
_TRAINING_TEXT = """\
The small model that ships with this program has never read a book. Its weights are random numbers, drawn the same way on every machine, so the text it writes is noise. That is fine: it is here so that the whole system can be started, tested and measured on a fresh computer without downloading anything at all.
When a request comes in, the server puts it in a queue. A worker takes the next batch of requests from the queue, turns each prompt into tokens, and runs the model one step at a time. After every step, the worker looks at which requests have finished and makes room for new ones. This is what people mean when they talk about continuous batching.
The cache that holds the keys and values of earlier tokens is split into pages of equal size. A request that grows only asks for one more page when the last one is full, so memory is not wasted on space that might never be used. When the request is done, its pages go back to the pool and another request can have them.
On a quiet morning the garden behind the house is full of birds. They sing in the trees, look for seeds between the stones, and fly away when the cat walks out of the kitchen door. The old man who lives there says that he has counted more than twenty kinds of birds this year, and that he writes down the name of every one in a little green book.
People often think that a computer is fast because it does one thing very quickly. In truth, most of the speed comes from doing many things at the same time, and from never waiting when there is other work that could be done instead. A good program keeps every part of the machine busy, and it does not ask for more than it needs.
Every evening, the children come home from school, put their bags by the door and ask what there is to eat. Their mother tells them to wash their hands first. Then they sit at the table, talk about their day, and argue about whose turn it is to feed the dog. After dinner they read for an hour before they go to bed.
If you want to learn something new, start with a question that you really want answered. Read what other people have written about it, try the simplest thing that could possibly work, and write down what happened. Most of the time the first answer is wrong, but it is wrong in a way that teaches you where to look next.
"""


def write_llama_checkpoint(folder, config: dict, *, seed: int = 0, tokenizer_json: str | None = None,
                           tokenizer_config: dict | None = None, max_shard_bytes: int | None = None) -> Path:
    """Writes a Hugging Face LlamaForCausalLM-compatible folder (or Qwen2 for model_type "qwen2").

    Files: config.json (the given dict, with architectures / model_type / torch_dtype defaults
    filled), generation_config.json (bos/eos from config), model.safetensors, or, when
    max_shard_bytes is set and the weights exceed it, model-0000i-of-0000N.safetensors shards plus
    model.safetensors.index.json; and tokenizer.json / tokenizer_config.json when given.

    Invariants: weights are float32 with HF parameter names, drawn from numpy's PCG64 generator seeded
    with `seed`, so the same seed and config give byte-identical files. The folder appears whole or
    not at all: it is written into a temporary sibling and renamed into place. An existing folder
    is replaced.
    """
    folder = Path(folder)
    tmp = _write_to_temp(folder, config, seed, tokenizer_json, tokenizer_config, max_shard_bytes)
    if folder.exists():
        # A directory rename cannot overwrite a non-empty one: move the old folder aside first.
        old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
        os.replace(folder, old / folder.name)
        os.replace(tmp, folder)
        shutil.rmtree(old)
    else:
        os.replace(tmp, folder)
    return folder


def _write_to_temp(folder: Path, config, seed, tokenizer_json, tokenizer_config, max_shard_bytes) -> Path:
    """Writes the checkpoint into a fresh hidden directory next to `folder` and returns it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; a published model is readable like any folder
        config = _with_defaults(config)
        _write_json(tmp / "config.json", config)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
        _write_json(tmp / "generation_config.json", generation)
        _write_weights(tmp, random_llama_weights(config, seed), max_shard_bytes)
        if tokenizer_json is not None:
            (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        if tokenizer_config is not None:
            _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors writes its files owner-only, unlike the rest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _with_defaults(config: dict) -> dict:
    config = dict(config)
    model_type = config.setdefault("model_type", "llama")
    if "architectures" not in config:
        if model_type not in _ARCHITECTURES:
            raise ValueError(f"no default architecture for model_type {model_type!r}; pass 'architectures'")
        config["architectures"] = [_ARCHITECTURES[model_type]]
    config.setdefault("torch_dtype", "float32")
    return config


def random_llama_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights named as Hugging Face names them, drawn in a fixed order from one generator.

    Matrices and biases are normal(0, 0.02); norm weights are 1 + normal(0, 0.02), so that code
    which forgets to apply a norm weight gives a different answer than code which applies it.
    """
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    # Qwen2 always has q/k/v biases and never an o bias; Llama has all four or none.
    qwen2 = config.get("model_type") == "qwen2"
    qkv_bias = qwen2 or bool(config.get("attention_bias"))
    o_bias = not qwen2 and bool(config.get("attention_bias"))
    mlp_bias = bool(config.get("mlp_bias"))

    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, out_dim, in_dim, bias in (
            ("self_attn.q_proj", heads * head_dim, hidden, qkv_bias),
            ("self_attn.k_proj", kv_heads * head_dim, hidden, qkv_bias),
            ("self_attn.v_proj", kv_heads * head_dim, hidden, qkv_bias),
            ("self_attn.o_proj", hidden, heads * head_dim, o_bias),
            ("mlp.gate_proj", inter, hidden, mlp_bias),
            ("mlp.up_proj", inter, hidden, mlp_bias),
            ("mlp.down_proj", hidden, inter, mlp_bias),
        ):
            shapes.append((f"{p}{name}.weight", (out_dim, in_dim)))
            if bias:
                shapes.append((f"{p}{name}.bias", (out_dim,)))
        shapes.append((f"{p}input_layernorm.weight", (hidden,)))
        shapes.append((f"{p}post_attention_layernorm.weight", (hidden,)))
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (vocab, hidden)))

    generator = np.random.default_rng(seed)
    weights = {}
    for name, shape in shapes:
        noise = generator.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        weights[name] = noise + np.float32(1.0) if name.endswith("norm.weight") else noise
    return weights


def _write_weights(folder: Path, weights: dict[str, np.ndarray], max_shard_bytes: int | None) -> None:
    from safetensors.numpy import save_file

    metadata = {"format": "pt"}  # transformers expects this tag on PyTorch safetensors files
    total = sum(t.nbytes for t in weights.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(weights, folder / "model.safetensors", metadata=metadata)
        return
    # Greedy, in parameter order; a tensor bigger than the limit gets a shard of its own.
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / filename, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, filename))
    _write_json(folder / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def byte_level_tokenizer_json() -> str:
    """A Llama-2-style tokenizer.json with 512 tokens: <unk>, <s>, </s>, the 256 byte-fallback
    tokens <0x00>..<0xFF>, the characters of the embedded training text, then BPE merges learned
    from that text. Any UTF-8 text encodes (unknown characters fall back to bytes) and decodes
    back exactly, except that one leading space is dropped, as with Llama's own tokenizer.
    The pipeline is the one transformers' LlamaTokenizer builds (Metaspace with split=False,
    prepend_scheme "first"), so it gives the same ids whether loaded from this JSON or rebuilt
    from its vocab and merges. Deterministic: the same string on every call and every machine.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    merges = _train_merges(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)])
    return tokenizer.to_str()


def _train_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Adds the training text's characters, then merged pieces, to `vocab` until it holds
    TOKENIZER_VOCAB_SIZE tokens; returns the merges in rank order.

    Plain BPE, as sentencepiece does it: words are split before each "▁", so no piece has a "▁"
    anywhere but at its start. Ties between equally frequent pairs go to the smaller pair, which
    keeps the result independent of dict and hash order.
    """
    splitter = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    counts = Counter(word for line in _TRAINING_TEXT.splitlines() for word, _ in splitter.pre_tokenize_str(line))
    words = [(list(word), n) for word, n in sorted(counts.items())]
    for char in sorted({c for symbols, _ in words for c in symbols}):
        vocab.setdefault(char, len(vocab))
    merges = []
    while len(vocab) < TOKENIZER_VOCAB_SIZE:
        pairs = Counter()
        for symbols, n in words:
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += n
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        if pairs[best] < 2:  # merging one-off pairs would just memorise rare words
            raise RuntimeError("training text too short for the tokenizer vocab size")
        merged = best[0] + best[1]
        merges.append(best)
        vocab.setdefault(merged, len(vocab))  # two merges can spell the same piece
        for symbols, _ in words:
            i = 0
            while i < len(symbols) - 1:
                if (symbols[i], symbols[i + 1]) == best:
                    symbols[i:i + 2] = [merged]
                i += 1
    return merges


def default_model_config() -> dict:
    """A small GQA Llama (about 3M parameters) sized for the default tokenizer."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 688,
        "hidden_act": "silu",
        "vocab_size": TOKENIZER_VOCAB_SIZE,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


def default_tokenizer_config() -> dict:
    return {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": default_model_config()["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


def ensure_default_model(models_dir) -> Path:
    """Returns models_dir/DEFAULT_MODEL_NAME, writing it first if it is absent.

    Safe under concurrent callers: each writes its own temporary folder and renames it into place;
    a rename that finds the folder already there loses, and the loser keeps the winner's copy.
    """
    path = Path(models_dir) / DEFAULT_MODEL_NAME
    if (path / "config.json").is_file():
        return path
    tmp = _write_to_temp(path, default_model_config(), 0, byte_level_tokenizer_json(), default_tokenizer_config(), None)
    try:
        os.rename(tmp, path)  # atomic; fails if another process already put a non-empty folder there
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "config.json").is_file():
            raise
        return path
    log.info("wrote default model %s to %s", DEFAULT_MODEL_NAME, path)
    return path

"""The checkpoint writer is checked against transformers, the reference loader of HF folders."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2ForCausalLM

from llmq.model import checkpoint
from llmq.model.checkpoint import (
    DEFAULT_MODEL_NAME,
    byte_level_tokenizer_json,
    default_model_config,
    ensure_default_model,
    write_llama_checkpoint,
)

ROUND_TRIP_TEXTS = [
    "Hello world, this is a test.",
    "two  spaces, a tab\tand\nnew lines\n\n",
    "Café, naïve, façade, Ærøskøbing",
    "中文字符和日本語のテキスト",
    "emoji 🎉🚀 and a family 👨‍👩‍👧 zwj sequence",
    "<|user|>\nhi\n<|assistant|>\n",  # a literal </s> would encode as the special token
    "",
]


def tiny_config(**overrides) -> dict:
    config = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 128,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update(overrides)
    return config


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def read_all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def default_model(tmp_path_factory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def test_same_seed_gives_identical_bytes_and_other_seed_differs(tmp_path):
    config = tiny_config(attention_bias=True, mlp_bias=True)
    a = write_llama_checkpoint(tmp_path / "a", config, seed=7, tokenizer_json=byte_level_tokenizer_json())
    b = write_llama_checkpoint(tmp_path / "b", config, seed=7, tokenizer_json=byte_level_tokenizer_json())
    c = write_llama_checkpoint(tmp_path / "c", config, seed=8)
    assert file_hashes(a) == file_hashes(b)
    assert file_hashes(a)["model.safetensors"] != file_hashes(c)["model.safetensors"]
    assert file_hashes(a)["config.json"] == file_hashes(c)["config.json"]


def test_tokenizer_json_is_the_same_in_another_process():
    # The merge trainer must not depend on hash or dict order, which PYTHONHASHSEED changes.
    code = "import hashlib; from llmq.model.checkpoint import byte_level_tokenizer_json as t; " \
           "print(hashlib.sha256(t().encode()).hexdigest())"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(checkpoint.__file__).parents[2])
    assert out.stdout.strip() == hashlib.sha256(byte_level_tokenizer_json().encode()).hexdigest()


def test_the_web_app_finds_the_default_model_without_importing_torch(tmp_path):
    checkpoint.ensure_default_model(tmp_path / "models")  # written once (by the demo, or a worker)
    code = "import sys; from app import create_app; create_app(); sys.exit('torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "MODEL_NAME")}
    env.update(LLMQ_HOME=str(tmp_path), DATABASE_URL=f"sqlite:///{tmp_path / 'llmq.db'}",
               REDIS_URL="redis://127.0.0.1:1/0")  # never reached: the app connects on first use
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(checkpoint.__file__).parents[2],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:] or "the web app imported torch"


CASES = {
    "default": (default_model_config(), LlamaForCausalLM),
    "gqa_untied_biases": (tiny_config(attention_bias=True, mlp_bias=True), LlamaForCausalLM),
    "qwen2": (tiny_config(model_type="qwen2", architectures=["Qwen2ForCausalLM"]), Qwen2ForCausalLM),
}


@pytest.mark.parametrize("case", CASES)
def test_transformers_loads_every_weight(tmp_path, case):
    config, model_class = CASES[case]
    folder = write_llama_checkpoint(tmp_path / case, config, seed=3)
    model, info = model_class.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    # Every stored tensor is what transformers holds, so nothing was silently re-initialised.
    written = read_all_tensors(folder)
    state = model.state_dict()
    for name, tensor in written.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    if config.get("tie_word_embeddings"):
        assert "lm_head.weight" not in written
        assert torch.equal(state["lm_head.weight"], written["model.embed_tokens.weight"])
    norms = [t for n, t in written.items() if n.endswith("norm.weight")]
    assert all(0.8 < t.mean() < 1.2 and t.std() > 0 for t in norms)

    ids = torch.tensor([[1, 5, 9, 17, 33]])
    logits = model(ids).logits
    assert logits.shape == (1, 5, config["vocab_size"]) and torch.isfinite(logits).all()


def test_bias_layout_follows_model_type(tmp_path):
    names = lambda config: set(read_all_tensors(write_llama_checkpoint(tmp_path / "x", config)))  # noqa: E731
    llama = names(tiny_config(attention_bias=True))
    qwen2 = names(tiny_config(model_type="qwen2"))
    plain = names(tiny_config())
    for proj in "qkv":
        assert f"model.layers.0.self_attn.{proj}_proj.bias" in llama & qwen2
    assert "model.layers.0.self_attn.o_proj.bias" in llama - qwen2
    assert not any(n.endswith(".bias") for n in plain)
    assert json.loads((tmp_path / "x" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_sharded_write_loads_and_index_covers_every_tensor(tmp_path):
    config = tiny_config()
    single = read_all_tensors(write_llama_checkpoint(tmp_path / "single", config, seed=5))
    folder = write_llama_checkpoint(tmp_path / "sharded", config, seed=5, max_shard_bytes=64 * 1024)

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (folder / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    for shard in shards:
        assert {n for n, f in index["weight_map"].items() if f == shard.name} == set(load_file(shard))
    sharded = read_all_tensors(folder)
    assert set(index["weight_map"]) == set(sharded) == set(single)
    assert all(torch.equal(sharded[n], single[n]) for n in single)  # sharding does not change the draw
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sharded.values())

    model, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()

    # Rewriting the folder replaces it whole: no stale shards are left behind.
    write_llama_checkpoint(folder, config, seed=5)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("loader", [AutoTokenizer, PreTrainedTokenizerFast])
def test_transformers_tokenizer_matches_tokenizers_library(default_model, loader):
    raw = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    hf = loader.from_pretrained(default_model)
    for text in ROUND_TRIP_TEXTS + [" leading space", "The cat sat on the mat."]:
        ids = raw.encode(text).ids
        assert hf(text).input_ids == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == raw.decode(ids)


def test_tokenizer_round_trips_and_has_llama_layout(default_model):
    raw = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    for text in ROUND_TRIP_TEXTS:
        ids = raw.encode(text).ids
        assert ids[0] == 1 and raw.decode(ids) == text, text
        assert 0 not in ids  # byte fallback, never <unk>
    assert raw.get_vocab_size() == 512 == json.loads((default_model / "config.json").read_text())["vocab_size"]
    assert [raw.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "<0x00>", "<0xFF>")] == [0, 1, 2, 3, 258]
    # The merges do real work on English text that is not the training text.
    text = "The children read a good book about birds in the garden after school."
    assert len(raw.encode(text).ids) < len(text) / 2
    assert byte_level_tokenizer_json() == byte_level_tokenizer_json()


def test_chat_template_renders_and_encodes(default_model):
    hf = AutoTokenizer.from_pretrained(default_model)
    messages = [{"role": "user", "content": "Hi there"}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>\nHi there</s>\n<|assistant|>\n"
    ids = hf(text, add_special_tokens=False).input_ids
    assert ids.count(1) == 1 and ids.count(2) == 1 and 0 not in ids
    assert hf.decode(ids, skip_special_tokens=True) == "<|user|>\nHi there\n<|assistant|>\n"


def test_ensure_default_model_writes_once(tmp_path, caplog):
    with caplog.at_level("INFO", logger=checkpoint.__name__):
        path = ensure_default_model(tmp_path)
    assert path == tmp_path / DEFAULT_MODEL_NAME and str(path) in caplog.text
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert {p.name for p in path.iterdir()} == expected
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] and tokenizer_config["add_bos_token"] is True
    assert json.loads((path / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}

    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert ensure_default_model(tmp_path) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]


def test_ensure_default_model_keeps_the_copy_of_a_process_that_won(tmp_path, monkeypatch):
    # Simulate another process finishing first: it publishes while we are still writing ours.
    real_write = checkpoint._write_to_temp

    def write_then_lose(folder, *args):
        tmp = real_write(folder, *args)
        theirs = real_write(folder, *args)
        (theirs / "theirs").touch()
        os.rename(theirs, folder)
        return tmp

    monkeypatch.setattr(checkpoint, "_write_to_temp", write_then_lose)
    path = ensure_default_model(tmp_path)
    assert (path / "theirs").exists() and (path / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]  # our temp folder was removed

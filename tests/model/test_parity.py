"""llmq's model against transformers, the reference implementation of Hugging Face checkpoints.

Two kinds of model:
- stories260K, a tiny *trained* Llama (shared fixture): greedy text must match token for token;
- small random models written by transformers itself (GQA with an explicit head_dim, Qwen2 q/k/v
  biases, Llama attention/MLP biases, untied lm_head, llama3 RoPE scaling in both config layouts,
  with whole, chunked and prefix-cached prefills, a sharded checkpoint, Mistral). These need no
  shared files: their tokenizer is a word-level one written here, and prompts are token ids.
Then folders llmq must refuse, each with a ValueError naming the file, field or tensor.

Every comparison goes through the public engine (`LLM.generate`), so the loader, RoPE tables,
paged KV cache, batching, and sampler are all on the path. The reference is transformers'
log_softmax of its raw logits, teacher-forced on llmq's own continuation: at every step llmq's
top-5 log-probabilities must equal transformers' within 1e-4, and llmq's greedy token must be
transformers' argmax (which, step by step, is exactly "transformers' greedy run gives the same
tokens").
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models as tokenizer_models
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from llmq.engine.config import EngineConfig
from llmq.engine.llm import LLM, LLMEngine
from llmq.model.cpu_prepack import dense_weight
from llmq.model.loader import ModelLoadError, load_model
from llmq.model.model_config import ModelConfigError
from llmq.sampling_params import SamplingParams

ATOL = 1e-4  # on log-probabilities, float32 on CPU
TOP_K = 5
KV_CACHE_BYTES = 8 << 20  # the models are tiny; no need for the 1 GiB default
VOCAB = 512

STORY_PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park",
    "The cat sat on the",
    "One day, a big dog",
    "Sara had a red ball. She",
]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_K)


def assert_logprobs_match(out_logprobs, ref_logprobs: torch.Tensor, token_ids: list[int], where: str) -> None:
    """llmq's per-step TokenLogprob list against reference log-probabilities [steps, vocab].

    The reference's top-k values must equal llmq's (as sorted lists), and each (id, value) llmq
    reports must be the reference's value for that id: together, same top-k up to order among
    exact near-ties. The chosen token's own log-probability must match too."""
    assert out_logprobs is not None and len(out_logprobs) == len(token_ids) == ref_logprobs.shape[0], where
    for step, (lp, token) in enumerate(zip(out_logprobs, token_ids)):
        ref = ref_logprobs[step]
        assert lp.token_id == token
        assert len(lp.top) == TOP_K
        ids = torch.tensor([i for i, _ in lp.top])
        values = torch.tensor([v for _, v in lp.top], dtype=torch.float32)
        torch.testing.assert_close(values, ref.topk(TOP_K).values, atol=ATOL, rtol=0,
                                   msg=lambda m: f"{where}, step {step}: top-{TOP_K} values differ\n{m}")
        torch.testing.assert_close(values, ref[ids], atol=ATOL, rtol=0,
                                   msg=lambda m: f"{where}, step {step}: top-{TOP_K} ids differ\n{m}")
        assert abs(lp.logprob - ref[token].item()) <= ATOL, f"{where}, step {step}: chosen token's logprob"


def assert_greedy_matches(token_ids: list[int], ref_logprobs: torch.Tensor, where: str) -> None:
    """Each llmq token is the reference's argmax at that step (a tie within ATOL is accepted: float
    noise may break it either way)."""
    for step, token in enumerate(token_ids):
        ref = ref_logprobs[step]
        best = int(ref.argmax())
        assert token == best or ref[best] - ref[token] <= ATOL, (
            f"{where}, step {step}: llmq chose {token} (logprob {ref[token]:.6f}), "
            f"transformers' argmax is {best} (logprob {ref[best]:.6f}); llmq tokens {token_ids}")


@torch.no_grad()
def teacher_forced_logprobs(model, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the vocabulary at each generation step, [len(generated), vocab]:
    one forward over prompt + continuation, read at the positions that predicted each new token."""
    ids = torch.tensor([prompt_ids + generated])
    logits = model(input_ids=ids).logits[0].float()
    return logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(generated)].log_softmax(-1)


# ---- stories260K: a trained model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def stories_hf(stories_dir):
    return AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stories_tokenizer(stories_dir):
    return AutoTokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module")
def stories_llm(stories_dir):
    return LLM(str(stories_dir), dtype="float32", kv_cache_bytes=KV_CACHE_BYTES)


def test_stories_greedy_and_logprobs_match_transformers_generate(stories_llm, stories_hf, stories_tokenizer):
    """Five prompts in one batch, 48 greedy tokens each: the ids equal transformers'
    generate(do_sample=False, min_new_tokens=48) token for token, and every step's top-5
    log-probabilities equal log_softmax of generate's raw logits."""
    n = 48
    outputs = stories_llm.generate(STORY_PROMPTS, greedy(n), use_tqdm=False)
    eos = stories_tokenizer.eos_token_id
    for prompt, out in zip(STORY_PROMPTS, outputs):
        ids = stories_tokenizer(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist(), f"{prompt!r}: llmq tokenizes differently"
        with torch.no_grad():
            ref = stories_hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                      min_new_tokens=n, output_logits=True, return_dict_in_generate=True)
        ref_ids = ref.sequences[0, ids.shape[1]:].tolist()
        # min_new_tokens masks EOS while ignore_eos keeps it: compare only where EOS is not wanted.
        assert eos not in out.token_ids, f"{prompt!r}: pick a prompt whose 48-token continuation has no EOS"
        assert len(out.token_ids) == len(ref_ids) == n
        assert out.token_ids == ref_ids, f"{prompt!r}:\nllmq {out.token_ids}\nhf   {ref_ids}"
        ref_logprobs = torch.stack(ref.logits)[:, 0].float().log_softmax(-1)
        assert_logprobs_match(out.logprobs, ref_logprobs, out.token_ids, repr(prompt))
        assert out.finish_reason == "length"


def test_stories_once_upon_a_time_continuation(stories_llm, stories_hf, stories_tokenizer):
    """The 40-token greedy continuation of "Once upon a time", ids and text, as transformers makes it."""
    prompt = "Once upon a time"
    ids = stories_tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = stories_hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40)
    ref_new = ref[0, ids.shape[1]:].tolist()
    assert len(ref_new) == 40  # the story does not end within 40 tokens

    out = stories_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[0].tolist()
    assert out.token_ids == ref_new
    assert prompt + out.text == stories_tokenizer.decode(ref[0], skip_special_tokens=True)
    assert "Lily" in out.text  # the documented continuation: ", there was a little girl named Lily. ..."


def test_stories_teacher_forced_logits_match(stories_llm, stories_hf, stories_tokenizer):
    """The same comparison by a plain (cache-free) transformers forward instead of generate."""
    prompt = "Tom found a shiny stone"
    out = stories_llm.generate(prompt, greedy(32), use_tqdm=False)[0]
    ref_logprobs = teacher_forced_logprobs(stories_hf, out.prompt_token_ids, out.token_ids)
    assert_greedy_matches(out.token_ids, ref_logprobs, repr(prompt))
    assert_logprobs_match(out.logprobs, ref_logprobs, out.token_ids, repr(prompt))


# ---- random models written by transformers ---------------------------------------------------------

def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the 512 ids the random models use ("<unk>", "<s>", "</s>", "t3".."t511").
    Prompts below are token ids; llmq only needs a tokenizer.json to start and to detokenize."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = BackendTokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False}))


_MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM}


def write_random_model(folder: Path, config, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Builds the transformers model for `config`, draws every parameter from a seeded normal and
    saves it with save_pretrained, plus a tokenizer. transformers' own init (std 0.02, zero biases)
    gives near-uniform next-token distributions where float noise can flip an argmax; here
    matrices and biases get std 0.2 and the embedding / lm_head 0.5, so distributions are peaked
    (mean top-1 probability ~0.4) and greedy is well defined; norm weights are 1 + 0.1 noise."""
    torch.manual_seed(seed)
    model = _MODEL_CLASSES[config.model_type](config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is listed once, as the embedding
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(0.5 * noise)  # logits spread wide: top-1/top-2 margins ~1e-2 and up, not ~1e-4
            else:
                param.copy_(0.2 * noise)
    options = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **options)
    write_tokenizer(folder)
    return folder


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def small_config(cls, **overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return cls(**kwargs)


def check_parity(folder: Path, prompts: list[list[int]], max_tokens: int = 16, **engine_options):
    """All prompts in one llmq batch; each continuation checked against transformers (loaded from
    the same folder with from_pretrained). Returns (llm, hf model, outputs) for further checks."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), kv_cache_bytes=KV_CACHE_BYTES, **{"dtype": "float32", **engine_options})
    outputs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.prompt_token_ids == prompt
        assert len(out.token_ids) == max_tokens
        ref_logprobs = teacher_forced_logprobs(hf, prompt, out.token_ids)
        where = f"{folder.name}, prompt {i} ({len(prompt)} tokens)"
        assert_greedy_matches(out.token_ids, ref_logprobs, where)
        assert_logprobs_match(out.logprobs, ref_logprobs, out.token_ids, where)
    return llm, hf, outputs


def llmq_model(llm: LLM):
    return llm.engine.model_runner.model


def test_gqa_with_explicit_head_dim(tmp_path):
    """8 query heads share 2 KV heads, and head_dim (16) is not hidden / heads (8)."""
    config = small_config(LlamaConfig, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    folder = write_random_model(tmp_path / "gqa", config, seed=1)
    assert json.loads((folder / "config.json").read_text())["head_dim"] == 16
    llm, _, _ = check_parity(folder, random_prompts([5, 13, 30]))
    attn = llmq_model(llm).model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (8, 2, 16)
    assert dense_weight(attn.qkv_proj.weight).shape == (8 * 16 + 2 * 2 * 16, 64)
    assert dense_weight(attn.o_proj.weight).shape == (64, 8 * 16)


def test_qwen2_qkv_biases(tmp_path):
    """Qwen2: q/k/v projections have biases (o_proj does not); tied embeddings, as small Qwen2s have."""
    config = small_config(Qwen2Config, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                          tie_word_embeddings=True)
    folder = write_random_model(tmp_path / "qwen2", config, seed=2)
    tensors = load_file(folder / "model.safetensors")
    for part in ("q_proj", "k_proj", "v_proj"):
        bias = tensors[f"model.layers.0.self_attn.{part}.bias"]
        assert bias.abs().min() > 0 and bias.abs().mean() > 0.05, f"{part} bias should be random, not zeros"
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    assert "lm_head.weight" not in tensors

    llm, _, _ = check_parity(folder, random_prompts([7, 21], seed=2))
    attn = llmq_model(llm).model.layers[1].self_attn
    expected = torch.cat([tensors[f"model.layers.1.self_attn.{p}.bias"] for p in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(attn.qkv_proj.bias, expected, atol=0, rtol=0)
    assert attn.o_proj.bias is None
    model = llmq_model(llm)  # tied: the embedding's matrix serves as the output matrix (on a CPU, a packed copy)
    assert torch.equal(dense_weight(model.lm_head.weight), model.model.embed_tokens.weight)


def test_untied_embeddings(tmp_path):
    """tie_word_embeddings=False: lm_head.weight is its own matrix, and llmq must use it."""
    config = small_config(LlamaConfig, tie_word_embeddings=False)
    folder = write_random_model(tmp_path / "untied", config, seed=3)
    tensors = load_file(folder / "model.safetensors")
    assert not torch.allclose(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])

    llm, _, _ = check_parity(folder, random_prompts([9, 17], seed=3))
    model = llmq_model(llm)
    assert model.lm_head is not None
    torch.testing.assert_close(dense_weight(model.lm_head.weight), tensors["lm_head.weight"], atol=0, rtol=0)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def llama3_folder(tmp_path_factory):
    config = small_config(LlamaConfig, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          rope_parameters=dict(LLAMA3_ROPE))
    return write_random_model(tmp_path_factory.mktemp("rope") / "llama3", config, seed=4)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 24], ids=["whole-prefill", "chunked-prefill"])
def test_llama3_rope_scaling(llama3_folder, max_num_batched_tokens):
    """llama3 RoPE (factor 8 beyond 64 original positions): prompts of 70 and 110 tokens plus 16
    generated, so most positions are past the original context. Also with prompts prefilled in
    chunks of at most 24 tokens, which attends to earlier chunks through the paged cache."""
    written = json.loads((llama3_folder / "config.json").read_text())
    rope = written.get("rope_parameters") or written.get("rope_scaling")
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0

    prompts = random_prompts([70, 110], seed=4)
    llm, hf, outputs = check_parity(llama3_folder, prompts, max_num_batched_tokens=max_num_batched_tokens)
    assert llm.engine.model_runner.model_config.rope_scaling["rope_type"] == "llama3"

    # The check has teeth: without the scaling, transformers' own answer moves far beyond ATOL.
    plain_config = AutoConfig.from_pretrained(llama3_folder)
    plain_config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain = AutoModelForCausalLM.from_pretrained(llama3_folder, config=plain_config, dtype=torch.float32).eval()
    prompt, out = prompts[1], outputs[1]
    scaled_lp = teacher_forced_logprobs(hf, prompt, out.token_ids)
    plain_lp = teacher_forced_logprobs(plain, prompt, out.token_ids)
    assert (scaled_lp - plain_lp).abs().max() > 100 * ATOL


def test_prefix_cache_hit_keeps_parity(llama3_folder):
    """A second request sharing 88 tokens (11 full blocks) with a finished one reuses their cached
    K/V and prefills only its own tail, attending to the cached blocks: same answer as transformers."""
    first, tail = random_prompts([100, 20], seed=10)
    llm, hf, _ = check_parity(llama3_folder, [first])
    second = first[:90] + tail
    out = llm.generate(second, greedy(16), use_tqdm=False)[0]
    assert llm.engine.block_manager.cached_blocks, "prefix caching should have published blocks"
    ref = teacher_forced_logprobs(hf, second, out.token_ids)
    assert_greedy_matches(out.token_ids, ref, "prefix-cache hit")
    assert_logprobs_match(out.logprobs, ref, out.token_ids, "prefix-cache hit")


def test_llama3_rope_scaling_legacy_config_keys(llama3_folder, tmp_path):
    """The same model with config.json in the pre-v5 layout: top-level rope_theta plus
    rope_scaling (as most checkpoints on the Hub still have it)."""
    folder = tmp_path / "legacy"
    shutil.copytree(llama3_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(config))
    llm, hf, _ = check_parity(folder, random_prompts([100], seed=8))
    assert llm.engine.model_runner.model_config.rope_scaling["rope_type"] == "llama3"
    assert hf.config.rope_parameters["rope_type"] == "llama3"  # transformers read the old keys too


def test_llama_attention_and_mlp_biases(tmp_path):
    """attention_bias=True gives Llama biases on q/k/v *and* o_proj; mlp_bias on gate/up/down."""
    config = small_config(LlamaConfig, attention_bias=True, mlp_bias=True)
    folder = write_random_model(tmp_path / "biases", config, seed=9)
    tensors = load_file(folder / "model.safetensors")
    for name in ("self_attn.o_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj"):
        assert tensors[f"model.layers.0.{name}.bias"].abs().mean() > 0.05
    llm, _, _ = check_parity(folder, random_prompts([12, 19], seed=9))
    layer = llmq_model(llm).model.layers[0]
    torch.testing.assert_close(layer.self_attn.o_proj.bias, tensors["model.layers.0.self_attn.o_proj.bias"],
                               atol=0, rtol=0)
    assert layer.mlp.gate_up_proj.bias is not None


def test_sharded_checkpoint(tmp_path):
    """save_pretrained with a small max_shard_size: model.safetensors.index.json plus several shards."""
    config = small_config(LlamaConfig, hidden_size=64, num_hidden_layers=3)
    folder = write_random_model(tmp_path / "sharded", config, seed=5, max_shard_size="200KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2, shards
    assert not (folder / "model.safetensors").exists()
    assert sorted(p.name for p in folder.glob("*.safetensors")) == shards

    llm, _, _ = check_parity(folder, random_prompts([6, 25], seed=5))
    # Every tensor of every shard landed where it belongs.
    params = {name: dense_weight(param) for name, param in llmq_model(llm).named_parameters()}
    config_json = json.loads((folder / "config.json").read_text())
    head_dim = config_json.get("head_dim") or 64 // config_json["num_attention_heads"]
    q_size = config_json["num_attention_heads"] * head_dim
    kv_size = config_json["num_key_value_heads"] * head_dim
    inter = config_json["intermediate_size"]
    slices = {"q_proj": ("qkv_proj", 0, q_size), "k_proj": ("qkv_proj", q_size, kv_size),
              "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
              "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}
    checked = 0
    for shard in shards:
        for name, tensor in load_file(folder / shard).items():
            parts = name.split(".")
            if len(parts) >= 3 and parts[-2] in slices:
                fused, start, size = slices[parts[-2]]
                loaded = params[".".join(parts[:-2] + [fused, parts[-1]])][start:start + size]
            else:
                loaded = params[name]
            torch.testing.assert_close(loaded, tensor, atol=0, rtol=0, msg=f"{shard}: {name}")
            checked += 1
    assert checked == len(index["weight_map"])


def test_mistral(tmp_path):
    """MistralForCausalLM (config.json as transformers writes it, sliding_window 4096 > context)."""
    config = small_config(MistralConfig, num_attention_heads=4, num_key_value_heads=1)
    folder = write_random_model(tmp_path / "mistral", config, seed=6)
    written = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == ["MistralForCausalLM"] and written["model_type"] == "mistral"
    llm, _, _ = check_parity(folder, random_prompts([11, 40], seed=6))
    assert llm.engine.model_runner.model_config.architecture == "MistralForCausalLM"


# ---- folders llmq must refuse, with a message naming the file or field --------------------------

@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    config = small_config(LlamaConfig, num_hidden_layers=2, max_position_embeddings=128)
    return write_random_model(tmp_path_factory.mktemp("base") / "base", config, seed=7)


@pytest.fixture
def model_copy(base_model, tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(base_model, folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def load(folder: Path):
    return load_model(folder, "cpu", torch.float32, max_positions=64)


def assert_refused(folder: Path, error_type: type[ValueError], *substrings: str) -> None:
    """Both the loader and the engine refuse the folder with `error_type` (a ValueError) whose
    message carries every one of `substrings`."""
    assert issubclass(error_type, ValueError)
    for attempt in (lambda: load(folder), lambda: LLMEngine(EngineConfig(model=str(folder), dtype="float32", kv_cache_bytes=1 << 20))):
        with pytest.raises(error_type) as caught:
            attempt()
        message = str(caught.value)
        for s in substrings:
            assert s in message, f"{s!r} not in {message!r}"


def test_base_model_loads(model_copy):
    """The unmodified folder loads (so each refusal below is due to its one change)."""
    model = load(model_copy)
    assert len(model.model.layers) == 2


def test_missing_config_json(model_copy):
    (model_copy / "config.json").unlink()
    assert_refused(model_copy, ModelConfigError, "config.json")


def test_unsupported_architecture(model_copy):
    edit_config(model_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    assert_refused(model_copy, ModelConfigError, "config.json", "architectures", "GPT2LMHeadModel")


def test_missing_required_field(model_copy):
    edit_config(model_copy, hidden_size=None)
    assert_refused(model_copy, ModelConfigError, "config.json", "hidden_size")


def test_unsupported_rope_type(model_copy):
    edit_config(model_copy, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    assert_refused(model_copy, ModelConfigError, "config.json", "yarn")


def test_missing_safetensors(model_copy):
    (model_copy / "model.safetensors").unlink()
    assert_refused(model_copy, ModelLoadError, "safetensors")


def test_tensor_of_wrong_shape(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    assert_refused(model_copy, ModelLoadError, "model.safetensors", name, "(64, 127)", "(64, 128)")


def test_tensor_of_wrong_shape_in_fused_part(model_copy):
    """k_proj fills a slice of the fused qkv parameter: its shape is still checked by name."""
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:1]])  # one row too many
    save_file(tensors, path, metadata={"format": "pt"})
    assert_refused(model_copy, ModelLoadError, "model.safetensors", name)


def test_missing_tensor(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    # v_proj is stored fused into qkv_proj: the message names the parameter left incomplete.
    assert_refused(model_copy, ModelLoadError, "missing", "model.layers.0.self_attn.qkv_proj.weight")


def test_unexpected_tensor(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, path, metadata={"format": "pt"})
    assert_refused(model_copy, ModelLoadError, "model.safetensors", "model.layers.0.self_attn.q_norm.weight")


def test_index_names_missing_shard(model_copy):
    tensors = load_file(model_copy / "model.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in tensors}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    assert_refused(model_copy, ModelLoadError, "model.safetensors.index.json", "model-00002-of-00002.safetensors")

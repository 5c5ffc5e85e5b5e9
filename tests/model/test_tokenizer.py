"""Tokenizer and IncrementalDetokenizer against transformers' AutoTokenizer on the stories260k folder.

Expected values come from transformers or from Tokenizer.decode itself, never typed in by hand,
except the ids of "Once upon a time", which the fixture's SOURCE.md records from transformers.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmq.model.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

REPO_ROOT = Path(__file__).resolve().parents[2]
STORIES_FOLDER = REPO_ROOT / "tests" / "fixtures" / "stories260k"

TEXTS = [
    "Once upon a time",
    "Once upon a time, there was a little girl named Lily.",
    "  two  leading spaces and  double  gaps",
    " one leading space",
    "trailing space ",
    "line one\nline two\n\n\tindented with a tab",
    "café naïve résumé Ångström",
    "日本語のテキスト",
    "hi 😀 there 👍🏽 family 👨‍👩‍👧",
    "mixed: 中文 and ελληνικά and emoji 🎉!",
    "x<s>y</s>z",
    "",
]


@pytest.fixture(scope="module")
def stories_folder() -> Path:
    return STORIES_FOLDER


@pytest.fixture(scope="module")
def tokenizer(stories_folder) -> Tokenizer:
    return Tokenizer.from_folder(stories_folder)


@pytest.fixture(scope="module")
def reference(stories_folder):
    transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")
    return transformers.AutoTokenizer.from_pretrained(str(stories_folder))


def copy_folder(source: Path, destination: Path) -> Path:
    """Copies the small files of a model folder (copyfile: the fixture's files are read-only)."""
    destination.mkdir(parents=True, exist_ok=True)
    for path in source.glob("*.json"):
        shutil.copyfile(path, destination / path.name)
    return destination


def edit_json(path: Path, **changes) -> None:
    content = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            content.pop(key, None)
        else:
            content[key] = value
    path.write_text(json.dumps(content), encoding="utf-8")


# ---------------------------------------------------------------- encode / decode


def test_once_upon_a_time_ids_match_the_fixture_record(tokenizer):
    assert tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizer, reference, text, add_special_tokens):
    expected = reference(text, add_special_tokens=add_special_tokens).input_ids
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizer, reference, text, skip_special_tokens):
    ids = reference(text).input_ids
    expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@pytest.mark.parametrize("text", [t for t in TEXTS if not t.startswith(" ") and "<" not in t])
def test_decode_roundtrips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_bos_is_never_added_twice(tokenizer, reference):
    # Deliberate difference from transformers, which doubles the BOS here: a chat template that
    # writes bos_token itself would otherwise give the model two.
    expected = reference("<s>Hello").input_ids
    assert expected[:2] == [tokenizer.bos_token_id] * 2
    assert tokenizer.encode("<s>Hello") == expected[1:]
    assert tokenizer.encode("<s>Hello", add_special_tokens=False) == expected[1:]


def test_add_bos_token_false_in_tokenizer_config_drops_bos(stories_folder, tmp_path):
    folder = copy_folder(stories_folder, tmp_path / "model")
    edit_json(folder / "tokenizer_config.json", add_bos_token=False)
    plain = Tokenizer.from_folder(stories_folder)
    no_bos = Tokenizer.from_folder(folder)
    assert no_bos.encode("Once upon a time") == plain.encode("Once upon a time", add_special_tokens=False)


def test_add_bos_token_true_adds_bos_when_post_processor_does_not(stories_folder, tmp_path):
    folder = copy_folder(stories_folder, tmp_path / "model")
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer_json["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json), encoding="utf-8")
    plain = Tokenizer.from_folder(stories_folder)
    assert Tokenizer.from_folder(folder).encode("Once upon a time") == plain.encode("Once upon a time")
    edit_json(folder / "tokenizer_config.json", add_bos_token=None)  # absent: follow the (empty) post-processor
    assert Tokenizer.from_folder(folder).encode("Once") == plain.encode("Once", add_special_tokens=False)


def test_truncation_in_tokenizer_json_is_ignored(stories_folder, tmp_path):
    folder = copy_folder(stories_folder, tmp_path / "model")
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer_json["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json), encoding="utf-8")
    text = TEXTS[1]
    assert Tokenizer.from_folder(folder).encode(text) == Tokenizer.from_folder(stories_folder).encode(text)


def test_token_text_keeps_the_leading_space_and_shows_byte_tokens(tokenizer, reference):
    once = tokenizer.encode("Once", add_special_tokens=False)[0]
    assert tokenizer.token_text(once) == reference.convert_ids_to_tokens(once).replace("\u2581", " ")
    emoji_ids = tokenizer.encode("😀", add_special_tokens=False)
    byte_ids = [i for i in emoji_ids if reference.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(byte_ids) == 4
    assert [tokenizer.token_text(i) for i in byte_ids] == reference.convert_ids_to_tokens(byte_ids)
    assert tokenizer.token_text(tokenizer.eos_token_ids[0]) == reference.eos_token
    assert tokenizer.token_text(tokenizer.vocab_size + 10) == ""


# ---------------------------------------------------------------- special ids and files


def test_stories_special_ids(tokenizer, reference):
    assert tokenizer.bos_token_id == 1 == reference.bos_token_id
    assert tokenizer.eos_token_ids == (2,) == (reference.eos_token_id,)
    assert tokenizer.vocab_size == len(reference)
    assert tokenizer.chat_template is None


def test_generation_config_list_of_eos_ids(stories_folder, tmp_path):
    folder = copy_folder(stories_folder, tmp_path / "model")
    edit_json(folder / "generation_config.json", eos_token_id=[2, 7, 2, 9])
    assert Tokenizer.from_folder(folder).eos_token_ids == (2, 7, 9)


def test_eos_falls_back_to_config_then_tokenizer_config(stories_folder, tmp_path):
    folder = copy_folder(stories_folder, tmp_path / "model")
    (folder / "generation_config.json").unlink()
    edit_json(folder / "config.json", eos_token_id=5)
    assert Tokenizer.from_folder(folder).eos_token_ids == (5,)
    edit_json(folder / "config.json", eos_token_id=None)
    assert Tokenizer.from_folder(folder).eos_token_ids == (2,)  # tokenizer_config's "</s>"
    edit_json(folder / "tokenizer_config.json", eos_token=None)
    assert Tokenizer.from_folder(folder).eos_token_ids == ()


def test_malformed_eos_id_names_the_file(stories_folder, tmp_path):
    folder = copy_folder(stories_folder, tmp_path / "model")
    edit_json(folder / "generation_config.json", eos_token_id="two")
    with pytest.raises(TokenizerError, match="generation_config.json"):
        Tokenizer.from_folder(folder)


def test_missing_tokenizer_json_is_named(stories_folder, tmp_path):
    folder = copy_folder(stories_folder, tmp_path / "model")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json") as raised:
        Tokenizer.from_folder(folder)
    assert str(folder) in str(raised.value)


def test_importing_the_module_does_not_import_torch():
    code = "import sys, llmq.model.tokenizer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


# ---------------------------------------------------------------- incremental detokenization

DETOKENIZER_TEXTS = TEXTS[:-1] + [
    "Once upon a time 😀 日本 there",
    "😀😀😀",
    "a\n\n😀\n",
    "end with emoji 🎉",
]


def stream(tokenizer, prompt_ids, generated_ids, skip_special_tokens=True):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.add(token_id) for token_id in generated_ids]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == detokenizer.text
    return deltas


@pytest.mark.parametrize("text", DETOKENIZER_TEXTS)
def test_deltas_join_to_the_decoded_continuation_at_every_split(tokenizer, text):
    ids = tokenizer.encode(text)
    full_text = tokenizer.decode(ids)
    checked = 0
    for split in range(0, len(ids)):
        prompt_text = tokenizer.decode(ids[:split])
        if prompt_text.endswith("\ufffd"):
            continue  # the prompt ends inside a character, so its text is no prefix of the full text
        assert full_text.startswith(prompt_text)
        deltas = stream(tokenizer, ids[:split], ids[split:])
        assert "".join(deltas) == full_text[len(prompt_text):], f"split at {split}"
        assert not any("\ufffd" in delta for delta in deltas), f"split at {split}: {deltas}"
        checked += 1
    assert checked > 0


def test_continuation_starting_with_a_space_token_keeps_the_space(tokenizer, reference):
    prompt_ids = tokenizer.encode("Once upon a")
    ids = tokenizer.encode("Once upon a time")
    assert ids[: len(prompt_ids)] == prompt_ids
    generated = ids[len(prompt_ids):]
    assert reference.convert_ids_to_tokens(generated[0]).startswith("\u2581")
    deltas = stream(tokenizer, prompt_ids, generated)
    assert deltas[0] == " " + tokenizer.decode(generated)


def test_bytes_are_withheld_until_the_character_completes(tokenizer):
    prompt_ids = tokenizer.encode("hi")
    emoji_ids = tokenizer.encode("hi😀", add_special_tokens=False)[len(prompt_ids) - 1:]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.add(token_id) for token_id in emoji_ids]
    assert deltas[:-1] == [""] * (len(emoji_ids) - 1)
    assert deltas[-1] == tokenizer.decode(prompt_ids + emoji_ids)[len("hi"):]


def test_flush_emits_a_broken_byte_sequence(tokenizer):
    prompt_ids = tokenizer.encode("Once")
    lead_byte = tokenizer.encode("😀", add_special_tokens=False)[-4]  # the 0xF0 byte token
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    assert detokenizer.add(lead_byte) == ""
    assert detokenizer.flush() == tokenizer.decode(prompt_ids + [lead_byte])[len("Once"):]
    assert "\ufffd" in detokenizer.text
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip_special_tokens):
    prompt_ids = tokenizer.encode("Once upon")
    generated = tokenizer.encode(" a time", add_special_tokens=False) + [tokenizer.eos_token_ids[0]]
    deltas = stream(tokenizer, prompt_ids, generated, skip_special_tokens)
    full = tokenizer.decode(prompt_ids + generated, skip_special_tokens=skip_special_tokens)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full[len(prompt_text):]


def test_the_ids_decode_leaves_out_are_those_has_no_text_names(tokenizer):
    ids = tokenizer.encode("  Once upon a time 😀", add_special_tokens=False)
    past = [tokenizer.vocab_size, tokenizer.vocab_size + 1000]
    special = [tokenizer.bos_token_id, tokenizer.eos_token_ids[0]]
    for token_id in past + special:
        assert tokenizer.has_no_text(token_id)
        for at in (0, 1, 5, len(ids)):
            assert tokenizer.decode(ids[:at] + [token_id] + ids[at:]) == tokenizer.decode(ids)
    assert not any(tokenizer.has_no_text(token_id, skip_special_tokens=False) for token_id in special)
    assert not any(tokenizer.has_no_text(token_id) for token_id in ids)


@pytest.mark.parametrize("text", DETOKENIZER_TEXTS)
def test_tokens_with_no_text_never_lengthen_the_window(tokenizer, text):
    """Skipped special tokens and ids past the vocabulary between a text's tokens: the deltas still join
    to its decode, and a long run of them does not grow the window each later add() decodes."""
    silent = [tokenizer.eos_token_ids[0], tokenizer.vocab_size + 5]
    text_ids = tokenizer.encode(text, add_special_tokens=False)
    generated = []
    for i, token_id in enumerate(text_ids):
        generated += [token_id] + silent * (1 + i % 3)
    generated += silent * 200
    prompt_ids = tokenizer.encode("Once upon")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.add(token_id) for token_id in generated]
    assert len(detokenizer._window) <= len(text_ids) + 8
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == tokenizer.decode(prompt_ids + text_ids)[len(tokenizer.decode(prompt_ids)):]


def test_empty_prompt_matches_plain_decode(tokenizer):
    generated = tokenizer.encode("Once upon a time 😀", add_special_tokens=False)
    assert "".join(stream(tokenizer, [], generated)) == tokenizer.decode(generated)


# ---------------------------------------------------------------- chat template

CHAT_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'system' %}
<<SYS>>{{ message['content'] }}<</SYS>>
    {% elif message['role'] == 'user' %}
{{ bos_token }}[INST] {{ message['content'] | trim }} [/INST]
    {% elif message['role'] == 'assistant' %}
 {{ message['content'] }}{{ eos_token }}
    {% else %}
{{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if loop.index >= 10 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
{{ {'meta': '<b>é&'} | tojson }}"""

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Tell me a story about Lily.  "},
    {"role": "assistant", "content": "Lily found a ball. 😀"},
    {"role": "user", "content": "Another, with 日本."},
]


@pytest.fixture
def chat_folder(stories_folder, tmp_path) -> Path:
    folder = copy_folder(stories_folder, tmp_path / "chat")
    edit_json(folder / "tokenizer_config.json", chat_template=CHAT_TEMPLATE)
    return folder


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(chat_folder, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    expected = transformers.AutoTokenizer.from_pretrained(str(chat_folder)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = Tokenizer.from_folder(chat_folder).apply_chat_template(MESSAGES, add_generation_prompt)
    assert rendered == expected


def test_chat_template_list_form_and_jinja_file(stories_folder, chat_folder, tmp_path):
    expected = Tokenizer.from_folder(chat_folder).apply_chat_template(MESSAGES)
    listed = copy_folder(stories_folder, tmp_path / "listed")
    edit_json(listed / "tokenizer_config.json", chat_template=[
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHAT_TEMPLATE},
    ])
    assert Tokenizer.from_folder(listed).apply_chat_template(MESSAGES) == expected
    separate = copy_folder(stories_folder, tmp_path / "separate")
    (separate / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    assert Tokenizer.from_folder(separate).apply_chat_template(MESSAGES) == expected


def test_raise_exception_in_template_becomes_tokenizer_error(chat_folder):
    with pytest.raises(TokenizerError, match="Unknown role: robot"):
        Tokenizer.from_folder(chat_folder).apply_chat_template([{"role": "robot", "content": "beep"}])


def test_folder_without_chat_template_raises(tokenizer):
    with pytest.raises(TokenizerError, match="chat_template"):
        tokenizer.apply_chat_template(MESSAGES)

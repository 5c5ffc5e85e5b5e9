"""Text <-> token ids for one Hugging Face model folder, plus streaming detokenization.

Built on the `tokenizers` library and jinja2 only: the web process imports this module, and it
must stay free of torch and transformers.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

# Named special tokens that transformers hands to chat templates as plain strings.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# How many prompt tokens the detokenizer decodes ahead of the first generated token: enough for
# decoders that strip the first space of a decode, and to start on a whole character.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHARACTER = "\ufffd"
_SENTENCEPIECE_SPACE = "\u2581"


class TokenizerError(ValueError):
    """A model folder's tokenizer files are missing or wrong, or a chat template cannot be applied.
    The message names the file or field at fault."""


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
    except (OSError, ValueError) as error:
        raise TokenizerError(f"cannot read {path}: {error}") from error
    if not isinstance(content, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return content


def _token_string(value: Any) -> str | None:
    # Older configs serialise special tokens as AddedToken dicts instead of plain strings.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _eos_ids_field(config: dict[str, Any] | None, path: Path) -> tuple[int, ...] | None:
    if config is None:
        return None
    value = config.get("eos_token_id")
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("eos_token_id")  # multimodal configs nest the text model's ids
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TokenizerError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(dict.fromkeys(ids))  # drop repeats, keep order


def _pick_chat_template(value: Any, path: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        return named.get("default")
    raise TokenizerError(f"{path}: chat_template must be a string or a list of {{name, template}}")


class _GenerationBlock(jinja2.ext.Extension):
    # Training-oriented templates wrap assistant turns in {% generation %}; rendering needs only the body.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _chat_template_environment() -> ImmutableSandboxedEnvironment:
    # Same settings as transformers, so a template renders to the same prompt the model was tuned on.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment


_CHAT_TEMPLATE_ENVIRONMENT = _chat_template_environment()


class Tokenizer:
    """The tokenizer of one model folder. Immutable after loading; safe to share between threads."""

    def __init__(self, backend: _BackendTokenizer, tokenizer_config: dict[str, Any],
                 eos_token_ids: tuple[int, ...], chat_template: str | None, folder: Path):
        self._backend = backend
        self._folder = folder
        self.special_tokens: dict[str, str] = {
            name: text for name in _SPECIAL_TOKEN_NAMES
            if (text := _token_string(tokenizer_config.get(name))) is not None
        }
        bos_token = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids: tuple[int, ...] = eos_token_ids
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # What decode() leaves out wherever it stands (IncrementalDetokenizer passes over it): ids past every
        # token's, and the special tokens where those are skipped. A model's embedding is often wider than
        # its vocabulary, and its sampled ids there have no text.
        self._id_bound = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._special_ids = frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
        self.chat_template: str | None = chat_template
        self._compiled_chat_template: jinja2.Template | None = None

        # The post-processor's ids for an empty text are exactly the special tokens it adds.
        self._post_processor_adds_bos = (
            self.bos_token_id is not None
            and backend.post_process(backend.encode("", add_special_tokens=False)).ids[:1] == [self.bos_token_id]
        )
        add_bos_token = tokenizer_config.get("add_bos_token")
        self._adds_bos = self.bos_token_id is not None and (
            add_bos_token if isinstance(add_bos_token, bool) else self._post_processor_adds_bos
        )

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> Tokenizer:
        """Loads tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja,
        generation_config.json and config.json from a Hugging Face model folder; only tokenizer.json
        is required. Raises TokenizerError naming the file that is missing or malformed."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"tokenizer.json not found in model folder {folder}")
        try:
            backend = _BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust library raises plain Exception on bad files
            raise TokenizerError(f"cannot load {tokenizer_file}: {error}") from error
        # A tokenizer.json may carry truncation or padding for training; prompts must never be cut or padded.
        backend.no_truncation()
        backend.no_padding()

        config_file = folder / "tokenizer_config.json"
        tokenizer_config = dict(_read_json(folder / "special_tokens_map.json") or {})
        tokenizer_config.update({k: v for k, v in (_read_json(config_file) or {}).items() if v is not None})

        eos_token_ids = (
            _eos_ids_field(_read_json(folder / "generation_config.json"), folder / "generation_config.json")
            or _eos_ids_field(_read_json(folder / "config.json"), folder / "config.json")
        )
        if eos_token_ids is None:
            eos_token = _token_string(tokenizer_config.get("eos_token"))
            eos_id = backend.token_to_id(eos_token) if eos_token else None
            eos_token_ids = (eos_id,) if eos_id is not None else ()

        # Newer exports keep the template in its own file, which transformers prefers over the config entry.
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _pick_chat_template(tokenizer_config.get("chat_template"), config_file)
        return cls(backend, tokenizer_config, eos_token_ids, chat_template, folder)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, the same as transformers' AutoTokenizer(text).input_ids, with two
        deliberate exceptions. With add_special_tokens, BOS leads the ids when tokenizer_config.json's
        add_bos_token says so (absent: whatever tokenizer.json's post-processor does; transformers 5
        ignores add_bos_token when tokenizer.json exists). And BOS is never doubled when the text
        itself starts with the BOS token (as rendered chat templates often do)."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        text_ids = encoding.ids
        if not add_special_tokens:
            return text_ids
        ids = self._backend.post_process(encoding).ids
        if self._post_processor_adds_bos and not self._adds_bos:
            ids = ids[1:]
        elif self._adds_bos and not self._post_processor_adds_bos:
            ids = [self.bos_token_id, *ids]
        if self._adds_bos and text_ids[:1] == [self.bos_token_id]:
            ids = ids[1:]
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """At least as many characters as any one token stands for (its vocabulary string is never
        shorter than its text: byte-level and byte-fallback tokens spell a character in several), so a
        text longer than n times this holds more than n tokens, which is known before encoding it."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1) or 1

    def has_no_text(self, token_id: int, skip_special_tokens: bool = True) -> bool:
        """Whether decode() leaves `token_id` out wherever it stands: an id past the vocabulary's, or a
        special token where they are skipped."""
        return token_id >= self._id_bound or (skip_special_tokens and token_id in self._special_ids)

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`. Incomplete UTF-8 byte sequences come out as U+FFFD. No
        clean-up of spaces is applied (transformers skips it for BPE tokenizers too)."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Printable text of one token, for logprobs: its decoded text with any leading space kept,
        or its raw vocabulary string (e.g. "<0xE2>") when it is part of a multi-byte character.
        Returns '' for an id outside the vocabulary."""
        text = self._backend.decode([token_id], skip_special_tokens=False)
        raw = self._backend.id_to_token(token_id)
        if raw is None:
            return text
        # Sentencepiece-style decoders drop the first space of any decode, which would hide " the" vs "the".
        if raw.startswith(_SENTENCEPIECE_SPACE) and not text.startswith(" "):
            text = " " + text
        if not text or _REPLACEMENT_CHARACTER in text:
            return raw
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Prompt text for `messages`, rendered like transformers' apply_chat_template(tokenize=False).
        The template sees messages, add_generation_prompt, tools=None, documents=None, the special
        token strings (bos_token, eos_token, ...), raise_exception() and strftime_now().
        Raises TokenizerError when the folder has no chat_template, or the template rejects the messages."""
        if self.chat_template is None:
            raise TokenizerError(
                f"model folder {self._folder} has no chat_template (tokenizer_config.json or chat_template.jinja)"
            )
        try:
            if self._compiled_chat_template is None:
                self._compiled_chat_template = _CHAT_TEMPLATE_ENVIRONMENT.from_string(self.chat_template)
            return self._compiled_chat_template.render(
                messages=messages, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as error:
            raise TokenizerError(f"chat_template of {self._folder} failed: {error}") from error


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas, decoding only a short window.

    Invariants: the joined deltas (after flush) equal decode(prompt + generated) minus the text of
    decode(prompt), so the leading space of a continuation is kept even with decoders that strip the
    first space of a decode; add() never returns U+FFFD from a byte sequence that is still incomplete
    (it returns '' until the character completes).
    Uses the prefix_offset/read_offset technique of vLLM and TGI: decode the window from the
    prefix offset with and without the unread tokens, and emit the difference."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._backend = tokenizer._backend
        self._has_no_text = tokenizer.has_no_text
        self._skip_special_tokens = skip_special_tokens
        # Only the window is kept: tokens before the prefix offset never matter again.
        self._window: list[int] = self._prompt_context(list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]))
        self._read_offset = len(self._window)
        self._prefix_text: str | None = None
        self._deltas: list[str] = []

    def _prompt_context(self, tail: list[int]) -> list[int]:
        # The window must start on a character boundary: the ByteFallback decoder turns a whole run of
        # byte tokens into U+FFFDs when the run starts mid-character, even bytes that complete later.
        for start in range(len(tail)):
            if not self._decode(tail[start:]).startswith(_REPLACEMENT_CHARACTER):
                return tail[start:]
        return tail

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, allow_incomplete: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read_offset])
        window_text = self._decode(self._window)
        if len(window_text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token: keep the window and wait for text
        if window_text.endswith(_REPLACEMENT_CHARACTER) and not allow_incomplete:
            return ""  # the last character's bytes are not all here yet
        delta = window_text[len(self._prefix_text):]
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._prefix_text = None
        self._deltas.append(delta)
        return delta

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text it completes ('' while waiting for more bytes)."""
        if self._has_no_text(token_id, self._skip_special_tokens):
            return ""  # decode() would leave it out: it need not lengthen the window every later add() decodes
        self._window.append(token_id)
        return self._emit(allow_incomplete=False)

    @property
    def text(self) -> str:
        """All text emitted so far: the joined deltas."""
        return "".join(self._deltas)

    def flush(self) -> str:
        """At the end of the sequence, returns any withheld text, U+FFFD included for bytes that
        never formed a character. Further calls return ''."""
        if len(self._window) <= self._read_offset:
            return ""
        return self._emit(allow_incomplete=True)

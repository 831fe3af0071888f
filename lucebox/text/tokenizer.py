"""Text <-> token ids: HF tokenizer.json or a GGUF vocabulary, both run by the `tokenizers` library.

A GGUF file carries its vocabulary as metadata, not as a tokenizer.json; `Tokenizer.from_gguf` (gguf_vocab.py) rebuilds
an equivalent `tokenizers.Tokenizer` so that both checkpoint kinds share one fast encode/decode path.
"""

from __future__ import annotations

import json
import logging
import operator
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from ..errors import CheckpointError, RequestError
from .chat_template import render_chat_template
from .prompt_encoder import PromptEncoder

logger = logging.getLogger(__name__)
_ENCODER_LOCK = threading.Lock()  # one PromptEncoder per tokenizer, made by the first thread that asks

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")



class Tokenizer:
    """A `tokenizers.Tokenizer` plus what a serving engine needs around it.

    `special_tokens` maps transformers' names (bos_token, eos_token, ...) to token strings; they are also
    chat-template variables. `add_bos_token` / `add_eos_token` of None keep whatever the backend's
    post-processor does; a bool replaces it (as transformers does when a config sets them).
    The backend tokenizer is used as is (and its post-processor may be changed), not copied.
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | Mapping[str, str] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        name: str = "<in-memory tokenizer>",
    ):
        self.backend = tok
        self._prompt_encoder: PromptEncoder | None = None  # made on first use
        self.name = name
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        if isinstance(chat_template, str):
            chat_template = {"default": chat_template}
        self.chat_templates: dict[str, str] = dict(chat_template or {})
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        if add_bos_token is not None or add_eos_token is not None:
            tok.post_processor = None  # encode() adds BOS/EOS itself, so the backend must not add them too
        self.eos_token_ids: set[int] = set(eos_token_ids)
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        if add_bos_token and self.bos_token_id is None:
            logger.warning("%s: add_bos_token is set but there is no BOS token; not adding one", name)

    @classmethod
    def from_tokenizers(cls, tok: tokenizers.Tokenizer, **kwargs: Any) -> Tokenizer:
        """Wrap a tokenizer built in memory; keyword arguments as for the constructor."""
        return cls(tok, **kwargs)

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError(
                f"{tok_file} not found: lucebox needs a fast tokenizer (tokenizer.json); "
                "re-save the tokenizer with transformers (AutoTokenizer ... save_pretrained) to create it"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception for bad JSON or an unknown model
            raise CheckpointError(f"{tok_file}: cannot load the tokenizer: {e}") from e

        cfg_file = path / "tokenizer_config.json"
        cfg = _read_json_object(cfg_file)
        special = {}
        for key in SPECIAL_TOKEN_NAMES:
            value = cfg.get(key)
            if isinstance(value, dict):  # a serialised AddedToken
                value = value.get("content")
            if value is not None and not isinstance(value, str):
                raise CheckpointError(f"{cfg_file}: {key} must be a string or {{'content': ...}}, got {value!r}")
            special[key] = value
        flags = {}
        for key in ("add_bos_token", "add_eos_token"):
            if cfg.get(key) is not None and not isinstance(cfg[key], bool):
                raise CheckpointError(f"{cfg_file}: {key} must be true or false, got {cfg[key]!r}")
            flags[key] = cfg.get(key)

        templates = _config_chat_templates(cfg.get("chat_template"), cfg_file)
        # Like transformers: standalone template files, when present, replace the config's templates.
        file_templates = {}
        if (path / "chat_template.jinja").is_file():
            file_templates["default"] = _read_text(path / "chat_template.jinja")
        extra_dir = path / "additional_chat_templates"
        if extra_dir.is_dir():
            for f in sorted(extra_dir.glob("*.jinja")):
                file_templates[f.stem] = _read_text(f)
        templates = file_templates or templates
        if not templates and (path / "chat_template.json").is_file():  # processor layout (multimodal models)
            templates = _config_chat_templates(
                _read_json_object(path / "chat_template.json").get("chat_template"), path / "chat_template.json"
            )

        gen_file = path / "generation_config.json"
        eos_ids = _id_list(_read_json_object(gen_file).get("eos_token_id"), f"{gen_file}: eos_token_id")
        return cls(tok, special_tokens=special, eos_token_ids=eos_ids, chat_template=templates, name=str(path), **flags)

    @classmethod
    def from_gguf(cls, reader: Any, path: str | Path | None = None) -> Tokenizer:
        """Rebuild the tokenizer from a `gguf.GGUFReader`'s `tokenizer.*` metadata."""
        from lucebox.text.gguf_vocab import tokenizer_from_gguf

        return tokenizer_from_gguf(reader, path)

    # ---- vocabulary ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The configured EOS token; generation stops on any of `eos_token_ids`."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def all_special_ids(self) -> list[int]:
        ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        ids.update(i for name in self.special_tokens if (i := self._special_id(name)) is not None)
        return sorted(ids)

    # ---- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched as single tokens.

        Encode a rendered chat prompt with add_special_tokens=False: templates write their own BOS.
        """
        if not isinstance(text, str):
            raise RequestError(f"a prompt to encode must be a string, got {type(text).__name__}")
        # encode_batch releases the GIL (encode holds it: 3 s for a 1.6 MB text, every other thread stalled)
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens:
            if self.add_bos_token and (bos := self.bos_token_id) is not None:
                ids.insert(0, bos)
            if self.add_eos_token and (eos := self.eos_token_id) is not None:
                ids.append(eos)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """encode(text, add_special_tokens=False) of a rendered chat prompt, reusing the ids of a recent
        prompt it extends (text/prompt_encoder.py): an agent's next turn encodes only what is new."""
        if not isinstance(text, str):
            raise RequestError(f"a prompt to encode must be a string, got {type(text).__name__}")
        if self._prompt_encoder is None:
            with _ENCODER_LOCK:
                if self._prompt_encoder is None:
                    self._prompt_encoder = PromptEncoder(self.backend)
        return self._prompt_encoder.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # int(): ids may come as numpy / torch integers, which the Rust side does not take
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: Sequence | None = None) -> str:
        """Template text: a named template, the given text itself, or the model's (tool_use if tools)."""
        templates = self.chat_templates
        if chat_template is not None:
            return templates.get(chat_template, chat_template)
        if not templates:
            raise RequestError(
                f"the model at {self.name} has no chat template; pass one (chat_template=...) or send a plain "
                "text prompt to the completions endpoint"
            )
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise RequestError(
            f"the model at {self.name} has several chat templates and none named 'default': {sorted(templates)}; "
            "choose one with chat_template=<name>"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text, as transformers' apply_chat_template(..., tokenize=False) renders it."""
        return render_chat_template(
            self.get_chat_template(chat_template, tools),
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **template_kwargs,
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces.

    A character can be split over several tokens (byte-level BPE, byte-fallback pieces), and some decoders
    change a token's text depending on its neighbours (SentencePiece strips the first leading space). So
    each step decodes a small window twice -- up to the last emitted token (`prefix`..`read`) and up to the
    newest token -- and emits the difference, holding it back while it ends in an incomplete character.
    The pieces concatenate to `tokenizer.decode(all ids)`, once `flush()` has been called at the end.

    `context_ids` (e.g. the prompt's last tokens) only give the first decoded window its left context.
    """

    _CONTEXT = 5  # tokens of context kept left of the window, as vLLM does
    # Tokens held back at most: a character is at most 4 bytes, so a longer run that still ends in an
    # incomplete one is not text (random or hostile output). It is emitted as decoded, replacement
    # characters included; waiting on would make every step decode an ever longer window.
    _MAX_PENDING = 16

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(context_ids)
        self._prefix = max(len(self.ids) - self._CONTEXT, 0)
        self._read = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add token(s); return the text they complete ("" while a character is still incomplete)."""
        try:  # one id: int, numpy or torch integer
            self.ids.append(operator.index(token_ids))
        except TypeError:
            self.ids.extend(int(i) for i in token_ids)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        held = len(text) <= len(prefix_text) or text.endswith("\ufffd")
        if held and len(self.ids) - self._read <= self._MAX_PENDING:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Return what is still held back (a byte sequence that never became a valid character)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prefix_text) :]


# ---- GGUF vocabularies -------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e


def _read_json_object(path: Path) -> dict:
    """The JSON object in `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _config_chat_templates(value: Any, where: Path) -> dict[str, str]:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise CheckpointError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")


def _id_list(value: Any, what: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CheckpointError(f"{what} must be a token id or a list of ids, got {value!r}")
    return values

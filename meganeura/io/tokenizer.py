"""Text <-> token ids for language models, over the ``tokenizers`` package (Hugging Face's Rust
tokenizers), plus chat templates rendered with jinja2 and streaming decoding.

Two sources:

- ``Tokenizer.from_gguf``: the byte-level BPE that llama.cpp embeds in a GGUF file
  (``tokenizer.ggml.*`` keys, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md). The
  vocabulary is already spelled in GPT-2's byte alphabet; the text is split before BPE the way
  llama.cpp splits it for the file's ``tokenizer.ggml.pre`` (``llama-vocab.cpp``); tokens typed
  CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens, so both are
  matched whole in the text.
- ``Tokenizer.from_file``: a Hugging Face folder's ``tokenizer.json`` and ``tokenizer_config.json``
  (special tokens and ``chat_template``; a ``chat_template.jinja`` file wins, as in transformers).

Chat templates render as transformers' ``apply_chat_template`` renders them: a sandboxed jinja2
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that keeps non-ASCII, the globals ``raise_exception`` and ``strftime_now``, and
the special tokens (``bos_token``, ``eos_token``...) as variables.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from meganeura.io._optional import require

__all__ = ["IncrementalDecoder", "Tokenizer", "TokenizerError", "attach_tokenizer"]

# GPT-2's pre-tokenizer split, which ByteLevel(use_regex=True) applies.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3, tokenizer.json of Meta-Llama-3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how llama.cpp splits before BPE: "gpt2" is the GPT-2 split alone,
# "digits" splits every digit off first, then GPT-2's (SmolLM, StarCoder...), "llama3" Llama 3's.
_PRE_SPLITS = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "command-r": "digits",
    "codeshell": "digits",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "smaug-bpe": "llama3",
}
# Tokens that end a turn in common chat formats; llama.cpp also stops on these (its EOG set).
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_CONTROL, _USER_DEFINED = 3, 4


class TokenizerError(ValueError):
    """Tokenizer data this module cannot use, or a chat template that cannot render."""


class IncrementalDecoder:
    """Streaming detokenizer: feed ids one by one, get the text they add.

    A UTF-8 character can span several byte-level tokens, and some decoders drop or add a space
    depending on the neighbouring token; so each step decodes a short window of recent ids and
    returns only what the whole window adds, once it no longer ends in an incomplete character
    (U+FFFD). The concatenation of all returned pieces and ``flush()`` equals
    ``decode(all ids)`` for byte-level BPE.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are fully emitted and no longer decoded
        self._read = 0  # ids before it have been emitted

    def step(self, token_id: int) -> str:
        """Add one id; return the new text ('' while a character is still incomplete)."""
        self._ids.append(int(token_id))
        done = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        """The text still held back (a truncated character decodes to U+FFFD); resets."""
        done = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._ids, self._prefix, self._read = [], 0, 0
        return text[len(done) :]


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with its special tokens and chat template.

    Build it with :meth:`from_gguf` or :meth:`from_file`.

    Attributes:
        backend: the ``tokenizers.Tokenizer``.
        chat_template: the jinja2 source, or None.
        bos_token, eos_token, unk_token, pad_token: token strings or None.
    """

    def __init__(
        self,
        backend: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.unk_token, self.pad_token = unk_token, pad_token
        self.chat_template = chat_template

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, chat_template={self.chat_template is not None})"
        )

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: Any) -> Tokenizer:
        """The tokenizer embedded in a GGUF file.

        Args:
            source: a :class:`~meganeura.io.gguf.GGUFCheckpoint`, a path to a ``.gguf`` file, or
                its metadata as a mapping (``tokenizer.ggml.tokens`` etc. as lists).

        Raises:
            TokenizerError: no tokenizer in the metadata, a model other than byte-level BPE
                (``tokenizer.ggml.model`` 'gpt2'), or an unknown ``tokenizer.ggml.pre``.
        """
        tk = require("tokenizers")
        if isinstance(source, (str, os.PathLike)):
            from meganeura.io.gguf import load_gguf

            source = load_gguf(source)
        meta: Mapping[str, Any] = getattr(source, "metadata", source)
        model = meta.get("tokenizer.ggml.model")
        if model is None or "tokenizer.ggml.tokens" not in meta:
            raise TokenizerError("the GGUF metadata has no tokenizer (tokenizer.ggml.model/tokens)")
        if model != "gpt2":
            raise TokenizerError(
                f"tokenizer.ggml.model {model!r} is not supported; supported: 'gpt2' "
                "(byte-level BPE)"
            )
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_SPLITS:
            raise TokenizerError(
                f"tokenizer.ggml.pre {pre!r} is not supported; supported: {sorted(_PRE_SPLITS)}"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = []
        for i, merge in enumerate(meta.get("tokenizer.ggml.merges", [])):
            pair = merge.split(" ")
            if len(pair) != 2:
                raise TokenizerError(f"tokenizer.ggml.merges[{i}] = {merge!r} is not 'a b'")
            merges.append((pair[0], pair[1]))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise TokenizerError(f"tokenizer.ggml.tokens repeats tokens ({len(tokens)} entries)")
        split = _PRE_SPLITS[pre]
        backend = tk.Tokenizer(
            tk.models.BPE(vocab, merges, ignore_merges=split == "llama3", fuse_unk=False)
        )
        backend.pre_tokenizer = _byte_level_pre_tokenizer(tk, split)
        backend.decoder = tk.decoders.ByteLevel()
        backend.add_special_tokens(
            [
                tk.AddedToken(tok, special=True, normalized=False)
                for tok, kind in zip(tokens, types)
                if kind == _CONTROL
            ]
        )
        backend.add_tokens(
            [
                tk.AddedToken(tok, special=False, normalized=False)
                for tok, kind in zip(tokens, types)
                if kind == _USER_DEFINED
            ]
        )

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        bos, eos = token("bos"), token("eos")
        _set_post_processor(
            tk,
            backend,
            bos if meta.get("tokenizer.ggml.add_bos_token", False) else None,
            eos if meta.get("tokenizer.ggml.add_eos_token", False) else None,
        )
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            unk_token=token("unknown"),
            pad_token=token("padding"),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_file(cls, folder: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face tokenizer folder (or a ``tokenizer.json`` path).

        Reads ``tokenizer.json``; ``tokenizer_config.json`` (special tokens, ``chat_template``)
        and ``special_tokens_map.json`` when present; ``chat_template.jinja`` overrides the
        config's template.

        Raises:
            FileNotFoundError: no ``tokenizer.json``.
        """
        tk = require("tokenizers")
        path = Path(folder)
        if path.is_file():
            path, file = path.parent, path
        else:
            file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tk.Tokenizer.from_file(str(file))
        # tokenizer.json may fix a padding length and truncation for batched training (the
        # MiniLM folder pads every text to 128); encode() returns one text's own ids.
        backend.no_padding()
        backend.no_truncation()
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if (path / name).is_file():
                config.update(json.loads((path / name).read_text(encoding="utf-8")))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers' default is "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")

        def token(key: str) -> str | None:
            value = config.get(key)
            return value.get("content") if isinstance(value, dict) else value

        return cls(
            backend,
            bos_token=token("bos_token"),
            eos_token=token("eos_token"),
            unk_token=token("unk_token"),
            pad_token=token("pad_token"),
            chat_template=template,
        )

    def save_pretrained(self, folder: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat
        template) into ``folder``, as transformers' ``save_pretrained`` does, so
        :meth:`from_file` (and transformers' ``AutoTokenizer``) read it back. Each file is
        written to a temporary name and renamed."""
        from .checkpoint import write_atomic

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        write_atomic(path / "tokenizer.json", self.backend.to_str().encode("utf-8"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if getattr(self, key) is not None:
                config[key] = getattr(self, key)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        write_atomic(path / "tokenizer_config.json", text.encode("utf-8"))

    # -- ids -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the embedding has at least this many rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_to_id(self.eos_token)

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end generation: eos first, then the end-of-turn tokens in the vocabulary
        (``<|im_end|>``, ``<|eot_id|>``...) and ``<|endoftext|>``, as llama.cpp's EOG set."""
        ids = [self.eos_token_id]
        ids += [self.token_to_id(t) for t in (*_END_OF_TURN, "<|endoftext|>")]
        return list(dict.fromkeys(i for i in ids if i is not None))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) map to their ids.

        Args:
            add_special_tokens: also add what the tokenizer's post-processor adds (a GGUF's bos
                when ``tokenizer.ggml.add_bos_token``; BERT's ``[CLS] ... [SEP]``).
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        """A fresh :class:`IncrementalDecoder` for streaming generated ids."""
        return IncrementalDecoder(self, skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text with the tokenizer's chat template.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``.
            add_generation_prompt: end with the header of the assistant's turn.
            tools, documents, kwargs: passed to the template as transformers passes them.

        Returns:
            The text; tokenize it with ``encode(text)`` (its special tokens are in it).

        Raises:
            TokenizerError: the tokenizer has no chat template, or the template raised.
        """
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template")
        jinja2 = require("jinja2")
        variables = {
            k: v
            for k, v in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
            )
            if v is not None
        }
        variables.update(kwargs)
        try:
            return _compile(self.chat_template).render(
                messages=[dict(m) for m in messages],
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None if documents is None else [dict(d) for d in documents],
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from e


def attach_tokenizer(model: Any, checkpoint: Any) -> None:
    """Give ``model`` (read back by its ``tokenizer`` property) ``checkpoint.tokenizer()``, or
    None when the checkpoint has none (``FileNotFoundError``); the models' ``from_pretrained``
    call it after loading the weights."""
    try:
        tokenizer = checkpoint.tokenizer()
    except FileNotFoundError:
        tokenizer = None
    object.__setattr__(model, "_tokenizer", tokenizer)


def _byte_level_pre_tokenizer(tk: Any, split: str) -> Any:
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split != "llama3")
    if split == "gpt2":
        return byte_level
    pattern = r"\p{N}" if split == "digits" else _LLAMA3_SPLIT
    first = tk.pre_tokenizers.Split(tk.Regex(pattern), behavior="isolated")
    return tk.pre_tokenizers.Sequence([first, byte_level])


def _set_post_processor(tk: Any, backend: Any, bos: str | None, eos: str | None) -> None:
    if bos is None and eos is None:
        return
    ends = ([bos] if bos else [], [eos] if eos else [])
    single = " ".join([*ends[0], "$A", *ends[1]])
    pair = " ".join([*ends[0], "$A", *ends[1], *ends[0], "$B", *ends[1]])
    special = [(t, backend.token_to_id(t)) for t in dict.fromkeys([*ends[0], *ends[1]])]
    backend.post_processor = tk.processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """The template compiled in an environment like transformers' (module docstring)."""
    jinja2 = require("jinja2")
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        # transformers marks assistant text with {% generation %}...{% endgeneration %} to
        # build masks; rendering only needs the body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # jinja2's own tojson escapes HTML characters, which would change the prompt text.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not parse: {e}") from e

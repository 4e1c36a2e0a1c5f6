"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``) with the chat/tool special tokens.

A tokenizer trained here is saved as ``tokenizer.json`` (the standard HF format)
in ``WORKDIR/tokenizer/`` and loaded by every later stage and by the sampler; an
HF ``tokenizer.json`` from a real model loads the same way (its own special
tokens are kept, and the chat tokens must then be present or mapped).

Pure Python, no JAX: the harness (``cursor_rl.env``) uses it on CPU-only workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

# The chat / tool-call protocol's special tokens (see cursor_rl.env.protocol for the
# format). Order fixes their ids in a freshly trained tokenizer: <|pad|> is 0.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<|tool_call|>",
    "<|/tool_call|>",
    "<|summary|>",
    "<|/summary|>",
)

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer`` with the project's special tokens."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer):
        self._tok = hf_tokenizer
        self._special = {}
        for token in SPECIAL_TOKENS:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                self._special[token] = token_id

    # ---- construction ---------------------------------------------------------------

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
        """Trains byte-level BPE on ``texts``; special tokens take the first ids."""
        if vocab_size < len(SPECIAL_TOKENS) + 256:
            raise ValueError(
                f"tokenizer.vocab_size={vocab_size} must be >= {len(SPECIAL_TOKENS) + 256} "
                "(special tokens + the 256 byte symbols)"
            )
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """Loads ``path`` (a ``tokenizer.json`` file or a directory holding one)."""
        file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(f"no tokenizer at {file}")
        try:
            return cls(tokenizers.Tokenizer.from_file(file))
        except Exception as e:  # tokenizers raises bare Exceptions on bad JSON
            raise ValueError(f"unreadable tokenizer file {file}: {e}") from e

    def save(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        file = os.path.join(directory, TOKENIZER_FILE)
        tmp = file + ".tmp"
        self._tok.save(tmp)
        os.replace(tmp, file)
        return file

    def to_json(self) -> str:
        return self._tok.to_str()

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_str(text))

    # ---- use ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text; special-token strings inside it are *not* special."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def decode_stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Incrementally decoded text pieces (multi-byte characters held until whole)."""
        ids = list(ids)
        emitted = ""
        for i in range(1, len(ids) + 1):
            text = self.decode(ids[:i])
            if text.endswith("\ufffd"):
                continue
            yield text[len(emitted) :]
            emitted = text

    def special_id(self, token: str) -> int:
        """Id of a special token; KeyError naming it when this tokenizer lacks it."""
        try:
            return self._special[token]
        except KeyError:
            raise KeyError(
                f"special token {token!r} is not in this tokenizer's vocabulary"
            ) from None

    def has_special(self, token: str) -> bool:
        return token in self._special

    @property
    def special_ids(self) -> dict[str, int]:
        return dict(self._special)

    @property
    def pad_id(self) -> int:
        return self._special.get("<|pad|>", 0)

    @property
    def eos_id(self) -> int:
        return self.special_id("<|eos|>")

    @property
    def bos_id(self) -> int:
        return self.special_id("<|bos|>")

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def describe(self) -> str:
        return json.dumps({"vocab_size": self.vocab_size, "special": self._special})

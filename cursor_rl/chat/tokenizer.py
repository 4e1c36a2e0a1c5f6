"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``) with the chat/tool special tokens.

A tokenizer trained here is saved as ``tokenizer.json`` (the standard HF format)
in ``WORKDIR/tokenizer/`` and loaded by every later stage and by the sampler; an
HF ``tokenizer.json`` from a real model loads the same way (its own special
tokens are kept; ``add_missing_special_tokens`` appends the chat tokens it lacks,
after which the model's embedding must grow to ``vocab_size``).

Design choices:

1. Special tokens are structure, never text: ``encode`` treats a literal
   ``"<|end|>"`` inside a file or a tool observation as ordinary characters, so a
   document (or an adversarial tool output) cannot forge a turn boundary. Only
   ``special_id`` produces special ids; the chat renderer places them.
2. Training takes a character budget (``max_chars``): BPE merges stabilise after a
   few MB of code, so training on a seeded sample of the corpus takes seconds
   instead of tokenising everything.

Pure Python, no JAX: the harness (``cursor_rl.env``) uses it on CPU-only workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence

import tokenizers
from etils import epath
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from cursor_rl.chat import tiktoken_tokenizer
from cursor_rl.chat.special import SPECIAL_TOKENS, SpecialTokens

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(SpecialTokens):
    """Thin wrapper over ``tokenizers.Tokenizer`` with the project's special tokens."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer):
        self._tok = hf_tokenizer
        # Choice 1: special-token strings in text are encoded as plain characters.
        self._tok.encode_special_tokens = True
        self._special = {}
        for token in SPECIAL_TOKENS:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                self._special[token] = token_id

    # ---- construction ---------------------------------------------------------------

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        min_frequency: int = 2,
        max_chars: int | None = None,
    ) -> Tokenizer:
        """Trains byte-level BPE on ``texts``; special tokens take the first ids.

        Args:
          texts: training documents (any iterable; consumed lazily).
          vocab_size: the vocabulary size including the special tokens.
          min_frequency: a pair must occur this often to be merged.
          max_chars: stop reading ``texts`` after this many characters (the last
            document is cut); None reads everything.

        Returns:
          The trained tokenizer.
        """
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
        if max_chars is not None:
            texts = _take_chars(texts, max_chars)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads ``path`` (a ``tokenizer.json`` file or a directory holding one; local
        or ``gs://``). A directory holding ``tiktoken.model`` and no ``tokenizer.json``
        (Kimi K2's format), or that file itself, gives a ``TiktokenTokenizer`` with the
        same methods (``cursor_rl.chat.tiktoken_tokenizer``)."""
        file = epath.Path(os.path.expanduser(os.fspath(path)))
        if file.is_dir():
            tiktoken_file = file / tiktoken_tokenizer.RANKS_FILE
            if not (file / TOKENIZER_FILE).exists() and tiktoken_file.exists():
                file = tiktoken_file
            else:
                file = file / TOKENIZER_FILE
        if file.name == tiktoken_tokenizer.RANKS_FILE:
            return tiktoken_tokenizer.TiktokenTokenizer.load(file)
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer at {file}")
        try:
            return cls.from_json(file.read_text(encoding="utf-8"))
        except Exception as e:  # tokenizers raises bare Exceptions on bad JSON
            raise ValueError(f"unreadable tokenizer file {file}: {e}") from e

    def add_missing_special_tokens(self) -> list[str]:
        """Appends the project's special tokens this tokenizer lacks (e.g. an HF model's).

        Returns:
          The tokens added, in id order; the vocabulary grows by that many.
        """
        missing = [t for t in SPECIAL_TOKENS if self._tok.token_to_id(t) is None]
        if missing:
            self._tok.add_special_tokens(missing)
            self._tok.encode_special_tokens = True
            for token in missing:
                self._special[token] = self._tok.token_to_id(token)
        return missing

    def save(self, directory: str) -> str:
        """Writes ``directory/tokenizer.json`` atomically; returns its path."""
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
        """Inverse of ``to_json`` (a ``TiktokenTokenizer``'s JSON gives one back)."""
        if tiktoken_tokenizer.is_tiktoken_json(text):
            return tiktoken_tokenizer.TiktokenTokenizer.from_json(text)
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


def _take_chars(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    remaining = max_chars
    for text in texts:
        if remaining <= 0:
            return
        yield text[:remaining]
        remaining -= len(text)

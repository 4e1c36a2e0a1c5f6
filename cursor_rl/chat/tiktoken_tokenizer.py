"""tiktoken BPE tokenizers as Kimi K2 ships them, behind the interface of ``Tokenizer``.

Kimi K2 (and K2.5) ship their tokenizer as two files in the model directory:

* ``tiktoken.model``: one line per BPE token, ``base64(token bytes) rank``; the
  ranks are the token ids 0..N-1 and their order is the merge priority.
* ``tokenizer_config.json``: the HF tokenizer config; its ``added_tokens_decoder``
  maps the special tokens' ids (N and above) to their strings, and ``bos_token``,
  ``eos_token`` and ``pad_token`` name three of them.

``Tokenizer.load`` returns a ``TiktokenTokenizer`` for a directory that holds
``tiktoken.model`` (and no ``tokenizer.json``); ``Tokenizer.from_json`` does the
same for this class's ``to_json`` text, so a run's workdir copy of the tokenizer
(``WORKDIR/tokenizer/tokenizer.json``) and the checkpoint metadata round-trip.

Design choices:

1. **Same interface, same rules as ``Tokenizer``.** Special-token strings inside
   text are ordinary characters (``encode`` is tiktoken's ``encode_ordinary``);
   only ``special_id`` gives special ids. ``decode`` skips ids outside the
   vocabulary, as the HF tokenizer does. ``special_ids`` holds every special token
   of the config (not only the project's chat tokens). ``bos_id``/``eos_id``/
   ``pad_id`` are the project's ``<|bos|>``/``<|eos|>``/``<|pad|>`` when the
   tokenizer has them (so they agree with the data pipeline, which looks those
   names up), else the config's ``bos_token``/``eos_token``/``pad_token``.
2. **Reserved ids are filled.** Ids between the last BPE rank and the largest
   special id that the config does not name get ``<|reserved_token_{id}|>``, as
   Kimi's own tokenizer code does, so every id below ``vocab_size`` decodes and
   the vocabulary matches the model's embedding (163,840 rows for Kimi K2).
3. **Strict files.** Each line of ``tiktoken.model`` is checked (two fields,
   strict base64, a non-negative integer rank, no repeated rank or token); ranks
   must be exactly 0..N-1 and cover all 256 single bytes (byte-level BPE can then
   encode any text). Every error names the file and the line.
4. **The pre-tokenizer is Kimi K2's** (``KIMI_PATTERN``): runs of Han characters,
   words (cased letter runs with English contractions), digits in groups of at
   most three, punctuation runs, newlines and other whitespace. A config may carry
   its own ``pat_str``; ``save`` writes it there so a tokenizer with another
   pattern round-trips.
5. **Adding tokens appends.** ``add_missing_special_tokens`` gives the project's
   chat tokens the ids after the vocabulary; the model must then grow with
   ``cursor_rl.model.resize.resize_vocab``.

Pure Python, no JAX. ``tiktoken`` (the ``hf`` extra) is imported only when a
tokenizer is built, so importing this module never needs it.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import copy
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from etils import epath

# tokenizer imports this module at its top (its loaders dispatch here), so this one
# imports it as a module and reads its names only when called.
from cursor_rl.chat.special import SPECIAL_TOKENS, SpecialTokens

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
# First key of ``to_json``'s object: ``Tokenizer.from_json`` dispatches on it.
JSON_FORMAT = "cursor_rl.tiktoken"
_JSON_START = re.compile(r'\s*\{\s*"format"\s*:\s*"' + re.escape(JSON_FORMAT) + '"')

# ---- Kimi K2's pre-tokenizer --------------------------------------------------------------
# Letters other than Han: upper/title/modifier/other letters and marks ("upper-ish"), and
# lower/modifier/other letters and marks ("lower-ish"); `&&` intersects the classes.
_UPPERISH = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWERISH = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_ONE_LEADING = r"[^\r\n\p{L}\p{N}]?"  # e.g. the space before a word
KIMI_PATTERN = "|".join(
    (
        r"[\p{Han}]+",  # a run of Han characters is one piece
        _ONE_LEADING + _UPPERISH + "*" + _LOWERISH + "+" + _CONTRACTION,  # "Word", "word"
        _ONE_LEADING + _UPPERISH + "+" + _LOWERISH + "*" + _CONTRACTION,  # "WORD"
        r"\p{N}{1,3}",  # digits, at most three per piece
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",  # punctuation (and the newlines after it)
        r"\s*[\r\n]+",  # newlines with the whitespace before them
        r"\s+(?!\S)",  # whitespace, leaving the last space to the next word
        r"\s+",
    )
)

_RESERVED = "<|reserved_token_{}|>"


class TiktokenTokenizer(SpecialTokens):
    """A tiktoken BPE vocabulary plus special tokens, with ``Tokenizer``'s methods.

    Args:
      ranks: token bytes -> rank, the ranks exactly 0..N-1 (N >= 256, every single
        byte present).
      special_tokens: special-token string -> id, every id >= N.
      pat_str: the pre-tokenizer regex (tiktoken/Rust ``regex`` syntax).
      roles: which special tokens the config names ``bos``, ``eos``, ``pad`` (and
        ``unk``), e.g. ``{"bos": "[BOS]"}``.
      config: the rest of ``tokenizer_config.json``, written back by ``save``.
      source: where the tokenizer came from, for error messages.
    """

    def __init__(
        self,
        ranks: Mapping[bytes, int],
        special_tokens: Mapping[str, int],
        pat_str: str = KIMI_PATTERN,
        roles: Mapping[str, str] | None = None,
        config: Mapping[str, Any] | None = None,
        source: str = "<memory>",
    ):
        self._ranks = dict(ranks)
        self._source = source
        _check_ranks(self._ranks, source)
        self._num_base = len(self._ranks)
        self._pat_str = pat_str
        self._roles = dict(roles or {})
        self._config = dict(config or {})
        self._special = _fill_reserved(dict(special_tokens), self._num_base, source)
        for role, token in self._roles.items():
            if token not in self._special:
                raise ValueError(
                    f"{source}: {role}_token {token!r} is not one of the special tokens"
                )
        self._build()

    def _build(self) -> None:
        try:
            import tiktoken
        except ImportError as e:
            raise ImportError(
                f"reading the tiktoken tokenizer {self._source} needs the tiktoken package "
                "(pip install -e '.[hf]')"
            ) from e
        self._special = dict(sorted(self._special.items(), key=lambda item: item[1]))
        self._special_set = frozenset(self._special.values())
        self._name_of = {i: token for token, i in self._special.items()}
        try:
            self._enc = tiktoken.Encoding(
                name=os.path.basename(self._source) or "tiktoken",
                pat_str=self._pat_str,
                mergeable_ranks=self._ranks,
                special_tokens=self._special,
            )
        except ValueError as e:  # e.g. a pattern the Rust regex engine rejects
            raise ValueError(f"{self._source}: tiktoken rejects this tokenizer: {e}") from e

    # ---- construction ---------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike) -> TiktokenTokenizer:
        """Loads a directory holding ``tiktoken.model`` and ``tokenizer_config.json``
        (or the ``tiktoken.model`` file itself); local or ``gs://``."""
        path = epath.Path(os.path.expanduser(os.fspath(path)))
        directory = path if path.is_dir() else path.parent
        ranks_file = path / RANKS_FILE if path.is_dir() else path
        config_file = directory / CONFIG_FILE
        if not ranks_file.exists():
            raise FileNotFoundError(f"no tiktoken BPE file at {ranks_file}")
        if not config_file.exists():
            raise FileNotFoundError(
                f"{config_file} does not exist: a tiktoken tokenizer needs it beside "
                f"{ranks_file.name} for its special tokens (added_tokens_decoder)"
            )
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"unreadable tokenizer config {config_file}: {e}") from e
        return cls._from_parts(
            ranks_file.read_bytes(), str(ranks_file), config, str(config_file), str(directory)
        )

    @classmethod
    def _from_parts(
        cls, ranks_data: bytes, ranks_name: str, config: Any, config_name: str, source: str
    ) -> TiktokenTokenizer:
        ranks = parse_ranks(ranks_data, ranks_name)
        special, roles, rest = parse_config(config, config_name, len(ranks))
        pat_str = rest.pop("pat_str", KIMI_PATTERN)
        if not isinstance(pat_str, str) or not pat_str:
            raise ValueError(f"{config_name}: pat_str must be a non-empty string")
        return cls(ranks, special, pat_str=pat_str, roles=roles, config=rest, source=source)

    def add_missing_special_tokens(self) -> list[str]:
        """Appends the project's chat tokens this tokenizer lacks (choice 5).

        Returns:
          The tokens added, in id order; the vocabulary grows by that many.
        """
        missing = [t for t in SPECIAL_TOKENS if t not in self._special]
        for token in missing:
            self._special[token] = self.vocab_size
        if missing:
            self._build()
        return missing

    def _config_json(self) -> dict[str, Any]:
        """``tokenizer_config.json``: the loaded config with this vocabulary's tokens."""
        config = copy.deepcopy(self._config)
        config["added_tokens_decoder"] = {
            str(i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token, i in self._special.items()
            if not _is_filled_reserved(token, i)
        }
        for role, token in self._roles.items():
            config[f"{role}_token"] = token
        if self._pat_str != KIMI_PATTERN:
            config["pat_str"] = self._pat_str
        return config

    def _ranks_text(self) -> str:
        by_rank = sorted(self._ranks.items(), key=lambda item: item[1])
        return "".join(f"{base64.b64encode(t).decode('ascii')} {r}\n" for t, r in by_rank)

    def save(self, directory: str | os.PathLike) -> str:
        """Writes ``directory/tiktoken.model`` and ``tokenizer_config.json`` (each
        atomically where the filesystem allows); returns the model file's path."""
        directory = epath.Path(os.fspath(directory))
        directory.mkdir(parents=True, exist_ok=True)
        contents = {
            RANKS_FILE: self._ranks_text(),
            CONFIG_FILE: json.dumps(self._config_json(), indent=2, ensure_ascii=False) + "\n",
        }
        for name, text in contents.items():
            tmp = directory / (name + ".tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(directory / name)
        return os.fspath(directory / RANKS_FILE)

    def to_json(self) -> str:
        """Both files in one JSON object (for the workdir copy and checkpoint metadata)."""
        return json.dumps(
            {"format": JSON_FORMAT, "ranks": self._ranks_text(), "config": self._config_json()},
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, text: str) -> TiktokenTokenizer:
        """Inverse of ``to_json``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"unreadable tiktoken tokenizer JSON: {e}") from e
        if not isinstance(data, dict) or data.get("format") != JSON_FORMAT:
            raise ValueError(f"not a tiktoken tokenizer JSON (no format {JSON_FORMAT!r})")
        ranks = data.get("ranks")
        if not isinstance(ranks, str):
            raise ValueError("tiktoken tokenizer JSON: 'ranks' must be the tiktoken.model text")
        return cls._from_parts(
            ranks.encode("utf-8"),
            f"<json>/{RANKS_FILE}",
            data.get("config"),
            f"<json>/{CONFIG_FILE}",
            "<json>",
        )

    # ---- use ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._num_base + len(self._special)

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text; special-token strings inside it are *not* special."""
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._enc.encode_ordinary(text) for text in texts]

    def _bytes(self, ids: Iterable[int], skip_special: bool) -> Iterator[bytes]:
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size or (skip_special and i in self._special_set):
                continue
            yield self._enc.decode_single_token_bytes(i)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return b"".join(self._bytes(ids, skip_special)).decode("utf-8", errors="replace")

    def decode_stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Incrementally decoded text pieces (multi-byte characters held until whole)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for piece in self._bytes(ids, skip_special=False):
            text = decoder.decode(piece)
            if text:
                yield text
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail

    def _role_id(self, project_token: str, role: str) -> int | None:
        if project_token in self._special:
            return self._special[project_token]
        if role in self._roles:
            return self._special[self._roles[role]]
        return None

    @property
    def pad_id(self) -> int:
        pad = self._role_id("<|pad|>", "pad")
        return 0 if pad is None else pad

    @property
    def eos_id(self) -> int:
        eos = self._role_id("<|eos|>", "eos")
        return self.special_id("<|eos|>") if eos is None else eos

    @property
    def bos_id(self) -> int:
        bos = self._role_id("<|bos|>", "bos")
        return self.special_id("<|bos|>") if bos is None else bos

    def id_to_token(self, token_id: int) -> str | None:
        """A special token's string, a BPE token's bytes as text (undecodable bytes
        as ``\\xNN``), None outside the vocabulary."""
        if token_id in self._name_of:
            return self._name_of[token_id]
        if not 0 <= token_id < self._num_base:
            return None
        return self._enc.decode_single_token_bytes(token_id).decode(
            "utf-8", errors="backslashreplace"
        )

    def describe(self) -> str:
        named = {t: i for t, i in self._special.items() if not _is_filled_reserved(t, i)}
        return json.dumps(
            {
                "format": "tiktoken",
                "vocab_size": self.vocab_size,
                "bpe_tokens": self._num_base,
                "reserved": len(self._special) - len(named),
                "special": named,
            }
        )


def is_tiktoken_json(text: str) -> bool:
    """Whether ``text`` is a ``TiktokenTokenizer.to_json`` object (not an HF tokenizer)."""
    return _JSON_START.match(text) is not None


# ---- parsing --------------------------------------------------------------------------------


def parse_ranks(data: bytes, name: str) -> dict[bytes, int]:
    """``tiktoken.model`` contents -> {token bytes: rank}; ValueError naming ``name:line``."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{name}:{line}: non-ASCII byte (expected 'BASE64 RANK' lines)") from e
    ranks: dict[bytes, int] = {}
    rank_line: dict[int, int] = {}
    token_line: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        where = f"{name}:{number}"
        if len(fields) != 2:
            raise ValueError(f"{where}: expected 'BASE64 RANK', got {line[:80]!r}")
        encoded, rank_text = fields
        try:
            token = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{where}: {encoded[:60]!r} is not valid base64 ({e})") from None
        if not token:
            raise ValueError(f"{where}: the token is empty")
        if not rank_text.isdigit():
            raise ValueError(f"{where}: rank {rank_text[:30]!r} is not a non-negative integer")
        rank = int(rank_text)
        if rank in rank_line:
            raise ValueError(f"{where}: rank {rank} is already given on line {rank_line[rank]}")
        if token in token_line:
            raise ValueError(
                f"{where}: token {token!r} already has rank {ranks[token]} "
                f"(line {token_line[token]})"
            )
        ranks[token], rank_line[rank], token_line[token] = rank, number, number
    if not ranks:
        raise ValueError(f"{name}: no tokens")
    return ranks


def _check_ranks(ranks: Mapping[bytes, int], source: str) -> None:
    values = set(ranks.values())
    if values != set(range(len(ranks))):
        missing = min(set(range(len(ranks))) - values)
        raise ValueError(
            f"{source}: the ranks must be 0..{len(ranks) - 1} (one per token); rank {missing} "
            "is missing"
        )
    for byte in range(256):
        if bytes([byte]) not in ranks:
            raise ValueError(
                f"{source}: no token for the single byte 0x{byte:02x} (a byte-level BPE "
                "vocabulary needs all 256)"
            )


def _token_name(value: Any) -> str | None:
    """A ``*_token`` config value: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def parse_config(
    config: Any, name: str, num_base: int
) -> tuple[dict[str, int], dict[str, str], dict[str, Any]]:
    """``tokenizer_config.json`` -> (special token -> id, role -> token, the other keys)."""
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a JSON object")
    rest = dict(config)
    added = rest.pop("added_tokens_decoder", None)
    if not isinstance(added, dict):
        raise ValueError(
            f"{name}: no 'added_tokens_decoder' object (the special tokens and their ids)"
        )
    special: dict[str, int] = {}
    for key, entry in added.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"{name}: added_tokens_decoder key {key!r} is not an id") from None
        content = _token_name(entry)
        if content is None:
            raise ValueError(f"{name}: added_tokens_decoder[{key!r}] has no 'content' string")
        if token_id < num_base:
            raise ValueError(
                f"{name}: special token {content!r} has id {token_id}, which is a BPE rank "
                f"(the tiktoken file has {num_base} tokens; special ids start there)"
            )
        if content in special:
            raise ValueError(
                f"{name}: special token {content!r} has two ids, {special[content]} and {token_id}"
            )
        special[content] = token_id
    roles: dict[str, str] = {}
    for role in ("bos", "eos", "pad", "unk"):
        value = rest.pop(f"{role}_token", None)
        if value is None:
            continue
        token = _token_name(value)
        if token is None or token not in special:
            raise ValueError(
                f"{name}: {role}_token {value!r} is not one of the added_tokens_decoder tokens"
            )
        roles[role] = token
    return special, roles, rest


def _fill_reserved(special: dict[str, int], num_base: int, source: str) -> dict[str, int]:
    """Names the unnamed ids between the BPE ranks and the largest special id (choice 2)."""
    by_id: dict[int, str] = {}
    for token, i in special.items():
        if i < num_base:
            raise ValueError(f"{source}: special token {token!r} has id {i} < {num_base}")
        if i in by_id:
            raise ValueError(f"{source}: id {i} is both {by_id[i]!r} and {token!r}")
        by_id[i] = token
    end = max(by_id, default=num_base - 1) + 1
    for i in range(num_base, end):
        if i not in by_id:
            name = _RESERVED.format(i)
            if name in special:
                raise ValueError(f"{source}: {name!r} names id {special[name]}, not {i}")
            special[name] = i
    return special


def _is_filled_reserved(token: str, token_id: int) -> bool:
    return token == _RESERVED.format(token_id)

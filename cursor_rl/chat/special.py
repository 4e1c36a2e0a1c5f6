"""The project's special tokens, and the lookups shared by the tokenizers
(``tokenizer.Tokenizer``, ``tiktoken_tokenizer.TiktokenTokenizer``): a subclass fills
``_special`` (name -> id)."""

from __future__ import annotations

# The chat / tool-call protocol's special tokens (see cursor_rl.chat.protocol for the
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


class SpecialTokens:
    """Looks tokens up in ``self._special``, the tokenizer's special tokens by name."""

    _special: dict[str, int]

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

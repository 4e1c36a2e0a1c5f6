"""Tokenizer: training on a budget, special tokens, save/load, foreign HF tokenizers."""

import json
import os

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from cursor_rl.chat import tokenizer as tokenizer_lib
from cursor_rl.chat.tokenizer import SPECIAL_TOKENS, Tokenizer

CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "for i in range(10):\n    print(i, 'ünïcödé ✓')\n",
] * 50


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(CODE, vocab_size=400)


def test_special_tokens_take_the_first_ids(tok):
    assert [tok.special_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.pad_id == 0 and tok.bos_id == 1 and tok.eos_id == 2
    assert tok.vocab_size <= 400


def test_round_trip_including_unicode(tok):
    for text in [*CODE[:3], "x = '\\u00e9'  # 日本語\n\ttab"]:
        assert tok.decode(tok.encode(text)) == text


def test_special_token_strings_in_text_stay_text(tok):
    ids = tok.encode("a <|end|> b <|tool_call|>")
    assert not set(ids) & set(tok.special_ids.values())
    assert tok.decode(ids) == "a <|end|> b <|tool_call|>"
    assert tok.decode([tok.special_id("<|end|>")]) == "<|end|>"


def test_max_chars_budget_limits_what_training_reads():
    consumed = []

    def texts():
        for text in CODE:
            consumed.append(text)
            yield text

    Tokenizer.train(texts(), vocab_size=300, max_chars=100)
    assert sum(len(t) for t in consumed) < 100 + len(max(CODE, key=len)) * 2
    assert len(consumed) < len(CODE)


def test_vocab_size_too_small_names_the_field():
    with pytest.raises(ValueError, match=r"tokenizer\.vocab_size"):
        Tokenizer.train(CODE, vocab_size=100)


def test_save_load_and_json_round_trip(tok, tmp_path):
    path = tok.save(str(tmp_path / "tokenizer"))
    assert os.path.basename(path) == tokenizer_lib.TOKENIZER_FILE
    for loaded in (Tokenizer.load(str(tmp_path / "tokenizer")), Tokenizer.load(path)):
        assert loaded.encode(CODE[0]) == tok.encode(CODE[0])
        assert loaded.special_ids == tok.special_ids
        assert loaded.encode("<|end|>") == tok.encode("<|end|>")
    assert Tokenizer.from_json(tok.to_json()).encode(CODE[1]) == tok.encode(CODE[1])


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer at"):
        Tokenizer.load(str(tmp_path / "missing"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=str(bad)):
        Tokenizer.load(str(bad))


def _foreign_hf_tokenizer_json(path):
    """An HF tokenizer.json laid out like a real model's: its own specials first."""
    hf = tokenizers.Tokenizer(models.BPE(unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(CODE, trainer=trainer)
    hf.save(str(path))


def test_foreign_hf_tokenizer_loads_and_gains_the_chat_tokens(tmp_path):
    file = tmp_path / "tokenizer.json"
    _foreign_hf_tokenizer_json(file)
    tok = Tokenizer.load(str(file))
    assert not tok.has_special("<|assistant|>")
    with pytest.raises(KeyError, match="<\\|assistant\\|>"):
        tok.special_id("<|assistant|>")
    before = tok.vocab_size
    text_ids = tok.encode(CODE[0])
    added = tok.add_missing_special_tokens()
    assert added == list(SPECIAL_TOKENS)
    assert tok.vocab_size == before + len(SPECIAL_TOKENS)
    assert tok.special_id("<|assistant|>") >= before
    assert tok.encode(CODE[0]) == text_ids  # existing ids unchanged
    assert tok.encode("<|assistant|>") != [tok.special_id("<|assistant|>")]
    tok.save(str(tmp_path / "out"))
    reloaded = Tokenizer.load(str(tmp_path / "out"))
    assert reloaded.special_ids == tok.special_ids
    assert json.loads(reloaded.describe())["vocab_size"] == tok.vocab_size

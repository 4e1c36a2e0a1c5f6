"""Kimi-K2-style tiktoken tokenizers (tiktoken.model + tokenizer_config.json) and vocab resizing.

A small byte-level BPE vocabulary (256 bytes + ~150 merges) is trained here and
written in Kimi K2's layout, with special tokens at ids after the BPE ranks and a
gap of reserved ids, so every test runs offline in well under a second; the
resize tests use a one-layer model.
"""

import base64
import collections
import importlib.util
import inspect
import itertools
import json
import re

import jax
import numpy as np
import pytest

from cursor_rl import model
from cursor_rl.chat import protocol
from cursor_rl.chat import tiktoken_tokenizer as tt
from cursor_rl.chat.tokenizer import SPECIAL_TOKENS, Tokenizer
from cursor_rl.model import hf_mapping
from cursor_rl.model.config import ModelConfig
from cursor_rl.model.resize import resize_vocab

CORPUS = (
    "def add(a, b):\n    return a + b\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n"
    "    def push(self, item):\n        self.items.append(item)\n"
    "for i in range(10):\n    print(i, 'ünïcödé ✓')  # 日本語のコメント\n"
    "HTTP_ERROR = 404; it's what we've got, isn't it?\r\n"
) * 20
NUM_MERGES = 150
# Special tokens as Kimi K2 declares them: ids after the BPE ranks, with gaps that the
# loader fills with reserved names.
SPECIAL_OFFSETS = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "[PAD]": 9}

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "x = '\\u00e9'  # 日本語\n\ttab and  double  spaces   \r\n",
    "emoji 🚀🔥, combining é (e + U+0301), Ελληνικά, русский, עברית, 中文字符",
    "WORD's CamelCase snake_case 1234567 3.14159 !!! ... \n\n\n   trailing   ",
    "",
]


def _train_ranks(text: str, num_merges: int) -> dict[bytes, int]:
    """Byte-level BPE: all 256 bytes, then the most frequent adjacent pair, repeatedly."""
    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    pieces = {w: [bytes([b]) for b in w.encode("utf-8")] for w in words}
    for _ in range(num_merges):
        pairs = collections.Counter()
        for word, count in words.items():
            seq = pieces[word]
            for pair in itertools.pairwise(seq):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        ranks.setdefault(a + b, len(ranks))
        for word, seq in pieces.items():
            merged, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            pieces[word] = merged
    return ranks


RANKS = _train_ranks(CORPUS, NUM_MERGES)
NUM_BASE = len(RANKS)
SPECIAL = {token: NUM_BASE + offset for token, offset in SPECIAL_OFFSETS.items()}


def _ranks_lines(ranks=RANKS) -> list[str]:
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    return [f"{base64.b64encode(t).decode()} {r}" for t, r in by_rank]


def _config(special=SPECIAL) -> dict:
    return {
        "added_tokens_decoder": {
            str(i): {"content": token, "special": True, "normalized": False}
            for token, i in special.items()
        },
        "bos_token": "[BOS]",
        "eos_token": {"content": "[EOS]", "special": True},  # the AddedToken-dict form
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "chat_template": "{{ messages }}",
    }


def _write(directory, lines=None, config=None):
    directory.mkdir(parents=True, exist_ok=True)
    text = "\n".join(_ranks_lines() if lines is None else lines) + "\n"
    (directory / "tiktoken.model").write_text(text)
    (directory / "tokenizer_config.json").write_text(json.dumps(config or _config()))
    return directory


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    # tiktoken comes with the hf extra; without it the tests that encode skip (file
    # checks, which fail before tiktoken is needed, and resizing still run).
    if importlib.util.find_spec("tiktoken") is None:
        pytest.skip("needs the hf extra (tiktoken)")
    return _write(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def tok(kimi_dir):
    return Tokenizer.load(kimi_dir)


# ---- loading and the interface ------------------------------------------------------------


def test_tokenizer_load_picks_tiktoken_for_a_kimi_directory_or_file(kimi_dir, tok):
    assert isinstance(tok, tt.TiktokenTokenizer)
    assert isinstance(Tokenizer.load(kimi_dir / "tiktoken.model"), tt.TiktokenTokenizer)
    assert NUM_BASE > 256 + 100  # the trained merges are there


def test_has_every_public_method_and_property_of_tokenizer(tok):
    """Same interface: everything callers use on Tokenizer (training aside) exists here,
    with the same parameters."""
    for name, member in vars(Tokenizer).items():
        if name.startswith("_") or name == "train":
            continue
        assert hasattr(tt.TiktokenTokenizer, name), name
        ours = getattr(tt.TiktokenTokenizer, name)
        if callable(member) and not isinstance(member, classmethod):
            assert list(inspect.signature(ours).parameters) == list(
                inspect.signature(member).parameters
            ), name


def test_special_ids_are_the_configs_and_gaps_are_reserved(tok):
    for token, i in SPECIAL.items():
        assert tok.special_id(token) == i and tok.has_special(token)
    assert tok.bos_id == SPECIAL["[BOS]"] and tok.eos_id == SPECIAL["[EOS]"]
    assert tok.pad_id == SPECIAL["[PAD]"]
    assert tok.vocab_size == NUM_BASE + 10
    # Ids the config leaves out are named like Kimi's reserved tokens and decode.
    assert tok.special_id(f"<|reserved_token_{NUM_BASE + 4}|>") == NUM_BASE + 4
    assert len(tok.special_ids) == 10
    assert tok.decode([NUM_BASE + 4]) == f"<|reserved_token_{NUM_BASE + 4}|>"
    with pytest.raises(KeyError, match=r"<\|end\|>"):
        tok.special_id("<|end|>")
    described = json.loads(tok.describe())
    assert described["vocab_size"] == tok.vocab_size and described["reserved"] == 5
    assert described["special"]["<|im_end|>"] == SPECIAL["<|im_end|>"]


def test_round_trip_including_unicode_and_merges(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < NUM_BASE for i in ids)
        assert tok.decode(ids) == text
    code = TEXTS[0]
    assert len(tok.encode(code)) <= len(code.encode()) // 2  # the merges are used
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_special_token_strings_in_text_stay_text(tok):
    text = "a [EOS] b <|im_end|> c [BOS]"
    ids = tok.encode(text)
    assert not set(ids) & set(tok.special_ids.values())
    assert tok.decode(ids) == text
    eos, end = tok.special_id("[EOS]"), tok.special_id("<|im_end|>")
    assert tok.decode([*tok.encode("hi"), end, eos]) == "hi<|im_end|>[EOS]"
    assert tok.decode([*tok.encode("hi"), end, eos], skip_special=True) == "hi"
    # Ids past the vocabulary are skipped, as the HF tokenizer does.
    assert tok.decode([*tok.encode("hi"), tok.vocab_size + 3]) == "hi"


def test_decode_stream_holds_multibyte_characters_until_whole(tok):
    text = "日本語のコメント ✓ 🚀 done"
    ids = tok.encode(text)
    pieces = list(tok.decode_stream(ids))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len(pieces) > 1  # streamed, not all at the end


def test_id_to_token(tok):
    assert tok.id_to_token(ord("a")) == "a"
    assert tok.id_to_token(0xE6) == "\\xe6"  # a lone UTF-8 lead byte
    assert tok.id_to_token(SPECIAL["[EOS]"]) == "[EOS]"
    assert tok.id_to_token(tok.vocab_size) is None


def test_kimi_pattern_splits_as_documented_and_tiktoken_agrees(tok):
    """KIMI_PATTERN's pieces (checked with the regex module's V1 set syntax), and
    tiktoken encodes a text as the concatenation of its pieces' encodings."""
    import regex  # a dependency of tiktoken

    pattern = regex.compile("(?V1)" + tt.KIMI_PATTERN)
    text = "Hello世界 WORLD's 12345\n\n  x, y!!\n"
    assert pattern.findall(text) == [
        "Hello", "世界", " WORLD's", " ", "123", "45", "\n\n", " ", " x", ",", " y",
        "!!\n",
    ]  # fmt: skip
    for text in [*TEXTS, CORPUS[:500]]:
        pieces = pattern.findall(text)
        assert "".join(pieces) == text
        assert tok.encode(text) == [i for p in pieces for i in tok.encode(p)]


# ---- saving, JSON, added tokens ----------------------------------------------------------


def _same(a, b):
    assert a.vocab_size == b.vocab_size and a.special_ids == b.special_ids
    assert (a.bos_id, a.eos_id, a.pad_id) == (b.bos_id, b.eos_id, b.pad_id)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)


def test_save_load_and_json_round_trip(tok, tmp_path):
    path = tok.save(str(tmp_path / "saved"))
    assert path.endswith("tiktoken.model")
    again = Tokenizer.load(tmp_path / "saved")
    _same(tok, again)
    config = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == "{{ messages }}"  # other keys are kept
    assert (tmp_path / "saved" / "tiktoken.model").read_text().splitlines() == _ranks_lines()
    from_json = Tokenizer.from_json(tok.to_json())
    assert isinstance(from_json, tt.TiktokenTokenizer)
    _same(tok, from_json)
    # A run keeps its tokenizer as WORKDIR/tokenizer/tokenizer.json (to_json's text),
    # re-indented or not; Tokenizer.load reads that too.
    (tmp_path / "workdir").mkdir()
    (tmp_path / "workdir" / "tokenizer.json").write_text(
        json.dumps(json.loads(tok.to_json()), indent=2)
    )
    _same(tok, Tokenizer.load(tmp_path / "workdir"))


def test_added_chat_tokens_make_a_chat_format_and_survive_saving(kimi_dir, tmp_path):
    """With the project's chat tokens appended, ChatFormat renders and parses with it."""
    tok = Tokenizer.load(kimi_dir)
    with pytest.raises(ValueError, match="lacks the chat special tokens"):
        protocol.ChatFormat(tok)
    added = tok.add_missing_special_tokens()
    assert added == list(SPECIAL_TOKENS)
    old_size = NUM_BASE + 10
    assert [tok.special_id(t) for t in added] == list(range(old_size, old_size + len(added)))
    assert tok.vocab_size == old_size + len(added)
    assert tok.add_missing_special_tokens() == []
    # The project's names win for bos/eos/pad once present (the data pipeline asks by name).
    assert tok.bos_id == tok.special_id("<|bos|>") and tok.pad_id == tok.special_id("<|pad|>")
    chat = protocol.ChatFormat(tok)
    messages = [
        protocol.Message("user", "Fix the bug ✓"),
        protocol.Message("assistant", "Looking.", tool_calls=(protocol.ToolCall("ls", {}),)),
    ]
    traj = chat.render(messages)
    assert traj.tokens[0] == tok.special_id("<|bos|>")
    tools = {"ls": protocol.ToolSpec("ls", "list files", ())}
    body = traj.tokens[traj.turns[-1].start + 1 : traj.turns[-1].end]
    parsed = chat.parse(body, tools)
    assert parsed.content == "Looking." and parsed.calls == (protocol.ToolCall("ls", {}),)
    tok.save(str(tmp_path))
    _same(tok, Tokenizer.load(tmp_path))


# ---- bad files ---------------------------------------------------------------------------


def _bad_lines(edit):
    lines = _ranks_lines()
    edit(lines)
    return lines


@pytest.mark.parametrize(
    "lines, match",
    [
        (_bad_lines(lambda ls: ls.__setitem__(2, "@@notbase64@@ 2")), r":3: .*not valid base64"),
        (
            _bad_lines(lambda ls: ls.__setitem__(200, "YQ== 200")),
            r":201: token b'a' already has rank 97 \(line 98\)",
        ),
        (
            _bad_lines(lambda ls: ls.__setitem__(7, ls[7].split()[0] + " 3")),
            r":8: rank 3 is already given on line 4",
        ),
        (_bad_lines(lambda ls: ls.__setitem__(9, "QQ==")), r":10: expected 'BASE64 RANK'"),
        (_bad_lines(lambda ls: ls.__setitem__(4, "BA== -4")), r":5: rank '-4' is not"),
        (_bad_lines(lambda ls: ls.__delitem__(300)), r"rank 300 is missing"),
        (
            _bad_lines(lambda ls: ls.__setitem__(0x41, "YWJjZGVm 65")),
            r"no token for the single byte 0x41",
        ),
    ],
    ids=["base64", "dup-token", "dup-rank", "fields", "negative", "gap", "no-byte"],
)
def test_malformed_tiktoken_file_names_file_and_line(tmp_path, lines, match):
    directory = _write(tmp_path / "bad", lines=lines)
    with pytest.raises(ValueError, match=match) as err:
        Tokenizer.load(directory)
    assert str(directory) in str(err.value)


def _config_with(**changes):
    config = _config()
    config.update(changes)
    return config


@pytest.mark.parametrize(
    "config, match",
    [
        (_config_with(added_tokens_decoder=None), "no 'added_tokens_decoder'"),
        (_config(special={**SPECIAL, "[X]": 7}), r"'\[X\]' has id 7, which is a BPE rank"),
        (_config_with(bos_token="<s>"), r"bos_token '<s>' is not one of"),
        (
            _config_with(added_tokens_decoder={"12x": {"content": "[X]"}}),
            "key '12x' is not an id",
        ),
    ],
    ids=["no-added", "collides", "bos", "bad-id"],
)
def test_malformed_config_names_the_file(tmp_path, config, match):
    directory = _write(tmp_path / "bad", config=config)
    with pytest.raises(ValueError, match=match) as err:
        Tokenizer.load(directory)
    assert "tokenizer_config.json" in str(err.value)


def test_missing_files_are_named(tmp_path):
    directory = _write(tmp_path / "kimi")
    (directory / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json does not exist"):
        Tokenizer.load(directory)
    with pytest.raises(FileNotFoundError, match=r"no tiktoken BPE file at .*nothing"):
        tt.TiktokenTokenizer.load(tmp_path / "nothing" / "tiktoken.model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no tokenizer at .*empty"):
        Tokenizer.load(tmp_path / "empty")
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"unreadable tokenizer config .*tokenizer_config"):
        Tokenizer.load(directory)


# ---- resizing the model's vocabulary -----------------------------------------------------

# One dense layer: the vocabulary only touches the embedding and the head, and a small
# graph compiles in about a second.
SMALL = ModelConfig(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_layers=1,
    num_heads=2,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    first_k_dense=1,
)
forward = jax.jit(model.forward, static_argnums=0)


def _random_variables(config: ModelConfig):
    """Random variables of ``config``'s shapes (``model.init`` compiles for seconds)."""
    rng = np.random.default_rng(0)
    flat = {
        key: (rng.standard_normal(shape) * (0.5 if key.endswith("scale") else 0.2) + 0.1).astype(
            dtype
        )
        for key, (shape, dtype) in hf_mapping.model_shapes(config).items()
    }
    return hf_mapping.unflatten_variables(flat)


@pytest.mark.parametrize("tied", [False, True])
def test_resize_adds_mean_rows_and_keeps_old_logits(tied):
    config = SMALL.replace(tie_word_embeddings=tied)
    variables = _random_variables(config)
    new_config, resized = resize_vocab(config, variables, 47)
    assert new_config == config.replace(vocab_size=47)
    embed, new_embed = variables["params"]["embed"], resized["params"]["embed"]
    assert new_embed.shape == (47, config.hidden_size)
    np.testing.assert_array_equal(new_embed[:40], embed)  # old rows unchanged
    np.testing.assert_allclose(new_embed[40:], np.tile(embed.mean(0), (7, 1)), rtol=1e-6)
    if tied:
        assert "lm_head" not in resized["params"]
    else:
        head, new_head = variables["params"]["lm_head"], resized["params"]["lm_head"]
        assert new_head.shape == (config.hidden_size, 47)
        np.testing.assert_array_equal(new_head[:, :40], head)
        np.testing.assert_allclose(new_head[:, 40:], np.tile(head.mean(1)[:, None], 7), rtol=1e-6)
    assert resized.keys() == variables.keys()
    assert all(resized[c] is variables[c] for c in variables if c != "params")

    tokens = np.random.default_rng(1).integers(0, 40, (2, 9)).astype(np.int32)
    before = np.asarray(forward(config, variables, tokens))
    after = np.asarray(forward(new_config, resized, tokens))
    assert after.shape == (2, 9, 47)
    np.testing.assert_allclose(after[..., :40], before, rtol=1e-5, atol=1e-5)
    if not tied:  # a linear head: each new token's logit is the mean old logit
        np.testing.assert_allclose(
            after[..., 40:], np.repeat(before.mean(-1, keepdims=True), 7, -1), atol=1e-5
        )
    # The new tokens are usable as inputs too.
    new_tokens = tokens.copy()
    new_tokens[:, -1] = 45
    assert np.isfinite(np.asarray(forward(new_config, resized, new_tokens))).all()


def test_resize_params_only_numpy_and_mean_of_first():
    rng = np.random.default_rng(0)
    params = {
        "embed": rng.standard_normal((40, 32)).astype(np.float32),
        "lm_head": rng.standard_normal((32, 40)).astype(np.float32),
        "final_norm": {"scale": np.ones(32, np.float32)},
    }
    config, out = resize_vocab(SMALL, params, 42, mean_of_first=30)
    assert config.vocab_size == 42 and isinstance(out["embed"], np.ndarray)
    np.testing.assert_allclose(out["embed"][41], params["embed"][:30].mean(0), rtol=1e-6)
    np.testing.assert_allclose(out["lm_head"][:, 40], params["lm_head"][:, :30].mean(1), rtol=1e-6)
    assert out["final_norm"] is params["final_norm"]
    assert resize_vocab(SMALL, params, 40)[1] is params  # same size: nothing to do


def test_resize_errors_name_the_problem():
    params = {"embed": np.zeros((40, 32), np.float32), "lm_head": np.zeros((32, 40), np.float32)}
    with pytest.raises(ValueError, match=r"new_vocab_size=39 is smaller than .*vocab_size=40"):
        resize_vocab(SMALL, params, 39)
    with pytest.raises(ValueError, match=r"params/lm_head is \(32, 41\).*needs \(32, 40\)"):
        resize_vocab(SMALL, {**params, "lm_head": np.zeros((32, 41))}, 44)
    with pytest.raises(ValueError, match=r"params have no 'lm_head'"):
        resize_vocab(SMALL, {"embed": params["embed"]}, 44)
    with pytest.raises(ValueError, match=r"expected the model variables"):
        resize_vocab(SMALL, {"weights": params}, 44)
    with pytest.raises(ValueError, match=r"mean_of_first=41 must be in \[1, 40\]"):
        resize_vocab(SMALL, params, 44, mean_of_first=41)


def test_added_tokens_then_resize_fit_together(kimi_dir):
    """The intended sequence: load Kimi's tokenizer, add the chat tokens, grow the model."""
    tok = Tokenizer.load(kimi_dir)
    config = SMALL.replace(vocab_size=tok.vocab_size)
    params = {
        "embed": np.ones((tok.vocab_size, 32), np.float32),
        "lm_head": np.ones((32, tok.vocab_size), np.float32),
    }
    tok.add_missing_special_tokens()
    new_config, resized = resize_vocab(config, params, tok.vocab_size, mean_of_first=NUM_BASE)
    assert new_config.vocab_size == tok.vocab_size == resized["embed"].shape[0]
    assert max(tok.special_ids.values()) == new_config.vocab_size - 1

"""SFT data: the JSONL conversation format, rendering with the harness protocol, batches."""

import json

import numpy as np
import pytest

from cursor_rl.chat import protocol
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.data import pipeline, sft

SEQ_LEN = 96


def _conversation(i, long=False):
    observation = "".join(f"{n:4d}  line {n} of module_{i}\n" for n in range(60 if long else 3))
    return {
        "id": f"c{i}",
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"Fix module_{i}.py"},
            {
                "role": "assistant",
                "content": "I will read it.",
                "tool_calls": [{"name": "read_file", "arguments": {"path": f"module_{i}.py"}}],
            },
            {"role": "tool", "content": observation},
            {"role": "assistant", "content": f"Fixed module_{i}."},
        ],
    }


@pytest.fixture(scope="module")
def tok():
    texts = [json.dumps(_conversation(i, long=True)) for i in range(10)]
    return Tokenizer.train(texts, vocab_size=400)


@pytest.fixture(scope="module")
def conversations_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "conversations.jsonl"
    path.write_text("".join(json.dumps(_conversation(i)) + "\n" for i in range(40)))
    return path


def _reference_render(tok, messages):
    """The agreed format written out by hand: (ids, mask) with mask on assistant tokens."""
    sid = tok.special_id
    ids, mask = [sid("<|bos|>")], [0]
    for m in messages:
        ids.append(sid(f"<|{m['role']}|>"))
        mask.append(0)
        body = tok.encode(m["content"])
        for call in m.get("tool_calls", []):
            body += [sid("<|tool_call|>"), *tok.encode(json.dumps(call)), sid("<|/tool_call|>")]
        body.append(sid("<|end|>"))
        ids += body
        mask += [int(m["role"] == "assistant")] * len(body)
    return ids, mask


def test_rendering_matches_the_agreed_format(tok):
    record = _conversation(3)
    messages = sft.conversation_from_record(record, "here")
    example = pipeline.RenderConversation(tok)({"messages": messages})
    ids, mask = _reference_render(tok, record["messages"])
    np.testing.assert_array_equal(example["tokens"], ids[:-1])
    np.testing.assert_array_equal(example["targets"], ids[1:])
    np.testing.assert_array_equal(example["loss_mask"], mask[1:])
    trained = tok.decode(example["targets"][example["loss_mask"] == 1])
    assert trained.startswith("I will read it.<|tool_call|>") and trained.endswith("<|end|>")
    assert "Fix module_3.py" not in trained and "You are" not in trained


def test_messages_round_trip_through_json():
    record = _conversation(1)
    messages = sft.conversation_from_record(record, "x")
    assert [sft.message_to_dict(m) for m in messages] == record["messages"]
    untrained = sft.message_from_dict(
        {"role": "assistant", "content": "old", "trainable": False, "summary": "s"}, "x"
    )
    assert sft.message_to_dict(untrained) == {
        "role": "assistant",
        "content": "old",
        "summary": "s",
        "trainable": False,
    }


@pytest.mark.parametrize(
    "record, error",
    [
        ({"messages": []}, "non-empty 'messages'"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\]: role 'robot'"),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\]: content must be"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"name": 1}]}]},
            r"messages\[0\]: tool_calls\[0\]",
        ),
        (
            {"messages": [{"role": "tool", "content": "x", "tool_calls": [{"name": "a"}]}]},
            r"messages\[0\]: only assistant messages",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no trainable assistant"),
        ({"messages": [{"role": "user", "text": "hi"}]}, r"unknown message fields \['text'\]"),
    ],
)
def test_bad_records_name_file_line_and_message(tmp_path, record, error):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_conversation(0)) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: .*{error}"):
        sft.open_conversations([str(path)])


def test_malformed_json_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_conversation(0)) + "\n{oops\n")
    with pytest.raises(ValueError, match=f"{path}:2: malformed JSON"):
        sft.open_conversations([str(path)])


def test_sft_batches_train_only_assistant_tokens(tok, conversations_file):
    config = pipeline.DataConfig(sft_sources=(str(conversations_file),), exclude_modules=())
    kwargs = dict(seq_len=SEQ_LEN, global_batch_size=4, seed=0)
    it = pipeline.make_sft_iterator(config, tok, **kwargs)
    for _ in range(5):
        batch = next(it)
        assert batch["tokens"].shape == (4, SEQ_LEN)
        trained = tok.decode(batch["targets"][batch["loss_mask"] == 1])
        assert "Fix module_" not in trained and "line 1 of" not in trained
        assert "I will read it." in trained
        assert (batch["loss_mask"][batch["segment_ids"] == 0] == 0).all()
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(4)]
    fresh = pipeline.make_sft_iterator(config, tok, **kwargs)
    fresh.set_state(state)
    for a, b in zip(expected, [next(fresh) for _ in range(4)]):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_eval_conversations_are_held_out(tok, conversations_file):
    config = pipeline.DataConfig(
        sft_sources=(str(conversations_file),), exclude_modules=(), sft_eval_fraction=0.25
    )
    source = sft.open_conversations(config.sft_sources)
    eval_ids = {
        source[i]["id"]
        for i in range(len(source))
        if pipeline.split_of(source[i]["text"], 0.25) == "eval"
    }
    assert 0 < len(eval_ids) < len(source)
    eval_users = {f"Fix module_{c[1:]}.py" for c in eval_ids}
    it = pipeline.make_sft_iterator(
        config, tok, seq_len=SEQ_LEN, global_batch_size=2, seed=0, split="eval"
    )
    for _ in range(3):
        text = tok.decode(next(it)["tokens"].ravel())
        users = {part.split("<|end|>")[0] for part in text.split("<|user|>")[1:]}
        assert users <= eval_users


def test_long_conversations_truncate_or_split(tok, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(_conversation(i, long=True)) + "\n" for i in range(6)))
    rendered = pipeline.RenderConversation(tok)(
        {"messages": sft.conversation_from_record(_conversation(0, long=True), "x")}
    )
    assert rendered["tokens"].shape[0] > 2 * SEQ_LEN
    for max_chunks, rows_per_conv in ((1, 1), (0, None)):
        config = pipeline.DataConfig(
            sft_sources=(str(path),),
            exclude_modules=(),
            sft_max_chunks=max_chunks,
            sft_eval_fraction=0.01,
            shuffle_window=0,
        )
        batch = next(
            pipeline.make_sft_iterator(config, tok, seq_len=SEQ_LEN, global_batch_size=4, seed=0)
        )
        starts = int((batch["tokens"] == tok.bos_id).sum())
        if rows_per_conv == 1:  # truncated: every row begins a conversation
            assert starts == 4 and (batch["positions"][:, 0] == 0).all()
        else:  # split: continuation chunks (no <|bos|>) carry the final answer
            assert starts < 4
            assert "Fixed module_" in tok.decode(batch["targets"][batch["loss_mask"] == 1])


def test_renderer_is_the_harness_protocol(tok):
    """SFT and RL produce identical ids: rendering == the rollout's incremental appends."""
    messages = sft.conversation_from_record(_conversation(2), "x")
    chat = protocol.ChatFormat(tok)
    rendered = chat.render(messages)
    traj = protocol.Trajectory()
    chat.start_segment(traj)
    for m in messages:
        if m.role == "assistant":
            chat.append_assistant_header(traj)
            chat.append_sampled(traj, chat.assistant_body(m))
        else:
            chat.append_message(traj, m)
    assert traj.tokens == rendered.tokens and traj.loss_mask == rendered.loss_mask

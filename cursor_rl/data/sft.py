"""SFT conversations: the JSONL record format, its validation, reading and writing.

One conversation per JSONL line::

    {"id": "optional",
     "messages": [
       {"role": "system", "content": "You are a coding agent..."},
       {"role": "user", "content": "Fix the failing test in stats.py"},
       {"role": "assistant", "content": "Let me look.",
        "tool_calls": [{"name": "read_file", "arguments": {"path": "stats.py"}}]},
       {"role": "tool", "content": "   1  def mean(xs):..."},
       {"role": "assistant", "content": "Done.", "summary": null, "trainable": true}
     ]}

Rendering (``cursor_rl.data.pipeline.RenderConversation``, the SFT pipeline's map
step) is ``cursor_rl.chat.protocol.ChatFormat.render`` — the very renderer the RL
harness uses — so SFT teaches exactly the token sequences the policy will see and
emit. Its loss mask is 1 on the assistant's own tokens (body, tool calls and the
closing ``<|end|>``) and 0 on ``<|bos|>``, role headers and system/user/tool text;
``cursor_rl.data.packing.example_from_ids`` shifts it onto the targets.

``builtin`` names the built-in set of agent trajectories shipped with the package
(``sft.jsonl`` beside this module, written by ``python -m cursor_rl.tasks.builtin_sft``:
the scripted solver runs tasks of the task factory, a floor above).

Pure Python, no JAX: the task factory's solver writes its demonstrations with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from cursor_rl.chat import protocol
from cursor_rl.data import sources

BUILTIN = "builtin"
BUILTIN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft.jsonl")

_MESSAGE_FIELDS = {"role", "content", "tool_calls", "summary", "trainable"}


def message_from_dict(data: Any, where: str) -> protocol.Message:
    """Builds a ``protocol.Message`` from its JSON form; errors name ``where``."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: a message must be a JSON object, not {type(data).__name__}")
    unknown = sorted(set(data) - _MESSAGE_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown message fields {unknown}")
    role = data.get("role")
    if role not in protocol.ROLES:
        raise ValueError(f"{where}: role {role!r} is not one of {protocol.ROLES}")
    content = data.get("content", "")
    if not isinstance(content, str):
        raise ValueError(f"{where}: content must be a string, not {type(content).__name__}")
    calls = data.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError(f"{where}: tool_calls must be a list")
    tool_calls = []
    for j, call in enumerate(calls):
        if (
            not isinstance(call, Mapping)
            or set(call) - {"name", "arguments"}
            or not isinstance(call.get("name"), str)
            or not isinstance(call.get("arguments", {}), Mapping)
        ):
            raise ValueError(
                f"{where}: tool_calls[{j}] must be {{'name': str, 'arguments': object}}"
            )
        tool_calls.append(protocol.ToolCall(call["name"], dict(call.get("arguments", {}))))
    summary = data.get("summary")
    if summary is not None and not isinstance(summary, str):
        raise ValueError(f"{where}: summary must be a string or null")
    trainable = data.get("trainable", True)
    if not isinstance(trainable, bool):
        raise ValueError(f"{where}: trainable must be true or false")
    try:
        return protocol.Message(
            role=role,
            content=content,
            tool_calls=tuple(tool_calls),
            summary=summary,
            trainable=trainable,
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def message_to_dict(message: protocol.Message) -> dict[str, Any]:
    """The JSON form of a message (inverse of ``message_from_dict``; defaults omitted)."""
    data: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        data["tool_calls"] = [
            {"name": c.name, "arguments": dict(c.arguments)} for c in message.tool_calls
        ]
    if message.summary is not None:
        data["summary"] = message.summary
    if not message.trainable:
        data["trainable"] = False
    return data


def conversation_from_record(record: Mapping[str, Any], where: str) -> list[protocol.Message]:
    """The messages of one JSONL record; errors name ``where`` and the message index."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty 'messages' list")
    parsed = [message_from_dict(m, f"{where}: messages[{i}]") for i, m in enumerate(messages)]
    if not any(m.role == "assistant" and m.trainable for m in parsed):
        raise ValueError(f"{where}: no trainable assistant message (nothing to learn)")
    return parsed


class ConversationSource(sources.JsonlSource):
    """JSONL conversations; each item is ``{"messages", "text", "source", "id"}``.

    ``text`` is the record's canonical JSON, which decides the eval split by hash.
    """

    def __init__(self, paths: Sequence[str], name: str = "sft"):
        super().__init__(paths, text_field="messages", name=name)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record, where = self.record(index)
        messages = conversation_from_record(record, where)
        canonical = json.dumps([message_to_dict(m) for m in messages], sort_keys=True)
        return {
            "messages": messages,
            "text": canonical,
            "source": self.name,
            "id": str(record.get("id", where)),
        }

    def validate(self) -> int:
        """Parses every record (raising on the first bad one); returns the count."""
        for index in range(len(self)):
            self[index]
        return len(self)


def open_conversations(specs: Sequence[str]) -> ConversationSource:
    """One source over ``builtin`` and/or JSONL globs, validated up front.

    Args:
      specs: ``builtin`` or JSONL paths/globs (a directory: its ``*.jsonl`` files).

    Returns:
      The validated source.
    """
    if not specs:
        raise ValueError("data.sft_sources is empty: name 'builtin' or JSONL files")
    patterns = [BUILTIN_PATH if s == BUILTIN else s for s in specs]
    source = ConversationSource(
        sources.expand_paths(patterns, directory_suffix=".jsonl"), name="sft"
    )
    if source.validate() == 0:
        raise ValueError(f"SFT sources {list(specs)} hold no conversation")
    return source


def write_conversations(
    path: str, conversations: Sequence[tuple[str, Sequence[protocol.Message]]]
) -> None:
    """Writes ``(id, messages)`` conversations as JSONL, atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for conversation_id, messages in conversations:
            record = {"id": conversation_id, "messages": [message_to_dict(m) for m in messages]}
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)

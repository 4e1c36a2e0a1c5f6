"""The saturation registry: history, retirement at the threshold, persistence, errors."""

import json
import os

import pytest

from cursor_rl.eval import registry as registry_lib


def _summary(pass_at_1, *, bench="tiny_bench", stage="rl", step=1):
    return {
        "bench": bench,
        "stage": stage,
        "step": step,
        "k_values": [1, 8],
        "overall": {
            "pass@1": pass_at_1,
            "pass@8": min(1.0, 2 * pass_at_1),
            "best_of_8": min(1.0, 2 * pass_at_1),
            "tasks": 10,
            "episodes": 80,
        },
    }


def test_retires_at_threshold_and_persists(tmp_path):
    path = str(tmp_path / "eval" / "registry.json")
    registry = registry_lib.Registry(path)
    assert registry.is_active("tiny_bench")  # never recorded
    assert not registry.record(_summary(0.3, stage="sft", step=0))
    assert not registry.record(_summary(0.899, step=10))
    assert registry.is_active("tiny_bench")
    assert registry.record(_summary(0.9, step=20), now=0.0)  # reaching counts
    assert not registry.is_active("tiny_bench")
    assert not registry.record(_summary(0.95, step=30))  # already retired

    reopened = registry_lib.Registry(path)
    entry = reopened.benchmarks()["tiny_bench"]
    assert entry["status"] == "retired"
    record = entry["retired"].pop("record")  # the retiring eval's own file
    assert entry["retired"] == {
        "stage": "rl",
        "step": 20,
        "date": "1970-01-01T00:00:00+00:00",
        "time": 0.0,
        "pass@1": 0.9,
        "threshold": 0.9,
        "run": None,
    }
    assert entry["history"][2]["record"] == record
    assert [h["step"] for h in entry["history"]] == [0, 10, 20, 30]
    assert entry["history"][1]["k"] == 8 and entry["history"][1]["pass@k"] == 1.0
    assert not reopened.is_active("tiny_bench")
    # One record per eval beside the (legacy) file path; no temporary left behind.
    assert os.listdir(tmp_path / "eval") == ["registry.records"]
    assert len(os.listdir(tmp_path / "eval" / "registry.records")) == 4


def test_threshold_is_configurable_and_lists(tmp_path):
    registry = registry_lib.Registry(str(tmp_path / "r.json"), threshold=0.5)
    registry.record(_summary(0.6, bench="easy"))
    registry.record(_summary(0.2, bench="hard"))
    registry.record(  # an eval with no scored task (every episode lost)
        {"bench": "empty", "stage": "rl", "step": 1, "k_values": [], "overall": {"tasks": 0}}
    )
    assert registry.active() == ["empty", "hard"]
    assert registry.retired() == ["easy"]
    text = registry.markdown()
    assert "| easy | retired | 1 | 0.600 | 0.600 | rl step 1 (" in text
    assert "| hard | active | 1 | 0.200 | 0.200 | - |" in text
    assert "| empty | active | 1 | - | - | - |" in text
    with pytest.raises(ValueError, match="threshold"):
        registry_lib.Registry("x.json", threshold=1.5)


def test_empty_registry_report(tmp_path):
    assert "No benchmark recorded" in registry_lib.Registry(str(tmp_path / "r.json")).markdown()


@pytest.mark.parametrize(
    "content,reason",
    [
        ("{not json", "not JSON"),
        ("[]", '"benchmarks"'),
        ('{"format": 2, "benchmarks": {}}', "format 2"),
        ('{"format": 1, "benchmarks": {"b": {"status": "retired", "history": []}}}', "'b'"),
    ],
)
def test_corrupt_registry_is_a_clear_error(tmp_path, content, reason):
    path = tmp_path / "registry.json"
    path.write_text(content)
    registry = registry_lib.Registry(str(path))
    with pytest.raises(registry_lib.RegistryError, match="corrupt") as err:
        registry.is_active("b")
    assert str(path) in str(err.value) and reason in str(err.value)
    with pytest.raises(registry_lib.RegistryError):
        registry.record(_summary(0.95, bench="b"))
    assert path.read_text() == content  # never overwritten


def test_records_are_plain_json(tmp_path):
    path = tmp_path / "r.json"
    registry_lib.Registry(str(path)).record(_summary(0.1))
    (record,) = os.listdir(tmp_path / "r.records")
    state = json.loads((tmp_path / "r.records" / record).read_text())
    assert state["format"] == 2 and state["bench"] == "tiny_bench"
    assert state["pass@1"] == 0.1 and state["threshold"] == 0.9

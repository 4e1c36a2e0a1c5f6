"""The Ray tool pool: same results as the local pool, back-pressure, per-worker caches,
grading on workers, and a killed worker (its episodes recovered by replay or lost).

Ray comes with the ``test`` extra, so these tests fail (never skip) without it; like
the local pool's tests they need the sandbox (root and its Debian packages).
"""

import os
import shutil
import signal
import time

import pytest

from cursor_rl import config_lib
from cursor_rl.chat.protocol import ToolCall
from cursor_rl.env import grader, testing
from cursor_rl.env.pool import ToolPool
from cursor_rl.env.ray_pool import RayToolPool, tool_pool
from tests.test_env_pool import agents_at_once, terminal

try:
    import ray
except ImportError as e:  # the test extra brings ray: an old .venv needs reinstalling
    raise ImportError("tests/test_env_ray_pool.py needs ray: pip install -e '.[test]'") from e


@pytest.fixture(autouse=True, scope="module")
def _ray():
    testing.skip_without_sandbox()
    # Two CPUs (two actors), a small object store: the machine is shared.
    ray.init(
        num_cpus=2,
        object_store_memory=96 << 20,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def edit(path, new, old=""):
    return ToolCall("edit_file", {"path": path, "old_str": old, "new_str": new})


def workspaces(root, n, prefix="ws"):
    paths = []
    for i in range(n):
        ws = root / f"{prefix}{i}"
        ws.mkdir()
        (ws / "id.txt").write_text(f"episode {i}\n")
        (ws / "gone.txt").write_text("deleted by the agent\n")
        paths.append(str(ws))
    return paths


def tree(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


SCRIPT = [
    terminal("cat id.txt"),
    edit("new.txt", "made by the agent\n"),
    edit("id.txt", "changed", old="episode"),
    terminal("rm gone.txt; ls; cat id.txt new.txt"),
    terminal("echo oops >&2; exit 3"),
    ToolCall("read_file", {"path": "id.txt"}),
    ToolCall("list_dir", {"path": "."}),
]


def run_script(pool, paths):
    episodes = [pool.open_episode(ws) for ws in paths]
    results = [[e.submit(call) for e in episodes] for call in SCRIPT]
    results = [[f.result(timeout=120) for f in row] for row in results]
    for e in episodes:
        e.close()
    return results, [tree(ws) for ws in paths]


@pytest.mark.parametrize("ship", [True, False], ids=["shipped", "shared_fs"])
def test_same_results_as_the_local_pool(tmp_path, ship):
    with ToolPool(2) as pool:
        expected, expected_trees = run_script(pool, workspaces(tmp_path, 3, "local"))
    with RayToolPool(2, ship_workspaces=ship) as pool:
        got, trees = run_script(pool, workspaces(tmp_path, 3, "ray"))
        assert pool.replaced == 0
    assert got == expected
    assert expected[4][0].ok is False and "exit code: 3" in expected[4][0].text
    assert trees == expected_trees
    assert trees[1]["id.txt"] == b"changed 1\n" and "gone.txt" not in trees[1]


def test_back_pressure(tmp_path):
    with RayToolPool(1, max_in_flight=2) as pool:
        episode = pool.open_episode(workspaces(tmp_path, 1)[0])
        held = [episode.submit(terminal("sleep 1")) for _ in range(2)]
        with pytest.raises(TimeoutError):
            episode.submit(terminal("true"), timeout=0.2)
        assert all(f.result(timeout=60).ok for f in held)
        assert episode.submit(terminal("true"), timeout=30).result().ok
        episode.close()
        assert pool.peak_in_flight == 2


def test_many_threads_stay_under_the_bound(tmp_path):
    with RayToolPool(2, max_in_flight=3) as pool:
        episodes = [pool.open_episode(ws) for ws in workspaces(tmp_path, 6)]
        failures = agents_at_once(episodes, 4)
        for e in episodes:
            e.close()
        assert failures == [] and pool.in_flight == 0
        assert pool.peak_in_flight == 3  # reached, never passed


def test_workers_cache_trees_and_grade(tmp_path):
    task = testing.make_toy_task(str(tmp_path / "task"))
    spec = task.spec()
    group = [shutil.copytree(task.repo, str(tmp_path / f"g{i}"), symlinks=True) for i in range(4)]
    with RayToolPool(2) as pool:
        episodes = [pool.open_episode(ws) for ws in group]
        assert len({e.worker_pid for e in episodes}) == 2
        # One tree for the group: each actor unpacked it once, its other episode hit.
        assert [s["unpacked"] for s in pool.worker_stats()] == [1, 1]
        old = 'def multiply(a, b):\n    raise NotImplementedError("multiply")\n'
        assert episodes[0].execute(edit("calc/ops.py", testing.SOLUTION, old=old)).ok
        for e in episodes:
            e.close()
        solved, unsolved = pool.grade(spec, group[0]), pool.grade(spec, group[1])
        # Both grades go to the first actor (no episodes left, the tree cached): the
        # pristine repository is the group's tree, only the hidden tests were new.
        assert [s["unpacked"] for s in pool.worker_stats()] == [2, 1]
    assert solved.resolved and not unsolved.resolved
    local = grader.grade(spec, group[0])
    assert (solved.fail_to_pass, solved.pass_to_pass) == (local.fail_to_pass, local.pass_to_pass)
    assert solved.changed_paths == local.changed_paths == ("calc/ops.py",)


def test_a_killed_worker_costs_no_other_episode(tmp_path):
    """Six episodes on two actors. Killing actor X mid-call: its deterministic episode
    is replayed elsewhere and goes on; its episode that read the clock cannot be
    replayed and is lost. Killing the recovered episode's new actor exhausts its one
    retry: lost. The other four episodes finish with their edits, and nothing is
    graded as a zero: the lost ones say so."""
    with RayToolPool(2, max_retries=1) as pool:
        paths = workspaces(tmp_path, 6)
        episodes = [pool.open_episode(ws) for ws in paths]
        for i, e in enumerate(episodes):
            assert e.execute(edit("new.txt", f"edit {i}\n")).ok
        victim_pid = episodes[0].worker_pid
        on_victim = [e for e in episodes if e.worker_pid == victim_pid]
        replayable, clock = on_victim[0], on_victim[1]
        assert clock.execute(terminal("date +%s%N")).ok  # differs on a replay
        pending = replayable.submit(terminal("sleep 2; cat new.txt id.txt"))
        time.sleep(0.5)
        os.kill(victim_pid, signal.SIGKILL)
        result = pending.result(timeout=120)
        assert (
            result.text
            == f"exit code: 0\nstdout:\nedit 0\nepisode {paths.index(replayable.workspace)}"
        )
        assert not replayable.lost and replayable.retries == 1 and pool.recovered >= 1
        assert "lost" in clock.execute(terminal("true")).text and clock.lost
        assert "replaying" in clock.lost_reason

        pending = replayable.submit(terminal("sleep 2"))
        time.sleep(0.5)
        os.kill(replayable.worker_pid, signal.SIGKILL)
        result = pending.result(timeout=120)
        assert not result.ok and "lost" in result.text and replayable.lost
        assert "died 2 times" in replayable.lost_reason
        assert pool.replaced == 2

        others = [e for e in episodes if e not in (replayable, clock)]
        for e in others:
            assert e.execute(terminal("cat new.txt")).text.endswith("edit " + e.workspace[-1])
        for e in episodes:
            e.close()  # a lost episode closes without error
        lost = [e for e in episodes if e.lost]
    assert len(lost) == 2 and len(others) == 4
    assert sum(e.retries for e in others) == 1  # the victim's third episode, replayed
    for e in others:
        assert tree(e.workspace)["new.txt"] == f"edit {e.workspace[-1]}\n".encode()


def test_config_and_factory():
    cfg = config_lib.base_config()
    assert cfg.rl.tool_backend == "local"
    assert set(cfg.rl.ray) >= {"address", "max_in_flight", "max_retries"}
    with pytest.raises(ValueError, match="tool_backend"):
        tool_pool("spark", 1)
    pool = tool_pool("ray", 1, {"max_in_flight": 5, "max_retries": 2})
    try:
        assert isinstance(pool, RayToolPool) and pool.max_retries == 2
        assert pool.max_in_flight == 5
    finally:
        pool.shutdown()

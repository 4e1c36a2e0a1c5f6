"""The tool pool: concurrent episodes, back-pressure, crashed and hung workers."""

import os
import shutil
import signal
import threading
import time

import pytest

from cursor_rl.chat.protocol import ToolCall
from cursor_rl.env import testing
from cursor_rl.env.pool import ToolPool
from cursor_rl.env.tools import ToolConfig


@pytest.fixture(autouse=True, scope="module")
def _needs_sandbox():
    testing.skip_without_sandbox()


def terminal(command, timeout_s=30):
    return ToolCall("run_terminal", {"command": command, "timeout_s": timeout_s})


def workspaces(tmp_path, n):
    paths = []
    for i in range(n):
        ws = tmp_path / f"ws{i}"
        ws.mkdir()
        (ws / "id.txt").write_text(f"episode {i}\n")
        paths.append(str(ws))
    return paths


def test_episodes_run_concurrently_and_keep_their_state(tmp_path):
    with ToolPool(2) as pool:
        episodes = [pool.open_episode(ws) for ws in workspaces(tmp_path, 4)]
        assert len({e.worker_pid for e in episodes}) == 2  # spread over the workers
        start = time.monotonic()
        futures = [e.submit(terminal("sleep 1; cat id.txt")) for e in episodes]
        texts = [f.result().text for f in futures]
        elapsed = time.monotonic() - start
        assert texts == [f"exit code: 0\nstdout:\nepisode {i}" for i in range(4)]
        assert elapsed < 3.5  # two at a time, not four in a row
        episodes[0].execute(
            ToolCall("edit_file", {"path": "new.txt", "old_str": "", "new_str": "x"})
        )
        for e in episodes:
            e.close()
    assert os.path.exists(tmp_path / "ws0" / "new.txt")  # synced back on close


def test_back_pressure(tmp_path):
    with ToolPool(1, max_pending=2) as pool:
        episode = pool.open_episode(workspaces(tmp_path, 1)[0])
        held = [episode.submit(terminal("sleep 1")) for _ in range(2)]
        with pytest.raises(TimeoutError):
            episode.submit(terminal("true"), timeout=0.2)
        assert all(f.result().ok for f in held)
        assert episode.submit(terminal("true"), timeout=5).result().ok
        episode.close()


def test_hung_and_crashing_commands_do_not_hurt_the_pool(tmp_path):
    with ToolPool(1) as pool:
        episode = pool.open_episode(workspaces(tmp_path, 1)[0])
        assert "timed out" in episode.execute(terminal("sleep 100", timeout_s=0.5)).text
        assert "exit code: 139" in episode.execute(terminal("kill -SEGV $$")).text
        assert episode.execute(terminal("echo fine")).ok and not episode.lost
        episode.close()


def test_a_crashed_worker_costs_only_its_episodes(tmp_path):
    with ToolPool(2) as pool:
        first, second = (pool.open_episode(ws) for ws in workspaces(tmp_path, 2))
        assert first.worker_pid != second.worker_pid
        pending = first.submit(terminal("sleep 30"))
        time.sleep(0.5)
        os.kill(first.worker_pid, signal.SIGKILL)
        result = pending.result(timeout=30)
        assert not result.ok and "lost" in result.text and first.lost and not second.lost
        assert "lost" in first.execute(terminal("true")).text
        assert second.execute(terminal("echo still here")).text.endswith("still here")
        third = pool.open_episode(str(tmp_path / "ws0"))  # the replacement worker serves
        assert third.execute(terminal("cat id.txt")).text.endswith("episode 0")
        third.close()
        second.close()
        first.close()  # a lost episode closes without error


def test_a_hung_worker_is_replaced(tmp_path):
    config = ToolConfig(default_timeout_s=1)
    with ToolPool(1, tool_config=config, slack_s=1) as pool:
        ws = workspaces(tmp_path, 1)[0]
        episode = pool.open_episode(ws)
        pid = episode.worker_pid
        pending = episode.submit(terminal("sleep 0.5", timeout_s=1))
        os.kill(pid, signal.SIGSTOP)  # the worker freezes: its deadline (1 s + 1 s) passes
        result = pending.result(timeout=30)
        assert "lost" in result.text and episode.lost
        fresh = pool.open_episode(shutil.copytree(ws, str(tmp_path / "again")))
        assert fresh.worker_pid != pid and fresh.execute(terminal("true")).ok
        fresh.close()


def agents_at_once(episodes, rounds):
    """One agent thread per episode, each running ``echo i`` for i < ``rounds``; the
    outputs that were not exactly that (empty: every call answered right)."""
    failures = []

    def agent(episode):
        for i in range(rounds):
            result = episode.execute(terminal(f"echo {i}"))
            if result.text != f"exit code: 0\nstdout:\n{i}":
                failures.append(result.text)

    threads = [threading.Thread(target=agent, args=(e,)) for e in episodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


def test_many_threads_share_the_pool(tmp_path):
    with ToolPool(2, max_pending=3) as pool:
        episodes = [pool.open_episode(ws) for ws in workspaces(tmp_path, 6)]
        assert agents_at_once(episodes, 5) == []
        for e in episodes:
            e.close()

"""The agent harness: tools, the episode loop, sandbox, grading.

Modules (pure Python, no JAX; sandbox workers run on CPU-only machines). The chat /
tool-call format they speak is ``cursor_rl.chat.protocol``, a floor below:

  tools       read_file, edit_file, search, list_dir, lint, run_terminal, submit.
  harness     AgentEpisode: one episode's loop of sampled turns and tool results.
  sandbox     Sandbox: namespaces, an unprivileged uid, rlimits, a workspace tmpfs,
              git history kept out, network allow-list (netns), command supervision
              (supervise); fs holds the tree operations on agent-controlled files.
  grader      grade(GradeSpec, workspace) -> GradeResult, with the harness-owned
              test runner (testrunner) reporting per test on a private channel.
  pool        ToolPool: many episodes' tool calls on worker processes.
  testing     a toy task whose solution hides in git history, for tests.

The sandbox needs root and Debian packages: ``bash launch/install_system_deps.sh``.
"""

"""Held-out evaluation of agent policies: benchmark runs, metrics, saturation, reports.

Modules (no JAX of their own; pure Python, NumPy and matplotlib):

  metrics   pass_at_k (unbiased, Chen et al. 2021), best_of_k (expected best reward
            over k-subsets), summarize(episodes, k_values): overall and per category.
  runner    evaluate(runner, tasks, ...): samples a benchmark through the RL rollout
            path, appends every episode to WORKDIR/eval/<bench>/results.jsonl,
            summarizes; eval_row(summary): the flat metrics.jsonl row.
  registry  Registry: each benchmark's eval history; retired once pass@1 saturates.
  report    write_report(workdir): report.md and PNG plots from metrics.jsonl
            (python -m cursor_rl.eval.report --workdir=DIR).
  testing   graded episodes for tests.

Episodes are ``cursor_rl.chat.episodes`` records, a floor below both this package and
``cursor_rl.rl`` (which runs evals during training and so sits above it).

The benchmark's decontamination against training data is ``cursor_rl.tasks.contamination``.
"""

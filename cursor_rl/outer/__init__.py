"""The outer loop: product feedback becomes weak areas, new evals and new training tasks.

    python -m cursor_rl.outer.run --feedback=cursor_rl/outer/example_feedback.jsonl \\
        --workdir=/tmp/outer [--eval_workdir=RUN_WORKDIR]

The inner loop (``cursor_rl.rl``, ``cursor_rl.eval``) trains and measures a policy on
the tasks it is given; the outer loop decides which tasks those should be, from what
users of the product said about the policy's work. Modules (import them directly;
this package's ``__init__`` imports nothing):

* ``ingest``: the feedback event format (JSONL, documented in ``docs/outer_loop.md``)
  and its validating loader (``load_feedback``); bad rows are kept as ``BadRow``\\ s
  with their line numbers, never dropped silently.
* ``classify``: each negative event's weak-area category and difficulty, by rules
  (comment keywords, the textual-feedback detectors of ``cursor_rl.rl.feedback`` on
  the trajectory, the referenced task's kind), or a judge where one is configured.
* ``rank``: weak areas ranked by negative feedback and by the current checkpoint's
  pass@1 on the bench tasks of matching generators (read from an RL run's eval
  results).
* ``factory``: the task factory (``cursor_rl.tasks.build``) turns the top areas into
  new validated, decontaminated train and bench datasets, with ``provenance.json``
  beside each, and registers each new bench in the saturation registry.
* ``report``: ``outer_report.md`` and ``outer_summary.json``.
* ``run``: the one command.
* ``judge``: a derived judge, distilled from the policy on rule-graded trajectories
  (a linear head on the frozen policy's hidden states): its train command, held-out
  accuracy report, and the callables the classification hook, detectors and task
  filtering take.

``example_feedback.jsonl`` is a small, valid example of the format.

Every module but ``judge`` is pure Python (no JAX); ``judge`` runs the policy.
"""

"""The task factory: validated coding tasks for RL and a private benchmark.

Modules (import them directly; this package imports nothing, so that
``cursor_rl.tasks.splits`` stays cheap for the data pipeline):

* ``splits``: ``BENCH_MODULES`` / ``TRAIN_MODULES`` and the tiny seed ranges.
* ``records``: ``TaskRecord``, ``load_tasks``/``read_tasks``/``write_tasks``, snapshots.
* ``generators``: the registry (``names()``, ``get(name)``) of feature-removal,
  bug-injection and refactor generators.
* ``sources``, ``tiny``, ``autoinstall``: working repositories (stdlib modules with
  their tests, generated tiny modules, any repository or sdist via Autoinstall).
* ``validation``: candidates become tasks in the harness sandbox (``RepoValidator``).
* ``build``: ``python -m cursor_rl.tasks.build --source=... --out=...``.
* ``grading``: ``prepare_task(record, root) -> GradeSpec`` for ``cursor_rl.env.grader``.
* ``contamination``: n-gram overlap of benchmark solutions with the corpus and
  training tasks (``python -m cursor_rl.tasks.contamination``).

No module here imports JAX.
"""

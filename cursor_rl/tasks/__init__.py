"""The task factory: validated coding tasks for RL and a private benchmark.

Modules (import them directly; this package's ``__init__`` imports nothing). The
train / benchmark split it follows is ``cursor_rl.data.splits``, a floor below, which
the pretraining corpus follows too:

* ``records``: ``TaskRecord``, ``load_tasks``/``read_tasks``/``write_tasks``, snapshots.
* ``generators``: the registry (``names()``, ``get(name)``) of feature-removal,
  bug-injection and refactor generators.
* ``sources``, ``tiny``, ``autoinstall``: working repositories (stdlib modules with
  their tests, the tiny modules of ``cursor_rl.data.tiny_modules``, any repository or
  sdist via Autoinstall).
* ``validation``: candidates become tasks in the harness sandbox (``RepoValidator``).
* ``build``: ``python -m cursor_rl.tasks.build --source=... --out=...``.
* ``grading``: ``prepare_task(record, root) -> GradeSpec`` for ``cursor_rl.env.grader``.
* ``contamination``: n-gram overlap of benchmark solutions with the corpus and
  training tasks (``python -m cursor_rl.tasks.contamination``).
* ``builtin_sft``: a scripted agent solving tasks in the harness: the SFT
  demonstrations shipped as ``cursor_rl/data/sft.jsonl``.

No module here imports JAX.
"""

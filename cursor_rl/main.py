"""Entry point: ``python -m cursor_rl.main --config=configs/NAME.py[:ARG] --workdir=DIR``.

This module only prepares the process, then hands over to ``cursor_rl.cli`` (the
flags and the run). The host allocator (``host_malloc``: tcmalloc preloaded by a
re-execution, else glibc's settings) must be in place before numpy and XLA start
threads, and the command line's imports start them (the config file's above all), so
nothing but ``host_malloc`` is imported before ``preload()`` and ``configure()``.
"""

from cursor_rl import host_malloc

if __name__ == "__main__":
    if host_malloc.preload() is None:  # re-executes with tcmalloc when installed
        host_malloc.configure()
    from cursor_rl import cli

    cli.run()

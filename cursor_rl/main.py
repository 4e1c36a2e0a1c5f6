"""Entry point: ``python -m cursor_rl.main --config=configs/NAME.py[:ARG] --workdir=DIR``.

This module only prepares the process, then hands over to ``cursor_rl.cli`` (the
flags and the run). glibc's malloc settings (``host_malloc``) must be in place before
numpy and XLA start threads, and the command line's imports start them (the config
file's above all), so nothing but ``host_malloc`` is imported before ``configure()``.
"""

from cursor_rl import host_malloc

if __name__ == "__main__":
    host_malloc.configure()
    from cursor_rl import cli

    cli.run()

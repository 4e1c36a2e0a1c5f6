"""cursor_rl: continued pretraining and agentic RL for MoE coding models, in JAX.

The package is built in floors, each importing only floors below it: ``chat`` (the
shared vocabulary: tokenizer, chat / tool-call protocol, episode records) and
``partitioning`` at the bottom, ``main`` at the top; ``python -m
cursor_rl.tools.import_graph`` prints them in order. ``docs/DESIGN.md`` is the map:
the recipe, the packages, the decisions and the public surface.

Importing the package (or any of its modules) changes nothing process-wide; entry
points that want glibc's malloc tuned for XLA call ``host_malloc.configure()`` first
(``cursor_rl/main.py`` does).
"""

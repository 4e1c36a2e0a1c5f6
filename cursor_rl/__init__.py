"""cursor_rl: continued pretraining and agentic RL for MoE coding models, in JAX.

Importing the package (or any of its modules) changes nothing process-wide; entry
points that want glibc's malloc tuned for XLA call ``host_malloc.configure()`` first
(``cursor_rl/main.py`` does).
"""

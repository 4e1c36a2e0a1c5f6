"""cursor_rl: continued pretraining and agentic RL for MoE coding models, in JAX."""

from cursor_rl import host_malloc

# Before any JAX computation starts XLA's threads (see host_malloc for why).
host_malloc.configure()

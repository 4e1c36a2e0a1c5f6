"""The project's shared vocabulary, on the lowest floor: conversations and episodes.

Modules (pure Python, no JAX; the harness's workers import them on CPU-only machines):

  tokenizer  Tokenizer: byte-level BPE with the chat / tool-call special tokens.
  protocol   the chat / tool-call format of the whole project: ChatFormat renders
             messages to token ids (SFT) or appends them turn by turn (rollouts) and
             parses model output into tool calls; Trajectory holds tokens, loss mask,
             log-probs, turn and segment boundaries.
  episodes   Episode (a graded episode), EpisodeOutcome and task_reward: the records
             rollouts produce and rewards, metrics and reports read.

It imports nothing else of cursor_rl, so data, env, tasks, sampler, rl and eval can
all speak it without importing one another.
"""

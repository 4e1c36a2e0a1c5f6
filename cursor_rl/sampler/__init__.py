"""The sampler: KV-cache generation with continuous batching, for eval, chat and RL.

``Sampler`` (sampler.py) is the public entry point; ``engine.py`` lists the design
choices; ``scheduler.py`` the scheduling policies; ``sampling.py`` which
log-probabilities a completion carries.
"""

from cursor_rl.sampler.sampler import Sampler
from cursor_rl.sampler.sampling import Completion, SamplingParams
from cursor_rl.sampler.scheduler import Session

__all__ = ["Completion", "Sampler", "SamplingParams", "Session"]

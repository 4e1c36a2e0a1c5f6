"""The RL loss learns: a micro policy on a contextual bandit, trained by the RL
stage's own path (``score_groups`` for rewards and group advantages, ``RLTrainer``
for packing, old log-probs and the GRPO update with its optimizer), goes from
chance to solving it; with the advantages' sign flipped it learns to avoid the
target instead, so the test fails for a loss that does not follow its advantages.

The bandit: four prompts of two tokens each, one target token per prompt. The
policy samples one token from the model's full distribution (vocabulary of 8, so
chance is 1/8); the episode is resolved (reward 1, ``rl.reward.name=task``) when
the sampled token is the prompt's target.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cursor_rl import checkpoints, config_lib, model
from cursor_rl.chat import protocol
from cursor_rl.rl import rewards
from cursor_rl.rl.loop import score_groups
from cursor_rl.rl.rollout import Episode
from cursor_rl.rl.trainer import RLTrainer
from tests.train_helpers import MICRO_MODEL

MODEL = MICRO_MODEL.replace(vocab_size=8)
PROMPTS = np.array([[1, 2], [1, 3], [1, 4], [1, 5]], np.int32)
TARGETS = np.array([6, 7, 2, 3])
CHANCE = 1 / MODEL.vocab_size
GROUP = 8  # samples per prompt
STEPS = 30


@pytest.fixture(scope="module")
def init_checkpoint(tmp_path_factory):
    """The starting policy, as the SFT stage leaves it (one for both runs)."""
    return checkpoints.save_variables(
        str(tmp_path_factory.mktemp("sft")),
        jax.device_get(model.init(MODEL, jax.random.key(0))),
        checkpoints.make_metadata(MODEL, stage="sft"),
    )


def _trainer(
    init_checkpoint, tmp_path, microbatch_rows: int = 0, seq_len: int = 16, eps: float = 1e-8
) -> RLTrainer:
    cfg = config_lib.base_config()
    cfg.rl.microbatch_rows = microbatch_rows
    cfg.optimizer.eps = eps
    cfg.model = config_lib.model_section(MODEL)
    cfg.rl.num_steps = STEPS
    cfg.rl.train_seq_len = seq_len
    cfg.optimizer.learning_rate = 1e-2
    cfg.optimizer.schedule = "constant"
    cfg.optimizer.warmup_steps = 0
    return RLTrainer(
        MODEL,
        cfg,
        init_from=init_checkpoint,
        state_dir=str(tmp_path / "state"),
        policy_dir=str(tmp_path / "policy"),
        metadata={},
    )


@jax.jit
def _policy(variables, key):
    """The policy's distribution after each prompt and GROUP samples per prompt."""
    logits = model.forward(MODEL, variables, jnp.asarray(PROMPTS))[:, -1]
    logp = jax.nn.log_softmax(logits)
    actions = jax.random.categorical(key, logp, shape=(GROUP, len(PROMPTS)))
    sampled_logp = logp[jnp.arange(len(PROMPTS))[None, :], actions]  # [GROUP, prompts]
    return jnp.exp(logp), actions, sampled_logp


def _episode(prompt: int, sample: int, action: int, logp: float) -> Episode:
    tokens = [*PROMPTS[prompt].tolist(), action]
    trajectory = protocol.Trajectory.from_json_dict(
        {
            "tokens": tokens,
            "loss_mask": [0] * (len(tokens) - 1) + [1],
            "logprobs": [None] * (len(tokens) - 1) + [logp],
            "turns": [],
            "segment_starts": [0],
        }
    )
    return Episode(
        f"bandit-{prompt}",
        "bandit",
        prompt,
        sample,
        trajectory,
        "submitted",
        generated_tokens=1,
        grade={"resolved": action == TARGETS[prompt]},
    )


def _run(init_checkpoint, tmp_path, advantage_sign: float) -> tuple[list[float], list[float]]:
    """STEPS rollout batches; returns the expected reward (the policy's mean
    probability of the targets) and the sampled mean reward, before each update."""
    trainer = _trainer(init_checkpoint, tmp_path)
    reward_config = rewards.RewardConfig(name="task")
    key = jax.random.key(1)
    expected, sampled = [], []
    try:
        for _ in range(STEPS):
            key, sub = jax.random.split(key)
            probs, actions, logps = jax.device_get(_policy(trainer.state.variables, sub))
            expected.append(float(probs[np.arange(len(PROMPTS)), TARGETS].mean()))
            episodes = [
                _episode(p, g, int(actions[g, p]), float(logps[g, p]))
                for g in range(GROUP)
                for p in range(len(PROMPTS))
            ]
            kept, advantages, metrics = score_groups(episodes, reward_config, trainer.grpo)
            sampled.append(metrics["reward"])
            if kept:  # as the RL loop: groups with equal rewards carry no signal
                trainer.train(kept, [advantage_sign * a for a in advantages])
    finally:
        trainer.close()
    print("expected reward:", np.round(expected, 3).tolist())
    print("sampled reward: ", np.round(sampled, 3).tolist())
    return expected, sampled


@pytest.mark.slow
def test_grpo_raises_the_bandit_reward_from_chance(init_checkpoint, tmp_path):
    """Expected reward (the policy's probability of the targets) from chance to >= 0.8
    in STEPS rollout batches; the sampled rewards of the last batches agree."""
    expected, sampled = _run(init_checkpoint, tmp_path, advantage_sign=1.0)
    assert expected[0] < 2 * CHANCE  # starts at chance
    assert expected[-1] >= 0.8
    assert np.mean(sampled[-5:]) >= 0.8


@pytest.mark.slow
def test_flipped_advantages_do_not_learn(init_checkpoint, tmp_path):
    """The same run with every advantage negated before it reaches the trainer."""
    expected, sampled = _run(init_checkpoint, tmp_path, advantage_sign=-1.0)
    assert expected[0] < 2 * CHANCE
    assert expected[-1] <= CHANCE + 0.05
    assert np.mean(sampled[-5:]) <= CHANCE + 0.05


@pytest.mark.slow
def test_microbatch_rows_cap_each_pass_and_keep_the_update(init_checkpoint, tmp_path):
    """rl.microbatch_rows: a batch of 16 rows updates in 2 passes of 8 rows (and its old
    log-probs in slices of 8), to the same parameters as one pass of 16 rows (8 is the
    emulated mesh's batch devices, so the smallest cap)."""
    key = jax.random.key(2)
    variables = None
    results = []
    for cap in (0, 8):
        # Adam's eps at 1 keeps its first update about linear in the gradient (with the
        # default, g / |g| turns float rounding in near-zero gradients into big steps).
        trainer = _trainer(
            init_checkpoint, tmp_path / f"cap{cap}", microbatch_rows=cap, seq_len=4, eps=1.0
        )
        try:
            if variables is None:  # a host copy: the update donates the state's arrays
                variables = jax.device_get(trainer.state.variables)
            _, actions, logps = jax.device_get(_policy(variables, key))
            episodes = [
                _episode(p, g, int(actions[g, p]), float(logps[g, p]))
                for g in range(GROUP)
                for p in range(len(PROMPTS))
            ]
            advantages = [float(i % 3 - 1) for i in range(len(episodes))]
            metrics = trainer.train(episodes, advantages)
            assert metrics["train_rows"] == 16  # two 3-token episodes to a row
            assert trainer.microbatches(16) == (1 if cap == 0 else 2)
            results.append(jax.device_get(trainer.state.params))
        finally:
            trainer.close()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), *results)
    assert not all(
        np.allclose(a, b)
        for a, b in zip(
            jax.tree.leaves(results[0]), jax.tree.leaves(jax.device_get(variables["params"]))
        )
    )  # the update moved the parameters


def test_microbatch_counts_divide_the_rows():
    """The count keeps each pass within the cap and always divides the row count."""
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.cfg = config_lib.base_config()
    trainer.microbatch_rows = 4
    assert [trainer.microbatches(r) for r in (1, 2, 4, 8, 32, 12, 6)] == [1, 1, 1, 2, 8, 3, 2]
    trainer.microbatch_rows = 0
    assert trainer.microbatches(32) == 1

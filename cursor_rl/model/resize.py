"""Growing the vocabulary of a model: embedding rows and LM-head columns for new tokens.

When a tokenizer gains special tokens (``Tokenizer.add_missing_special_tokens``, e.g.
the project's chat tokens on Kimi K2's tokenizer), the model needs a row of
``params/embed`` [V, D] and a column of ``params/lm_head`` [D, V] for each new id.

Design choices:

1. **New rows are the mean of the existing ones** (in float32, stored in the
   parameter's dtype). A new token then starts as an "average" token: its
   embedding lies in the distribution the layers were trained on, and its logit
   is the mean of the old logits at every position (the head is linear), well
   below the likely tokens' logits, so the new tokens start improbable without
   being impossible (random rows could give any logit). ``mean_of_first``
   averages only the first rows, e.g. the BPE tokens without never-trained
   reserved special rows.
2. **Old rows are kept bit for bit**, so the logits of the old vocabulary are
   unchanged: the model computes the same function on every token it knew.
3. **Growing only.** A smaller size would drop tokens the tokenizer may produce;
   it is an error, as is a tree whose shapes do not match the config.

The returned config has the new ``vocab_size``. Optimizer state is not resized:
resize before the first training step (when importing a base), then initialise
the optimizer. For a sharded vocabulary axis, pick a size the mesh divides (rows
past the tokenizer's vocabulary are never produced by it).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from cursor_rl.model.config import ModelConfig


def _grow(array: Any, axis: int, new_size: int, mean_of_first: int | None, name: str) -> Any:
    """``array`` with ``new_size`` entries along ``axis``; the new ones are the mean."""
    old = array.shape[axis]
    rows = old if mean_of_first is None else mean_of_first
    if not 0 < rows <= old:
        raise ValueError(f"mean_of_first={mean_of_first} must be in [1, {old}] for {name}")
    xp = np if isinstance(array, np.ndarray) else jnp
    head = xp.take(array, xp.arange(rows), axis=axis).astype(np.float32)
    mean = head.mean(axis=axis, keepdims=True).astype(array.dtype)
    reps = [1] * array.ndim
    reps[axis] = new_size - old
    return xp.concatenate([array, xp.tile(mean, reps)], axis=axis)


def resize_vocab(
    config: ModelConfig,
    variables: dict[str, Any],
    new_vocab_size: int,
    mean_of_first: int | None = None,
) -> tuple[ModelConfig, dict[str, Any]]:
    """Grows the embedding (and the untied LM head) to ``new_vocab_size`` tokens.

    Args:
      config: the model config the variables belong to.
      variables: ``model.init``'s ``{"params": ..., "router": ...}``, or its
        ``params`` alone (NumPy or JAX arrays, scanned or unscanned layers).
      new_vocab_size: the vocabulary size after growing (>= ``config.vocab_size``).
      mean_of_first: average only the first this many rows for the new ones
        (default: all existing rows).

    Returns:
      (the config with ``vocab_size=new_vocab_size``, the variables with the same
      structure, only ``embed`` and ``lm_head`` replaced; the input is not changed).

    Raises:
      ValueError: a smaller size, or ``embed``/``lm_head`` whose shape does not
        match ``config`` (naming the parameter and both shapes).
    """
    old = config.vocab_size
    if new_vocab_size < old:
        raise ValueError(
            f"resize_vocab: new_vocab_size={new_vocab_size} is smaller than the model's "
            f"vocab_size={old}; the vocabulary can only grow"
        )
    if "params" in variables:
        params, wrap = variables["params"], lambda p: {**variables, "params": p}
    elif "embed" in variables:
        params, wrap = variables, lambda p: p
    else:
        raise ValueError(
            "resize_vocab: expected the model variables ({'params': ...}) or their params "
            f"(with 'embed'), got keys {sorted(variables)}"
        )
    d = config.hidden_size
    expected = {"embed": (old, d)}
    if not config.tie_word_embeddings:
        expected["lm_head"] = (d, old)
    for name, shape in expected.items():
        if name not in params:
            raise ValueError(f"resize_vocab: params have no {name!r} (expected {shape})")
        if tuple(params[name].shape) != shape:
            raise ValueError(
                f"resize_vocab: params/{name} is {tuple(params[name].shape)}, but the config "
                f"(vocab_size={old}, hidden_size={d}) needs {shape}"
            )
    new_config = config.replace(vocab_size=new_vocab_size).validate()
    if new_vocab_size == old:
        return new_config, variables
    new_params = dict(params)
    new_params["embed"] = _grow(params["embed"], 0, new_vocab_size, mean_of_first, "embed")
    if not config.tie_word_embeddings:
        new_params["lm_head"] = _grow(
            params["lm_head"], 1, new_vocab_size, mean_of_first, "lm_head"
        )
    return new_config, wrap(new_params)

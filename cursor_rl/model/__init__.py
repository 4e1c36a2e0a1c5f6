"""The DeepSeek-V3 / Kimi-K2 family MoE transformer (Flax Linen, pure functions)."""

from cursor_rl.model.config import ModelConfig, RopeScaling
from cursor_rl.model.moe import update_router_bias
from cursor_rl.model.transformer import (
    abstract_variables,
    first_shape_difference,
    forward,
    forward_cached,
    forward_with_aux,
    hidden_with_aux,
    init,
    parameter_shapes,
    project_logits,
    stack_layers,
    unstack_layers,
    update_router,
    variable_shardings,
)

__all__ = [
    "ModelConfig",
    "RopeScaling",
    "abstract_variables",
    "first_shape_difference",
    "forward",
    "forward_cached",
    "forward_with_aux",
    "hidden_with_aux",
    "init",
    "parameter_shapes",
    "project_logits",
    "stack_layers",
    "unstack_layers",
    "update_router",
    "update_router_bias",
    "variable_shardings",
]

"""The model configuration: one frozen dataclass, converted from ConfigDicts here only."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
MOE_IMPLS = ("auto", "ragged", "blocked", "padded", "dense")
ATTENTION_IMPLS = ("dot", "chunked", "splash")
CONTEXT_PARALLEL = ("ring", "none")
REMAT_POLICIES = (
    "none",
    "full",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "offload_layer_inputs",
)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (arXiv:2309.00071), named as in DeepSeek-V3's config."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # Round the correction range outward, as transformers does by default.
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a DeepSeek-V3-family MoE transformer (Kimi K2 included).

    Field names follow the Hugging Face `DeepseekV3Config` where one exists, so
    conversion is a rename; ``first_k_dense`` is HF's ``first_k_dense_replace``.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256  # dense SwiGLU hidden size (first_k_dense layers)
    moe_intermediate_size: int = 64  # per-expert SwiGLU hidden size
    num_layers: int = 2
    num_heads: int = 4
    # MLA (DeepSeek-V2 sec. 2.1): queries optionally through a low-rank bottleneck,
    # keys/values through a compressed latent plus one shared decoupled RoPE key.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # MoE.
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense: int = 1
    # Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2): bias step size gamma.
    router_bias_update_rate: float = 1e-3
    # Sequence-wise balance loss (DeepSeek-V3 eq. 17), alpha; 0 disables it.
    aux_loss_coef: float = 0.0
    # "ragged": sort + jax.lax.ragged_dot (TPU/GPU); "blocked": sort into fixed-size
    # blocks + batched matmul (fastest on XLA:CPU); "padded": each expert's rows
    # padded to one capacity + batched matmul (XLA:CPU decode steps, few rows);
    # "dense": every expert on every token (reference); "auto": ragged on
    # accelerators, blocked on CPU.
    moe_impl: str = "auto"
    moe_block_size: int = 128
    # Expert-parallel send buffers: 0 = worst case (dropless); c > 0 = c x the
    # balanced share per peer, dropping overflow (see moe.py).
    moe_capacity_factor: float = 0.0
    # "dot": scores materialised [B, H, T, T] (fastest for short rows); "chunked":
    # query chunks of attention_chunk_size, recomputed in backward (long rows);
    # "splash": the TPU splash-attention Pallas kernel in tiles of attention_chunk_size
    # (interpreted, slowly, off TPU; model/splash.py); rows under 128 tokens (the
    # kernel's smallest tile; e.g. init's one-token trace) take the "dot" path.
    attention_impl: str = "dot"
    attention_chunk_size: int = 512
    # When the mesh rules split the sequence over devices (act_length over the context
    # axis, the long_context preset): "ring" = ring attention over a causally
    # load-balanced layout (context_parallel.py); "none" = leave the split sequence to
    # XLA's partitioner, which gathers keys and values. No effect on an unsplit sequence.
    context_parallel: str = "ring"
    # Forward aux output "attn_max_logit" [L, H]: each head's largest pre-softmax
    # logit in the batch (QK-clip reads it; the train step turns it on for
    # optimizer.qk_clip_tau > 0). Off: not computed.
    report_attn_max_logit: bool = False
    # Positions.
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    # Misc.
    rms_norm_eps: float = 1e-6
    # The MLA latent norms (q_a_norm, kv_a_norm) use their own eps: DeepSeek-V3's and
    # Kimi-K2's reference code builds them with the RMSNorm default 1e-6 whatever
    # rms_norm_eps says (HF transformers too), so an imported model keeps 1e-6 here.
    latent_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # Numerics and memory.
    param_dtype: str = "float32"
    dtype: str = "float32"  # activations/matmul inputs; router, norms, softmax stay fp32
    scan_layers: bool = True
    # "full" recomputes each decoder layer in the backward pass from its saved input;
    # "offload_layer_inputs" the same, with those inputs (one [B, T, D] per layer) kept
    # in host memory (``pinned_host``) between the passes instead of on the chip.
    remat_policy: str = "none"

    # ---- derived -------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(d_qk), times mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- validation ----------------------------------------------------------------

    def validate(self) -> ModelConfig:
        """Raises ValueError naming the first inconsistent field; returns self."""

        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"model.{field}={getattr(self, field, None)!r}: {why}")

        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_layers",
            "num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "n_group",
            "topk_group",
            "max_position_embeddings",
        ):
            need(int(getattr(self, field)) > 0, field, "must be a positive integer")
        need(
            self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
            "qk_rope_head_dim",
            "must be positive and even (RoPE rotates pairs)",
        )
        need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", "None or > 0")
        need(0 <= self.first_k_dense <= self.num_layers, "first_k_dense", "in [0, num_layers]")
        if self.num_moe_layers > 0:
            need(self.n_routed_experts > 0, "n_routed_experts", "must be > 0 with MoE layers")
            need(
                0 < self.num_experts_per_tok <= self.n_routed_experts,
                "num_experts_per_tok",
                "must be in [1, n_routed_experts]",
            )
            need(
                self.n_routed_experts % self.n_group == 0,
                "n_group",
                f"must divide n_routed_experts={self.n_routed_experts}",
            )
            need(
                self.n_group == 1 or self.n_routed_experts // self.n_group >= 2,
                "n_group",
                "groups must hold >= 2 experts (group score = sum of its top-2)",
            )
            need(self.topk_group <= self.n_group, "topk_group", "must be <= n_group")
            need(
                self.topk_group * (self.n_routed_experts // self.n_group)
                >= self.num_experts_per_tok,
                "topk_group",
                "the selected groups must hold at least num_experts_per_tok experts",
            )
        need(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
        need(self.moe_impl in MOE_IMPLS, "moe_impl", f"must be one of {MOE_IMPLS}")
        need(self.moe_block_size > 0, "moe_block_size", "must be > 0")
        need(self.moe_capacity_factor >= 0, "moe_capacity_factor", "must be >= 0")
        need(self.attention_impl in ATTENTION_IMPLS, "attention_impl", f"one of {ATTENTION_IMPLS}")
        need(self.attention_chunk_size > 0, "attention_chunk_size", "must be > 0")
        need(
            self.attention_impl != "splash" or self.attention_chunk_size % 128 == 0,
            "attention_chunk_size",
            "must be a multiple of 128 for the splash kernel's tiles",
        )
        need(
            self.context_parallel in CONTEXT_PARALLEL,
            "context_parallel",
            f"one of {CONTEXT_PARALLEL}",
        )
        need(self.remat_policy in REMAT_POLICIES, "remat_policy", f"one of {REMAT_POLICIES}")
        need(self.dtype in _DTYPES, "dtype", f"one of {sorted(_DTYPES)}")
        need(self.param_dtype in _DTYPES, "param_dtype", f"one of {sorted(_DTYPES)}")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        need(self.latent_norm_eps > 0, "latent_norm_eps", "must be > 0")
        need(self.rope_theta > 0, "rope_theta", "must be > 0")
        rs = self.rope_scaling
        if rs is not None:
            need(rs.factor >= 1.0, "rope_scaling", "factor must be >= 1")
            need(
                rs.original_max_position_embeddings > 0,
                "rope_scaling",
                "original_max_position_embeddings must be > 0",
            )
        return self

    # ---- counting ------------------------------------------------------------------

    def param_counts(self) -> dict[str, int]:
        """Parameter counts: total, active per token, and the embedding share."""
        d, h = self.hidden_size, self.num_heads
        if self.q_lora_rank is None:
            q = d * h * self.qk_head_dim
        else:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        kv = (
            d * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        )
        attn = q + kv + h * self.v_head_dim * d + 2 * d  # + two layer norms
        dense_mlp = 3 * d * self.intermediate_size
        expert = 3 * d * self.moe_intermediate_size
        shared = self.n_shared_experts * expert
        router = d * self.n_routed_experts
        moe_total = self.n_routed_experts * expert + shared + router
        moe_active = self.num_experts_per_tok * expert + shared + router
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        layers_total = self.first_k_dense * (attn + dense_mlp) + self.num_moe_layers * (
            attn + moe_total
        )
        layers_active = self.first_k_dense * (attn + dense_mlp) + self.num_moe_layers * (
            attn + moe_active
        )
        return {
            "total": layers_total + embed + d,
            "active": layers_active + embed + d,
            "embedding": embed,
        }

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Model FLOPs per token: 2 * active matmul params (+ attention), x3 for training.

        Attention counts the causal half of QK^T and AV (PaLM appendix B convention).
        """
        counts = self.param_counts()
        # The input embedding is a lookup, not a matmul (unless tied to the LM head).
        matmul_params = counts["active"] - (
            0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        )
        attn = self.num_layers * self.num_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
        forward = 2 * matmul_params + 2 * attn
        return float(forward * (3 if training else 1))

    # ---- conversion ----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from a dict or ConfigDict (the one conversion point).

        Unknown keys are an error naming the key, so a typo in a config or an
        override never silently falls back to a default.
        """
        values = dict(values.to_dict() if hasattr(values, "to_dict") else values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"model: unknown field(s) {unknown}; known fields: {sorted(known)}")
        rs = values.get("rope_scaling")
        if rs is not None and not isinstance(rs, RopeScaling):
            rs = dict(rs.to_dict() if hasattr(rs, "to_dict") else rs)
            rs_known = {f.name for f in dataclasses.fields(RopeScaling)}
            bad = sorted(set(rs) - rs_known)
            if bad:
                raise ValueError(f"model.rope_scaling: unknown field(s) {bad}")
            values["rope_scaling"] = RopeScaling(**rs)
        return cls(**values).validate()


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention-temperature correction, 0.1 * mscale * ln(s) + 1 (for s > 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0

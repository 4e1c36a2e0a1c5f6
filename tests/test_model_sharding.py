"""Sharded forward and gradients equal the single-device results on emulated meshes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from cursor_rl import model, partitioning
from cursor_rl.model.config import ModelConfig

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_layers=2,
    num_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=2,
    first_k_dense=1,
    moe_block_size=8,
)

MESHES = [
    {"data": 8},
    {"expert": 4, "data": 2},
    {"fsdp": 2, "tensor": 2, "expert": 2},
    {"tensor": 2, "fsdp": 4},
]

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (emulated) devices")


def _loss(config, params, router, tokens):
    logits, aux = model.forward_with_aux(config, {"params": params, "router": router}, tokens)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
    return nll, aux["expert_load"]


@pytest.fixture(scope="module")
def reference():
    variables = model.init(CONFIG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, CONFIG.vocab_size)
    fn = jax.jit(jax.value_and_grad(lambda p, r, t: _loss(CONFIG, p, r, t), has_aux=True))
    (loss, load), grads = fn(variables["params"], variables["router"], tokens)
    return variables, tokens, loss, load, grads


@needs_8
@pytest.mark.parametrize("impl", ["blocked", "ragged"])
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.slow
def test_sharded_forward_and_grads_match(reference, shape, impl):
    variables, tokens, ref_loss, ref_load, ref_grads = reference
    config = CONFIG.replace(moe_impl=impl)
    mesh = partitioning.make_mesh(shape)
    rules = partitioning.DEFAULT_RULES
    shardings = model.variable_shardings(config, mesh, rules)
    sharded = jax.device_put(variables, shardings)
    batch_sharding = partitioning.logical_sharding(("act_batch", "act_length"), mesh, rules)
    with partitioning.use_mesh(mesh, rules):
        fn = jax.jit(
            jax.value_and_grad(lambda p, r, t: _loss(config, p, r, t), has_aux=True),
            in_shardings=(shardings["params"], shardings["router"], batch_sharding),
            out_shardings=((None, None), shardings["params"]),
        )
        (loss, load), grads = fn(sharded["params"], sharded["router"], tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_array_equal(load, ref_load)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        ref = ref_grads
        for key in path:
            ref = ref[key.key]
        np.testing.assert_allclose(g, ref, atol=2e-6, rtol=2e-4, err_msg=str(path))
    # Parameters really are split: the expert weights over the expert axis.
    expert_w = sharded["params"]["moe_layers"]["layer"]["moe"]["gate_proj"]
    if shape.get("expert", 1) > 1:
        assert expert_w.sharding.spec[1] == "expert"


@needs_8
@pytest.mark.slow
def test_init_directly_sharded_equals_host_init():
    mesh = partitioning.make_mesh({"fsdp": 2, "expert": 4})
    sharded = model.init(CONFIG, jax.random.key(0), mesh)
    plain = model.init(CONFIG, jax.random.key(0))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)
    emb = sharded["params"]["embed"]
    # [vocab, embed]: dense weights shard embed over fsdp and expert together; routed
    # experts take the expert axis for their expert dimension and fsdp for embed.
    assert emb.sharding.spec[1] == ("fsdp", "expert")
    gate = sharded["params"]["moe_layers"]["layer"]["moe"]["gate_proj"]
    assert tuple(gate.sharding.spec[1:3]) == ("expert", "fsdp")


def test_mesh_shape_errors_name_the_axis():
    with pytest.raises(ValueError, match="tensr"):
        partitioning.make_mesh({"tensr": 2})
    with pytest.raises(ValueError, match="divisible"):
        partitioning.resolve_mesh_shape({"expert": 3, "data": -1}, 8)
    with pytest.raises(ValueError, match="multiply"):
        partitioning.resolve_mesh_shape({"expert": 2}, 8)
    assert partitioning.resolve_mesh_shape({"expert": 2, "data": -1}, 8)["data"] == 4


def test_rule_overrides_and_presets():
    rules = partitioning.make_rules("default", {"embed": None, "mlp": ["tensor"]})
    assert [axes for name, axes in rules if name == "embed"] == [None]  # replaces both
    assert dict(rules)["mlp"] == ("tensor",)
    long_context = partitioning.rules_preset("long_context")
    assert dict(long_context)["act_length"] == "context"
    # Parameters are sharded over context too: a dense weight over fsdp x context x
    # expert, a routed expert's embed dim (its expert dim takes `expert`) over the rest.
    spec = partitioning.logical_to_spec(("embed", "mlp"), long_context)
    assert spec == P(("fsdp", "context", "expert"), "tensor")
    spec = partitioning.logical_to_spec(("expert", "embed", "mlp"), long_context)
    assert spec == P("expert", ("fsdp", "context"), "tensor")
    with pytest.raises(ValueError, match="unknown logical axis"):
        partitioning.make_rules("default", {"embedd": None})
    with pytest.raises(ValueError, match="rules_preset"):
        partitioning.rules_preset("nope")


@needs_8
@pytest.mark.slow
def test_expert_capacity_bounds_buffers_and_counts_drops(reference):
    variables, tokens, _, _, _ = reference
    mesh = partitioning.make_mesh({"expert": 4, "data": 2})

    def run(factor):
        config = CONFIG.replace(moe_capacity_factor=factor)
        with partitioning.use_mesh(mesh):
            fn = jax.jit(lambda v, t: model.forward_with_aux(config, v, t))
            return fn(variables, tokens)

    dropless_logits, dropless_aux = run(0.0)
    roomy_logits, roomy_aux = run(4.0)  # 4 = expert shards: the worst case fits
    tight_logits, tight_aux = run(0.25)
    assert float(dropless_aux["dropped"].sum()) == 0.0
    assert float(roomy_aux["dropped"].sum()) == 0.0
    np.testing.assert_allclose(roomy_logits, dropless_logits, atol=1e-6)
    assert float(tight_aux["dropped"].sum()) > 0
    assert not np.allclose(tight_logits, dropless_logits)


def _capacity_reference(x, idx, w, wg, wu, wd, shards, factor):
    """Expert-parallel dispatch with bounded buffers, in NumPy: each token shard sends
    every peer at most ceil(factor * A / shards) of its A assignments, taken in (expert,
    token, choice) order; the rest are dropped. Returns y and the dropped count."""
    x, idx, w = np.asarray(x, np.float64), np.asarray(idx), np.asarray(w, np.float64)
    experts, per_shard, k = wg.shape[0], x.shape[0] // shards, idx.shape[1]
    local = experts // shards
    capacity = min(per_shard * k, -(-int(factor * per_shard * k) // shards))
    y, dropped = np.zeros_like(x), 0
    for shard in range(shards):
        tokens = range(shard * per_shard, (shard + 1) * per_shard)
        assignments = sorted((idx[n, j], n, j) for n in tokens for j in range(k))
        sent = [0] * shards
        for e, n, j in assignments:
            peer = e // local
            sent[peer] += 1
            if sent[peer] > capacity:
                dropped += 1
                continue
            gate, up = x[n] @ np.asarray(wg[e]), x[n] @ np.asarray(wu[e])
            y[n] += w[n, j] * ((gate / (1 + np.exp(-gate)) * up) @ np.asarray(wd[e]))
    return y, dropped


@needs_8
@pytest.mark.parametrize("impl", ["blocked", "ragged"])
def test_expert_parallel_dispatch_keeps_exactly_the_assignments_capacity_allows(impl):
    """The send buffers are gathered from the tokens and the outputs read back per
    assignment (moe._dispatch_local): under tight capacity the kept assignments, the
    output and the dropped count match the NumPy reference exactly; the gradient flows
    to kept assignments only (a token whose every assignment was dropped gets none)."""
    from cursor_rl.model import moe

    shards, n, d, f, e, k = 4, 12, 8, 6, 8, 3
    keys = jax.random.split(jax.random.key(3), 6)
    x = jax.random.normal(keys[0], (shards * n, d))
    # Skewed routing: experts 0-1 (peer 0) are chosen most, so peer 0's buffers overflow.
    probs = jnp.asarray([0.3, 0.25, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05])
    idx = jax.vmap(lambda key: jax.random.choice(key, e, (k,), replace=False, p=probs))(
        jax.random.split(keys[1], shards * n)
    )
    w = jax.random.uniform(keys[2], (shards * n, k))
    wg, wu = (jax.random.normal(keys[i], (e, d, f)) * 0.5 for i in (3, 4))
    wd = jax.random.normal(keys[5], (e, f, d)) * 0.5
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:shards]), ("expert",))
    for factor in (0.5, 1.0, 4.0):  # 4.0 = shards: nothing can be dropped
        fn = functools.partial(
            moe._dispatch_local, num_experts=e, impl=impl, block=4, expert_axis="expert",
            expert_shards=shards, tensor_axis=None, capacity_factor=factor,
            token_axes=("expert",),
        )  # fmt: skip
        specs = dict(in_specs=(P("expert"),) * 6, out_specs=(P("expert"), P()))
        dispatch = jax.jit(jax.shard_map(fn, mesh=mesh, check_vma=False, **specs))
        y, dropped = dispatch(x, idx, w, wg, wu, wd)
        y_ref, dropped_ref = _capacity_reference(x, idx, w, wg, wu, wd, shards, factor)
        assert int(dropped) == dropped_ref, (factor, int(dropped), dropped_ref)
        np.testing.assert_allclose(np.asarray(y), y_ref, atol=1e-5, err_msg=f"factor {factor}")
        assert (dropped_ref > 0) == (factor < 4.0), (factor, dropped_ref)
        dw = jax.grad(lambda w, run=dispatch: run(x, idx, w, wg, wu, wd)[0].sum())(w)
        unused = np.abs(y_ref).sum(1) == 0  # tokens with every assignment dropped
        assert not np.asarray(dw)[unused].any()


@needs_8
def test_linear_keeps_a_sharded_sequence_in_place():
    """``linear`` flattens batch and length into one matmul dimension only when the
    sequence is not sharded: under context parallelism (the ``long_context`` rules)
    its forward and gradients need exactly the collectives of the einsum it
    replaces, so no sequence all-gather is added; without a sequence axis it flattens."""
    import re

    from jax.sharding import NamedSharding

    from cursor_rl.model.layers import linear

    mesh = partitioning.make_mesh({"fsdp": 2, "context": 2, "tensor": 2})
    x_spec = P("fsdp", "context", None)
    x = jax.device_put(jnp.ones((8, 16, 32)), NamedSharding(mesh, x_spec))
    w = jax.device_put(jnp.ones((32, 4, 8)), NamedSharding(mesh, P(None, "tensor", None)))
    out = NamedSharding(mesh, P("fsdp", "context", "tensor", None))

    def grads(f):
        def loss(x, w):
            return jnp.sum(jnp.sin(jax.lax.with_sharding_constraint(f(x, w), out)))

        return jax.grad(loss, (0, 1))

    def collectives(fn):  # (kind, elements moved) of each collective in the compiled step
        text = jax.jit(fn).lower(x, w).compile().as_text()
        found = re.findall(
            r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce|all-to-all|collective-permute|"
            r"reduce-scatter)\(",
            text,
        )
        sizes = [np.prod([int(d) for d in dims.split(",") if d]) for dims, _ in found]
        return sorted(zip([kind for _, kind in found], sizes))

    def einsum(x, w):
        return jnp.einsum("btd,dhk->bthk", x, w)

    with partitioning.use_mesh(mesh, partitioning.rules_preset("long_context")):
        assert partitioning.length_sharded()
        assert collectives(grads(linear)) == collectives(grads(einsum))
        np.testing.assert_allclose(jax.jit(linear)(x, w), einsum(x, w))
    with partitioning.use_mesh(mesh, partitioning.DEFAULT_RULES):
        assert not partitioning.length_sharded()
        flat = jax.make_jaxpr(lambda x, w: linear(x, w))(x, w)  # a new function: no cached trace
        assert any(eqn.params.get("new_sizes") == (128, 32) for eqn in flat.eqns), flat
    assert not partitioning.length_sharded()  # no mesh: flatten

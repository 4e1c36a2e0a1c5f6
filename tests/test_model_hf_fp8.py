"""Block-fp8 HF checkpoints (DeepSeek-V3 / Kimi-K2 release layout) and the streaming import.

The checkpoints are written here, in exactly the released layout: every decoder-layer
projection ``X.weight`` float8_e4m3fn plus a float32 ``X.weight_scale_inv`` with one
entry per 128 x 128 block (scale = the block's largest |w| / 448, the last block of a
dimension that is no multiple of 128 partial), ``quantization_config`` in config.json;
embeddings, norms, router and ``lm_head`` float32. The config mixes dimensions that are
multiples of 128 (hidden 256, kv_b's 128 rows) with ones that are not (200, 160, 96,
80, 64), and the 8-device mesh cuts blocks (256 into 64s, 200 into 100s, 160 into 80s).

What is checked:
* every shard of every streamed array equals the same slice of the float32
  dequantisation computed here in numpy (``fp8 x scale_inv``), bit for bit, in the
  target shardings, scanned per-expert and unscanned fused, also under rules that
  split head dims (the gather path) and with row-chunked file mappings; the host
  import agrees, and a bf16 checkpoint streams like today's host import;
* the logits' error against the unquantised original is FP8 rounding's and nothing
  else (tolerance derived in ``test_fp8_logits_within_fp8_rounding_error``);
* the reads: each element of each HF tensor that a process's distinct shards need is
  read exactly once, nothing else (one process on 8 devices here; two processes of 4
  devices each, in ``test_two_processes_read_only_their_shards``);
* bad input fails with an error naming the tensor before any read or device array.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import portpicker
import pytest
import safetensors.numpy

from cursor_rl import model, partitioning
from cursor_rl.model import hf, hf_mapping, hf_stream
from cursor_rl.model.config import ModelConfig
from cursor_rl.sampler import Sampler
from tests.test_model_hf import _inputs, _random_variables, forward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BLOCK = 128
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}
# What DeepSeek-V3's release stores in fp8: every projection of a decoder layer.
PROJECTION = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$|\.experts\.\w+_proj$")

FP8_CONFIG = ModelConfig(
    vocab_size=96,
    hidden_size=256,
    intermediate_size=200,
    moe_intermediate_size=160,
    num_layers=3,
    num_heads=2,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=4,
    num_experts_per_tok=4,  # see test_fp8_logits_within_fp8_rounding_error
    n_group=1,
    topk_group=1,
    first_k_dense=1,
)
MESH = {"fsdp": 2, "expert": 2, "tensor": 2}
SCALE = "_scale_inv"


def quantize_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float8_e4m3fn values and float32 per-block scales of ``w`` [..., R, C], the
    way DeepSeek-V3's weights were quantised (scale = block amax / 448)."""
    *lead, rows, cols = w.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = np.zeros((*lead, nr * BLOCK, nc * BLOCK), np.float32)
    padded[..., :rows, :cols] = w
    blocks = padded.reshape(*lead, nr, BLOCK, nc, BLOCK)
    scale = np.abs(blocks).max(axis=(-3, -1)) / E4M3_MAX
    scale[scale == 0] = 1.0
    q = (blocks / scale[..., :, None, :, None]).astype(jnp.float8_e4m3fn)
    q = q.reshape(*lead, nr * BLOCK, nc * BLOCK)[..., :rows, :cols]
    # safetensors writes an array's buffer: a sliced view must be made contiguous.
    return np.ascontiguousarray(q), scale.astype(np.float32)


def dequantize_blocks(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The reference: each fp8 value times its block's scale, in float32."""
    rows, cols = q.shape[-2:]
    full = np.repeat(np.repeat(scale, BLOCK, axis=-2), BLOCK, axis=-1)[..., :rows, :cols]
    return q.astype(np.float32) * full


def _rewrite(directory, edit_tensors, edit_config=None):
    """Applies ``edit_tensors(name, array) -> {name: array}`` to every tensor of every
    file of a checkpoint, keeping the index in step, and ``edit_config`` to config.json."""
    index_path = os.path.join(directory, hf.INDEX_FILE)
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    weight_map = {}
    for file in files:
        path = os.path.join(directory, file)
        tensors = {}
        for name, value in safetensors.numpy.load_file(path).items():
            tensors.update(edit_tensors(name, value))
        safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if os.path.exists(index_path):
        with open(index_path, "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if edit_config is not None:
        config_path = os.path.join(directory, hf.CONFIG_FILE)
        with open(config_path) as f:
            config = json.load(f)
        with open(config_path, "w") as f:
            json.dump(edit_config(config), f)


def to_fp8(name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """One float32 tensor of a checkpoint as the release stores it."""
    if not PROJECTION.search(name):
        return {name: value}
    q, scale = quantize_blocks(value)
    return {name: q, name + SCALE: scale}


def _write_fp8_pair(root, config, layout, shard_bytes):
    """(original fp32, fp8, dequantised fp32 reference) checkpoint directories."""
    original, fp8, reference = (os.path.join(root, n) for n in ("original", "fp8", "reference"))
    variables = _random_variables(config, seed=3)
    hf.save_hf_checkpoint(
        original, config, variables, expert_layout=layout, max_shard_bytes=shard_bytes
    )
    shutil.copytree(original, fp8)
    shutil.copytree(original, reference)

    def to_reference(name, value):
        converted = to_fp8(name, value)
        if len(converted) == 1:
            return converted
        q, scale = converted.values()
        return {name: dequantize_blocks(q, scale)}

    _rewrite(fp8, to_fp8, lambda c: {**c, "quantization_config": QUANTIZATION})
    _rewrite(reference, to_reference)
    return original, fp8, reference, variables


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory):
    """Scanned layers, per-expert tensors in two files: (original, fp8, reference, variables)."""
    return _write_fp8_pair(tmp_path_factory.mktemp("per_expert"), FP8_CONFIG, "per_expert", 2**22)


@pytest.fixture(scope="module")
def mesh():
    return partitioning.make_mesh(MESH)


def _shard_boxes(array) -> list[tuple[tuple[int, int], ...]]:
    """The distinct boxes of an array's addressable shards."""
    boxes = {
        tuple(s.indices(n)[:2] for s, n in zip(shard.index, array.shape))
        for shard in array.addressable_shards
    }
    return sorted(boxes)


def _assert_shards_equal(variables, reference):
    """Every addressable shard of ``variables`` (or each host array) equals the slice
    of ``reference``, bit for bit."""
    flat = dict(hf_mapping.flatten_variables(reference))
    for key, array in hf_mapping.flatten_variables(variables):
        assert array.shape == flat[key].shape and array.dtype == flat[key].dtype, key
        if isinstance(array, np.ndarray):
            np.testing.assert_array_equal(array, flat[key], key)
            continue
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), flat[key][shard.index], key)


def test_fixture_is_the_released_layout(per_expert):
    """The written checkpoint: F8_E4M3 projections with F32 scales in ceil(n/128)
    blocks, dims both multiples of 128 and not, everything else float32."""
    _, fp8, _, _ = per_expert
    headers = {}
    for file in os.listdir(fp8):
        if file.endswith(".safetensors"):
            headers.update(hf.read_safetensors_header(os.path.join(fp8, file)))
    assert len({h.file for h in headers.values()}) == 2  # the index is exercised
    dims = set()
    for name, header in headers.items():
        if name.endswith(SCALE):
            weight = headers[name[: -len(SCALE)]]
            assert header.dtype == "F32"
            assert header.shape == tuple(-(-n // BLOCK) for n in weight.shape), name
        elif PROJECTION.search(name):
            assert header.dtype == "F8_E4M3" and name + SCALE in headers, name
            dims.update(header.shape)
        else:
            assert header.dtype == "F32", name
    assert {128, 256} <= dims and {200, 160, 96, 80, 64} <= dims


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_streamed_shards_equal_the_dequantised_reference(per_expert, mesh, param_dtype):
    """Each device's shard is the slice of numpy's ``fp8 x scale_inv`` (rounded once to
    bf16 for a bf16 model), bit for bit, in the model's shardings; so is the host import."""
    _, fp8, reference, _ = per_expert
    config, streamed = hf_stream.load_hf_checkpoint_sharded(fp8, mesh, param_dtype=param_dtype)
    _, expected = hf.load_hf_checkpoint(reference, param_dtype=param_dtype)
    _assert_shards_equal(streamed, expected)
    shardings = dict(
        hf_mapping.flatten_variables(
            model.variable_shardings(config, mesh, partitioning.DEFAULT_RULES)
        )
    )
    for key, array in hf_mapping.flatten_variables(streamed):
        assert array.sharding == shardings[key], key
    # Shard boundaries inside 128-blocks: 200 in 100s, 160 in 80s, 256 in 64s.
    params = streamed["params"]
    assert params["dense_layers"]["layer"]["mlp"]["gate_proj"].sharding.shard_shape(
        (1, 256, 200)
    ) == (1, 64, 100)
    assert params["moe_layers"]["layer"]["moe"]["down_proj"].sharding.shard_shape(
        (2, 4, 160, 256)
    ) == (2, 2, 80, 128)
    _, host = hf.load_hf_checkpoint(fp8, param_dtype=param_dtype)
    _assert_shards_equal(host, expected)


def test_the_sampler_streams_an_fp8_checkpoint_into_its_own_shardings(
    per_expert, mesh, monkeypatch
):
    """Sampler.from_hf / load_hf take the streaming path: the weights land in the
    engine's shardings equal to the dequantised reference (the sampler keeps
    unscanned layers), with or without a mesh; a checkpoint of another shape is refused
    before any read."""
    _, fp8, reference, _ = per_expert
    _, expected = hf.load_hf_checkpoint(reference, scan_layers=False)

    def no_host_copy(*args, **kwargs):
        raise AssertionError("the sampler built a host copy (hf.load_hf_checkpoint)")

    monkeypatch.setattr(hf, "load_hf_checkpoint", no_host_copy)
    for sampler_mesh in (mesh, None):
        sampler = Sampler.from_hf(fp8, mesh=sampler_mesh, num_slots=4, page_size=8, max_seq_len=32)
        assert sampler.policy_version == 0
        _assert_shards_equal(sampler.engine.variables, expected)
    streamed = []
    monkeypatch.setattr(hf_stream, "load_hf_checkpoint_sharded", lambda *a, **k: streamed.append(a))
    wider = dataclasses.replace(FP8_CONFIG, vocab_size=128)
    other = Sampler(wider, mesh=mesh, num_slots=4, page_size=8, max_seq_len=32)
    with pytest.raises(ValueError, match="does not fit the sampler's model"):
        other.load_hf(fp8)
    assert streamed == []


def test_fused_unscanned_fp8_streams_exactly(tmp_path, mesh):
    """Fused expert tensors [E, 2F, D] (scales per expert and block; the gate/up
    boundary at 160 cuts a block) into the unscanned layout."""
    _, fp8, reference, _ = _write_fp8_pair(tmp_path, FP8_CONFIG, "fused", 2**30)
    _, streamed = hf_stream.load_hf_checkpoint_sharded(fp8, mesh, scan_layers=False)
    _, expected = hf.load_hf_checkpoint(reference, scan_layers=False)
    assert "moe_layers_1" in streamed["params"]
    _assert_shards_equal(streamed, expected)


def test_split_head_dims_stream_exactly(per_expert, mesh):
    """Rules that split the head dims (``kv``) instead of the heads: a shard is then no
    box of the merged [heads x head dim] HF axis, and is gathered from its covering
    range (hf_stream choice 2)."""
    _, fp8, reference, _ = per_expert
    swap = {("heads", "tensor"): ("heads", None), ("kv", None): ("kv", "tensor")}
    rules = tuple(swap.get(rule, rule) for rule in partitioning.DEFAULT_RULES)
    reads = []
    _, streamed = hf_stream.load_hf_checkpoint_sharded(fp8, mesh, rules, reads=reads)
    _, expected = hf.load_hf_checkpoint(reference)
    o_proj = streamed["params"]["moe_layers"]["layer"]["attn"]["o_proj"]  # [L, H, Dv, D]
    assert o_proj.sharding.shard_shape(o_proj.shape)[1:] == (2, 16, 64)
    # HF o_proj is [D, H x Dv] = [256, 64]: half of each head is columns 0-15 and 32-47,
    # read as the covering range 0-47.
    o_name = "model.layers.1.self_attn.o_proj.weight"
    assert {box[1][1] - box[1][0] for name, box in reads if name == o_name} == {48}
    _assert_shards_equal(streamed, expected)


def test_reads_map_bounded_spans(per_expert, mesh, monkeypatch):
    """With the reader's mapping limit at 600 bytes (64 MiB in use), every box is read
    in row-chunks of its own: the same numbers, host and streamed."""
    _, fp8, reference, _ = per_expert
    monkeypatch.setattr(hf, "_MAX_SPAN", 600)
    _, expected = hf.load_hf_checkpoint(reference)
    _assert_shards_equal(hf.load_hf_checkpoint(fp8)[1], expected)
    _assert_shards_equal(hf_stream.load_hf_checkpoint_sharded(fp8, mesh)[1], expected)


def test_bf16_checkpoint_streams_like_the_host_import(tmp_path, mesh):
    """No fp8: the streamed arrays equal today's host import of a bf16 export."""
    variables = _random_variables(FP8_CONFIG)
    hf.save_hf_checkpoint(str(tmp_path), FP8_CONFIG, variables, dtype="bfloat16")
    _, streamed = hf_stream.load_hf_checkpoint_sharded(tmp_path, mesh)
    _, host = hf.load_hf_checkpoint(tmp_path)
    _assert_shards_equal(streamed, host)


def _rms(x):
    return float(np.sqrt(np.mean(np.square(x))))


def test_fp8_logits_within_fp8_rounding_error(per_expert, mesh):
    """Tolerance, derived: e4m3 keeps 3 mantissa bits, so rounding moves each weight by
    at most 2^-4 of itself (the block scale puts the block's largest value at 448, so
    nearly all are normal numbers; measured RMS 2.6%). To first order the logits then
    move by J.dW, J the forward pass's Jacobian and dW = dequantised - original: a jvp
    along the actual rounding computes it. The imported logits' error must be that
    first-order error to within 15% of its size (second-order terms are ~2^-4 of it;
    measured 5.2%), and so within 2^-4 of the logits' RMS (measured 4.1%).

    FP8_CONFIG routes every token to all experts so that the forward pass is smooth in
    the weights: with top-2 of 4, the rounding flips some tokens' expert choice (seen
    here: logits error 9%, twice the first-order one), a jump no tolerance derived
    from the rounding can bound. The dequantised logits equal the float32 reference's
    to 1e-6 whatever the routing."""
    original, fp8, reference, _ = per_expert
    config, streamed = hf_stream.load_hf_checkpoint_sharded(fp8, mesh)
    streamed = jax.device_get(streamed)
    _, exact = hf.load_hf_checkpoint(original)
    _, dequantised = hf.load_hf_checkpoint(reference)
    tokens, positions = _inputs(config.vocab_size)
    logits = lambda variables: np.asarray(forward(config, variables, tokens, positions))
    expected, got = logits(exact), logits(streamed)
    np.testing.assert_allclose(got, logits(dequantised), rtol=0, atol=1e-6)
    delta = jax.tree.map(np.subtract, dequantised, exact)
    _, first_order = jax.jvp(lambda v: forward(config, v, tokens, positions), (exact,), (delta,))
    error, first_order = got - expected, np.asarray(first_order)
    print(
        f"\nfp8 logits: relative RMS error {_rms(error) / _rms(expected):.4f}, "
        f"beyond first order {_rms(error - first_order) / _rms(first_order):.4f}"
    )
    assert _rms(error - first_order) <= 0.15 * _rms(first_order)
    assert 0 < _rms(error) <= 2**-4 * _rms(expected)


# ---- what is read ---------------------------------------------------------------------


def element_ids(config: ModelConfig):
    """(model variables holding, in each element, the global id of the HF element it
    comes from, {tensor: first id}): the oracle of which HF elements a shard needs."""
    config = config.replace(param_dtype="float32")
    base, first = {}, 0
    spec = hf_mapping.weight_spec(config)
    for mapping in spec:
        base[mapping.name] = first
        first += int(np.prod(mapping.shape))
    assert first < 2**24, "ids must be exact in float32"
    tensors = (
        (m.name, np.arange(base[m.name], base[m.name] + np.prod(m.shape)).reshape(m.shape))
        for m in spec
    )
    ids = hf_mapping.variables_from_hf_tensors(config, tensors)
    return dict(hf_mapping.flatten_variables(ids)), base


def _flat_indices(box, shape) -> np.ndarray:
    """Row-major positions of a box's elements in a tensor of ``shape``."""
    return np.ravel_multi_index(np.ix_(*(np.arange(a, b) for a, b in box)), shape).ravel()


def check_reads(config, boxes, reads, shapes):
    """Asserts ``reads`` holds each HF element the distinct shard ``boxes`` need exactly
    once and nothing else, and each fp8 box's scales as the blocks it touches.

    Returns:
      {tensor: elements read} for the weights.
    """
    ids, base = element_ids(config)
    needed = np.concatenate(
        [ids[key][tuple(slice(a, b) for a, b in box)].ravel() for key in ids for box in boxes[key]]
    )
    weights = [(name, box) for name, box in reads if not name.endswith(SCALE)]
    got = np.concatenate([base[name] + _flat_indices(box, shapes[name]) for name, box in weights])
    np.testing.assert_array_equal(np.sort(got), np.sort(needed.astype(np.int64)))
    scales = sorted((name, tuple(map(tuple, box))) for name, box in reads if name.endswith(SCALE))
    touched = sorted(
        (name + SCALE, (*box[:-2], *((a // BLOCK, -(-b // BLOCK)) for a, b in box[-2:])))
        for name, box in weights
        if name + SCALE in shapes
    )
    assert scales == touched
    counts = {}
    for name, box in weights:
        counts[name] = counts.get(name, 0) + int(np.prod([b - a for a, b in box]))
    return counts


def _tensor_shapes(directory):
    shapes = {}
    for file in os.listdir(directory):
        if file.endswith(".safetensors"):
            headers = hf.read_safetensors_header(os.path.join(directory, file))
            shapes.update({name: h.shape for name, h in headers.items()})
    return shapes


def test_each_needed_element_is_read_once(per_expert, mesh):
    """One process, 8 devices: shards replicated over devices (q_a_proj over the tensor
    axis, the norms everywhere) are read once, and no tensor more than its shards need."""
    _, fp8, _, _ = per_expert
    reads = []
    config, streamed = hf_stream.load_hf_checkpoint_sharded(fp8, mesh, reads=reads)
    boxes = {key: _shard_boxes(a) for key, a in hf_mapping.flatten_variables(streamed)}
    shapes = _tensor_shapes(fp8)
    counts = check_reads(config, boxes, reads, shapes)
    # Here every element is needed once: each tensor read in full, but in slices.
    assert counts == {name: int(np.prod(shapes[name])) for name in counts}
    boxes_read = {name: sum(1 for n, _ in reads if n == name) for name in counts}
    assert boxes_read["model.layers.1.mlp.experts.2.down_proj.weight"] == 4  # fsdp x tensor
    assert boxes_read["model.layers.0.mlp.gate_proj.weight"] == 8  # embed 4 x mlp 2


_PROCESS = """
import json, sys
import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2])
)
import numpy as np

from cursor_rl import model, partitioning
from cursor_rl.model import hf, hf_mapping, hf_stream

fp8, reference, out = sys.argv[3:6]
mesh = partitioning.make_mesh(json.loads(sys.argv[6]))
reads = []
config, streamed = hf_stream.load_hf_checkpoint_sharded(fp8, mesh, reads=reads)
_, expected = hf.load_hf_checkpoint(reference)
expected = dict(hf_mapping.flatten_variables(expected))
boxes, mismatches = {}, []
for key, array in hf_mapping.flatten_variables(streamed):
    boxes[key] = sorted(
        {tuple(s.indices(n)[:2] for s, n in zip(sh.index, array.shape))
         for sh in array.addressable_shards}
    )
    for shard in array.addressable_shards:
        if not np.array_equal(np.asarray(shard.data), expected[key][shard.index]):
            mismatches.append(key)
devices = sorted(d.id for d in jax.local_devices())
with open(out, "w") as f:
    json.dump({"boxes": boxes, "reads": reads, "mismatches": mismatches, "devices": devices}, f)
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_two_processes_read_only_their_shards(per_expert, tmp_path):
    """Two JAX processes of 4 CPU devices, one 8-device mesh (fsdp 2 x expert 2 x
    tensor 2): each process's shards equal the reference, and its reads are exactly
    its distinct shards' elements, once each: half of each fsdp-split tensor, all of a
    replicated one; the two halves together are the whole tensor."""
    _, fp8, reference, _ = per_expert
    script = tmp_path / "process.py"
    script.write_text(textwrap.dedent(_PROCESS))
    port = portpicker.pick_unused_port()
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                f"127.0.0.1:{port}",
                str(i),
                fp8,
                reference,
                str(tmp_path / f"process{i}.json"),
                json.dumps(MESH),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for i in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for i, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {i} failed:\n{output[-4000:]}"
    results = [json.loads((tmp_path / f"process{i}.json").read_text()) for i in range(2)]
    assert results[0]["devices"] != results[1]["devices"]
    shapes = _tensor_shapes(fp8)
    counts = []
    for result in results:
        assert result["mismatches"] == []
        boxes = {k: [tuple(map(tuple, b)) for b in v] for k, v in result["boxes"].items()}
        reads = [(name, tuple(map(tuple, box))) for name, box in result["reads"]]
        counts.append(check_reads(FP8_CONFIG, boxes, reads, shapes))
    for name in ("model.layers.1.mlp.experts.3.up_proj.weight", "model.embed_tokens.weight"):
        size = int(np.prod(shapes[name]))
        assert counts[0][name] == counts[1][name] == size // 2, name  # split over fsdp
        halves = [
            np.concatenate([_flat_indices(box, shapes[name]) for n, box in r["reads"] if n == name])
            for r in results
        ]
        assert np.array_equal(np.union1d(*halves), np.arange(size)), name
    norm = "model.layers.2.input_layernorm.weight"
    assert counts[0][norm] == counts[1][norm] == shapes[norm][0]  # replicated
    assert counts[0].keys() == counts[1].keys()


# ---- bad input --------------------------------------------------------------------------

Q_A = "model.layers.1.self_attn.q_a_proj.weight"  # [96, 256]: scales [1, 2]
NORM = "model.layers.0.input_layernorm.weight"
ROUTER = "model.layers.1.mlp.gate.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"  # [256, 200]


def _fp8(value):
    return quantize_blocks(np.atleast_2d(value))[0].reshape(value.shape)


@pytest.mark.parametrize(
    "edit_tensors, edit_config, match",
    [
        (
            lambda t: {n: v for n, v in t.items() if n != Q_A + SCALE},
            None,
            rf"missing tensor '{Q_A}_scale_inv': the \(1, 2\) per-block scales "
            rf".*'{Q_A}' \(96, 256\)",
        ),
        (
            lambda t: {
                n: np.ones((1, 1), np.float32) if n == Q_A + SCALE else v for n, v in t.items()
            },
            None,
            rf"'{Q_A}_scale_inv' has shape \(1, 1\), expected \(1, 2\): one scale per 128x128 "
            rf"block of '{Q_A}' \(96, 256\)",
        ),
        (
            lambda t: {n: _fp8(v) if n == NORM else v for n, v in t.items()},
            None,
            rf"'{NORM}' has dtype F8_E4M3, but only decoder-layer projection weights may be fp8",
        ),
        (
            lambda t: {n: _fp8(v) if n == ROUTER else v for n, v in t.items()},
            None,
            rf"'{ROUTER}' has dtype F8_E4M3, but only",
        ),
        (
            lambda t: {n: np.zeros(v.shape, np.float32) if n == DOWN else v for n, v in t.items()},
            None,
            rf"unexpected tensor '{DOWN}_scale_inv': '{DOWN}' is F32, not F8_E4M3",
        ),
        (
            lambda t: t,
            lambda c: {k: v for k, v in c.items() if k != "quantization_config"},
            r"has dtype F8_E4M3, but config.json has no quantization_config",
        ),
        (
            lambda t: t,
            lambda c: {**c, "quantization_config": {"quant_method": "compressed-tensors"}},
            r"quantization_config \(quant_method='compressed-tensors'\) is not supported",
        ),
        (
            lambda t: t,
            lambda c: {**c, "quantization_config": {**QUANTIZATION, "weight_block_size": [128]}},
            r"weight_block_size=\[128\] must be two positive integers",
        ),
    ],
    ids=[
        "missing_scale",
        "scale_shape",
        "fp8_norm",
        "fp8_router",
        "scale_of_float_weight",
        "no_quantization_config",
        "other_method",
        "block_size",
    ],
)
def test_bad_input_fails_before_any_read_or_device_array(
    per_expert, mesh, tmp_path, monkeypatch, edit_tensors, edit_config, match
):
    """Each error names the tensor (and for scales both shapes); the streaming import
    raises it before reading any data or building any device array, and the host
    import raises the same."""
    original, _, _, _ = per_expert
    directory = tmp_path / "bad"
    shutil.copytree(original, directory)
    # safetensors' numpy reader cannot load float8: edit on the way from the original.
    edit_config = edit_config or (lambda c: c)
    _rewrite(
        directory,
        lambda name, value: edit_tensors(to_fp8(name, value)),
        lambda c: edit_config({**c, "quantization_config": QUANTIZATION}),
    )
    built, reads = [], []
    monkeypatch.setattr(jax, "make_array_from_callback", lambda *a, **k: built.append(a))
    with pytest.raises(hf.HFCheckpointError, match=match):
        hf_stream.load_hf_checkpoint_sharded(directory, mesh, reads=reads)
    assert built == [] and reads == []
    with pytest.raises(hf.HFCheckpointError, match=match):
        hf.load_hf_checkpoint(directory)

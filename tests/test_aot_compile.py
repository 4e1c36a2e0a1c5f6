"""The AOT tool really compiles the train step, the GRPO update and the sampler's programs.

On the emulated 8-device CPU mesh always; for a small TPU topology too when libtpu is
importable (the ``tpu`` extra), which the CPU-only development venv does not have.
"""

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from train_helpers import MICRO_MODEL

from cursor_rl import config_lib
from cursor_rl.model.config import ModelConfig
from cursor_rl.tools import aot_compile

SLOTS, CONTEXT = 8, 128
_TESTS = os.path.dirname(os.path.abspath(__file__))


def micro_config():
    """A 2-layer model with short rows: every program compiles in seconds."""
    c = config_lib.base_config()
    c.stage = "pretrain"
    c.model = config_lib.model_section(MICRO_MODEL)
    c.tokenizer.vocab_size = MICRO_MODEL.vocab_size
    c.train.batch_size = 8
    c.train.seq_len = 32
    c.train.num_steps = 10
    rl = c.rl
    rl.train_seq_len = 64
    rl.tasks_per_step = 2
    rl.rollout.group_size = 4
    rl.sampler.num_slots = SLOTS
    rl.sampler.max_seq_len = CONTEXT
    rl.sampler.prefill_tokens = 0
    return c


def latent_bytes_per_token(m: ModelConfig) -> int:
    """Cache bytes of one token over all layers, from the model's shapes alone."""
    itemsize = np.dtype(m.dtype).itemsize
    return m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * itemsize


def _sane(report):
    assert report.argument_bytes > 0 and report.temp_bytes > 0
    # XLA:CPU reports no generated-code size; the TPU compiler does.
    assert report.code_bytes > 0 or report.device_kind == "cpu"
    assert report.total_bytes > 0 and report.flops_per_device > 0 and report.compile_s > 0
    assert not report.refused and report.fits
    # The sharded inputs' bytes are on the chip, whether or not the program reads them all.
    assert report.held_argument_bytes >= sum(report.inputs.values())


def test_train_step_compiles_on_the_cpu_mesh():
    report = aot_compile.compile_train_step(micro_config(), "cpu")
    _sane(report)
    assert report.num_devices == 8 and report.mesh_shape["data"] == 8
    assert report.inputs["parameters"] > 0 and report.inputs["optimizer state"] > 0
    # 5 int32 keys of [8, 32], the rows split over 8 devices.
    assert report.inputs["batch"] == 5 * 8 * 32 * 4 // 8
    assert "parameters" in report.text() and "no HBM limit known" in report.text()


@pytest.mark.parametrize("with_feedback", [False, True])
def test_grpo_step_compiles_with_its_batch(with_feedback):
    report = aot_compile.compile_grpo_step(micro_config(), "cpu", with_feedback=with_feedback)
    _sane(report)
    # One row per episode: 2 tasks x 4 samples = 8 rows of 64, over 8 batch shards.
    rows, seq_len = 8, 64
    # 5 int32 and 5 float32 keys, the rows split over the 8 devices.
    assert report.inputs["batch"] == 10 * 4 * rows * seq_len // 8
    batch = report.inputs["batch"] + report.inputs.get("feedback teacher rows", 0)
    state = sum(v for k, v in report.inputs.items() if k not in ("batch", "feedback teacher rows"))
    assert report.inputs["parameters"] > 0 and report.inputs["optimizer state"] > 0
    assert report.held_argument_bytes == state + batch
    # The compiler's own count leaves out the arrays the step never reads (ref_logprobs at
    # kl_coef 0, loss_mask: token_weight carries it, ...); most of the batch is read.
    assert report.argument_bytes > state + batch // 2
    assert report.tokens_per_step == rows * seq_len
    if with_feedback:
        # 5 teacher keys of [8, 64] plus feedback_index [8, 64], int32, over 8 shards.
        assert report.inputs["feedback teacher rows"] == 6 * 8 * 64 * 4 // 8
        assert "feedback" in report.program


def test_sampler_compiles_prefill_and_decode_with_the_stated_cache():
    config = micro_config()
    report = aot_compile.compile_sampler(config, "cpu", cache_sequences=SLOTS)
    for program in report.programs:
        _sane(program)
    shards = report.decode.mesh_shape["fsdp"]
    assert shards == 8
    model = ModelConfig.from_dict(config.model.to_dict())
    # The cache holds slots x context tokens, its pages split over the row shards.
    assert report.cache_bytes * shards == SLOTS * CONTEXT * latent_bytes_per_token(model)
    assert report.cache_bytes_per_token == latent_bytes_per_token(model)
    assert report.weights_bytes > 0
    assert report.decode.inputs["KV cache"] == report.cache_bytes
    # The cache is donated and updated in place: its bytes are aliased, not doubled.
    assert report.decode.alias_bytes >= report.cache_bytes
    assert report.total_bytes >= report.weights_bytes + report.cache_bytes
    text = report.text()
    assert "KV cache" in text and "prefill" in text and "decode" in text


def test_the_command_line_exits_1_and_names_the_knobs_when_a_program_does_not_fit():
    # 1 KiB of "HBM" per chip: the sampler cannot fit.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_TESTS, os.path.dirname(_TESTS)]))
    result = subprocess.run(
        [sys.executable, "-m", "cursor_rl.tools.aot_compile",
         f"--config={os.path.join(_TESTS, 'rl_micro_config.py')}", "--program=sampler",
         "--topology=cpu", f"--sampler_slots={SLOTS}", f"--sampler_context={CONTEXT}",
         "--hbm_gib=1e-6"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    out = result.stdout
    assert "sampler on cpu: 8 x cpu" in out and "KV cache" in out
    assert "DOES NOT FIT" in out and "--sampler_slots" in out and "--sampler_context" in out
    assert "largest inputs per chip" in out and "kv_latent" in out
    assert "does not fit: sampler" in result.stderr


def _refused_report():
    return aot_compile.AotReport(
        topology="v5p:2x2x1", device_kind="TPU v5", num_devices=4, mesh_shape={"fsdp": 4},
        hbm_bytes=95 * aot_compile.GiB, model_flops_per_step=0.0, tokens_per_step=0,
        compile_s=1.0, knobs=("more fsdp",),
    )  # fmt: skip


def test_the_compiler_refusal_is_summarised_with_its_largest_buffers():
    # What libtpu 0.0.42.1 says when the temporaries alone exceed HBM.
    report = _refused_report()
    message = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (299.71G) exceeds available HBM (95.74G)."
    )
    assert aot_compile._refusal(message, report)
    assert not report.fits and report.temp_bytes == int(299.71 * aot_compile.GiB)
    assert "temporaries alone need 299.71GB" in report.text() and "more fsdp" in report.text()
    # The other form, with the compiler's listing of its largest allocations.
    report = _refused_report()
    message = (
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
        "space hbm. Used 120.50G of 95.74G hbm. Exceeded hbm capacity by 24.76G.\n"
        "Total hbm usage >= 120.50G:\n    reserved 1.00M\n\nLargest program allocations in hbm:\n"
        '  1. Size: 12.00G\n     Operator: op_name="jit(train_step)/dot_general"\n'
        "     Shape: bf16[8,4096,7168]{2,1,0}\n     Unpadded size: 12.00G\n"
        "     XLA label: fusion.1 = fusion(...)\n"
    )
    assert aot_compile._refusal(message, report)
    text = report.text()
    assert "120.50GB needed per chip" in text and "Size: 12.00G" in text
    assert "bf16[8,4096,7168]" in text and "more fsdp" in text and "DOES NOT FIT" in text
    assert "Unpadded" not in text  # only the buffer summary lines are kept
    assert not aot_compile._refusal("some other compiler error", report)


def test_a_compiler_failure_other_than_memory_is_a_clear_error():
    """A compiler crash (here libtpu 0.0.42.1's on Kimi-K2's 384 experts at fsdp=512)
    names the program and topology and gives the compiler's first line, not a traceback
    through jax."""

    class Lowered:
        def compile(self):
            raise RuntimeError(
                "INTERNAL: during context [post-optimization]: %bitcast.2606 = s32[384,1] "
                "bitcast(%slice_subtract_fusion.4): Bitcast cannot have different shape sizes"
                "\n(more lines)"
            )

    class Fn:
        def lower(self, *args):
            return Lowered()

    mesh = aot_compile.partitioning.make_mesh({"data": 1}, devices=aot_compile.jax.devices()[:1])
    report = _refused_report()
    with pytest.raises(aot_compile.CompilerError) as raised:
        aot_compile._compile(Fn(), (), mesh, aot_compile.partitioning.DEFAULT_RULES, report)
    text = str(raised.value)
    assert text.startswith(f"{report.program} on {report.topology}: the compiler failed")
    assert "Bitcast cannot have different shape sizes" in text and "more lines" not in text


def test_largest_arrays_of_a_lowered_program():
    text = """
    %1 = stablehlo.dot_general %0, %a : (tensor<64x32xf32>, tensor<32x9xf32>) -> tensor<64x512xf32>
    %2 = stablehlo.add %1, %1 : tensor<64x512xf32>
    %3 = stablehlo.convert %2 : (tensor<64x512xf32>) -> tensor<64x512xbf16>
    %4 = stablehlo.compare  GT, %x, %y : (tensor<8xi32>, tensor<8xi32>) -> tensor<8xi1>
    """
    assert aot_compile.largest_arrays(text, count=2) == [
        "f32[64,512] 128.00 KiB (stablehlo.dot_general)",
        "bf16[64,512] 64.00 KiB (stablehlo.convert)",
    ]


def test_flags_parse():
    assert aot_compile.parse_programs("all") == ("train", "grpo", "sampler")
    assert aot_compile.parse_programs("grpo,sampler") == ("grpo", "sampler")
    with pytest.raises(ValueError, match="--program"):
        aot_compile.parse_programs("rollout")
    assert aot_compile.parse_mesh("expert=-1, tensor=2") == {"expert": -1, "tensor": 2}


def test_default_grpo_rows_follow_the_packer():
    rl = micro_config().rl
    assert aot_compile.default_grpo_rows(rl, 8) == 8
    rl.tasks_per_step, rl.updates_per_batch = 5, 2  # 20 episodes -> 32 rows, 2 updates
    assert aot_compile.default_grpo_rows(rl, 8) == 16
    rl.microbatch_rows = 8
    assert aot_compile.grpo_microbatches(rl, 16) == 2


_HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


@pytest.mark.slow  # ~20-35 s: four TPU compiles
@pytest.mark.skipif(not _HAS_LIBTPU, reason="needs libtpu (the tpu extra)")
def test_all_programs_compile_for_a_small_tpu_topology():
    config = micro_config()
    train, grpo, sampler = aot_compile.compile_programs(
        config, aot_compile.PROGRAMS, topology="v5p:2x2x1"
    )
    for report in (train, grpo, *sampler.programs):
        assert report.device_kind.startswith("TPU v5") and report.num_devices == 4
        assert report.hbm_bytes == 95 * aot_compile.GiB
        _sane(report)
    model = ModelConfig.from_dict(config.model.to_dict())
    expected = 2 * SLOTS * CONTEXT * latent_bytes_per_token(model)  # 2 x slots by default
    assert sampler.cache_bytes * 4 == expected
    assert sampler.fits and math.isfinite(sampler.total_bytes)

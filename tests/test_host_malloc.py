"""cursor_rl.host_malloc: when the glibc settings apply, and that they stop the page faults."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from cursor_rl import host_malloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "env, accelerator, expected",
    [
        ({"JAX_PLATFORMS": "cpu"}, True, True),
        ({"JAX_PLATFORMS": "cpu,tpu"}, True, True),
        ({"JAX_PLATFORMS": "tpu"}, False, False),
        ({}, False, True),  # JAX will pick the CPU
        ({}, True, False),  # JAX may pick the accelerator
        ({"JAX_PLATFORMS": "tpu", host_malloc.ENV: "on"}, True, True),
        ({"JAX_PLATFORMS": "cpu", host_malloc.ENV: "off"}, False, False),
        ({"JAX_PLATFORMS": "cpu", host_malloc.ENV: " Auto "}, True, True),
    ],
)
def test_wanted_follows_the_variable_and_the_platform(env, accelerator, expected):
    assert host_malloc.wanted(env, accelerator=lambda: accelerator) is expected


def test_a_bad_value_names_the_variable():
    with pytest.raises(ValueError, match="CURSOR_RL_HOST_MALLOC='sometimes'"):
        host_malloc.wanted({host_malloc.ENV: "sometimes"})


# Runs in a fresh process (the settings must precede XLA's threads): a jitted
# function whose 64 MiB product is a temporary, called repeatedly; prints the median
# minor page faults of a call after warm-up and the executable's temporary size.
_PROBE = textwrap.dedent(
    """
    import json, resource
    import cursor_rl
    from cursor_rl import host_malloc
    import jax, jax.numpy as jnp

    x = jnp.ones((4096, 256), jnp.float32)
    w = jnp.ones((256, 4096), jnp.float32) / 256
    f = jax.jit(lambda x, w: jnp.dot(jnp.dot(x, w), w.T))  # [4096, 4096] in between
    temp = f.lower(x, w).compile().memory_analysis().temp_size_in_bytes
    for _ in range(4):
        f(x, w).block_until_ready()
    faults = []
    for _ in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x, w).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    faults = sorted(faults)[len(faults) // 2]  # median: the heap may still grow once or twice
    print(json.dumps({"applied": host_malloc.applied, "temp": temp, "faults": faults}))
    """
)


def _probe(mode):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env[host_malloc.ENV] = mode
    env.pop("XLA_FLAGS", None)  # one device is enough
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_settings_stop_xla_refaulting_its_temporaries_every_call():
    """Without the settings each call first-touches its temporaries again (a fault per
    4 KiB page); with them the freed block is reused and the faults all but vanish."""
    off, on = _probe("off"), _probe("on")
    assert not off["applied"] and on["applied"]
    pages = off["temp"] / 4096
    assert off["temp"] >= 64 * 2**20, off
    assert off["faults"] >= pages / 2, (off, pages)  # the behaviour being worked around
    assert on["faults"] <= off["faults"] / 10, (on, off)

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
    from cursor_rl import host_malloc
    host_malloc.configure()  # before jax and numpy start threads
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


def _run(argv, mode, **kwargs):
    """Runs ``python ARGV`` in a fresh process with CURSOR_RL_HOST_MALLOC=mode."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env[host_malloc.ENV] = mode
    env.pop("XLA_FLAGS", None)  # one device is enough
    out = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300, **kwargs
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def _probe(mode):
    return json.loads(_run(["-c", _PROBE], mode).stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
@pytest.mark.slow
def test_settings_stop_xla_refaulting_its_temporaries_every_call():
    """Without the settings each call first-touches its temporaries again (a fault per
    4 KiB page); with them the freed block is reused and the faults all but vanish."""
    off, on = _probe("off"), _probe("on")
    assert not off["applied"] and on["applied"]
    pages = off["temp"] / 4096
    assert off["temp"] >= 64 * 2**20, off
    assert off["faults"] >= pages / 2, (off, pages)  # the behaviour being worked around
    assert on["faults"] <= off["faults"] / 10, (on, off)


# Starts a thread that allocates, then has glibc list its arenas (malloc_stats, on
# stderr): with glibc's defaults the thread gets an arena of its own, under
# M_ARENA_MAX=1 (host_malloc's settings) it shares the main one. Prints whether
# configure() ran and whether numpy had been imported by then.
_ARENAS = textwrap.dedent(
    """
    def report_arenas():
        import ctypes, json, sys, threading
        from cursor_rl import host_malloc
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
        libc.free.argtypes = (ctypes.c_void_p,)
        thread = threading.Thread(target=lambda: libc.free(libc.malloc(64)))
        thread.start()
        thread.join()
        libc.malloc_stats()
        state = {"applied": host_malloc.applied, "numpy": "numpy" in sys.modules}
        print(json.dumps(state), flush=True)
    """
)


def _arenas(out):
    """The arena count malloc_stats printed and the probe's JSON line."""
    arenas = sum(line.startswith("Arena ") for line in out.stderr.splitlines())
    return arenas, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_importing_cursor_rl_leaves_malloc_alone():
    """Even with the settings wanted (``on``), ``import cursor_rl`` applies none: a new
    thread still gets an arena of its own. configure() itself does change that."""
    imported = _run(["-c", "import cursor_rl\n" + _ARENAS + "report_arenas()"], "on")
    arenas, state = _arenas(imported)
    assert not state["applied"] and arenas >= 2, (arenas, state)
    configured = "from cursor_rl import host_malloc\nhost_malloc.configure()\n"
    arenas, state = _arenas(_run(["-c", configured + _ARENAS + "report_arenas()"], "on"))
    assert state["applied"] and arenas == 1, (arenas, state)


# ``python -m cursor_rl.main ARGS`` as runpy runs it, with an audit hook that prints, in
# order, the first import of numpy and of jax and the lookup of glibc's mallopt.
_ENTRY = textwrap.dedent(
    """
    import runpy, sys
    seen = set()
    def hook(event, args):
        name = args[0] if event == "import" else args[1] if event == "ctypes.dlsym" else None
        if name in ("numpy", "jax", "mallopt") and name not in seen:
            seen.add(name)
            sys.stdout.write(f"first {name}\\n")
    sys.addaudithook(hook)
    sys.argv = ["cursor_rl.main", *sys.argv[1:]]
    runpy.run_module("cursor_rl.main", run_name="__main__", alter_sys=True)
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_the_entry_point_configures_before_numpy_and_jax(tmp_path):
    """``python -m cursor_rl.main`` applies the settings before importing numpy or jax;
    when the config file is loaded (the pipeline imported), a new thread shares the
    main arena, as every thread started since has."""
    config = tmp_path / "probe_config.py"
    get_config = "def get_config():\n    report_arenas()\n    raise SystemExit(0)\n"
    config.write_text(_ARENAS + get_config)
    argv = ["-c", _ENTRY, f"--config={config}", f"--workdir={tmp_path / 'run'}"]
    out = _run(argv, "on", cwd=ROOT)
    firsts = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("first ")]
    assert firsts[0] == "mallopt" and {"numpy", "jax"} <= set(firsts), firsts
    arenas, state = _arenas(out)
    assert state == {"applied": True, "numpy": True} and arenas == 1, (arenas, state)


# Calls preload() as an entry point does, then reports what serves malloc in this
# process and in a child it starts, and whether configure() still applied glibc's settings.
_PRELOAD = textwrap.dedent(
    """
    from cursor_rl import host_malloc
    name = host_malloc.preload()
    import json, os, subprocess, sys
    probe = "from cursor_rl import host_malloc; print(host_malloc.preloaded())"
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    print(json.dumps({
        "name": name, "preloaded": host_malloc.preloaded(), "configured": host_malloc.configure(),
        "ld_preload": os.environ.get("LD_PRELOAD"), "child": child.stdout.strip(),
        "argv": sys.argv[1:],
    }))
    """
)


@pytest.mark.skipif(host_malloc.find_library("tcmalloc") is None, reason="tcmalloc not installed")
def test_preload_reexecutes_with_tcmalloc_and_children_keep_glibc(tmp_path):
    """In ``auto`` on the CPU, preload() re-executes the program (arguments kept) with
    tcmalloc serving malloc, glibc's settings then stay off, and a subprocess it starts
    runs on glibc again; with ``off`` nothing is preloaded."""
    script = tmp_path / "entry.py"
    script.write_text(_PRELOAD)
    state = json.loads(_run([str(script), "--flag=1"], "auto").stdout.strip().splitlines()[-1])
    assert state == {
        "name": "tcmalloc", "preloaded": "tcmalloc", "configured": False,
        "ld_preload": None, "child": "None", "argv": ["--flag=1"],
    }, state  # fmt: skip
    state = json.loads(_run([str(script)], "off").stdout.strip().splitlines()[-1])
    assert state["name"] is None and state["preloaded"] is None, state


# Frees a touched 256 MiB block under the allocator in use, then releases free memory;
# prints the resident size after the free and after the release.
_RELEASE = textwrap.dedent(
    """
    import ctypes, json
    from cursor_rl import host_malloc, hostmem
    host_malloc.preload()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    size = 256 * 2**20
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    freed = hostmem.rss_bytes()
    how = hostmem.release_free_memory()
    print(json.dumps({"how": how, "freed": freed, "released": hostmem.rss_bytes()}))
    """
)


@pytest.mark.skipif(host_malloc.find_library("tcmalloc") is None, reason="tcmalloc not installed")
def test_release_free_memory_returns_what_tcmalloc_kept():
    """tcmalloc keeps a freed block resident (that is its speed); release_free_memory()
    (called by the pipeline between stages) gives it back to the system."""
    state = json.loads(_run(["-c", _RELEASE], "tcmalloc").stdout.strip().splitlines()[-1])
    assert state["how"] == "tcmalloc", state
    assert state["freed"] - state["released"] >= 200 * 2**20, state

"""cursor_rl.hostmem: resident-memory figures and the per-stage peak reset."""

import mmap
import sys

import numpy as np
import pytest

from cursor_rl import hostmem


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_peak_follows_an_allocation_and_resets_to_the_current_size():
    assert hostmem.rss_bytes() > 0
    if not hostmem.reset_peak():
        pytest.skip("the kernel does not allow resetting VmHWM here")
    assert hostmem.peak_is_per_stage()
    before = hostmem.peak_bytes()
    # A fresh anonymous mapping, every page written: new resident memory whatever the
    # allocator (tcmalloc or glibc would hand back freed, still-resident pages for an
    # np.ones of the same size, and the mark would not move).
    block = mmap.mmap(-1, 64 * 2**20)
    pages = np.frombuffer(block, np.uint8)
    pages[:: mmap.PAGESIZE] = 1
    assert hostmem.peak_bytes() >= before + 60 * 2**20
    del pages
    block.close()
    assert hostmem.reset_peak()
    # After the reset the mark is today's size, not the 64 MiB high-water mark.
    assert hostmem.peak_bytes() < hostmem.rss_bytes() + 32 * 2**20


def test_release_free_memory_names_the_allocator_or_none():
    assert hostmem.release_free_memory() in ("tcmalloc", "glibc", None)


def test_gib_formats_two_decimals():
    assert hostmem.gib(3 * 2**29) == "1.50 GiB"

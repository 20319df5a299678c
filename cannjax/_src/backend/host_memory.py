"""Keep freed host memory in the heap, so that XLA:CPU's steps stop page-faulting.

XLA:CPU allocates each execution's temp buffer anew and frees it when the execution
ends. glibc serves a block that large (above its mmap threshold, 32 MiB at most) with a
fresh ``mmap`` and unmaps it on ``free``, and a thread on a secondary arena always does
so for blocks larger than its 64 MiB heap. So every step first touches its whole temp
again: one minor page fault per 4 KiB page, each page zeroed by the kernel. A step with
``S`` bytes of temp pays ``S / 4096`` faults per execution (``docs/performance.md`` gives
the measured system time).

:func:`keep_freed_memory` sets glibc's allocator (``mallopt``) so that freed blocks stay
in the process heap and the next step reuses them: one arena for every thread
(``M_ARENA_MAX=1``), no ``mmap``-served blocks (``M_MMAP_MAX=0``), no trimming of the
heap's top (``M_TRIM_THRESHOLD``), and heap growth in ``top_pad`` steps
(``M_TOP_PAD``). The same settings as environment variables (``MALLOC_ARENA_MAX=1
MALLOC_MMAP_MAX_=0 ...``) need the process restarted; a Jupyter kernel or a training
script calls this instead.

It changes the whole process's allocator, so cannjax never calls it on import: only
``cannjax demo`` (a process cannjax owns) and users who ask. The cost is that the
process keeps its peak heap: freed memory is not returned to the OS until exit.
"""

from __future__ import annotations

import ctypes
import platform

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def _backends_started() -> bool:
    from jax._src import xla_bridge  # whether XLA's client, and so its threads, exist

    return xla_bridge.backends_are_initialized()


def keep_freed_memory(*, top_pad: int = 256 << 20) -> bool:
    """Make glibc keep freed memory in the heap, for XLA:CPU's temp buffers to reuse.

    Call it once, before the first JAX computation of the process (before any array is
    created): a thread that has already allocated keeps the arena it has, and XLA's
    threads start with the backend. See the module docstring for what it sets and why.

    Args:
      top_pad: bytes by which the heap grows beyond a request (``M_TOP_PAD``), so that
        a step's temp is not grown page by page; an ``int >= 0``.

    Returns:
      True when the settings were made (Linux with glibc); False where the C library is
      not glibc (macOS, musl), where the allocator is left as it is.

    Raises:
      TypeError: if ``top_pad`` is not an int.
      ValueError: if ``top_pad`` is negative or does not fit glibc's ``int``.
      RuntimeError: if a JAX backend has already started: its threads already own their
        arenas, so the settings could not reach them.

    Example:
      >>> import cannjax
      >>> cannjax.backend.keep_freed_memory()  # doctest: +SKIP
      True
    """
    name = "cannjax.backend.keep_freed_memory"
    if isinstance(top_pad, bool) or not isinstance(top_pad, int):
        raise TypeError(f"{name}: top_pad must be an int (bytes), got {type(top_pad).__name__}")
    if not 0 <= top_pad < 2**31:
        raise ValueError(f"{name}: top_pad must be in [0, 2**31) bytes, got {top_pad}")
    if _backends_started():
        raise RuntimeError(
            f"{name}: a JAX backend has already started, and its threads keep the malloc "
            "arenas they have; call it before the first JAX computation of the process "
            "(first thing after the imports), or set MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 "
            "MALLOC_TRIM_THRESHOLD_=2147483647 in the environment before Python starts"
        )
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    settings = (
        (_M_ARENA_MAX, 1),
        (_M_MMAP_MAX, 0),
        (_M_TRIM_THRESHOLD, 2**31 - 1),
        (_M_TOP_PAD, top_pad),
    )
    # mallopt returns 1 on success; glibc accepts each of these values.
    return all(libc.mallopt(param, value) == 1 for param, value in settings)

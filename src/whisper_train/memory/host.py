"""The process's own memory between training and final/: what the steps left behind, handed back.

When the last step is done, the optimizer's moments (8 bytes a trainable parameter under AdamW)
are no longer needed: the last checkpoint holds them. And the C allocator keeps what the steps
freed: glibc's malloc returns a freed block to the system only from the top of its heap, so a
step's activations, once freed, stay resident as free heap (on the multilingual base's LoRA, about
550 MB after three steps of batch 4). What final/ does next is load and copy: with
--quantize-base the base is loaded again in full precision and the adapters merged into it. Held
on top of that free heap, final/ would set the run's peak where training's was lower
(bench/quantized_base.py measures the peaks; BENCHMARKS.md "LoRA on a quantized base").

During the steps glibc is left as it is. A fixed mmap threshold (MALLOC_MMAP_THRESHOLD_=65536)
maps every block over 64 KiB afresh and unmaps it when freed; it lowers the CPU LoRA run's
peak (batch 8, no checkpointing, 3 steps, means of three runs): the multilingual base's from
3,641 to 2,369 MiB (nf4: 3,561 to 2,227), tiny.en's from 1,973 to 1,460 (nf4: 2,056 to 1,407).
But each step then faults all its activations in again, page by page: the base's step took
37% more CPU seconds (6.78 to 9.28; nf4 45%), tiny.en's 59% (nf4 69%), and with huge pages
(GLIBC_TUNABLES=glibc.malloc.hugetlb=1) still 36%. glibc's own threshold (raised to the
largest block freed, up to 32 MiB) keeps those blocks as free heap that the next step reuses;
handing that heap back after each step (`return_freed_memory`) cost tiny.en's step 29% and
lowered no peak. A user short of memory can set MALLOC_MMAP_THRESHOLD_ for a run and pay that
(`bench/quantized_base.py --peak-only` measures both).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

import torch


@functools.cache
def _glibc_malloc_trim():
    """glibc's `malloc_trim`, or None where the C library is another (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def return_freed_memory() -> bool:
    """Collect Python's garbage, then hand the allocator's free pages back to the system
    (glibc's `malloc_trim(0)`, which releases free pages inside the heap, not only at its top).
    True where the allocator could be asked; elsewhere only the garbage is collected."""
    gc.collect()
    trim = _glibc_malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def release_training_state(optimizer: torch.optim.Optimizer) -> None:
    """After the last step (and the last checkpoint): the gradients and the optimizer's state
    dropped, and what they and the steps freed returned to the system."""
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()
    return_freed_memory()


__all__ = ["release_training_state", "return_freed_memory"]

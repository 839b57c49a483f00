"""After the last step (`memory.host`): the optimizer's state and the gradients are dropped, and
the memory the steps freed goes back to the system before final/ loads and copies on top of it."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import torch

from whisper_train.memory import release_training_state


def test_release_drops_gradients_and_optimizer_state_and_keeps_the_weights():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).square().sum().backward()
    optimizer.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert optimizer.state and model.weight.grad is not None

    release_training_state(optimizer)

    assert not optimizer.state
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


# A heap of small blocks freed below one still held: glibc's free() cannot shrink the heap past
# the live block at its top, so the freed pages stay resident until malloc_trim releases them.
FREED_INSIDE_THE_HEAP = textwrap.dedent(
    """
    import ctypes, json
    from whisper_train.memory import return_freed_memory

    def resident_mib():
        with open("/proc/self/status") as status:
            line = next(x for x in status if x.startswith("VmRSS"))
        return int(line.split()[1]) / 1024

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(800)]  # 50 MiB under the mmap threshold
    for block in blocks:
        ctypes.memset(block, 1, 64 * 1024)  # resident
    for block in blocks[:-1]:
        libc.free(block)
    before = resident_mib()
    asked = return_freed_memory()
    print(json.dumps({"asked": asked, "released": before - resident_mib()}))
    """
)


def test_the_memory_a_step_freed_goes_back_to_the_system_where_the_allocator_allows():
    done = subprocess.run(
        [sys.executable, "-c", FREED_INSIDE_THE_HEAP], capture_output=True, text=True, check=True
    )
    import json

    said = json.loads(done.stdout)
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert said["asked"] is True
        assert said["released"] > 40, said  # of the ~50 MiB freed
    else:  # another C library: nothing to ask it, and nothing pretends otherwise
        assert said["asked"] is False

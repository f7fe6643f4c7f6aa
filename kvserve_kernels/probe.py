"""A start-up check that Triton can compile and launch on a device.

Importing triton proves little: the first launch also builds a small C launcher (it needs a
C compiler and the Python headers), loads the GPU driver and runs ptxas. ``run_probe`` does
all of that on a 16-element tensor and checks the result, so a broken toolchain shows up at
start-up with its own error instead of failing the first request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PROBE_SIZE = 16


@triton.jit
def _add_one_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)


def run_probe(device: torch.device) -> None:
    """Launch the probe kernel on ``device`` and check its output; raise on any failure
    (the exception is the diagnosis). On a CPU it works only under ``TRITON_INTERPRET=1``."""
    x = torch.arange(PROBE_SIZE, dtype=torch.float32, device=device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            _add_one_kernel[(1,)](x, BLOCK=PROBE_SIZE)
            torch.cuda.synchronize(device)
    else:
        _add_one_kernel[(1,)](x, BLOCK=PROBE_SIZE)
    expect = torch.arange(1, PROBE_SIZE + 1, dtype=torch.float32)
    if not torch.equal(x.cpu(), expect):
        raise RuntimeError(f"the probe kernel ran but computed {x.cpu().tolist()} instead of "
                           f"{expect.tolist()}")

"""Whether this machine has a GPU driver, known without importing torch, and what a process on a
machine without one leaves unimported.

Triton compiles GPU kernels only, yet the CUDA builds of torch (what ``pip install torch`` gives
on Linux, also on machines with no GPU) import it with ``torch._dynamo``, which transformers'
model classes import: resident memory per process (``libtriton.so`` and its Python modules;
BENCHMARKS.md "vs colpali-engine") that a CPU-only process never uses.
"""

from __future__ import annotations

import os
import sys

GPU_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidia0", "/dev/kfd")
"""Files present where an NVIDIA (CUDA) or AMD (ROCm) GPU driver is loaded."""

KEEP_TRITON_ENV = "RAGGEDVL_KEEP_TRITON"
"""Set to 1 to let Triton import on a machine without a GPU driver."""


def has_gpu_driver() -> bool:
    """True when any of ``GPU_DRIVER_FILES`` exists (no torch import)."""
    return any(os.path.exists(f) for f in GPU_DRIVER_FILES)


def skip_triton() -> bool:
    """On a machine without a GPU driver, make ``import triton`` raise ``ImportError`` in this
    process (``sys.modules["triton"] = None``), so torch and transformers take their paths for
    "Triton not installed" (``torch.compile`` still compiles for the CPU). Does nothing when
    Triton is already imported, when a GPU driver is present, or when ``RAGGEDVL_KEEP_TRITON=1``.
    Returns whether Triton is now kept out. Call it before torch's compiler or transformers'
    models are imported (``raggedvl``'s command line does, first)."""
    if "triton" in sys.modules or has_gpu_driver() or os.environ.get(KEEP_TRITON_ENV) == "1":
        return sys.modules.get("triton", 0) is None
    sys.modules["triton"] = None
    return True

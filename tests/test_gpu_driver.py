"""skip_triton: on a machine without a GPU driver Triton is never imported by a raggedvl command."""

from __future__ import annotations

import os
import subprocess
import sys

CASE = """
import sys
from raggedvl.app import gpu_driver
gpu_driver.GPU_DRIVER_FILES = ({driver!r},)
kept_out = gpu_driver.skip_triton()
try:
    import triton  # noqa: F401
    imported = True
except ImportError:
    imported = False
import torch
from torch.utils._triton import has_triton
print(kept_out, imported, has_triton(), gpu_driver.skip_triton())
"""


def _run(driver: str, **env) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CASE.format(driver=driver)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_no_gpu_driver_keeps_triton_out():
    # ImportError for `import triton`, torch agrees there is no Triton, a second call says the same
    assert _run("/nonexistent/gpu-driver") == ["True", "False", "False", "True"]


def test_gpu_driver_or_opt_out_leaves_triton_alone(tmp_path):
    driver = tmp_path / "nvidia-version"
    driver.write_text("fake driver\n")
    try:
        import triton  # noqa: F401
        installed = "True"
    except ImportError:
        installed = "False"
    assert _run(str(driver))[:2] == ["False", installed]
    assert _run("/nonexistent/gpu-driver", RAGGEDVL_KEEP_TRITON="1")[:2] == ["False", installed]


def test_the_command_line_keeps_triton_out_first():
    command = ["train", "--help"]
    code = ("import sys; from raggedvl.app import gpu_driver; gpu_driver.GPU_DRIVER_FILES = ('/nonexistent/gpu',)\n"
            "from raggedvl.app.cli import main\n"
            f"try:\n    main({command!r})\nexcept SystemExit:\n    pass\n"
            "print('triton' in sys.modules and sys.modules['triton'] is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout + out.stderr

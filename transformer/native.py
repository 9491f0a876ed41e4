"""Building the package's C and C++ sources on first use (the fused CPU attention,
model/flash_cpu.cc; the library that keeps large step buffers, keep_blocks.c): where the libraries
are cached and how one is compiled without two processes tripping over each other. The standard
library only: accelerator.py uses it before train.py's restart, and the model package beneath it."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def kernel_cache() -> Path:
    """Where the libraries this package compiles on first use are kept (`TRANSFORMER_KERNEL_CACHE`,
    default ~/.cache/transformer-ablations/kernels)."""
    default = Path.home() / ".cache" / "transformer-ablations" / "kernels"
    return Path(os.environ.get("TRANSFORMER_KERNEL_CACHE", default))


def compile_library(command: list[str], target: Path) -> str | None:
    """Run a compiler's `command` with `-o` a file beside `target`, then move it there: processes
    building at once each write their own file and the last rename wins, an identical library.
    None once built; else the compiler's last line of complaint."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*command, "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return f"{command[0]} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

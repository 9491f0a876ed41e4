"""What a compiled XLA executable depends on beyond the program: the suite's persistent compilation
cache is kept apart per kind of machine (tests/conftest.py)."""

import hashlib
import importlib.metadata


def machine_key() -> str:
    """This CPU's features and jaxlib's version: a compiled executable is only valid where both are
    the same (one compiled for another CPU kind aborts the process that loads it)."""
    try:
        with open("/proc/cpuinfo") as f:
            features = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        features = ""
    return hashlib.sha256((features + importlib.metadata.version("jaxlib")).encode()).hexdigest()[:12]

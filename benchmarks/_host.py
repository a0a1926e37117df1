"""Small host helpers the benchmarks share that import neither torch nor
coordl (safe in a benchmark's outer process, whose own CPU and memory must
stay out of the measurement)."""
from __future__ import annotations

import os
import time

__all__ = ["rmdir_retry", "pyplot"]


def rmdir_retry(path: str, tries: int = 50) -> None:
    """Remove an (empty) cgroup directory, retrying while the kernel still
    counts processes that just exited in it; a missing one is fine."""
    for _ in range(tries):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a message) when
    matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return None
    return plt

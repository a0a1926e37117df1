"""What the benchmark tests (test_benchmarks*.py) share: a benchmark script
run as ``python benchmarks/<name> <args>`` in a child with a hard timeout."""
import os

from coordl.testing import run_in_child

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _script(name, *args, timeout=240):
    code = (f"import sys; sys.argv = [{name!r}] + {list(args)!r}; sys.path.insert(0, {BENCH!r}); "
            f"import runpy; runpy.run_path({os.path.join(BENCH, name)!r}, run_name='__main__')")
    r = run_in_child(code, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout

"""The cases of one parametrized test run in one child process.

A child that imports torch and coordl spends seconds of CPU before it runs a
line of the test; a parametrized test whose every case runs a few lines in a
child of its own pays that once per case.  :func:`run_cases` runs every case
in one child, one after the other, each at the top level of the child's
``__main__`` (classes it defines pickle as they would in a child of their
own), its exception printed into its own output rather than ending the
child, the names it bound deleted and the garbage collected before the next
case starts.  Each case of the test then asserts on its own output.  One
hard timeout covers the whole child.

Only for cases that check what their own loaders deliver or raise: a case
that counts the process's threads, children or mappings needs a child of
its own.
"""
from __future__ import annotations

import textwrap

from coordl.testing import run_in_child

_BEGIN, _END = "@@case-begin ", "@@case-end"

_CASE = """
print({begin!r}, flush=True)
_names_before = set(globals())
try:
{body}
except BaseException:
    import traceback as _tb
    _tb.print_exc(file=sys.stdout)
for _name in set(globals()) - _names_before - {{"_names_before"}}:
    del globals()[_name]
del _names_before
import gc as _gc
_gc.collect()
print({end!r}, flush=True)
"""


def run_cases(cases: dict[str, str], timeout: float, prelude: str = "") -> dict[str, str]:
    """``{case: its output}`` (stdout) of each body in ``cases``, run in one
    child after ``prelude``; a case the child never finished gets the whole
    output and stderr, so that its assertion shows why."""
    code = ["import sys", textwrap.dedent(prelude)]
    for name, body in cases.items():
        assert '"""' not in body and "'''" not in body, "a case's body is indented: no multi-line strings"
        code.append(_CASE.format(begin=_BEGIN + name, end=_END,
                                 body=textwrap.indent(textwrap.dedent(body).strip("\n") + "\npass", "    ")))
    r = run_in_child("\n".join(code), timeout=timeout)
    out = {}
    for name in cases:
        head = r.stdout.find(_BEGIN + name + "\n")
        tail = r.stdout.find(_END, head) if head >= 0 else -1
        if head < 0 or tail < 0:
            out[name] = f"(the child did not finish this case; rc {r.returncode})\n{r.stdout}\n{r.stderr}"
        else:
            out[name] = r.stdout[head + len(_BEGIN + name) + 1:tail]
    return out

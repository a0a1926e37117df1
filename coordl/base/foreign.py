"""Other libraries' classes recognized by their module and name, never
imported (torchvision's folders, timm's dataset), the checks that say
why such an object cannot be read as raw bytes + prep, and the reading of
a user's function by its bytecode (what a small function does, where its
name says nothing)."""
from __future__ import annotations

import types
from typing import Any

__all__ = ["class_named", "why_overridden", "why_not_callable", "plain_function", "instructions"]

# operations that carry no meaning for what a function does (the interpreter's bookkeeping)
_NOISE_OPS = frozenset({"RESUME", "PUSH_NULL", "PRECALL", "CACHE", "NOP", "NOT_TAKEN"})
# the ways of loading a local, each Python version's
_LOAD_FAST = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"})


def plain_function(fn: Any, nargs: int) -> bool:
    """Whether ``fn`` is a Python function of exactly ``nargs`` positional
    arguments and nothing else: no keyword-only or variable arguments, not
    a generator or coroutine, no closure."""
    if not isinstance(fn, types.FunctionType):
        return False
    code = fn.__code__
    flags = code.co_flags & (0x04 | 0x08 | 0x20 | 0x80 | 0x100 | 0x200)  # *args **kw generator coroutine...
    return code.co_argcount == nargs and not (code.co_kwonlyargcount or flags or code.co_freevars
                                              or code.co_cellvars)


def instructions(fn: Any, resolve: bool = False) -> list[tuple[str, Any]]:
    """``fn``'s bytecode as ``(operation, argument)`` pairs, without the
    interpreter's bookkeeping, every kind of local load as ``LOAD_FAST``.
    ``resolve``: arguments that depend on how the source was written, not on
    what it does, replaced by what they stand for: a local by its number,
    a global by the object it names in ``fn``'s module (or the builtins), a
    jump by the number of the instruction it goes to."""
    import dis

    kept = [ins for ins in dis.get_instructions(fn) if ins.opname not in _NOISE_OPS]
    if not resolve:
        return [("LOAD_FAST" if ins.opname in _LOAD_FAST else ins.opname, ins.argval) for ins in kept]
    code, number = fn.__code__, {ins.offset: k for k, ins in enumerate(kept)}
    names = fn.__globals__
    builtins = names.get("__builtins__", __builtins__)
    builtins = builtins if isinstance(builtins, dict) else vars(builtins)
    jumps = set(dis.hasjrel) | set(dis.hasjabs)
    out = []
    for ins in kept:
        op, arg = ("LOAD_FAST" if ins.opname in _LOAD_FAST else ins.opname), ins.argval
        if op == "LOAD_METHOD":     # Python 3.11 loads a method so unless its owner is a name an import bound
            op = "LOAD_ATTR"
        if "FAST" in op:
            arg = tuple(code.co_varnames.index(a) for a in (arg if isinstance(arg, tuple) else (arg,)))
        elif op in ("LOAD_GLOBAL", "LOAD_NAME"):
            arg = ("global", names[arg] if arg in names else builtins.get(arg, _MISSING))
        elif ins.opcode in jumps:
            arg = ("to", number.get(arg, len(kept)))
        out.append((op, arg))
    return out


_MISSING = object()


def class_named(cls: type, module: str, name: str) -> type | None:
    """The class in ``cls``'s MRO defined as ``module.name``, or None."""
    for c in cls.__mro__:
        if c.__module__ == module and c.__name__ == name:
            return c
    return None


def why_overridden(cls: type, base: type, attrs=("__getitem__", "__len__"), what: str = "") -> str | None:
    """Why ``cls`` is not ``base`` for coordl's reading (the first of
    ``attrs`` it overrides, ``what`` naming it), or None."""
    for attr in attrs:
        if getattr(cls, attr) is not getattr(base, attr):
            return (f"{what or cls.__name__} overrides {attr}, which coordl cannot prove equivalent to raw bytes "
                    "+ prep")
    return None


def why_not_callable(obj: Any, attrs=("transform", "target_transform")) -> str | None:
    """Why coordl cannot run ``obj``'s transforms (one set but not
    callable), or None."""
    for attr in attrs:
        fn = getattr(obj, attr, None)
        if fn is not None and not callable(fn):
            return f"its {attr} {fn!r} is not callable, so coordl cannot run it"
    return None

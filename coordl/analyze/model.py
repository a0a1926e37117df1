"""The analyzer's model: pure functions of measured rates, CPU costs and bandwidths.

Everything here is arithmetic on numbers the measurement produced (see
:mod:`coordl.analyze.measure`), so it can be checked against hand-computed
cases, and it imports nothing but the standard library (the validation
benchmark loads this file by path, without torch).  Rates are samples per
second, bandwidths bytes per second, CPU costs CPU-seconds per sample.

**Why not ``min(fetch, prep, step)``.**  Fetch threads, prep workers and a
step that runs on the CPU share the same cores.  Taking the slowest of
three rates each measured with the whole machine to itself over-predicts
whenever their sum of CPU demands exceeds the cores (a CPU step that runs
181 samples/s alone and a prep pool that runs 160/s alone do not run 160/s
together on 2 cores).  The model here is the bottleneck law of operational
analysis: each resource ``k`` a sample needs ``D_k`` seconds of bounds the
throughput by ``capacity_k / D_k``, and the prediction is the smallest of
those bounds:

* ``step``:    the training thread, which runs the step and takes each
               batch from the loader in turn: ``1 / (1/G + m)``, ``1/G`` the
               step's wall time per sample (measured alone, with the device
               synchronized for an accelerator step), ``m`` the thread's
               own CPU per sample for taking batches;
* ``fetch``:   storage and cache bandwidth, ``N / (D*x/C_bw + D*(1-x)/S_bw)``;
* ``workers``: what ``w`` worker processes can prep when the cores are not
               the limit: Amdahl ``P1*w / (1 + s*(w-1))`` fitted to the
               measured prep rates (so it can say "more workers help");
* ``cpu``:     the shared cores, ``eta * cores / (a_warm + (1-x)*a_cold +
               b(w) + c_step)``: loader process CPU per sample (fetch
               threads, batch assembly), the extra CPU a read from storage
               costs, the workers' prep CPU per sample, and the step's CPU
               per sample (about 0 for an accelerator step); ``eta`` the
               share of the cores the pipeline was measured to get;
* ``turns``:   a step that keeps ``k`` cores busy and fewer workers than
               the cores it leaves idle while the training thread waits
               for a batch: only prep on the ``cores - k`` free cores
               overlaps the step, the rest runs in turn with it
               (:func:`_turns`; one worker beside a step on every core:
               ``1 / (1/G + 1/P1)``).

Every input is an :class:`Est` (value and interval, and where it came
from); every bound is monotone in each input, so the interval of a
prediction is the prediction at the pessimistic ends of all inputs and at
the optimistic ends (interval arithmetic, :func:`predict`), widened by the
model's own relative error ``Inputs.model_error`` (``lo / (1 + e)``, ``hi
/ (1 - e)``).
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field, asdict
from typing import Iterable, Mapping, Sequence

__all__ = ["Est", "est_from_samples", "stalls", "fetch_rate", "amdahl", "fit_amdahl", "Inputs", "bounds",
           "predict", "verdict", "MODEL_ERROR_VERDICT", "what_if_cache", "what_if_workers", "what_if_grid", "predict_from_report",
           "inputs_from_dict"]


def _positive(value: float, name: str) -> float:
    v = float(value)
    if not v > 0 or math.isnan(v):
        raise ValueError(f"{name} should be a positive number, but got {name}={value!r}")
    return v


# ------------------------------------------------------------- intervals
@dataclass(frozen=True)
class Est:
    """A quantity with its interval ``[lo, hi]`` (``lo <= value <= hi``) and
    where it came from (``"measured: ..."`` or ``"modelled: ..."``)."""
    value: float
    lo: float
    hi: float
    source: str = "measured"

    def __post_init__(self):
        for k in ("value", "lo", "hi"):
            if math.isnan(float(getattr(self, k))):
                raise ValueError(f"Est.{k} should be a number, but got {k}=nan")
        if not self.lo <= self.value <= self.hi:
            raise ValueError(f"Est should have lo <= value <= hi, but got lo={self.lo!r}, value={self.value!r}, "
                             f"hi={self.hi!r}")

    @classmethod
    def exact(cls, v: float, source: str = "given") -> "Est":
        return cls(float(v), float(v), float(v), source)

    def end(self, which: str) -> float:
        return {"value": self.value, "lo": self.lo, "hi": self.hi}[which]

    def as_dict(self) -> dict:
        return asdict(self)


def est_from_samples(samples: Sequence[float], source: str, within: Sequence[float] = ()) -> Est:
    """The estimate of a quantity measured ``len(samples)`` times (repeated
    passes): value = the median, interval = ``[min, max]`` of the samples
    (for 3 independent passes that range holds the true median with
    probability 1 - 2/2**3 = 75%).  ``within``: the rates of segments of one
    pass (batch means); with a single pass, the interval is the mean of the
    segments +- 2 standard errors, scaled to the pass's rate.  Always
    widened to hold every one of ``samples``."""
    xs = [float(v) for v in samples]
    if not xs:
        raise ValueError("est_from_samples needs at least one sample")
    med = statistics.median(xs)
    lo, hi = min(xs), max(xs)
    seg = [float(v) for v in within if v > 0]
    if len(xs) == 1 and len(seg) >= 2:
        m = statistics.fmean(seg)
        se = statistics.stdev(seg) / math.sqrt(len(seg)) / m  # relative standard error of the mean
        # a pass so unsteady that 2 standard errors reach below half its rate: half its rate (and said so
        # by the width of the interval)
        lo, hi = min(lo, max(med * (1 - 2 * se), med / 2)), max(hi, med * (1 + 2 * se))
    return Est(med, max(lo, 0.0), hi, source)


# ------------------------------------------------- the DS-Analyzer stalls
def stalls(ingest: float, cached: float, cold: float) -> dict:
    """Measured fetch and prep stall (CoorDL's differential definition) as
    fractions of the cold epoch time.

    ``prep_stall = (1/cached - 1/ingest) / (1/cold)``,
    ``fetch_stall = (1/cold - 1/cached) / (1/cold)``; they add up to
    ``total``.  Measurements out of order (noise) are clamped into that
    order first, so each stall stays in [0, 1]; ``noise`` says by how much,
    as a fraction of the cold epoch.
    """
    g, c, f = _positive(ingest, "ingest"), _positive(cached, "cached"), _positive(cold, "cold")
    t_g, t_c, t_f = 1 / g, 1 / c, 1 / f
    noise = max(0.0, t_g - t_f) / t_f
    t_g = min(t_g, t_f)
    t_c_in = min(max(t_c, t_g), t_f)
    noise += abs(t_c - t_c_in) / t_f
    prep = (t_c_in - t_g) / t_f
    fetch = (t_f - t_c_in) / t_f
    return {"fetch": fetch, "prep": prep, "total": (t_f - t_g) / t_f, "noise": noise}


def fetch_rate(samples: int, dataset_bytes: float, cached_fraction: float, cache_bw: float,
               storage_bw: float) -> float:
    """Samples per second the fetch stage's I/O delivers when
    ``cached_fraction`` of the dataset's bytes are in the cache:
    ``N / (D*x/C_bw + D*(1-x)/S_bw)``."""
    n = _positive(samples, "samples")
    d = _positive(dataset_bytes, "dataset_bytes")
    x = float(cached_fraction)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"cached_fraction should be in [0, 1], but got cached_fraction={cached_fraction!r}")
    c, s = _positive(cache_bw, "cache_bw"), _positive(storage_bw, "storage_bw")
    return n / (d * x / c + d * (1.0 - x) / s)


# ----------------------------------------------------- workers (Amdahl)
def amdahl(p1: float, s: float, w: int) -> float:
    """``P1 * w / (1 + s*(w-1))``: ``s = 0`` linear, ``s = 1`` no gain."""
    return p1 * w / (1 + s * (w - 1))


def _fit_once(points: Sequence[tuple[int, float]], cap: Mapping[int, float]) -> tuple[float, float]:
    """Least squares on relative error of ``min(amdahl(P1, s, w), cap[w])``
    against the points, over a grid of ``s`` (step 0.005) and candidate
    ``P1`` values (each point's ``P1`` for that ``s``)."""
    best = (math.inf, 0.0, points[0][1])
    for k in range(201):
        s = k / 200
        cands = {r * (1 + s * (w - 1)) / w for w, r in points}
        for p1 in cands:
            err = sum((min(amdahl(p1, s, w), cap.get(w, math.inf)) / r - 1) ** 2 for w, r in points)
            if err < best[0] - 1e-12:
                best = (err, s, p1)
    return best[1], best[2]


def fit_amdahl(prep_runs: Mapping[int, Sequence[float]], cap: Mapping[int, float] | None = None,
               draws: int = 200, seed: int = 0) -> dict:
    """Fit ``P(w) = min(P1*w/(1+s*(w-1)), cap(w))`` to prep rates measured
    at several worker counts (each a list of repeated passes; ``cap``: the
    CPU bound at each count, so points the cores limit do not read as
    serial work).  Returns ``{"s": Est, "p1": Est, "draws": [(s, P1)...],
    "points": n}``: the fit to the medians, and its uncertainty by
    bootstrap (each draw refits with one pass drawn at random per worker
    count; the interval is the draws' 5th to 95th percentile).  With one
    worker count measured there is nothing to fit: ``s`` is unknown
    (interval ``[0, 1]``)."""
    pts = sorted((int(w), [_positive(r, f"prep_runs[{w}]") for r in rs]) for w, rs in prep_runs.items())
    if not pts or pts[0][0] < 1 or any(not rs for _, rs in pts):
        raise ValueError(f"prep_runs should map worker counts >= 1 to lists of rates, but got "
                         f"prep_runs={prep_runs!r}")
    cap = dict(cap or {})
    med = [(w, statistics.median(rs)) for w, rs in pts]
    if len(pts) == 1:
        w, r = med[0]
        p1 = r / w
        return {"s": Est(0.0, 0.0, 1.0, "modelled: one worker count measured, s unknown"),
                "p1": Est(p1, p1 / w if w > 1 else p1, p1, "modelled: the measured rate / workers"),
                "draws": [(0.0, p1), (1.0, r)], "points": 1}
    s, p1 = _fit_once(med, cap)
    rng = random.Random(seed)
    out = []
    if all(len(rs) == 1 for _, rs in pts):
        # no repeats: bootstrap over the points themselves (leave one out)
        for i in range(len(med)):
            sub = med[:i] + med[i + 1:]
            out.append(_fit_once(sub, cap) if len(sub) >= 2 else (s, p1))
    else:
        for _ in range(draws):
            out.append(_fit_once([(w, rng.choice(rs)) for w, rs in pts], cap))
    ss = sorted(d[0] for d in out)
    ps = sorted(d[1] for d in out)

    def pct(v, q):
        return v[min(len(v) - 1, max(0, int(round(q * (len(v) - 1)))))]
    src = f"modelled: Amdahl fitted to prep rates at {', '.join(str(w) for w, _ in pts)} workers"
    return {"s": Est(s, min(s, pct(ss, 0.05)), max(s, pct(ss, 0.95)), src),
            "p1": Est(p1, min(p1, pct(ps, 0.05)), max(p1, pct(ps, 0.95)), src),
            "draws": out, "points": len(pts)}


# ------------------------------------------------------------- the model
@dataclass
class Inputs:
    """What the model needs, each an :class:`Est`.  ``worker_cpu`` maps
    measured worker counts to prep CPU-seconds per sample (a count not
    measured uses the nearest measured one)."""
    samples: int
    dataset_bytes: float
    cores: int
    storage_bw: Est
    cache_bw: Est
    ingest: Est                 # the step alone, samples/s (wall)
    step_cpu: Est               # CPU-seconds per sample the step uses
    loader_cpu: Est             # loader process CPU-s/sample, data in memory
    storage_cpu: Est            # extra loader CPU-s/sample for a read from storage
    worker_cpu: dict            # {w: Est} CPU-s/sample in the worker processes
    amdahl_s: Est
    amdahl_p1: Est
    eta: Est                    # share of the cores the pipeline gets
    step_kind: str = "accelerator"
    amdahl_draws: list = field(default_factory=list)
    consumer_cpu: Est = Est(0.0, 0.0, 0.0, "not measured")  # the training thread's loader CPU-s/sample
    # relative error of the model itself, beside the inputs' spread: a measurement m is expected within
    # |prediction / m - 1| <= model_error, so intervals run from lo / (1 + e) to hi / (1 - e)
    model_error: Est = Est(0.0, 0.0, 0.0, "not stated")
    # cores the step keeps busy while it runs (its CPU-seconds per second of running); None: step_cpu x ingest
    step_cores: Est | None = None

    def b(self, w: int) -> Est:
        if not self.worker_cpu:
            return Est.exact(0.0, "none")
        k = min(self.worker_cpu, key=lambda m: (abs(m - w), -m))
        return self.worker_cpu[k]

    def as_dict(self) -> dict:
        d = {k: (v.as_dict() if isinstance(v, Est) else v) for k, v in self.__dict__.items()
             if k not in ("worker_cpu", "amdahl_draws")}
        d["worker_cpu"] = {str(k): v.as_dict() for k, v in self.worker_cpu.items()}
        d["amdahl_draws"] = [list(x) for x in self.amdahl_draws]
        return d


def inputs_from_dict(d: Mapping) -> Inputs:
    """:meth:`Inputs.as_dict` back into :class:`Inputs` (from a JSON report)."""
    def e(v):
        return Est(v["value"], v["lo"], v["hi"], v.get("source", ""))
    kw = {}
    for k, v in d.items():
        if k == "worker_cpu":
            kw[k] = {int(w): e(x) for w, x in v.items()}
        elif k == "amdahl_draws":
            kw[k] = [tuple(x) for x in v]
        elif isinstance(v, Mapping) and "value" in v:
            kw[k] = e(v)
        else:
            kw[k] = v
    return Inputs(**kw)


_UP = ("storage_bw", "cache_bw", "ingest", "amdahl_p1", "eta")     # more is faster
_DOWN = ("step_cpu", "loader_cpu", "storage_cpu", "amdahl_s", "consumer_cpu")      # more is slower


def _workers_bound(inp: Inputs, w: int, end: str) -> float:
    """The workers' own bound at ``w``: Amdahl at the fitted values; its
    ends are the 5th/95th percentiles over the fit's bootstrap draws (``P1``
    and ``s`` move together: taking each one's worst end alone would give
    an interval far wider than the data allow), else each one's end."""
    v = amdahl(inp.amdahl_p1.value, min(max(inp.amdahl_s.value, 0.0), 1.0), w)
    if end == "value":
        return v
    if inp.amdahl_draws:
        xs = sorted(amdahl(p1, min(max(s, 0.0), 1.0), w) for s, p1 in inp.amdahl_draws)
        q = 0.05 if end == "lo" else 0.95
        d = xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]
        return min(d, v) if end == "lo" else max(d, v)
    s = inp.amdahl_s.hi if end == "lo" else inp.amdahl_s.lo
    return amdahl(inp.amdahl_p1.end(end), min(max(s, 0.0), 1.0), w)


def bounds(inp: Inputs, cached_fraction: float, workers: int, end: str = "value", *,
           no_fetch: bool = False, no_prep: bool = False) -> dict:
    """Each resource's bound on throughput at ``cached_fraction`` and
    ``workers``.  ``end``: ``"value"``, ``"lo"`` (every input at its
    pessimistic end) or ``"hi"`` (optimistic).  ``no_fetch``: as if every
    sample were in memory (x = 1); ``no_prep``: as if prep cost nothing."""
    if end not in ("value", "lo", "hi"):
        raise ValueError(f'end should be "value", "lo" or "hi", but got end={end!r}')
    w = int(workers)
    if w < 0:
        raise ValueError(f"workers should be >= 0, but got workers={workers!r}")
    x = 1.0 if no_fetch else float(cached_fraction)
    flip = {"value": "value", "lo": "hi", "hi": "lo"}[end]

    def g(name):
        v = getattr(inp, name)
        return v.end(end if name in _UP else flip)
    b = inp.b(max(w, 1)).end(flip)
    per = 1 / g("ingest") + g("consumer_cpu")
    out = {"step": 1 / per if per > 0 else math.inf,
           "fetch": fetch_rate(inp.samples, inp.dataset_bytes, x, g("cache_bw"), g("storage_bw"))}
    if not no_prep:
        out["workers"] = _workers_bound(inp, max(w, 1), end)
    else:
        b = 0.0
    demand = g("loader_cpu") + (1 - x) * g("storage_cpu") + b + g("step_cpu")
    if w == 0 and not no_prep:
        # everything in one process: prep and step take turns on the main thread
        out["workers"] = 1 / (1 / out["workers"] + 1 / out["step"])
    out["cpu"] = g("eta") * inp.cores / demand if demand > 0 else math.inf
    if w > 0 and not no_prep:
        if inp.step_cores is not None:
            k = inp.step_cores.end(flip)
        else:
            k = g("step_cpu") * inp.ingest.value
        t = _turns(inp, w, per, k, out["workers"], g("eta") * inp.cores / (g("loader_cpu") + b)
                   if g("loader_cpu") + b > 0 else math.inf)
        if t is not None:
            out["turns"] = t
    return out


def _turns(inp: Inputs, w: int, per: float, step_cores: float, workers: float, cores_prep: float) -> float | None:
    """The ``turns`` bound: a step that keeps ``k`` cores busy while it runs
    (``k`` = ``step_cores``, measured as its CPU-seconds per second of
    running alone, else its CPU-seconds per sample x its rate alone; at
    most the cores) leaves ``cores - k`` of them to the workers during the step.
    Its intra-op threads wait for the slowest, so prep done on a step's
    core delays the step by as much: only prep on the free cores overlaps
    the step.  The rest runs while the training thread waits for the next
    batch, on ``min(w, cores)`` cores.  Per sample, with ``s`` the training
    thread's time (``1/G + m``), ``r`` the workers' rate on their own
    (``min(workers bound, cores' prep rate)``) and ``f = min(w, cores - k)
    / min(w, cores)`` the share of it that fits beside the step:
    ``T = s + max(0, 1 - s*f*r) / r``.  The prefetch depth does not enter:
    running ahead during the step costs the step what it gains.  With ``f
    = 1`` (an accelerator step, or a free core per worker) this is
    ``max(s, 1/r)``, already the ``step`` and ``workers`` bounds, and
    ``None`` is returned; with ``w >= cores`` it is the core sum with the
    step's part not divided by ``eta`` (never below the ``cpu`` bound).  It
    matters where the workers are fewer than the cores a CPU
    step leaves idle while it waits for a batch: one worker beside a
    two-thread step on 2 cores runs step and prep in turn (1 / (1/G +
    1/P1)), not side by side (the core sum)."""
    g = 1 / per if per > 0 else math.inf
    k = min(float(inp.cores), max(step_cores, 0.0))
    busy = min(w, inp.cores)
    f = min(w, max(inp.cores - k, 0.0)) / busy
    if f >= 1.0 or not math.isfinite(g):
        return None
    r = min(workers, cores_prep)
    if not r > 0:
        return None
    if not math.isfinite(r):
        return g
    t = per + max(0.0, 1.0 - per * f * r) / r
    return 1 / t


def predict(inp: Inputs, cached_fraction: float, workers: int, **kw) -> dict:
    """Predicted throughput with its interval: ``{"throughput", "lo", "hi",
    "lo_inputs", "hi_inputs", "model_error", "bound", "bounds"}``
    (``bound``: the resource that limits it).  ``lo_inputs``/``hi_inputs``:
    the prediction with every input at its pessimistic / optimistic end
    (the measurements' spread); ``lo``/``hi`` widen that by the model's own
    error ``e`` (``inp.model_error``), relative to the measurement:
    ``lo_inputs / (1 + e)`` and ``hi_inputs / (1 - e)``."""
    out = {}
    for end in ("value", "lo", "hi"):
        bs = bounds(inp, cached_fraction, workers, end, **kw)
        name = min(bs, key=bs.get)
        out[end] = (bs[name], name, bs)
    t, name, bs = out["value"]
    lo, hi = min(out["lo"][0], t), max(out["hi"][0], t)
    e = min(max(float(inp.model_error.value), 0.0), 0.9)
    return {"throughput": t, "lo": lo / (1 + e), "hi": hi / (1 - e), "lo_inputs": lo, "hi_inputs": hi,
            "model_error": e, "bound": name, "bounds": bs}


#: The largest model error a verdict is given under: the model's error on its own check passes (or the
#: error stated with ``model_error=``).  The speed-ups a verdict compares (removing the fetch stall vs the
#: prep stall) are typically x1.1 to x2; past 30% either is inside the model's own error.
MODEL_ERROR_VERDICT = 0.30


def verdict(now: Mapping, no_fetch: Mapping, no_prep: Mapping, threshold: float = 0.05, *,
            model_error: float | None = None, measured: Mapping | None = None) -> dict:
    """Which stall is largest, by the what-if: the one whose removal helps
    most.  ``now``, ``no_fetch``, ``no_prep``: :func:`predict` results (the
    cold run, the same with every sample in memory, the same with free
    prep).  A stall is the share of the current time per sample that
    removing it saves, ``1 - now/without``.  Neither above ``threshold``:
    the step is not waiting for data (``"largest": None``).

    No conclusion (``"conclusive": False``, ``"largest": None`` and
    ``"why"`` saying why) when the model's error (``model_error``) is past
    :data:`MODEL_ERROR_VERDICT`, or when the measured stalls
    (``measured``: :func:`stalls`) say otherwise: the model names a stall
    the measurement puts under ``threshold`` or more than ``threshold``
    below the other, or names none while the measurement has one."""
    t = now["throughput"]
    fetch = max(0.0, 1 - t / no_fetch["throughput"])
    prep = max(0.0, 1 - t / no_prep["throughput"])
    largest = None
    if max(fetch, prep) >= threshold:
        largest = "fetch" if fetch >= prep else "prep"
    why = None
    if model_error is not None and model_error > MODEL_ERROR_VERDICT:
        why = (f"the model missed its own check passes by {model_error:.0%}, more than the "
               f"{MODEL_ERROR_VERDICT:.0%} a verdict needs (a busy machine, or a pipeline the model does not "
               f"describe): run again on a quiet machine")
    elif measured is not None:
        m = {"fetch": float(measured["fetch"]), "prep": float(measured["prep"])}
        said = (f"the measured stalls are fetch {m['fetch']:.1%}, prep {m['prep']:.1%}")
        if largest is None and max(m.values()) >= threshold:
            why = f"the model says the step is not waiting for data, but {said}"
        elif largest is not None:
            other = "prep" if largest == "fetch" else "fetch"
            if m[largest] < threshold or m[other] > m[largest] + threshold:
                why = f"the model says removing the {largest} stall helps most, but {said}"
    return {"largest": None if why else largest, "conclusive": why is None, "why": why,
            "model_largest": largest, "fetch_stall": fetch, "prep_stall": prep,
            "speedup_without_fetch": no_fetch["throughput"] / t, "speedup_without_prep": no_prep["throughput"] / t,
            "bound_now": now["bound"], "rule": "the stall whose removal the model says raises throughput most; "
                                               f"none when neither saves {threshold:.0%}; no conclusion past a "
                                               f"model error of {MODEL_ERROR_VERDICT:.0%} or against the measured "
                                               "stalls"}


def _row(p: dict, **extra) -> dict:
    return {**extra, "throughput": p["throughput"], "lo": p["lo"], "hi": p["hi"], "lo_inputs": p["lo_inputs"],
            "hi_inputs": p["hi_inputs"], "bound": p["bound"]}


def what_if_cache(inp: Inputs, workers: int, fractions: Iterable[float] = tuple(i / 10 for i in range(11))) -> list:
    """Rows ``{"cached_fraction", "fetch_rate", "throughput", "lo", "hi", "bound"}``."""
    rows = []
    for x in fractions:
        p = predict(inp, x, workers)
        rows.append(_row(p, cached_fraction=float(x), fetch_rate=p["bounds"]["fetch"]))
    return rows


def what_if_workers(inp: Inputs, cached_fraction: float, workers: Sequence[int], measured: Iterable[int] = ()) -> list:
    """Rows ``{"workers", "prep_rate", "prep_lo", "prep_hi", "measured", "throughput", "lo", "hi", "bound"}``;
    ``prep_rate``: the model's prep-only rate at that count (data in memory, no step)."""
    meas = {int(m) for m in measured}
    free = Inputs(**{**inp.__dict__, "ingest": Est.exact(math.inf), "step_cpu": Est.exact(0.0)})
    rows = []
    for w in workers:
        p = predict(inp, cached_fraction, w)
        q = predict(free, 1.0, w)
        rows.append(_row(p, workers=int(w), prep_rate=q["throughput"], prep_lo=q["lo"], prep_hi=q["hi"],
                         measured=int(w) in meas))
    return rows


def what_if_grid(inp: Inputs, fractions: Sequence[float], workers: Sequence[int]) -> list:
    """Every (cached fraction, workers) pair: rows ``{"cached_fraction", "workers", "throughput", "lo", "hi",
    "bound"}``."""
    return [_row(predict(inp, x, w), cached_fraction=float(x), workers=int(w)) for w in workers for x in fractions]


def predict_from_report(report: Mapping, cached_fraction: float, workers: int) -> dict:
    """:func:`predict` from a report of :func:`coordl.analyze.analyze` (its
    JSON): the prediction at a point the analyzer may not have measured."""
    return predict(inputs_from_dict(report["model"]["inputs"]), cached_fraction, workers)

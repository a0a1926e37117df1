"""The analyzer's model: pure functions of measured rates and bandwidths.

Everything here is arithmetic on numbers the measurement produced (see
:mod:`coordl.analyze.measure`), so it can be checked against hand-computed
cases.  Rates are samples per second, bandwidths bytes per second, sizes
bytes.  Definitions (CoorDL's DS-Analyzer):

* ``ingest`` (G): the training step alone, fed from memory;
* ``cached`` (R_c): loader + step with every sample's bytes in memory
  (fetch is free, prep is paid);
* ``cold`` (R_f): loader + step reading from storage.

Per sample the step costs 1/G, a cached epoch 1/R_c and a cold one 1/R_f;
the differences are what prep and fetch add, reported as fractions of the
cold epoch (the time the trainer actually spends).
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

__all__ = ["stalls", "fetch_rate", "predict", "fit_serial_fraction", "prep_rate_at", "what_if_cache",
           "what_if_workers", "what_if_grid"]


def _positive(value: float, name: str) -> float:
    v = float(value)
    if not v > 0 or math.isnan(v):
        raise ValueError(f"{name} should be a positive number, but got {name}={value!r}")
    return v


def stalls(ingest: float, cached: float, cold: float) -> dict:
    """Fetch and prep stall as fractions of the cold epoch time.

    ``prep_stall = (1/cached - 1/ingest) / (1/cold)``,
    ``fetch_stall = (1/cold - 1/cached) / (1/cold)``; they add up to
    ``total``, the share of the cold epoch the step waited for data,
    ``(1/cold - 1/ingest) / (1/cold)``.  Measurements out of order (noise:
    the cached pass slower than the cold one, or faster than the step
    alone) are clamped into that order first -- the cached time per
    sample into ``[1/ingest, 1/cold]`` -- so each stall stays in [0, 1];
    ``noise`` says by how much, as a fraction of the cold epoch.
    """
    g, c, f = _positive(ingest, "ingest"), _positive(cached, "cached"), _positive(cold, "cold")
    t_g, t_c, t_f = 1 / g, 1 / c, 1 / f
    noise = max(0.0, t_g - t_f) / t_f  # the cold pass beat the step alone
    t_g = min(t_g, t_f)
    t_c_in = min(max(t_c, t_g), t_f)
    noise += abs(t_c - t_c_in) / t_f
    prep = (t_c_in - t_g) / t_f
    fetch = (t_f - t_c_in) / t_f
    return {"fetch": fetch, "prep": prep, "total": (t_f - t_g) / t_f, "noise": noise}


def fetch_rate(samples: int, dataset_bytes: float, cached_fraction: float, cache_bw: float,
               storage_bw: float) -> float:
    """Samples per second the fetch stage delivers when ``cached_fraction`` of
    the dataset's bytes are in the cache: the epoch's fetch time is
    ``T_fetch = D*x/C_bw + D*(1-x)/S_bw``."""
    n = _positive(samples, "samples")
    d = _positive(dataset_bytes, "dataset_bytes")
    x = float(cached_fraction)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"cached_fraction should be in [0, 1], but got cached_fraction={cached_fraction!r}")
    c, s = _positive(cache_bw, "cache_bw"), _positive(storage_bw, "storage_bw")
    t = d * x / c + d * (1.0 - x) / s
    return n / t


def predict(fetch: float, prep: float, ingest: float) -> float:
    """Throughput of a pipelined loader + step: the slowest of the three."""
    return min(_positive(fetch, "fetch"), _positive(prep, "prep"), _positive(ingest, "ingest"))


def fit_serial_fraction(prep_rates: Mapping[int, float]) -> float:
    """Amdahl's serial fraction ``s`` fitted to measured prep rates by worker
    count: ``P(w) = P(1) * w / (1 + s*(w-1))``, ``s`` in [0, 1] (0: linear
    scaling, 1: no gain from more workers).  ``P(1)`` is the measured 1-worker
    rate, or the fit's when 1 worker was not measured.  Least squares on the
    relative error over a grid of ``s`` (step 0.001).  One point: ``s = 0``."""
    pts = sorted((int(w), _positive(r, f"prep_rates[{w}]")) for w, r in prep_rates.items())
    if not pts or pts[0][0] < 1:
        raise ValueError(f"prep_rates should map worker counts >= 1 to rates, but got prep_rates={prep_rates!r}")
    if len(pts) == 1:
        return 0.0
    best, best_err = 0.0, math.inf
    for k in range(1001):
        s = k / 1000
        shape = [(w / (1 + s * (w - 1)), r) for w, r in pts]
        # the P(1) that fits best for this s (least squares on relative error)
        p1 = sum(r / sh for sh, r in shape) / len(shape) if 1 not in dict(pts) else dict(pts)[1]
        err = sum((p1 * sh / r - 1) ** 2 for sh, r in shape)
        if err < best_err - 1e-15:
            best, best_err = s, err
    return best


def prep_rate_at(workers: int, prep_rates: Mapping[int, float], cpus: int) -> float:
    """Prep rate with ``workers`` workers: the measured rate when there is
    one; otherwise Amdahl's law fitted to the measured points
    (:func:`fit_serial_fraction`), with no gain past ``cpus`` cores (a worker
    beyond the cores only time-shares them)."""
    w = int(workers)
    if w < 1:
        raise ValueError(f"workers should be >= 1, but got workers={workers!r}")
    cpus = max(1, int(cpus))
    rates = {int(k): float(v) for k, v in prep_rates.items()}
    if w in rates:
        return rates[w]
    s = fit_serial_fraction(rates)
    if 1 in rates:
        p1 = rates[1]
    else:
        p1 = sum(r * (1 + s * (k - 1)) / k for k, r in rates.items()) / len(rates)
    eff = min(w, cpus)
    if eff in rates:
        return rates[eff]
    return p1 * eff / (1 + s * (eff - 1))


def what_if_cache(samples: int, dataset_bytes: float, cache_bw: float, storage_bw: float, prep: float,
                  ingest: float, fractions: Iterable[float] = tuple(i / 10 for i in range(11))) -> list[dict]:
    """Predicted throughput for each cached fraction (prep and ingestion
    rates fixed): rows of ``{"cached_fraction", "fetch_rate", "throughput",
    "bound"}``, ``bound`` naming the stage that limits it."""
    rows = []
    for x in fractions:
        f = fetch_rate(samples, dataset_bytes, x, cache_bw, storage_bw)
        t = predict(f, prep, ingest)
        bound = "fetch" if t == f else "prep" if t == prep else "ingest"
        rows.append({"cached_fraction": float(x), "fetch_rate": f, "throughput": t, "bound": bound})
    return rows


def what_if_workers(prep_rates: Mapping[int, float], cpus: int, fetch: float, ingest: float,
                    workers: Sequence[int]) -> list[dict]:
    """Predicted throughput for each worker count (fetch and ingestion
    rates fixed): rows of ``{"workers", "prep_rate", "measured", "throughput",
    "bound"}``."""
    rows = []
    for w in workers:
        p = prep_rate_at(w, prep_rates, cpus)
        t = predict(fetch, p, ingest)
        bound = "fetch" if t == fetch else "prep" if t == p else "ingest"
        rows.append({"workers": int(w), "prep_rate": p, "measured": int(w) in {int(k) for k in prep_rates},
                     "throughput": t, "bound": bound})
    return rows


def what_if_grid(samples: int, dataset_bytes: float, cache_bw: float, storage_bw: float,
                 prep_rates: Mapping[int, float], cpus: int, ingest: float, fractions: Sequence[float],
                 workers: Sequence[int]) -> list[dict]:
    """Every (cached fraction, workers) pair: rows of ``{"cached_fraction",
    "workers", "throughput", "bound"}``."""
    rows = []
    for w in workers:
        p = prep_rate_at(w, prep_rates, cpus)
        for r in what_if_cache(samples, dataset_bytes, cache_bw, storage_bw, p, ingest, fractions):
            rows.append({"cached_fraction": r["cached_fraction"], "workers": int(w),
                         "throughput": r["throughput"], "bound": r["bound"]})
    return rows

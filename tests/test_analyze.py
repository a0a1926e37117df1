"""coordl analyze: the what-if model against hand-computed cases, stall
attribution on datasets with known delays, and the CLI end to end."""
from __future__ import annotations

import json
import math
import os
import sys
import statistics
import textwrap
import time

import pytest

from coordl.analyze import model
from coordl.testing import run_in_child

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------ model
def test_stalls_hand_computed():
    # per sample: step 10 ms, cached 12.5 ms, cold 20 ms
    st = model.stalls(ingest=100, cached=80, cold=50)
    assert st["prep"] == pytest.approx(0.125)
    assert st["fetch"] == pytest.approx(0.375)
    assert st["total"] == pytest.approx(0.5)
    assert st["noise"] == 0


def test_stalls_noise_is_clamped_and_reported():
    # cached measured slower than cold (noise): no fetch stall, prep is the whole stall
    st = model.stalls(ingest=100, cached=40, cold=50)
    assert st["fetch"] == 0
    assert st["prep"] == pytest.approx(0.5)   # (1/50 - 1/100) / (1/50)
    assert st["noise"] == pytest.approx(0.25)  # (1/40 - 1/50) / (1/50)
    # far slower: the prep stall used to come out above 100% (a short, noisy pass saw 133%)
    st = model.stalls(ingest=100, cached=20, cold=50)
    assert st["prep"] == pytest.approx(0.5) and st["fetch"] == 0
    assert st["noise"] == pytest.approx(1.5)
    # cached faster than the step alone: no prep stall
    st = model.stalls(ingest=100, cached=200, cold=50)
    assert st["prep"] == 0 and st["fetch"] == pytest.approx(0.5) and st["noise"] == pytest.approx(0.25)
    # cold faster than the step alone: no stall at all
    st = model.stalls(ingest=100, cached=200, cold=400)
    assert st["prep"] == 0 and st["fetch"] == 0 and st["total"] == 0


@pytest.mark.parametrize("g, c, f", [(100, 80, 50), (100, 40, 50), (100, 20, 50), (100, 200, 50), (1e6, 5, 50),
                                     (10, 80, 50), (100, 100, 100)])
def test_stalls_stay_in_range_and_add_up(g, c, f):
    st = model.stalls(g, c, f)
    assert 0 <= st["fetch"] <= 1 and 0 <= st["prep"] <= 1 and 0 <= st["total"] <= 1, st
    assert st["fetch"] + st["prep"] == pytest.approx(st["total"]), st


def test_fetch_rate_hand_computed():
    # 1000 samples, 1 GB; 10 GB/s cache, 100 MB/s storage; half cached:
    # T = 0.5e9/1e10 + 0.5e9/1e8 = 0.05 + 5 = 5.05 s
    assert model.fetch_rate(1000, 1e9, 0.5, 1e10, 1e8) == pytest.approx(1000 / 5.05)
    assert model.fetch_rate(1000, 1e9, 0.0, 1e10, 1e8) == pytest.approx(100.0)
    assert model.fetch_rate(1000, 1e9, 1.0, 1e10, 1e8) == pytest.approx(10000.0)


def _inputs(**kw):
    """Hand-made model inputs: 1000 samples of 1 MB, 2 cores; storage 100 MB/s (100 samples/s), cache 10 GB/s;
    loader 1 CPU-ms/sample, +1 CPU-ms for a read from storage; prep 15 CPU-ms/sample in a worker and a worker
    preps 1/0.015 = 66.7 samples/s, scaling linearly (s = 0); all cores available; a step at 100 samples/s
    that uses no CPU."""
    E = model.Est.exact
    base = dict(samples=1000, dataset_bytes=1e9, cores=2, storage_bw=E(1e8), cache_bw=E(1e10), ingest=E(100.0),
                step_cpu=E(0.0), loader_cpu=E(0.001), storage_cpu=E(0.001), worker_cpu={1: E(0.015)},
                amdahl_s=E(0.0), amdahl_p1=E(1 / 0.015), eta=E(1.0))
    base.update(kw)
    return model.Inputs(**base)


def test_model_shared_cores_cpu_step():
    # a CPU step: 100 samples/s alone using one core (10 CPU-ms/sample). With 4 workers and data in memory:
    # workers 4 x 66.7 = 266.7/s, step 100/s, but the 2 cores must hold 1 + 15 + 10 = 26 CPU-ms/sample:
    # 2 / 0.026 = 76.9/s, below every separate rate (min(prep, step) would say 100)
    inp = _inputs(step_cpu=model.Est.exact(0.010), step_kind="cpu")
    p = model.predict(inp, 1.0, 4)
    assert p["bound"] == "cpu" and p["throughput"] == pytest.approx(2 / 0.026)
    assert p["bounds"]["step"] == 100 and p["bounds"]["workers"] == pytest.approx(4 / 0.015)
    # cold: a read from storage costs 1 CPU-ms more, and storage gives 100/s: fetch-bound at 100? no: the
    # cores give 2 / 0.027 = 74.1 < 100, so the cores still bound
    p = model.predict(inp, 0.0, 4)
    assert p["bound"] == "cpu" and p["throughput"] == pytest.approx(2 / 0.027)


def test_model_accelerator_step():
    # the same step on an accelerator (no host CPU): the step binds at 100/s (cores: 2 / 0.016 = 125/s)
    p = model.predict(_inputs(), 1.0, 4)
    assert p["bound"] == "step" and p["throughput"] == 100
    # a faster accelerator: now the cores bind, at 2 / 0.016
    p = model.predict(_inputs(ingest=model.Est.exact(500.0)), 1.0, 4)
    assert p["bound"] == "cpu" and p["throughput"] == pytest.approx(125.0)


def test_model_one_worker_and_a_step_on_every_core_take_turns():
    # a CPU step whose intra-op threads keep both cores busy: 100 samples/s alone (10 ms a sample of wall
    # time) using 20 CPU-ms a sample (2 cores).  One worker preps 66.7/s alone (15 ms a sample).  The core
    # sum says 2 / (1 + 15 + 20 ms) = 55.6/s, but the step leaves no core free while it runs: prep done
    # during the step delays the step by as much (its threads wait for the slowest), and while the training
    # thread waits for the next batch only the one worker runs (one core idle).  So per sample 10 ms of step
    # + 15 ms of prep: 40/s (the independent validation measured 466/s here where the core sum said 620)
    inp = _inputs(step_cpu=model.Est.exact(0.020), step_kind="cpu")
    p = model.predict(inp, 1.0, 1)
    assert p["bound"] == "turns" and p["throughput"] == pytest.approx(1 / (0.010 + 0.015))
    assert p["bounds"]["cpu"] == pytest.approx(2 / 0.036) and p["bounds"]["workers"] == pytest.approx(1 / 0.015)
    # two workers on the two cores: the turns are the core sum again (10 ms of step + 16 ms of the cores'
    # prep and loader work spread over 2 cores = 18 ms)
    p = model.predict(inp, 1.0, 2)
    assert p["throughput"] == pytest.approx(2 / 0.036) and p["bounds"]["turns"] == pytest.approx(1 / 0.018)
    # a step on one thread (10 CPU-ms a sample: 1 core) leaves the other core to the worker: no turns,
    # the worker binds
    p = model.predict(_inputs(step_cpu=model.Est.exact(0.010), step_kind="cpu"), 1.0, 1)
    assert p["bound"] == "workers" and "turns" not in p["bounds"]
    # an accelerator step (no CPU): prep runs during the step, no turns either
    assert "turns" not in model.predict(_inputs(), 1.0, 1)["bounds"]
    # without prep (the verdict's "prep removed") there is nothing to take turns with
    assert "turns" not in model.predict(inp, 1.0, 1, no_prep=True)["bounds"]
    # half a core free (1.5 cores of step): the worker preps 0.5 x 10 ms = 5 ms of its 15 during the step,
    # the other 10 ms while the training thread waits: 10 + 10 = 20 ms a sample
    p = model.predict(_inputs(step_cpu=model.Est.exact(0.015), step_kind="cpu"), 1.0, 1)
    assert p["bound"] == "turns" and p["throughput"] == pytest.approx(1 / 0.020)


def test_model_error_widens_the_interval_beyond_the_inputs_spread():
    # the step binds at 100 [90, 110] from its inputs; a stated model error of 10% (relative to the
    # measurement) widens that to [90 / 1.1, 110 / 0.9]; the inputs-only interval is kept beside it
    E = model.Est
    inp = _inputs(ingest=E(100.0, 90.0, 110.0), model_error=E(0.10, 0.10, 0.10, "modelled: stated"))
    p = model.predict(inp, 1.0, 4)
    assert (p["throughput"], p["lo_inputs"], p["hi_inputs"]) == (100, 90, 110)
    assert p["lo"] == pytest.approx(90 / 1.1) and p["hi"] == pytest.approx(110 / 0.9)
    # so a measurement m holds |predicted / m - 1| <= 10% exactly when it lies inside [100/1.1, 100/0.9]
    q = model.predict(_inputs(model_error=E(0.10, 0.10, 0.10, "modelled: stated")), 1.0, 4)
    assert (q["lo"], q["hi"]) == (pytest.approx(100 / 1.1), pytest.approx(100 / 0.9))
    rows = model.what_if_cache(inp, 4, [0.0, 1.0])
    assert rows[1]["lo"] == pytest.approx(90 / 1.1) and rows[1]["lo_inputs"] == 90


def test_model_training_thread_takes_batches_between_steps():
    # the step (1/500 s a sample) and taking batches (0.5 CPU-ms a sample) share the training thread:
    # 1 / (0.002 + 0.0005) = 400/s, not 500
    inp = _inputs(ingest=model.Est.exact(500.0), consumer_cpu=model.Est(0.0005, 0.0004, 0.0006, "measured"),
                  loader_cpu=model.Est.exact(0.0), cores=16)
    p = model.predict(inp, 1.0, 16)  # 16 workers on 16 cores: 1067/s, the cores 16 / 0.015
    assert p["bound"] == "step" and p["throughput"] == pytest.approx(400.0)
    assert p["lo"] == pytest.approx(1 / 0.0026) and p["hi"] == pytest.approx(1 / 0.0024)


def test_model_fetch_bound_and_prep_bound():
    fast = _inputs(ingest=model.Est.exact(1e6))
    # 2 workers, nothing cached: storage gives 100/s; workers 133/s; cores 2 / 0.017 = 117.6/s
    p = model.predict(fast, 0.0, 2)
    assert p["bound"] == "fetch" and p["throughput"] == pytest.approx(100.0)
    # half cached: fetch 1000/5.05 = 198/s; workers 133.3/s; cores 2 / 0.0165 = 121.2/s -> the cores
    p = model.predict(fast, 0.5, 2)
    assert p["bound"] == "cpu" and p["throughput"] == pytest.approx(2 / 0.0165)
    # one worker, all cached: the worker binds (66.7/s)
    p = model.predict(fast, 1.0, 1)
    assert p["bound"] == "workers" and p["throughput"] == pytest.approx(1 / 0.015)
    # the fetch rate is not held fixed across worker counts: at 40% cached, fetch I/O gives 1000/3.04 = 329/s,
    # but the loader's CPU for reads from storage competes with the workers' prep
    rows = model.what_if_workers(fast, 0.4, [1, 2, 4])
    assert [r["bound"] for r in rows] == ["workers", "cpu", "cpu"]
    assert rows[2]["throughput"] == pytest.approx(2 / (0.001 + 0.6 * 0.001 + 0.015))


def test_interval_arithmetic():
    E = model.Est
    inp = _inputs(ingest=E(100.0, 90.0, 110.0), loader_cpu=E(0.001, 0.0005, 0.002))
    p = model.predict(inp, 1.0, 4)
    assert (p["throughput"], p["lo"], p["hi"], p["bound"]) == (100, 90, 110, "step")
    # the cores bind at the pessimistic end: loader 2 ms -> 2 / 0.017 = 117.6 > 90: still the step's 90
    inp = _inputs(ingest=E(200.0, 150.0, 250.0), loader_cpu=E(0.001, 0.0005, 0.002), eta=E(1.0, 0.8, 1.0))
    p = model.predict(inp, 1.0, 4)
    assert p["throughput"] == pytest.approx(125.0) and p["bound"] == "cpu"
    assert p["lo"] == pytest.approx(0.8 * 2 / 0.017)   # every input at its pessimistic end
    assert p["hi"] == pytest.approx(2 / 0.0155)        # every input at its optimistic end
    # measured rates: median and range; one pass: batch means +- 2 standard errors
    e = model.est_from_samples([120.0, 100.0, 90.0], "measured: x")
    assert (e.value, e.lo, e.hi) == (100.0, 90.0, 120.0)
    e = model.est_from_samples([100.0], "measured: x", within=[90.0, 110.0, 100.0, 100.0])
    se = statistics.stdev([90.0, 110.0, 100.0, 100.0]) / 2 / 100
    assert e.lo == pytest.approx(100 * (1 - 2 * se)) and e.hi == pytest.approx(100 * (1 + 2 * se))
    with pytest.raises(ValueError, match="lo <= value <= hi"):
        E(1.0, 2.0, 3.0)


def test_amdahl_fit_can_say_more_workers_help_with_uncertainty():
    # P(w) = 100 w / (1 + 0.2 (w - 1)), three repeats per count, +-5%
    runs = {w: [model.amdahl(100, 0.2, w) * f for f in (0.95, 1.0, 1.05)] for w in (1, 2, 3)}
    fit = model.fit_amdahl(runs)
    assert fit["s"].value == pytest.approx(0.2, abs=0.01) and fit["p1"].value == pytest.approx(100, rel=0.01)
    assert fit["s"].lo < 0.2 < fit["s"].hi and fit["s"].hi - fit["s"].lo < 0.6   # uncertainty shown, bounded
    inp = _inputs(ingest=model.Est.exact(1e6), cores=16, amdahl_s=fit["s"], amdahl_p1=fit["p1"],
                  amdahl_draws=fit["draws"], worker_cpu={1: model.Est.exact(0.001)})
    rows = model.what_if_workers(inp, 1.0, [1, 2, 3, 4, 6])
    ws = [r["throughput"] for r in rows]
    assert ws == sorted(ws) and ws[-1] > 1.3 * ws[2]   # more workers help, beyond the measured counts (300 vs 214)
    assert all(r["lo"] <= r["throughput"] <= r["hi"] for r in rows) and rows[-1]["hi"] > rows[-1]["lo"]
    # points the cores limit do not read as serial work: linear up to 2, capped at 2 cores' worth
    capped = model.fit_amdahl({1: [100.0], 2: [198.0], 3: [200.0]}, cap={1: 200.0, 2: 200.0, 3: 200.0})
    assert capped["s"].value < 0.05
    uncapped = model.fit_amdahl({1: [100.0], 2: [198.0], 3: [200.0]})
    assert uncapped["s"].value >= 0.2
    # one count: s unknown, said so
    one = model.fit_amdahl({2: [150.0]})
    assert (one["s"].lo, one["s"].hi) == (0.0, 1.0) and "unknown" in one["s"].source


def test_verdict_names_the_stall_whose_removal_helps_most():
    def P(t, bound="x"):
        return {"throughput": t, "bound": bound}
    v = model.verdict(P(100), no_fetch=P(180), no_prep=P(120))
    assert v["largest"] == "fetch" and v["speedup_without_fetch"] == pytest.approx(1.8)
    assert v["fetch_stall"] == pytest.approx(1 - 100 / 180) and v["prep_stall"] == pytest.approx(1 - 100 / 120)
    assert model.verdict(P(100), P(110), P(150))["largest"] == "prep"
    assert model.verdict(P(100), P(102), P(101))["largest"] is None
    # on the model: a CPU step sharing the cores, all in memory -> prep is the stall (removing fetch gains
    # nothing, removing prep frees 15 of 26 CPU-ms) -- the case where the old verdict said "fetch"
    inp = _inputs(step_cpu=model.Est.exact(0.010), storage_bw=model.Est.exact(1e10))
    now = model.predict(inp, 0.0, 4)
    v = model.verdict(now, model.predict(inp, 0.0, 4, no_fetch=True), model.predict(inp, 0.0, 4, no_prep=True))
    assert v["largest"] == "prep"
    # slow storage, accelerator step: fetch
    inp = _inputs(storage_bw=model.Est.exact(2e7))
    now = model.predict(inp, 0.0, 4)
    v = model.verdict(now, model.predict(inp, 0.0, 4, no_fetch=True), model.predict(inp, 0.0, 4, no_prep=True))
    assert v["largest"] == "fetch" and now["bound"] == "fetch"


def test_no_verdict_past_a_model_error_it_cannot_stand_behind():
    """A busy machine: the model missed its own check passes by 84.5% and
    the measured stalls were 0.0%; the report named a stall all the same."""
    from coordl.analyze import MODEL_ERROR_VERDICT
    from coordl.analyze.report import verdict_text

    def P(t, bound="x"):
        return {"throughput": t, "bound": bound}
    quiet = {"fetch": 0.0, "prep": 0.0, "total": 0.0, "noise": 0.0}
    v = model.verdict(P(100), P(110), P(150), model_error=0.845, measured=quiet)
    assert v["largest"] is None and v["conclusive"] is False
    assert "84%" in v["why"] and f"{MODEL_ERROR_VERDICT:.0%}" in v["why"], v["why"]
    text = verdict_text(v, quiet)
    assert text.startswith("verdict: cannot conclude") and "84%" in text and "largest stall" not in text, text
    # within the error it stands behind, but the measured stalls say no stall: no verdict either
    v = model.verdict(P(100), P(110), P(150), model_error=0.10, measured=quiet)
    assert v["largest"] is None and v["conclusive"] is False
    assert "prep" in v["why"] and "measured" in v["why"], v["why"]
    # the measured stalls say fetch, the model prep: the verdict does not take sides
    v = model.verdict(P(100), P(110), P(150), model_error=0.10,
                      measured={"fetch": 0.4, "prep": 0.1, "total": 0.5, "noise": 0.0})
    assert v["largest"] is None and v["conclusive"] is False
    # agreement: the verdict stands
    v = model.verdict(P(100), P(110), P(150), model_error=0.10,
                      measured={"fetch": 0.05, "prep": 0.3, "total": 0.35, "noise": 0.0})
    assert v["largest"] == "prep" and v["conclusive"] is True
    assert verdict_text(v, {"fetch": 0.05, "prep": 0.3}).startswith("verdict: the largest stall is prep (CPU)")


def test_step_kind_in_words():
    from coordl.analyze.report import step_words

    assert step_words("cpu") == "a CPU step" and step_words("accelerator") == "an accelerator step"


def test_model_error_comes_from_the_held_out_passes_with_a_floor():
    from coordl import analyze as A

    # the analyzer's own cold and cached loader + step passes are predicted, not fitted: the model says 100/s
    # cold (fetch) and 100/s cached (the step) at 4 workers
    inp = _inputs()
    assert model.predict(inp, 0.0, 4)["throughput"] == pytest.approx(100.0)
    assert model.predict(inp, 1.0, 4)["throughput"] == pytest.approx(100.0)
    # measured within 10%: the floor (run-to-run drift of the inputs) is the model error
    e, held = A._model_error(inp, {"cold": {"rate": 104.0}, "cached": {"rate": 97.0}}, 4, None)
    assert e.value == A.MODEL_ERROR_FLOOR == 0.10 and e.source.startswith("modelled")
    assert held == {"cold": pytest.approx(100 / 104 - 1), "cached": pytest.approx(100 / 97 - 1)}
    # the model missed its own check by 25%: every interval carries that
    e, _ = A._model_error(inp, {"cold": {"rate": 80.0}, "cached": {"rate": 97.0}}, 4, None)
    assert e.value == pytest.approx(0.25)
    inp.model_error = e
    p = model.predict(inp, 1.0, 4)
    assert p["lo"] == pytest.approx(100 / 1.25) and p["hi"] == pytest.approx(100 / 0.75)
    # a figure given by the user wins, and is said to be given
    e, _ = A._model_error(inp, {"cold": {"rate": 80.0}, "cached": {"rate": 97.0}}, 4, 0.05)
    assert e.value == 0.05 and e.source.startswith("given")


def test_model_turns_use_the_measured_step_cores():
    # on a busy machine a two-thread step waits for a core, so CPU-seconds per sample x its rate says 1.2
    # cores; the cores it keeps busy while running (measured without the run-queue wait) say 2: turns
    inp = _inputs(step_cpu=model.Est.exact(0.012), step_kind="cpu")
    # 0.012 x 100 = 1.2 cores: 0.8 free, the worker preps 0.8 x 10 ms during the step: 10 + 7 ms a sample
    assert model.predict(inp, 1.0, 1)["throughput"] == pytest.approx(1 / 0.017)
    inp.step_cores = model.Est(2.0, 1.9, 2.0, "measured")
    p = model.predict(inp, 1.0, 1)
    assert p["bound"] == "turns" and p["throughput"] == pytest.approx(1 / (0.010 + 0.015))
    # the interval's optimistic end has 0.1 core free: the worker preps 0.1 x 10 ms during the step
    assert p["hi_inputs"] == pytest.approx(1 / (0.010 + (1 - 0.1 * 0.010 / 0.015) * 0.015))


def test_inputs_round_trip_through_json():
    fit = model.fit_amdahl({1: [100.0, 98.0], 2: [180.0, 185.0]})
    inp = _inputs(amdahl_s=fit["s"], amdahl_p1=fit["p1"], amdahl_draws=fit["draws"], step_kind="cpu",
                  step_cpu=model.Est.exact(0.02), step_cores=model.Est(1.9, 1.8, 2.0, "measured"),
                  model_error=model.Est.exact(0.12, "given"))
    back = model.inputs_from_dict(json.loads(json.dumps(inp.as_dict())))
    for x, w in ((0.0, 1), (0.5, 3), (1.0, 8)):
        assert model.predict(back, x, w) == model.predict(inp, x, w)


@pytest.mark.parametrize("call, msg", [
    (lambda: model.fetch_rate(10, 100, 1.5, 1, 1), "cached_fraction should be in [0, 1], but got cached_fraction=1.5"),
    (lambda: model.stalls(0, 1, 1), "ingest should be a positive number, but got ingest=0"),
    (lambda: model.bounds(_inputs(), 0.5, -1), "workers should be >= 0, but got workers=-1"),
    (lambda: model.fit_amdahl({0: [1.0]}), "prep_runs should map worker counts >= 1"),
])
def test_model_argument_errors(call, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_step_kind_is_measured_from_cpu_seconds_per_wall_second():
    from coordl.analyze.measure import ingest_rate
    import torch

    batch = torch.zeros(4, 2)

    def sleeps(b):
        time.sleep(0.01)

    def computes(b):
        t = time.thread_time()
        while time.thread_time() - t < 0.01:
            pass
    s = ingest_rate(sleeps, batch, seconds=0.3)
    c = ingest_rate(computes, batch, seconds=0.3)
    assert s["cpu_share"] < 0.5 < c["cpu_share"], (s, c)
    assert len(s["rates"]) == 3 and s["synchronized"] is False  # no CUDA here: nothing to synchronize


def test_analyze_argument_errors():
    from coordl.analyze import analyze

    with pytest.raises(ValueError, match="give exactly one of step .* and rate"):
        analyze("/nonexistent", rate=None, step=None, log=None)
    with pytest.raises(ValueError, match="give exactly one of root"):
        analyze(None, rate=10, log=None)
    with pytest.raises(ValueError, match="cache should be"):
        analyze("/x", rate=10, cache="disk", log=None)
    with pytest.raises(ValueError, match=r"model_error should be a number in \[0, 0.9\)"):
        analyze("/x", rate=10, model_error=1.5, log=None)


def test_cli_argument_errors_exit_2_with_the_reason(capsys):
    from coordl.cli import main

    assert main(["analyze", "--rate", "10"]) == 2
    assert "give exactly one of root" in capsys.readouterr().err
    assert main(["analyze", "/x", "--rate", "10", "--scaling-workers", "one"]) == 2
    assert "--scaling-workers should be worker counts like 1,2, but got --scaling-workers='one'" in \
        capsys.readouterr().err
    assert main(["analyze", "/nonexistent-dir", "--rate", "10", "--evict", "fadvise"]) == 2
    assert "/nonexistent-dir" in capsys.readouterr().err


# ------------------------------------------------------- stall attribution
def _analyze_in_child(spec: str, **kw) -> dict:
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {HERE!r})
        from coordl.analyze import analyze
        r = analyze(dataset={spec!r}, batch_size=4, workers=1, scaling_workers=(1,), fetch_threads=1,
                    evict="fadvise", log=None, ingest_seconds=0.5, repeats=2, {args})
        print("REPORT", json.dumps(r, default=str))
    """)
    res = run_in_child(code, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(l for l in res.stdout.splitlines() if l.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


def test_slow_fetch_is_attributed_to_fetch():
    # raw() 20 ms, prep() 1 ms, one fetch thread, no model bound
    r = _analyze_in_child("_analyze_helpers:slow_fetch", rate=1e6)
    st = r["stalls"]
    assert st["fetch"] > st["prep"], st
    assert st["fetch"] > 0.5, st
    # cached is several times faster than cold (fetch cost 20x prep cost)
    assert r["rates"]["cached"] > 2 * r["rates"]["cold"], r["rates"]
    # storage bandwidth ~ 4096 B / 20 ms; sleep is a floor on the read time
    ratio = r["bandwidth"]["storage"] / (4096 / 0.020)
    assert 0.3 < ratio < 1.1, ratio
    # the model's cold prediction (fetch-bound) is within a factor 2 of the measurement
    assert 0.5 < r["check"]["cold_predicted"] / r["check"]["cold_measured"] < 2, r["check"]
    assert r["what_if"]["cache"][0]["bound"] == "fetch"
    assert r["what_if"]["cache"][-1]["bound"] != "fetch"
    assert r["verdict"]["largest"] == "fetch", r["verdict"]
    # every prediction carries its interval
    assert all(row["lo"] <= row["throughput"] <= row["hi"] for row in r["what_if"]["cache"])


def test_slow_prep_is_attributed_to_prep():
    # raw() 1 ms, prep() 20 ms: the cache does not help, more CPU would
    r = _analyze_in_child("_analyze_helpers:slow_prep", rate=1e6)
    st = r["stalls"]
    assert st["prep"] > st["fetch"], st
    assert st["prep"] > 0.5, st
    ratio = r["rates"]["prep"]["1"] * 0.020
    assert 0.3 < ratio < 1.1, ratio
    assert all(row["bound"] in ("workers", "cpu") for row in r["what_if"]["cache"]), r["what_if"]["cache"]
    # the verdict agrees with the table: removing prep helps most
    assert r["verdict"]["largest"] == "prep", r["verdict"]
    # with a GPU, the report says to decode there (this dataset has no transform: it says why not)
    import torch

    from coordl.analyze import format_report, recommend

    assert r["recommendations"] == recommend(r["verdict"], None, gpu=torch.cuda.is_available())
    [rec] = recommend(r["verdict"], None, gpu=True)
    assert not rec["applies"] and "has no transform" in rec["why"]
    text = format_report({**r, "recommendations": [rec]})
    assert "not applicable: decode='device': prep (decode and augmentation on the CPU) is the largest" in text


def test_a_prep_stall_with_a_gpu_recommends_decoding_on_it(tmp_path, monkeypatch):
    import torch

    import coordl
    from coordl import transforms as T
    from coordl.analyze import format_report, recommend
    from coordl.analyze.measure import Subset, make_transform
    from coordl.synth import make_image_folder

    root = make_image_folder(str(tmp_path / "d"), num_images=4, num_classes=2, image_size=(40, 30))
    ds = Subset(coordl.ImageFolder(root, transform=make_transform("rrc224")), 2)   # as the analyzer reads it
    prep = {"largest": "prep"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    [rec] = recommend(prep, ds)
    assert rec["applies"] and rec["option"] == "decode='device'"
    assert "device='cuda', decode='device'" in rec["why"] and "RandomResizedCrop + RandomHorizontalFlip" in rec["why"]
    assert recommend({"largest": "fetch"}, ds) == [] and recommend({"largest": None}, ds) == []
    ds.dataset.transform = T.Compose([T.RandomResizedCrop(8), lambda x: x, T.ToTensor()])
    [rec] = recommend(prep, ds)
    assert not rec["applies"] and "step 1 is <function" in rec["why"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert recommend(prep, ds) == []


def test_step_from_a_script_sets_the_ingestion_rate(tmp_path):
    # a step given as file.py:fn, 5 ms per batch of 4 -> at most 800 samples/s
    script = tmp_path / "mystep.py"
    script.write_text("import time\ndef step(batch):\n    time.sleep(0.005)\n")
    r = _analyze_in_child("_analyze_helpers:slow_fetch", step=f"{script}:step")
    g = r["rates"]["ingest"]
    assert 0.3 < g / 800 < 1.05, g
    assert r["rates"]["ingest_source"].startswith("measured")
    assert r["settings"]["step_kind"] == "accelerator"  # it sleeps: no CPU


def test_an_accelerator_step_is_timed_with_the_device_synchronized(monkeypatch):
    # no GPU here: stand in for CUDA's API and count the synchronizes -- the step returns at once (as a
    # kernel launch does) and the device "finishes" in synchronize(), 10 ms a batch of 4
    import torch
    from coordl.analyze import measure as M

    calls = {"step": 0, "sync": 0}

    def step(b):
        calls["step"] += 1

    def sync():
        calls["sync"] += 1
        time.sleep(0.01)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    r = M.ingest_rate(step, torch.zeros(4, 2), seconds=0.15)
    assert r["synchronized"] and calls["sync"] == calls["step"]  # after every call, the warm-up's too
    assert r["rate"] < 4 / 0.01 * 1.05, r   # the device's time, not the launch's
    assert r["cpu_share"] < 0.5             # and an accelerator step
    wrapped = M.SyncStep(step, sync)
    wrapped(None)
    assert calls["sync"] == calls["step"]


def test_a_cpu_step_is_detected_and_charged_to_the_shared_cores():
    r = _analyze_in_child("_analyze_helpers:quick", step="_analyze_helpers:busy_step")
    inp = r["model"]["inputs"]
    assert r["settings"]["step_kind"] == "cpu" and inp["step_kind"] == "cpu", r["passes"]["ingest"]
    # 4 CPU-ms a batch of 4: about 1 CPU-ms a sample (the busy loop overshoots a little)
    assert 0.0008 < inp["step_cpu"]["value"] < 0.003, inp["step_cpu"]
    assert "step_cpu" in r["model"]["measured"]
    # the cores bound counts the step's CPU with the loader's and the workers'
    from coordl.analyze import predict
    p = predict(r, 1.0, 1)
    demand = inp["loader_cpu"]["value"] + inp["worker_cpu"]["1"]["value"] + inp["step_cpu"]["value"]
    assert p["bounds"]["cpu"] == pytest.approx(inp["eta"]["value"] * inp["cores"] / demand)


def test_measure_prep_runs_the_analyzers_prep_pass_alone():
    # raw() 1 ms, prep() 20 ms: one worker preps at most 50 samples/s (the sleep is a floor), and
    # the passes read the node cache the fill pass filled, never storage
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {HERE!r})
        from coordl.analyze import measure_prep
        r = measure_prep(dataset="_analyze_helpers:slow_prep", batch_size=4, workers=[1], fetch_threads=1,
                         repeats=2, log=None)
        print("REPORT", json.dumps(r, default=str))
    """)
    res = run_in_child(code, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.loads(next(l for l in res.stdout.splitlines() if l.startswith("REPORT "))[len("REPORT "):])
    assert set(r["prep"]) == {"1"} and set(r["passes"]) == {"fill", "prep_1w"}
    assert r["settings"]["cache"] == "node" and r["dataset"]["samples"] == 64
    p = r["passes"]["prep_1w"]
    assert len(p["rates"]) == 2 and p["rate"] == pytest.approx(sum(p["rates"]) / 2) == r["prep"]["1"]
    assert 0 < p["rate"] < 50 * 1.1, p
    assert p["samples"] == 64 and p["bytes_storage"] == 0 and p["samples_from_cache"] == 64, p
    assert r["passes"]["fill"]["bytes_storage"] > 0


@pytest.mark.parametrize("kw, msg", [
    ({"workers": 2}, "workers should be a list of worker counts (each >= 1), but got workers=2"),
    ({"workers": [1, 0]}, "workers[i] should be a positive int, but got workers[i]=0"),
    ({"workers": [1], "cache": "disk"}, 'cache should be "auto", "node" or "page", but got cache=\'disk\''),
    ({"workers": [1], "repeats": 0}, "repeats should be a positive int, but got repeats=0"),
])
def test_measure_prep_argument_errors(kw, msg):
    from coordl.analyze import measure_prep

    with pytest.raises(ValueError) as e:
        measure_prep("/nonexistent", log=None, **kw)
    assert msg in str(e.value)


# ------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from coordl.synth import make_image_folder

    return make_image_folder(tmp_path_factory.mktemp("an") / "data", num_images=64, num_classes=4,
                             image_size=(64, 48))


EXPECTED_KEYS = {"version", "dataset", "settings", "eviction", "rates", "bandwidth", "stalls", "what_if",
                 "check", "passes", "seconds", "warnings", "plot", "plot_skipped", "model", "verdict"}


def test_cli_end_to_end(tiny_folder, tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = (f"import sys; from coordl.cli import main; sys.exit(main(['analyze', {tiny_folder!r}, '--rate', '1e6', "
            f"'--batch-size', '8', '--workers', '1', '--evict', 'fadvise', '--max-samples', '48', "
            f"'--repeats', '2', '--json', {str(out_json)!r}, '--plot', {str(out_png)!r}]))")
    r = run_in_child(code, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out_json.read_text())
    assert EXPECTED_KEYS <= set(rep), set(rep) ^ EXPECTED_KEYS
    assert rep["dataset"]["samples"] == 48 and rep["dataset"]["files"] == 48
    assert rep["eviction"] == {"cold_fetch_pass": "fadvise", "cold_pass": "fadvise"}
    assert [row["cached_fraction"] for row in rep["what_if"]["cache"]] == [i / 10 for i in range(11)]
    assert {"1", "2", "3"} <= set(rep["rates"]["prep"])     # three worker counts by default
    # every model input says whether it was measured or modelled, and carries an interval
    inputs = rep["model"]["inputs"]
    assert set(rep["model"]["measured"]) | set(rep["model"]["modelled"]) >= {"storage_bw", "cache_bw", "ingest",
                                                                             "loader_cpu", "amdahl_s", "eta"}
    assert "amdahl_s" in rep["model"]["modelled"] and "loader_cpu" in rep["model"]["measured"]
    for k in rep["model"]["measured"] + rep["model"]["modelled"]:
        assert inputs[k]["lo"] <= inputs[k]["value"] <= inputs[k]["hi"], (k, inputs[k])
    assert inputs["step_kind"] == "accelerator" and rep["settings"]["step_kind"] == "accelerator"
    # the workers' prep CPU was counted (their processes are children of the analyzer)
    assert all(v["value"] > 0 for v in inputs["worker_cpu"].values()), inputs["worker_cpu"]
    # the verdict is the what-if's: the stall whose removal it says helps most
    v = rep["verdict"]
    if v["largest"] is not None:
        assert v["speedup_without_" + v["largest"]] == max(v["speedup_without_fetch"], v["speedup_without_prep"])
    row100 = rep["what_if"]["cache"][-1]
    assert row100["throughput"] == pytest.approx(rep["check"]["cached_predicted"])
    assert v["speedup_without_fetch"] == pytest.approx(row100["throughput"] / rep["check"]["cold_predicted"])
    # the public predict() gives the report's model at points it did not measure, with an interval
    from coordl.analyze import predict
    p = predict(rep, 0.35, 5)
    assert p["lo"] <= p["throughput"] <= p["hi"] and p["bound"] in ("step", "fetch", "workers", "cpu", "turns")
    # intervals carry the model's own error beside the inputs' spread, stated and sourced
    me = inputs["model_error"]
    assert me["value"] >= 0.10 and "model_error" in rep["model"]["modelled"], me
    assert p["lo"] == pytest.approx(p["lo_inputs"] / (1 + me["value"]))
    assert set(rep["check"]["held_out_errors"]) == {"cold", "cached"}
    from coordl.analyze import MODEL_ERROR_CAP
    worst = max(abs(v) for v in rep["check"]["held_out_errors"].values())
    assert me["value"] >= min(worst, MODEL_ERROR_CAP) - 1e-12
    assert ("capped" in me["source"]) == (worst > MODEL_ERROR_CAP), me
    assert "model error" in r.stdout and "step_cores" in inputs
    # --repeats 2: every in-memory pass ran twice and the median (of two: the mean) is the rate
    for name in ("fetch_warm", "prep_1w", "prep_2w", "prep_3w", "cached"):
        rates = rep["passes"][name]["rates"]
        assert len(rates) == 2 and rep["passes"][name]["rate"] == pytest.approx(sum(rates) / 2)
    assert rep["passes"]["cold"]["bytes_storage"] > 0     # the cold pass read from storage
    assert rep["passes"]["cached"]["bytes_storage"] == 0  # the cached pass did not (node cache)
    for k in ("fetch", "prep", "total"):
        assert 0 <= rep["stalls"][k] <= 1 and math.isfinite(rep["stalls"][k])
    assert "fetch" in r.stdout and "what if: cached fraction" in r.stdout and "verdict:" in r.stdout
    assert "model inputs (value [interval]; where from)" in r.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot: skipped: matplotlib is not installed" in r.stdout
        assert rep["plot"] is None
    else:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert rep["plot"] == str(out_png)


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    from coordl.analyze import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    why = write_plot({}, tmp_path / "x.png")
    assert why is not None and "matplotlib is not installed" in why
    assert not (tmp_path / "x.png").exists()


def test_evict_fadvise_drops_the_files_pages(tmp_path):
    from coordl.analyze.measure import evict

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    os.sync()  # fadvise drops clean pages only
    with open(path, "rb") as f:
        f.read()
    before = _resident_pages(str(path))
    if before == 0:
        pytest.skip("the file system keeps no page cache for this file")
    assert evict([str(path)], "fadvise") == "fadvise"
    after = _resident_pages(str(path))
    assert after < before, (before, after)


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache (libc mincore on a read-only mapping)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    page = os.sysconf("SC_PAGE_SIZE")
    vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            pytest.skip(f"mmap failed: errno {ctypes.get_errno()}")
        try:
            if libc.mincore(addr, size, vec) != 0:
                pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def test_repeated_passes_report_the_median_not_the_fastest():
    """An in-memory pass repeated N times reports the median rate: the
    fastest of N over-predicted every prep-bound point of the validation."""
    from coordl import analyze as A

    class FakeM:
        rates = iter([300.0, 100.0, 200.0])

        def run_pass(self, loader, step, keep_batch=False):
            r = next(self.rates)
            return {"rate": r, "tag": r, **({"batch": "first"} if keep_batch else {})}

    got = A._typical(FakeM(), None, None, 3, keep_batch=True)
    assert got["rate"] == 200.0 and got["tag"] == 200.0  # the median's own pass, not the 300 one
    assert got["rates"] == [300.0, 100.0, 200.0]
    assert got["batch"] == "first"                        # the batch of the first pass is kept


def test_validation_pairs_the_dropped_points_so_each_step_keeps_both_fractions_and_counts():
    """benchmarks/analyze_validate.py --grid paired (the default): the slow dropped-page-cache points pair each
    cache fraction with one worker count, rotated between the steps; each step keeps two fractions and two
    counts, the two steps together cover every pair, warm points at every count."""
    import importlib.util

    path = os.path.join(os.path.dirname(HERE), "benchmarks", "analyze_validate.py")
    spec = importlib.util.spec_from_file_location("_anval_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pages, fr, ws = ["dropped", "warm"], [0.2, 0.5], [1, 4]
    sleep, cpu = mod._points(pages, fr, ws, 0, "paired"), mod._points(pages, fr, ws, 1, "paired")
    for pts in (sleep, cpu):
        dropped = [(x, w) for pg, x, w in pts if pg == "dropped"]
        assert {x for x, _ in dropped} == set(fr) and {w for _, w in dropped} == set(ws) and len(dropped) == 2
        assert [(x, w) for pg, x, w in pts if pg == "warm"] == [(1.0, 1), (1.0, 4)]
    both = {(x, w) for pg, x, w in sleep + cpu if pg == "dropped"}
    assert both == {(x, w) for x in fr for w in ws}
    full = mod._points(pages, fr, ws, 0, "full")
    assert len([p for p in full if p[0] == "dropped"]) == 4
    # one fraction, one count (the smoke test's size): one dropped point per step
    assert mod._points(pages, [0.5], [1], 1, "paired") == [("dropped", 0.5, 1), ("warm", 1.0, 1)]


def test_a_look_past_the_verdicts_error_is_measured_once_more():
    """A look whose model error is past MODEL_ERROR_VERDICT (a pass disturbed
    by other work on the machine) is followed by one second look; the report
    is the look with the smaller error and says so.  The first look's error
    is made large here by wrapping the real error computation."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {HERE!r})
        import coordl.analyze as A
        from coordl.analyze import model
        real, calls = A._model_error, []
        def first_disturbed(inp, passes, workers, given):
            e, held = real(inp, passes, workers, given)
            calls.append(e.value)
            if len(calls) == 1:
                return model.Est(0.6, 0.6, 0.6, "disturbed"), held
            return e, held
        A._model_error = first_disturbed
        kw = dict(dataset="_analyze_helpers:slow_fetch", batch_size=4, workers=1, scaling_workers=(1,),
                  fetch_threads=1, evict="fadvise", log=None, ingest_seconds=0.3, repeats=1, rate=1e6)
        r = A.analyze(**kw)
        given = A.analyze(model_error=0.5, **kw)
        print("REPORT", json.dumps({{"r": r, "given": given, "calls": calls}}, default=str))
    """)
    res = run_in_child(code, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(next(l for l in res.stdout.splitlines() if l.startswith("REPORT "))[len("REPORT "):])
    r, given = out["r"], out["given"]
    assert len(out["calls"]) == 3                                 # two looks, then one for the given error
    assert [lk["model_error"] for lk in r["looks"]][0] == 0.6 and len(r["looks"]) == 2
    best = min(r["looks"], key=lambda lk: lk["model_error"])     # the second, unless it was disturbed too
    assert r["check"]["model_error"] == best["model_error"] and r["verdict"]["largest"] == best["verdict"]
    assert any("measured once more" in w for w in r["warnings"]), r["warnings"]
    # an error the user gives is not second-guessed: one look (its verdict is inconclusive at 50%)
    assert len(given["looks"]) == 1 and given["check"]["model_error"] == 0.5
    assert given["verdict"]["conclusive"] is False

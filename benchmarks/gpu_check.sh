#!/usr/bin/env bash
# The prepared GPU check: run from a fresh checkout on a machine with a GPU
# (Python 3.12, a CUDA build of torch, torchvision, numpy, pillow, psutil,
# pytest, gcc, libjpeg headers; no package registry needed).  In under 9
# minutes it writes one report (all output, then the benchmark's JSON):
#
#   benchmarks/gpu_check.sh [REPORT]          # default gpu_report.txt
#   benchmarks/gpu_check.sh --stage           # only keep DALI_DIR's parts in DALI_STAGE
#
# The device tool replaces a carried folder at each call, so the DALI parts
# (one per call, each call carrying DALI_DIR/SHA256SUMS and one part) are
# moved out of the checkout by "--stage" into DALI_STAGE (default
# /tmp/coordl-dali-parts), which lasts as long as the machine; the check
# itself stages the parts it was carried with, then uses DALI_STAGE.
#
# 1. installs the wheels in WHEELS (default .whl/, made by
#    benchmarks/gpu_wheels.sh) into SITE (default /tmp/site);
# 2. when DALI_DIR (default .dali/) holds the parts gpu_wheels.sh --dali
#    made, all of them and each matching DALI_DIR/SHA256SUMS: joins them,
#    checks the whole tar's sha256, installs DALI and its requirements
#    into SITE (once per machine); missing parts are named and DALI is
#    skipped;
# 3. builds the crop extension in place;
# 4. prints nvidia-smi and the versions;
# 5. runs the CUDA test modules (CUDA_TESTS), going on when they fail;
# 6. measures decode="device" against the CPU path (device_decode_fidelity.py --device cuda),
#    then every JPEG decoder and backend at hand: images/s, CPU per image, pixels against the
#    CPU decodes (device_decoders.py, at most DECODERS_TIMEOUT s; JSON beside the report);
# 7. the decode stage's per-image cost in the main process (device_stage.py
#    --device cuda, 224x224: the geometry with the batch kernel and with one
#    launch per image; at most STAGE_TIMEOUT s);
# 8. with SCALING_TIMEOUT above 0 (default 0: it does not fit the 8
#    minutes beside the rest), compares fetch threads added on demand with a
#    fixed count at 15 workers on every core (worker_scaling.py, 1,500
#    synthetic JPEGs; part (a) of gpu.py splits the CPU by process anyway);
# 9. runs benchmarks/gpu.py (BENCH_ARGS) with what is left of TOTAL_LIMIT as
#    its --budget (a measurement that would not fit is skipped, saying so),
#    and step 6's decoders JSON (--decoders-json: coordl-decode-measured's
#    weights), its JSON beside the report (REPORT with .json) and appended to it.
#
# Exit status: 1 when a CUDA test failed or the tests did not run, 3 when
# only the benchmark failed, 0 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

DALI_DIR=${DALI_DIR:-.dali}
DALI_STAGE=${DALI_STAGE:-/tmp/coordl-dali-parts}

stage_dali() {  # DALI_DIR's parts and sums into DALI_STAGE (kept across calls on one machine)
  mkdir -p "$DALI_STAGE"
  if compgen -G "$DALI_DIR/*" > /dev/null; then
    cp -f "$DALI_DIR"/* "$DALI_STAGE"/
  fi
  DALI_DIR=$DALI_STAGE
}

if [ "${1:-}" = "--stage" ]; then
  stage_dali
  ls -l "$DALI_STAGE"
  exit 0
fi

REPORT=$(realpath -m "${1:-gpu_report.txt}")
JSON=${REPORT%.txt}.json
[ "$JSON" = "$REPORT" ] && JSON=$REPORT.json
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
CUDA_TESTS=${CUDA_TESTS:-"tests/test_cuda.py tests/test_device.py tests/test_device_split.py tests/test_pin.py tests/test_device_decode.py tests/test_device_batch_reads.py tests/test_device_decoder_split.py"}
# The CUDA modules took 115 s at -n 4 and 108 s at -n 8 on 16 vCPUs (the slowest tests bound
# them: --durations names them), before the hardware-first, hybrid and split decoders joined the
# decode tests (180 s leaves room); gpu.py takes what is left as its --budget.
PYTEST_ARGS=${PYTEST_ARGS:-"-n $(( $(nproc) >= 12 ? 8 : 4 )) --durations=12"}
TEST_TIMEOUT=${TEST_TIMEOUT:-180}
# The whole check stays under 9 minutes: the benchmark, last, gets what the
# steps before it left of TOTAL_LIMIT seconds (at most BENCH_TIMEOUT); its
# JSON is rewritten after every measurement, so a cut run keeps its figures.
# On an H200 with 16 vCPUs (DALI carried in): 17 s to the tests, 108 s of tests, 26 s of
# fidelity, then gpu.py: 13 s of data and facts, (a) 87 s at 2 s windows, (b) 66 s, (c) 134 s
# at 4 s windows (three loaders, each alone and then four jobs, every job a new process).
# device_decoders.py: 15 decoder variants (14 on a GPU), 1 and 2 threads, 1 s windows: 60 s for 13 on
# the third H200 run, so about 65 s.
TOTAL_LIMIT=${TOTAL_LIMIT:-525}
DECODERS_TIMEOUT=${DECODERS_TIMEOUT:-75}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-45}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-400}
# windows of 1.5 s (a), 4 s (b), 3 s (c): thousands of images each on a GPU
BENCH_ARGS=${BENCH_ARGS:---seconds 1.5 --train-seconds 4 --job-seconds 3}
SCALING_TIMEOUT=${SCALING_TIMEOUT:-0}
SCALING_WORKERS=${SCALING_WORKERS:-$(( $(nproc) > 2 ? $(nproc) - 1 : 2 ))}
export PYTHONUNBUFFERED=1

step() { printf '\n==== %s  (%(%H:%M:%S)T)\n' "$*" -1; }

nvidia_namespace() {
  # Some wheels (DALI's requirements, nvImageCodec) ship nvidia/__init__.py:
  # make SITE's nvidia package take in the nvidia/ folders of the other
  # sys.path entries (torch's CUDA libraries).
  [ -d "$SITE/nvidia" ] &&
    printf '__path__ = __import__("pkgutil").extend_path(__path__, __name__)\n' > "$SITE/nvidia/__init__.py"
  return 0
}

install_dali() {
  local sums=$DALI_DIR/SHA256SUMS work stamp
  if [ ! -f "$sums" ]; then
    if compgen -G "$DALI_DIR/dali-wheels.tar.part-*" > /dev/null; then
      echo "DALI: parts in $DALI_DIR but no $sums (carry it with each part): skipped"
    else
      echo "DALI: no parts in $DALI_DIR (benchmarks/gpu_wheels.sh --dali makes them): skipped"
    fi
    return 0
  fi
  stamp=$SITE/.dali-tar-sha256
  want=$(awk '$2 == "dali-wheels.tar" { print $1 }' "$sums")
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "DALI: already installed in $SITE from this tar (sha256 $want)"
    return 0
  fi
  local missing=() bad=() name sum
  while read -r sum name; do
    [ "$name" = "dali-wheels.tar" ] && continue
    if [ ! -f "$DALI_DIR/$name" ]; then
      missing+=("$name")
    elif [ "$(sha256sum < "$DALI_DIR/$name" | cut -d' ' -f1)" != "$sum" ]; then
      bad+=("$name")
    fi
  done < "$sums"
  if [ ${#missing[@]} -gt 0 ] || [ ${#bad[@]} -gt 0 ]; then
    echo "DALI: skipped: parts missing: ${missing[*]:-none}; parts whose sha256 differs from $sums: ${bad[*]:-none}" \
         "(carry each part in a call of its own, in a row on the same machine)"
    return 0
  fi
  work=$(mktemp -d)
  # shellcheck disable=SC2046
  cat $(awk '$2 != "dali-wheels.tar" { print "'"$DALI_DIR"'/" $2 }' "$sums" | sort) > "$work/dali-wheels.tar"
  if [ "$(sha256sum < "$work/dali-wheels.tar" | cut -d' ' -f1)" != "$want" ]; then
    echo "DALI: skipped: the joined tar's sha256 is not the recorded $want"
    rm -rf "$work"
    return 0
  fi
  mkdir -p "$work/wheels" && tar -C "$work/wheels" -xf "$work/dali-wheels.tar" && rm -f "$work/dali-wheels.tar"
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
       "$work"/wheels/*.whl; then
    nvidia_namespace
    echo "$want" > "$stamp"
    echo "DALI: installed $(ls "$work/wheels" | tr '\n' ' ')"
  else
    echo "DALI: pip install failed: skipped"
  fi
  rm -rf "$work"
}

main() {
  local t0=$SECONDS tests_rc=1 bench_rc=1
  step "coordl GPU check: $(pwd)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(uname -srm)  cpus: $(nproc)  report: $REPORT"
  git rev-parse HEAD 2>/dev/null | sed 's/^/commit: /'

  step "wheels ($WHEELS -> $SITE)"
  mkdir -p "$SITE"
  if compgen -G "$WHEELS/*.whl" > /dev/null; then
    ls -l "$WHEELS"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl || echo "pip install of $WHEELS failed"
    nvidia_namespace
  else
    echo "no wheels in $WHEELS (benchmarks/gpu_wheels.sh makes them); simplejpeg must be installed already"
  fi
  export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

  stage_dali
  step "DALI ($DALI_DIR)"
  install_dali
  for d in "$SITE"/nvidia/cu13/lib "$SITE"/nvidia/libnvcomp/lib64 "$SITE"/nvidia/nvimgcodec; do
    [ -d "$d" ] && export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done

  step "build the extensions"
  python3 setup.py build_ext --inplace -q 2>&1 | tail -20 || true
  ls coordl/decode/_jpegcrop*.so 2>/dev/null || echo "the crop extension did not build"
  python3 - <<'PY' || true
from coordl import transforms as T
from coordl.pipeline.device_batches import native_draws
from coordl.device.encoded import plan_for
plan = plan_for(T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()]))
print("decode='device' draws:", "the _draws extension (agrees with this Python)" if native_draws(plan) else "Python's")
PY

  step "machine and versions"
  nvidia-smi || echo "nvidia-smi failed"
  python3 - <<'PY'
import importlib.metadata as md, os, platform, sys
print("python", platform.python_version(), sys.executable)
for n in ("torch", "torchvision", "numpy", "pillow", "psutil", "simplejpeg", "pytest", "pytest-xdist",
          "pytest-timeout", "nvidia-dali-cuda130", "nvidia-nvimgcodec-cu13", "nvidia-nvjpeg", "triton"):
    try:
        print(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        print(f"{n} not installed")
import torch
print("cuda available:", torch.cuda.is_available(), "| torch cuda", torch.version.cuda,
      "| device:", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
import coordl
print("coordl", coordl.__version__, "from", os.path.dirname(coordl.__file__))
try:
    import nvidia.dali
    print("nvidia.dali", nvidia.dali.__version__, "imports")
except Exception as e:
    print("nvidia.dali does not import:", type(e).__name__, e)
try:
    from nvidia import nvimgcodec
    print("nvidia.nvimgcodec", getattr(nvimgcodec, "__version__", "?"), "imports")
except Exception as e:
    print("nvidia.nvimgcodec does not import:", type(e).__name__, e)
try:    # a batched crop-and-resize kernel would be written in Triton: is it there?
    import triton
    print("triton", triton.__version__, "imports")
except Exception as e:
    print("triton does not import:", type(e).__name__, e)
import shutil
print("nvcc:", shutil.which("nvcc") or "not found")
PY

  step "CUDA tests: $CUDA_TESTS"
  # shellcheck disable=SC2086
  timeout -s INT -k 30 "$TEST_TIMEOUT" python3 -m pytest -q $PYTEST_ARGS -rfEs --junitxml=/tmp/gpu-check-junit.xml \
    $CUDA_TESTS
  tests_rc=$?
  python3 - "$tests_rc" <<'PY'
import sys, xml.etree.ElementTree as ET
rc = int(sys.argv[1])
try:
    root = ET.parse("/tmp/gpu-check-junit.xml").getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    print(f"CUDA tests: {passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped "
          f"(pytest exit status {rc})")
except (OSError, ET.ParseError) as e:
    print(f"CUDA tests: no results ({e}); pytest exit status {rc}")
PY
  rm -f /tmp/gpu-check-junit.xml

  step "decode on the device against the CPU path (limit 50 s)"
  if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    timeout -s INT -k 10 50 python3 benchmarks/device_decode_fidelity.py --images 24 --device cuda
  else
    echo "no CUDA device: skipped"
  fi

  step "JPEG decoders and backends for decode=\"device\" (limit ${DECODERS_TIMEOUT} s)"
  if [ "$DECODERS_TIMEOUT" -gt 0 ] && python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    # nvImageCodec warns once per image a backend returns empty (tens of thousands of lines in the
    # third run, from threads, interleaved): counted, not printed
    timeout -s INT -k 10 "$DECODERS_TIMEOUT" python3 benchmarks/device_decoders.py --device cuda \
      --json "${REPORT%.txt}_decoders.json" 2>&1 | awk '
        /Something went wrong during decoding|pynvimgcodec/ { n++; next }
        /^(\033\[[0-9;]*m|[[:space:]])*$/ { next }
        { print; fflush() }
        END { if (n) printf "(%d lines of nvImageCodec warnings about images a backend returned empty, left out)\n", n }'
    [ "${PIPESTATUS[0]}" = 0 ] || echo "device_decoders.py did not finish"
  else
    echo "skipped (DECODERS_TIMEOUT=${DECODERS_TIMEOUT}, or no CUDA device)"
  fi

  step "decode=\"device\" stage, per image in the main process (limit ${STAGE_TIMEOUT} s)"
  if [ "$STAGE_TIMEOUT" -gt 0 ] && python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    timeout -s INT -k 5 "$STAGE_TIMEOUT" python3 benchmarks/device_stage.py --device cuda --sizes 224 \
      --images 256 --batches 2 --repeats 3 || echo "device_stage.py did not finish"
  else
    echo "skipped (STAGE_TIMEOUT=${STAGE_TIMEOUT}, or no CUDA device)"
  fi

  step "workers on every core: fetch threads on demand against 8 fixed (limit ${SCALING_TIMEOUT} s)"
  if [ "$SCALING_TIMEOUT" -gt 0 ]; then
    local synth
    synth=$(mktemp -d)
    timeout -s INT -k 10 "$SCALING_TIMEOUT" bash -c "
      python3 -m coordl.synth '$synth/photos' --images 1500 > /dev/null &&
      python3 benchmarks/worker_scaling.py --root '$synth/photos' --workers $SCALING_WORKERS --rounds 1 --epochs 2"
    rm -rf "$synth"
  else
    echo "skipped (SCALING_TIMEOUT=0)"
  fi

  local left=$(( TOTAL_LIMIT - (SECONDS - t0) - 10 )) bench_limit
  bench_limit=$(( BENCH_TIMEOUT < left ? BENCH_TIMEOUT : left ))
  [ "$bench_limit" -lt 60 ] && bench_limit=60
  step "benchmarks/gpu.py $BENCH_ARGS (limit ${bench_limit} s)"
  # --budget: gpu.py skips (saying so) a measurement that would not end before the limit
  # the decoders step's figures weigh coordl-decode-measured's decoders (a missing file: that row says so)
  # shellcheck disable=SC2086
  timeout -s INT -k 15 "$bench_limit" python3 benchmarks/gpu.py --out "$JSON" --budget $(( bench_limit - 20 )) \
    --decoders-json "${REPORT%.txt}_decoders.json" $BENCH_ARGS
  bench_rc=$?

  step "figures ($JSON)"
  cat "$JSON" 2>/dev/null || echo "no JSON was written"
  echo

  step "summary"
  echo "CUDA tests exit status $tests_rc; benchmarks/gpu.py exit status $bench_rc; $((SECONDS - t0)) s in all"
  if [ "$tests_rc" != 0 ]; then return 1; fi
  if [ "$bench_rc" != 0 ]; then return 3; fi
  return 0
}

mkdir -p "$(dirname "$REPORT")"
main 2>&1 | tee "$REPORT"
exit "${PIPESTATUS[0]}"

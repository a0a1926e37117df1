#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels that the GPU test machine
# lacks, for benchmarks/gpu_check.sh to install there (no registry there).
#
#   benchmarks/gpu_wheels.sh            # .whl/: coordl's requirements missing there (simplejpeg)
#   benchmarks/gpu_wheels.sh --dali     # also .dali/: NVIDIA DALI and its requirements, in parts
#   benchmarks/gpu_wheels.sh --nvimgcodec  # also NVIDIA nvImageCodec and nvJPEG into .whl/ (~29 MiB)
#
# The GPU machine has Python 3.12, torch (CUDA 13), torchvision, numpy,
# pillow, psutil and pytest; every other name in setup.cfg's
# install_requires is downloaded as a cp312 manylinux x86_64 wheel into
# WHEELS (default .whl/; an older wheel of the same package there is removed
# first: two versions of one package stop the install there).
#
# --nvimgcodec: nvImageCodec's CUDA 13 wheel and nvJPEG's (the libraries its
# JPEG decoder loads) into WHEELS, so that a run without the DALI parts
# (which hold both) also measures decode="device" with nvImageCodec, the
# GPU's hardware JPEG decoder where it has one.  Not with --dali: the last
# call carries WHEELS beside a DALI part, and both must fit in 64 MiB.
#
# --dali: DALI's CUDA 13 wheel (~190 MiB) and the requirements the machine
# lacks (~67 MiB) go into one tar, split into parts of PART_MIB (default 56)
# MiB under DALI_DIR (default .dali/), with DALI_DIR/SHA256SUMS listing the
# sha256 of every part and of the whole tar.  The device tool uploads at
# most 64 MiB a call, the checkout included: carry one part (and SHA256SUMS)
# per call; gpu_check.sh joins the parts once all are there, checks the
# sums, and installs.  Both folders are git-ignored (.gitignore: /.whl/ and
# /.dali/), so that the device tool sends them only when carried.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=${WHEELS:-.whl}
DALI_DIR=${DALI_DIR:-.dali}
PART_MIB=${PART_MIB:-56}
# what the GPU test machine already has (setup.cfg names it need not carry)
GPU_HAS=${GPU_HAS:-"torch numpy pillow psutil"}
DALI=nvidia-dali-cuda130==2.4.0
# DALI 2.4.0's Requires-Dist that the GPU machine lacks, pinned (numpy,
# packaging, six, pyyaml, typing-extensions and wheel are there)
DALI_REQUIRES="nvidia-libnvcomp-cu13==5.3.0.16 nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43
  nvidia-nvjpeg2k-cu13==0.11.0.51 nvidia-nvtiff-cu13==0.8.0.82 astunparse==1.6.3 gast==0.7.0 libcst==1.9.0
  makefun==1.16.0 nvtx==0.2.17 optree==0.20.0"

NVIMGCODEC="nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43"

with_dali=0
with_nvimgcodec=0
for a in "$@"; do
  case "$a" in
    --dali) with_dali=1 ;;
    --nvimgcodec) with_nvimgcodec=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_wheels.sh: unknown argument $a (expected --dali or --nvimgcodec)" >&2; exit 2 ;;
  esac
done
if [ "$with_dali" = 1 ] && [ "$with_nvimgcodec" = 1 ]; then
  echo "gpu_wheels.sh: --nvimgcodec is for a run without DALI (its parts hold nvImageCodec already)" >&2
  exit 2
fi

download() {  # DIR SPEC...
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@"
}

# coordl's requirements, less what the GPU machine has
mapfile -t needed < <(python3 - "$GPU_HAS" <<'PY'
import configparser, re, sys
have = {n.lower() for n in sys.argv[1].split()}
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
for line in cfg["options"]["install_requires"].splitlines():
    line = line.split("#")[0].strip()
    name = re.match(r"[A-Za-z0-9_.-]+", line)
    if name and name.group(0).lower().replace("_", "-") not in have:
        print(line)
PY
)
if [ "$with_nvimgcodec" = 1 ]; then
  # shellcheck disable=SC2206
  needed+=($NVIMGCODEC)
fi
mkdir -p "$WHEELS"
# an older wheel of the same package would make two versions there
python3 - "$WHEELS" "${needed[@]}" <<'PY'
import os, re, sys
names = {re.sub(r"[-_.]+", "_", re.match(r"[A-Za-z0-9_.-]+", s).group(0)).lower() for s in sys.argv[2:]}
for f in os.listdir(sys.argv[1]):
    if f.endswith(".whl") and f.split("-")[0].lower() in names:
        os.remove(os.path.join(sys.argv[1], f))
PY
if [ ${#needed[@]} -gt 0 ]; then
  download "$WHEELS" "${needed[@]}"
fi
echo "$WHEELS/: ${needed[*]:-nothing needed}"
ls -l "$WHEELS"

if [ "$with_dali" = 1 ]; then
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  # shellcheck disable=SC2086
  download "$stage/wheels" "$DALI" $DALI_REQUIRES
  mkdir -p "$DALI_DIR"
  rm -f "$DALI_DIR"/dali-wheels.tar.part-* "$DALI_DIR"/SHA256SUMS
  tar -C "$stage/wheels" -cf "$stage/dali-wheels.tar" .
  split -b "${PART_MIB}M" -d -a 2 "$stage/dali-wheels.tar" "$DALI_DIR/dali-wheels.tar.part-"
  (cd "$stage" && sha256sum dali-wheels.tar) > "$stage/SHA256SUMS"
  (cd "$DALI_DIR" && sha256sum dali-wheels.tar.part-*) >> "$stage/SHA256SUMS"
  mv "$stage/SHA256SUMS" "$DALI_DIR/SHA256SUMS"
  ls "$stage/wheels"
  ls -l "$DALI_DIR"
  echo "$DALI_DIR/: $(ls "$DALI_DIR"/dali-wheels.tar.part-* | wc -l) part(s) of at most $PART_MIB MiB; carry one per" \
       "device call with $DALI_DIR/SHA256SUMS, then run benchmarks/gpu_check.sh"
fi

#!/usr/bin/env bash
# Regenerates docs/accuracy/: the mask-error and attention-error figures, their data and the
# table of fitted exponents.
#
#   docs/accuracy/regenerate.sh [masks|attention|plot|all]   (default: all)
#
# masks:     error_decay --masks, one row of n at a time: n = 10^3, 10^4, 10^5 with n * s <= 10^7
#            (merged into masks.json), the row n = 10^6 with n * s <= 10^8 (s <= 100), then
#            error_decay --time at n = 10^6, s = 100 (the timings); about half an hour on one core
# attention: trains the miniature model of examples/python/lm.py (ALiBi variant, seed 1, the
#            script's default 2000 steps) unless build/accuracy/alibi-s1.pt exists, dumps its q, k
#            on the first 2048 bytes of the validation text (examples/python/qk_dump.py), then
#            error_decay --attention
# plot:      docs/accuracy/plot.py (matplotlib: python3-matplotlib), then bench/report.py (the
#            tables of docs/accuracy.md)
#
# Environment: PLSH_JOBS (build jobs, default 2), PLSH_PYTHON (default /usr/bin/python3),
# PLSH_BUILD_DIR (the Release build of error_decay, default build/release).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
what=${1:-all}
jobs=${PLSH_JOBS:-2}
python=${PLSH_PYTHON:-/usr/bin/python3}
build=${PLSH_BUILD_DIR:-build/release}
work=build/accuracy
out=docs/accuracy
mkdir -p "${work}"

build_error_decay() {
  if [[ ! -f "${build}/CMakeCache.txt" ]]; then
    cmake -S . -B "${build}" -DCMAKE_BUILD_TYPE=Release
  fi
  cmake --build "${build}" --target error_decay -j "${jobs}"
}

masks() {
  build_error_decay
  # n = 10^3, 10^4, 10^5 with n * s <= 10^7, one row at a time, into masks.json.
  local rows=()
  for n in 1000 10000 100000; do
    "${build}/examples/error_decay" --masks "${work}/masks-row-${n}.json" 1e7 "${n}"
    rows+=("${work}/masks-row-${n}.json")
  done | tee "${work}/masks.log"
  "${python}" - "${out}/masks.json" "${work}"/masks-row-{1000,10000,100000}.json <<'PY'
import json, sys
points = [p for path in sys.argv[2:] for p in json.load(open(path))["points"]]
with open(sys.argv[1], "w") as out:
    out.write('{"budget_n_times_s": 1e+07, "points": [\n')
    out.write(",\n".join(json.dumps(p) for p in points))
    out.write("\n]}\n")
PY
  # The row n = 10^6 up to s = 100 (n * s <= 10^8): plot.py reads it beside masks.json.
  "${build}/examples/error_decay" --masks "${out}/masks-1e6.json" 1e8 1000000 |
    tee "${work}/masks-1e6.log"
  "${build}/examples/error_decay" --time "${out}/timing.json" 1000000 100 |
    tee "${work}/timing.log"
}

attention() {
  build_error_decay
  bash scripts/python.sh build
  if [[ ! -f "${work}/alibi-s1.pt" ]]; then
    PYTHONPATH=build/python "${python}" examples/python/lm.py --variant alibi --seed 1 \
      --eval-bytes 16384 --data-cache "${work}/bible.txt" --save "${work}/alibi-s1.pt" \
      --out "${work}/alibi-s1.json" | tee "${work}/train.log"
    cp "${work}/alibi-s1.json" "${out}/train-alibi-s1.json"
  fi
  PYTHONPATH=build/python "${python}" examples/python/qk_dump.py \
    --checkpoint "${work}/alibi-s1.pt" --length 2048 --data-cache "${work}/bible.txt" \
    --out "${work}/qk.bin"
  cp "${work}/qk.bin.json" "${out}/qk.json"
  "${build}/examples/error_decay" --attention "${work}/qk.bin" "${out}/attention.json" |
    tee "${work}/attention.log"
}

case "${what}" in
  masks) masks ;;
  attention) attention ;;
  plot) ;;
  all)
    masks
    attention
    ;;
  *)
    echo "usage: docs/accuracy/regenerate.sh [masks|attention|plot|all]" >&2
    exit 2
    ;;
esac
"${python}" "${out}/plot.py" "${out}"
# The tables of docs/accuracy.md (the exponents above among them).
"${python}" bench/report.py

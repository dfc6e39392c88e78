#!/usr/bin/env bash
# One device call of benchmarks/gpu_session.sh: the checkout installed once (`env`), then each
# argument, a group of parts, run as its own gpu_session.sh beside the others on the one GPU, and
# everything tarred into $OUT/all.tgz (a call brings back at most 8 files).
#
#   bash benchmarks/gpu_call.sh "mooncake" "tests fp8"      # on the device machine ($OUT set there)
#
# Groups run side by side share the GPU and the host: their times are comparable within a group,
# not with a group run alone. CAP (default 545 s) bounds each group, so the tar is written inside
# a 10-minute call; MOONCAKE, REPLAY_TIMEOUT, TESTS_TIMEOUT and the rest pass through.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-call}/w
mkdir -p "$out"
bash benchmarks/gpu_session.sh "$out/env" env > "$out/env.log" 2>&1
python3 -c "import simpy" 2>/dev/null || export PYTHONPATH=/tmp/kvsim-site  # what env installed
i=0
for group in "$@"; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # a group is a list of parts
    timeout "${CAP:-545}" bash benchmarks/gpu_session.sh "$out/g$i" $group > "$out/g$i.log" 2>&1 &
done
wait
for f in "$out"/g*.log; do echo "### $f"; grep -v "^step \|^\[" "$f" | tail -40; done
tar czf "${OUT:-/tmp/gpu-call}/all.tgz" -C "$out" .

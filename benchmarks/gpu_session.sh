#!/bin/bash
# The lent GPU node's main call, after loads 01..05 are staged (docs/gpu-testing.md, part 2):
#   carry [".gpu-loads/06", ".gpu-test-wheels"], timeout_s 600:  bash benchmarks/gpu_session.sh
# In order of importance, within about 400 s: the last load; install, env and every gpu test;
# bench_gpu at 8M rows (and cached epochs with more reads in flight: --grid); a thread profile
# of a first epoch with cuDF and of cached epochs. Six files come back in $OUT (at most 8 can).
# Then, on the still-warm machine, the rest of the suite: bash benchmarks/gpu_suite.sh.
export WHEELHOUSE_STAGE=/tmp/wh/stage WHEELHOUSE_SITE=/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-node-logs}; mkdir -p "$OUT"
T0=$(date +%s); left() { echo $(( $1 - ($(date +%s) - T0) )); }
bash .gpu-loads/06/unpack.sh > /tmp/unpack.log 2>&1; echo "unpack: exit $? | $(tail -1 /tmp/unpack.log)"
python3 benchmarks/gpu_node.py run install env gpu --wheels .gpu-test-wheels --limit 240 --out "$OUT"
export PYTHONPATH=/tmp/site:$PWD
timeout "$(left 340)" python3 benchmarks/bench_gpu.py --rows 8000000 --repeat 2 --dir /tmp/b8 --grid 2:2,2:8,4:8,8:16 \
    --details "$OUT/bench-details.md" --json "$OUT/bench.json" > /tmp/bench.log 2>&1
echo "bench: exit $?"; tail -14 /tmp/bench.log; rm -rf /tmp/b8
python3 benchmarks/gpu_node.py run profile --rows 8000000 --limit "$(left 400)" --out "$OUT"
ls "$OUT"
# the whole suite is the next call (benchmarks/gpu_suite.sh): sharing this one's 600 s, it reached 99% in 380 s
# on the H200 (2026-11-27) and its last failures went unnamed

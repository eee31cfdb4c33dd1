#!/bin/bash
# The lent GPU node's call after benchmarks/gpu_session.sh, on the same warm machine (the RAPIDS
# stack and the test wheels it installed live in /tmp/site): carry nothing, timeout_s 480:
#   bash benchmarks/gpu_suite.sh
# Every test not marked gpu, 12 workers, each test's outcome in suite.log as it ends (-v), so a
# call stopped at its limit still names the failures seen so far; a test hung past 240 s fails alone.
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-gpu-node-logs}; mkdir -p "$OUT"
if [ ! -d /tmp/site ]; then echo "no /tmp/site: this is a fresh machine; run the loads and gpu_session.sh first"; exit 2; fi
python3 benchmarks/gpu_node.py run suite --workers 12 --limit 450 --out "$OUT"
grep -E "FAILED|ERROR|Timeout" "$OUT/suite.log" | head -40
tail -3 "$OUT/suite.log"

#!/bin/bash
# Optional last call of a GPU session (docs/gpu-testing.md, part 2), after gpu_session.sh and only with
# 5 minutes of device time left: issue #25's peers table on the node's own CPU cores, bare metal instead of
# the development VM, whose fresh memory costs more than the work (docs/benchmarks.md):
#   carry [".gpu-test-wheels"], timeout_s 330:  bash benchmarks/gpu_peers.sh
# The loaders that need no venv of their own (torchdata comes in the test wheels), 8M rows, the CPU path,
# a 1-thread consumer: pinned to 2 cores (the targets are for 2 cores), then on every core, where
# gpuload-wide (num_threads = the cores - 3) says what the default num_threads=2 leaves on the table.
# Four files come back in $OUT: each run's markdown table and JSON.
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-node-logs}; mkdir -p "$OUT"
ROWS=${ROWS:-8000000}
T0=$(date +%s); left() { echo $(( $1 - ($(date +%s) - T0) )); }
if ! PYTHONPATH=/tmp/site python3 -c "import fsspec, torchdata" 2>/dev/null; then  # a fresh machine: install
    python3 benchmarks/gpu_node.py run install --wheels .gpu-test-wheels --limit 60 --out /tmp/peers-install
fi
export PYTHONPATH=/tmp/site:$PWD
LOADERS=ideal,ideal-window,gpuload,gpuload-block,gpuload-stacked,gpuload-noshuffle,naive,torchdata-nodes
peers() {  # $1: the run's name, $2: seconds it may take, then the command's prefix (taskset)
    local name=$1 limit=$2; shift 2
    timeout "$limit" "$@" python3 benchmarks/bench_peers.py --rows "$ROWS" --loaders "$LOADERS" --threads 1 \
        --limit-s 40 --timeout 120 --workdir /tmp/peers --keep --json "$OUT/peers-$name.json" \
        --out "$OUT/peers-$name.md" > "/tmp/peers-$name.log" 2>&1
    echo "peers $name: exit $? in $(( $(date +%s) - T0 )) s"; grep -E "^\| (gpuload|ideal|torchdata|naive)" "$OUT/peers-$name.md" | cut -c1-160
}
peers 2cores "$(left 200)" taskset -c 0,1
LOADERS=$LOADERS,gpuload-wide  # num_threads = the cores - 3: what the default of 2 leaves on a many-core node
peers allcores "$(left 310)"
rm -rf /tmp/peers
ls "$OUT"

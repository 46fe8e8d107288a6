#!/usr/bin/env bash
# Run one pytest node N times under CPU load and count the failures (opt-in: intermittent failures show up
# here, where a single run in CI passes). Each failing run's output is kept.
#
#   tests/soak/loop_test.sh 'tests/e2e/test_expert_parallel.py::test_a_member_killed_while_serving_fails_its_requests_at_once_and_the_group_comes_back' 20
#
# LOAD: busy loops in the background, one per core by default (LOAD=0: none). OUT: where logs go.
# A test that shares a session server runs after the files before it, in the suite's order, through pytest's own
# PYTEST_ADDOPTS (those paths come first on its command line):
#
#   PYTEST_ADDOPTS='tests/e2e/test_supervisor.py tests/e2e/test_engine_wire.py' \
#       tests/soak/loop_test.sh tests/e2e/test_concurrency.py::test_aborted_stream_frees_its_slot 20
set -uo pipefail
cd "$(dirname "$0")/../.."
node="${1:?usage: $0 PYTEST_NODE [N]}"
runs="${2:-10}"
load="${LOAD:-$(nproc)}"
out="${OUT:-$(mktemp -d /tmp/zserve-loop-XXXXXX)}"
mkdir -p "$out"
py=".venv/bin/python"
[ -x "$py" ] || py=python3

busy=()
stop_load() { for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null; done; }
trap stop_load EXIT
trap 'exit 130' INT TERM
for _ in $(seq 1 "$load"); do
    "$py" -c 'while True: pass' &
    busy+=("$!")
done

failed=0
for i in $(seq 1 "$runs"); do
    start=$(date +%s)
    if "$py" -m pytest "$node" -x -q -p no:cacheprovider >"$out/run-$i.log" 2>&1; then
        echo "run $i/$runs: passed ($(( $(date +%s) - start ))s)"
        rm -f "$out/run-$i.log"
    else
        failed=$((failed + 1))
        echo "run $i/$runs: FAILED ($(( $(date +%s) - start ))s), output in $out/run-$i.log"
    fi
done
echo "$failed of $runs runs failed under $load busy loop(s)"
[ "$failed" -eq 0 ]

#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser (issue 14), bounded by time:
#   scripts/fuzz.sh [--seconds TOTAL] [TARGET...]
# TOTAL (default 20) is shared evenly between the targets (at least 1 s each). Each target runs in
# its own process (tests/fuzz/run.py: atheris when installed, else hypothesis) from the committed
# seed corpus tests/fuzz/corpus/<target>/; finds go to a scratch directory. Prints seconds,
# executions and executions per second per target; exits 1 on the first crash, whose input is
# kept in the scratch directory (named in the output).
set -uo pipefail
cd "$(dirname "$0")/.."
total=20
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) total="$2"; shift 2 ;;
    --seconds=*) total="${1#*=}"; shift ;;
    -h|--help) sed -n 2,8p "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests/fuzz"); from targets import TARGETS; print("\n".join(sorted(TARGETS)))')
fi
per=$(( total / ${#targets[@]} )); [ "$per" -lt 1 ] && per=1
scratch=$(mktemp -d /tmp/uomp-fuzz-XXXXXX)
status=0
printf '%-11s %7s %10s %9s %s\n' target seconds execs exec/s engine
for t in "${targets[@]}"; do
  log="$scratch/$t.log"
  start=$(date +%s.%N)
  .venv/bin/python tests/fuzz/run.py "$t" "$per" "$scratch/$t" >"$log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  engine=atheris; grep -q "(hypothesis)" "$log" && engine=hypothesis
  secs=$(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}')
  rate=$(awk -v n="${execs:-0}" -v s="$per" 'BEGIN{printf "%d", n/s}')
  printf '%-11s %7s %10s %9s %s\n' "$t" "$secs" "${execs:-?}" "$rate" "$engine"
  if [ $rc -ne 0 ]; then
    echo "fuzz: $t crashed (exit $rc); input and log in $scratch/$t, $log:"; tail -30 "$log"; status=1; break
  fi
done
[ $status -eq 0 ] && rm -rf "$scratch"
exit $status

#!/usr/bin/env bash
# `make test` on N consecutive fresh clones of this repository's HEAD, each under load: a bias study
# (`seco-lab study bias`, in its own results folder, restarted whenever it finishes) runs beside it the whole time.
# Each clone installs on first use as a newcomer's would (the time includes it).  One line per run goes to
# OUT/results.tsv: commit, start time (UTC), exit status, seconds, load average at the end, bias studies started, and
# pytest's summary line.  Resumable: a run with a line there is skipped; it stops at the first failing run.
#
#   experiments/loaded_fresh_clones.sh [RUNS=5] [OUT=../loaded_runs]    (BIAS_JOBS=1: the load's worker count)
#
# The load runs from this repository's .venv (make install first).  Nothing outside OUT is written.
set -u
here=$(git rev-parse --show-toplevel) || { echo "run it inside the repository" >&2; exit 2; }
runs=${1:-5}; out=$(realpath -m "${2:-$here/../loaded_runs}"); jobs=${BIAS_JOBS:-1}
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "RUNS must be a positive integer, got '$runs'" >&2; exit 2; }
[ -x "$here/.venv/bin/seco-lab" ] || { echo "no $here/.venv/bin/seco-lab: run 'make install' first" >&2; exit 2; }
mkdir -p "$out" && cd "$out" || exit 2
for i in $(seq 1 "$runs"); do
  grep -q "^run$i	" results.tsv 2>/dev/null && continue
  d=$out/run$i
  [ -e "$d" ] && mv "$d" "$d.interrupted.$(date +%s)"  # an interrupted run's folder is kept aside, not deleted
  mkdir -p "$d" && git clone -q "$here" "$d/repo" || exit 2
  commit=$(git -C "$d/repo" rev-parse --short HEAD)
  ( n=0; while :; do n=$((n + 1))
      (cd "$d" && exec "$here/.venv/bin/seco-lab" study bias --out "$d/load$n" --jobs "$jobs" --no-progress) \
        >"$d/load$n.log" 2>&1
    done ) &
  load=$!
  sleep 20  # the load under way first
  t0=$(date +%s)
  (cd "$d/repo" && exec make test) >"$d/test.log" 2>&1 &
  tests=$!
  # stopped (Ctrl-C, kill): the load and the tests stop too (background jobs ignore the terminal's SIGINT)
  trap 'kill "$load" "$tests" 2>/dev/null; pkill -f "study bias --out $d/load"; pkill -f "$d/repo/"; exit 130' INT TERM
  wait "$tests"; rc=$?
  trap - INT TERM
  t1=$(date +%s); avg=$(cut -d' ' -f1-3 /proc/loadavg)
  kill "$load" 2>/dev/null; pkill -f "study bias --out $d/load"; sleep 2; pkill -9 -f "study bias --out $d/load"
  summary=$(grep -E "passed|failed|error" "$d/test.log" | tail -n 1)
  printf "run%s\t%s\t%s\trc=%s\t%ss\tloadavg_end=%s\tbias_studies=%s\t%s\n" "$i" "$commit" \
    "$(date -u -d "@$t0" +%FT%TZ)" "$rc" "$((t1 - t0))" "$avg" "$(ls -d "$d"/load[0-9]* 2>/dev/null | wc -l)" \
    "$summary" >> results.tsv
  [ "$rc" = 0 ] || { echo "run$i failed: $d/test.log" >&2; exit 1; }
done
cat results.tsv

# The step runner shared by scripts/gpu_check.sh and scripts/gpu_perf.sh (sourced; bash).
#
# The caller sets PLAN (rows "name|timeout in seconds|title"; a step named NAME is the
# exported function step_NAME with '-' as '_'), BUDGET (seconds of wall time for the run),
# SUMMARY_RESERVE (seconds kept back for the step named "summary", which always runs), DRY
# (1: no budget, every step capped at 300 s, since a dry run is not timed against the GPU) and
# OUT (where step-NAME.log goes), then calls
#   run_plan RUN_NAME STEPS_TSV TIMEOUT_FAILS [ONLY]
# Each step runs under `timeout`, its limit the smaller of its own and what the budget has
# left; no step starts with under 5 s left (OUT-OF-TIME). Exit 77 is SKIPPED, 124/137 TIMEOUT.
# Each step's row "name<TAB>status<TAB>seconds<TAB>limit<TAB>title" goes to STEPS_TSV.
# TIMEOUT_FAILS=1: a timed-out step fails the run (0: it is reported, and what it printed
# before the cut stays). ONLY: comma-separated step names to run (the others SKIPPED; the
# environment and summary steps always run). Returns non-zero when a step failed.
# tests/test_gpu_runner.py runs it on a plan of its own.

print_plan() {  # the plan as tab-separated rows, for the tests
  printf 'BUDGET\t%s\n' "$BUDGET"
  printf 'SUMMARY_RESERVE\t%s\n' "$SUMMARY_RESERVE"
  local entry name limit title
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name limit title <<< "$entry"
    printf 'step\t%s\t%s\t%s\n' "$name" "$limit" "$title"
  done
}

run_plan() {
  local run=$1 tsv=$2 timeout_fails=$3 only=${4:-}
  local start total=0 i=0 entry name limit title used reserve left t0 rc dt status bad timeouts
  start=$(date +%s)
  : > "$tsv"
  for entry in "${PLAN[@]}"; do total=$((total + $(cut -d'|' -f2 <<< "$entry"))); done
  echo "$run$([ "$DRY" = 1 ] && echo ' --dry-run'): ${#PLAN[@]} steps, timeouts add up to ${total} s," \
       "wall budget ${BUDGET} s; logs in $OUT"
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name limit title <<< "$entry"
    title=${title//\$\{WIOLA_CUDA_ARCH\}/${WIOLA_CUDA_ARCH:-}}
    i=$((i + 1))
    used=$(( $(date +%s) - start ))
    reserve=$([ "$name" = summary ] && echo 0 || echo "$SUMMARY_RESERVE")
    left=$(( BUDGET - used - reserve ))
    if [ -n "$only" ] && [ "$name" != summary ] && [ "$name" != environment ] \
       && ! grep -q -w -- "$name" <<< "${only//,/ }"; then  # a rerun of some steps only
      printf '%s\t%s\t%s\t%s\t%s\n' "$name" SKIPPED 0 "$limit" "$title" >> "$tsv"
      continue
    fi
    if [ "$DRY" = 0 ] && [ "$name" != summary ]; then  # the summary always runs, in its own time
      if [ "$left" -lt 5 ]; then
        echo; echo "=== [$i/${#PLAN[@]}] $title: OUT-OF-TIME (${used} s of the ${BUDGET} s budget used)"
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" OUT-OF-TIME 0 "$limit" "$title" >> "$tsv"
        continue
      fi
      [ "$limit" -gt "$left" ] && limit=$left
    fi
    echo; echo "=== [$i/${#PLAN[@]}] $title (timeout ${limit} s, $(date +%T))"
    t0=$(date +%s)
    # Dry runs are not timed against the GPU budget (this machine is slower); 5 minutes each at most.
    timeout -k 10 "$([ "$DRY" = 1 ] && echo 300 || echo "$limit")" bash -c "step_${name//-/_}" 2>&1 \
      | tee "$OUT/step-$name.log"
    rc=${PIPESTATUS[0]}
    dt=$(( $(date +%s) - t0 ))
    case $rc in
      0) status=PASS ;;
      77) status=SKIPPED ;;
      124|137) status=TIMEOUT ;;
      *) status=FAIL ;;
    esac
    echo "--- $name: $status in ${dt} s (timeout ${limit} s)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$dt" "$limit" "$title" >> "$tsv"
  done
  bad=$(cut -f2 "$tsv" | grep -c -E "FAIL|OUT-OF-TIME$([ "$timeout_fails" = 1 ] && echo '|TIMEOUT')")
  timeouts=$(cut -f2 "$tsv" | grep -c TIMEOUT)
  echo "$run$([ "$DRY" = 1 ] && echo ' --dry-run'): $([ "$bad" = 0 ] && echo PASSED || echo "FAILED ($bad step(s))")" \
       "in $(( $(date +%s) - start )) s$([ "$timeout_fails" = 0 ] && [ "$timeouts" -gt 0 ] && \
       echo "; $timeouts step(s) cut short by their timeout (rows they finished are in $OUT)")"
  [ "$bad" = 0 ]
}

# Sourced by ci/all.sh (and by ci/house.sh, which checks it): runs CI steps and reports each as
# passed (exit 0), skipped (exit 77, automake's SKIP: the reason is the step's last line
# holding "skipped: REASON") or failed (any other exit). A skip is never counted as a pass.

ci_results=()
ci_start=$(date +%s)

# ci_step NAME [SCRIPT]: runs SCRIPT (default ci/NAME.sh) with its output shown as it comes,
# and records the outcome. Returns 0 when it passed or skipped, else its exit status.
ci_step() {
  local name=$1 script=${2:-ci/$1.sh} log rc reason
  echo "== ci: $name ($(($(date +%s) - ci_start))s)"
  log=$(mktemp)
  if bash "$script" 2>&1 | tee "$log"; then rc=0; else rc=${PIPESTATUS[0]}; fi
  reason=$(sed -n 's/.*skipped: //p' "$log" | tail -n 1)
  rm -f "$log"
  case $rc in
    0) ci_results+=("$name: passed") ;;
    77) ci_results+=("$name: skipped: ${reason:-the step gave no reason}") ;;
    *) ci_results+=("$name: failed (exit $rc)") ;;
  esac
  [ "$rc" = 0 ] || [ "$rc" = 77 ] || return "$rc"
}

# ci_summary: one line per step run so far, then the counts.
ci_summary() {
  local r passed=0 skipped=0 failed=0
  echo "== ci: steps"
  for r in "${ci_results[@]}"; do
    echo "  $r"
    case $r in
      "${r%%: *}: skipped: "*) skipped=$((skipped + 1)) ;;
      "${r%%: *}: passed") passed=$((passed + 1)) ;;
      *) failed=$((failed + 1)) ;;
    esac
  done
  echo "steps: $passed passed, $failed failed, $skipped skipped"
}

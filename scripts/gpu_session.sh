#!/usr/bin/env bash
# One GPU call's worth of work, for the device machine (H200): every step writes its log (and JSON)
# under $OUT and is bounded by `timeout`, so one failing step never loses the others' results.
#   scripts/gpu_session.sh MODE     MODE's steps (default: check)
#   scripts/gpu_session.sh help     every mode with what it runs and how long it takes
# The modes live in scripts/gpu/*.sh as mode_NAME functions (NAME with - as _), each under `#:` lines
# that `help` prints; the helpers they share (step, bench, run_tests) are here.
# The device lacks the gguf package: scripts/device_wheels.sh fills .whl/ (git-ignored); pass carry [".whl"].
# A call brings back at most 8 files: a mode leaving more packs them into one MODE-HHMMSS.tgz.
# fla-core (.whl/fla_core*.whl) is opt-in: FLA=1 installs it, so hybrid prefill chunks take its kernels
# (which compile for minutes on a cold Triton cache); without it they take the torch chunk path.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
install_wheels() {  # .whl/*.whl into /tmp/site (fla-core only with FLA=1), once per call
  local wheels=() w
  [ "${FLA:-0}" = 1 ] || rm -rf /tmp/site/fla /tmp/site/fla_core-*.dist-info  # a warm machine's earlier FLA=1 call
  for w in .whl/*.whl; do
    [ -e "$w" ] || continue
    case "${w##*/}" in fla_core*) [ "${FLA:-0}" = 1 ] || continue ;; esac
    wheels+=("$w")
  done
  [ ${#wheels[@]} -gt 0 ] || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
  export PYTHONPATH=/tmp/site:.
}
if [ -z "${GPU_SESSION_SITE:-}" ]; then
  install_wheels
  export GPU_SESSION_SITE=1  # a nested call installs nothing again
fi
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: run, log to $out/NAME.log, report the exit status
  local name=$1 seconds=$2; shift 2
  timeout --signal=INT --kill-after=20 "$seconds" "$@" > "$out/$name.log" 2>&1  # INT: the trainer saves its weights
  echo "== $name: exit $? ($(tail -n 1 "$out/$name.log" | cut -c1-160))"
}
bench() {  # bench NAME SECONDS ARGS...: lucebox bench speed with --json, its table shown
  local name=$1 seconds=$2; shift 2
  step "$name" "$seconds" python3 -m lucebox.cli bench speed --json "$out/$name.json" "$@"
  sed -n '/^| measure/,$p' "$out/$name.log"
}
run_tests() {  # run_tests NAME SECONDS PYTEST-ARGS...: pytest with one line a test in $out/NAME.log, written as each
               # starts and ends (unbuffered, no pipe), so a step the timeout ends still says how far it got
  local name=$1 seconds=$2; shift 2
  python3 -c "import importlib.util as u; print('fla-core', 'on' if u.find_spec('fla') else 'off (FLA=1 installs it)')"
  # --verbosity=1, not -v: pyproject's addopts -q would take a -v back
  step "$name" "$seconds" python3 -m pytest --verbosity=1 -rs -p no:cacheprovider --durations=20 \
    -o console_output_style=classic "$@"
  test_summary "$out/$name.log"
}
test_summary() {  # test_summary LOG: counts, failures, and the test a timeout cut off
  local log=$1 last
  echo "   $(grep -cE '::.* PASSED' "$log") passed, $(grep -cE '::.* (FAILED|ERROR)' "$log") failed," \
    "$(grep -cE '::.* SKIPPED' "$log") skipped"
  grep -E '^(FAILED|ERROR) ' "$log" | head -n 20 | cut -c1-240
  # the last test line before pytest's report sections (whose warnings and durations name tests too)
  last=$(awk '/^(=+ (FAILURES|ERRORS|warnings summary|short test summary|slowest)|!+ KeyboardInterrupt)/ {exit}
              /^tests\/.*::/ {line = $0} END {print line}' "$log")
  case "$last" in
    ""|*PASSED*|*FAILED*|*SKIPPED*|*ERROR*|*XFAIL*|*XPASS*) ;;
    *) echo "   cut off in: $last" ;;
  esac
}
parts=(tests bench kernels profile hybrid)  # scripts/gpu/PART.sh, in the order `help` lists them
here=$(dirname "${BASH_SOURCE[0]}")/gpu
for part in "${parts[@]}"; do
  source "$here/$part.sh"
done
usage() {
  for part in "${parts[@]}"; do grep '^#:' "$here/$part.sh" | cut -c4-; done
}
pack() {  # a device call brings back at most 8 files: past 7 loose ones, they go into one MODE-TIME.tgz
  local loose
  loose=$(find "$out" -maxdepth 1 -type f ! -name '*.tgz' -printf '%f\n' | sort)
  [ "$(printf '%s' "$loose" | grep -c .)" -gt 7 ] || return 0
  # shellcheck disable=SC2086  # file names are letters, digits, '.', '_' and '-'
  (cd "$out" && tar czf "$1-$(date +%H%M%S).tgz" $loose && rm -f $loose)
  echo "== packed $(printf '%s' "$loose" | grep -c .) files into $out/$1-*.tgz (tar xzf it here)"
}
mode=${1:-check}
if [ "$mode" = help ]; then
  usage
elif declare -F "mode_${mode//-/_}" > /dev/null; then
  "mode_${mode//-/_}"
  pack "$mode"
else
  echo "unknown mode '$mode'; the modes:" >&2
  usage >&2
  exit 2
fi

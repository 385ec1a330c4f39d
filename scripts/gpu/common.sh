# Sourced by the device-call scripts: carried wheels installed, PYTHONPATH, $OUT, and the two runners.
#   t NAME LIMIT CMD...        run CMD under a time limit, log to $OUT/NAME.log, print rc, time and the result lines
#   gpu_test NAME LIMIT ARGS   pytest -m gpu on ARGS through t, verbose (a timeout still shows how far it got)
#   pack_logs                  every log into $OUT/logs.tgz (a device call returns at most 8 files)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"
  grep -E "passed|failed|^E |FAILED|PROBLEM|faster|tok/s|x the|speedup|x$" "$OUT/$name.log" | tail -n 8; return $rc; }
gpu_test() { local name=$1 limit=$2; shift 2
  t "$name" "$limit" python3 -m pytest -v -x --tb=short --durations=5 -p no:cacheprovider -m gpu "$@"; }
pack_logs() { tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log; }

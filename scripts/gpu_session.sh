#!/usr/bin/env bash
# One time-boxed session on a GPU machine whose python3 holds a CUDA torch (no network needed):
# the MNIST paths with the shipped paper-width posterior, then the kernel table, each under a
# deadline, packed into at most 8 files of at most 16 MB in OUTDIR.
#
#   scripts/gpu_session.sh OUTDIR [SECONDS]        # SECONDS: the whole budget (default 570)
#   GPU_SESSION_DRY=1 scripts/gpu_session.sh /tmp/s 120   # the same steps on a CPU: install --dry-run,
#                                                         # no compile, tiny sampling, the table on the CPU
#
# Steps, with the time each gets (experiments/mnist/RESULTS.md, "On a lent GPU"):
#   0. facts (in the background): date, CPUs, memory, Python, pip, torch, Triton, nvcc, nvidia-smi
#      (card, driver) into env.log;
#   1. install the package without compiling and without the network (pip --no-index --no-deps
#      --no-build-isolation -e .; the Triton kernels come with it: etweedie.kernels is checked
#      from outside the tree, and linked into it when the install failed) and, in the background
#      on the CPUs, compile the CUDA extension in a copy of the tree (sm_90) until the sampling's
#      share of the budget ends (+30 s);
#   2. experiments.mnist.gpu_sample until SAMPLE_SHARE of the budget (default 0.65; killed ≤ 15 s
#      later): the parts continue in WORK (default runs/mnist_gpu; carry a pack's parts.tar.gz there
#      to go on); a run killed or crashed before its pack is packed by `gpu_sample --pack-only`;
#   3. the compiled extension copied in, then scripts/gpu_check.py (the table; with
#      GPU_TESTS="pytest args" also those tests, for GPU_TESTS_S seconds, default 90) until the
#      budget ends less a reserve;
#   4. OUTDIR: the sampling pack (≤ 7 files: <path>.npy, progress.npz, sampling_log.json,
#      parts.tar.gz; pooled <path>.npy beyond four go inside parts.tar.gz) and gpu_session.tar.gz (session.log, env.log, install/build/sample logs, the
#      table's log and results.json; each log cut to its head and tail beyond LOG_CAP bytes).
#      gpu_session.tar.gz is also written after each step, so a session killed from outside
#      still returns the logs so far.  At the end OUTDIR holds at most 8 plain files of at most
#      16 MB (extras are moved into the tarball, an oversized file is cut).
#
# Every step runs under `timeout` (its process group killed at its limit): nothing runs past
# SECONDS.  Test hook: GPU_SESSION_SIMULATE="step=fail|hang|spew,..." (steps: install, check,
# build, sample, pack, table) replaces a step's command by a failing, hanging or 30 MB-printing
# stand-in.
set -uo pipefail

out="${1:?usage: scripts/gpu_session.sh OUTDIR [SECONDS]}"
budget="${2:-570}"
case "$budget" in
  ''|*[!0-9]*) echo "gpu_session: error: SECONDS must be a whole number of seconds, got '$budget'" >&2; exit 2 ;;
esac
if [ "$budget" -lt 10 ]; then echo "gpu_session: error: SECONDS must be >= 10, got $budget" >&2; exit 2; fi
t0=$(date +%s)
mkdir -p "$out" && out="$(cd "$out" && pwd)" || { echo "gpu_session: error: cannot create OUTDIR $out" >&2; exit 2; }
py="${PYTHON:-python3}"
case "$py" in */*) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac  # (steps run in other folders)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
work="${WORK:-runs/mnist_gpu}"
posterior="${POSTERIOR:-mnist_full}"
share="${SAMPLE_SHARE:-0.65}"
dry="${GPU_SESSION_DRY:-}"
GPU_SESSION_SIMULATE="${GPU_SESSION_SIMULATE:-}"
max_files=8
max_bytes=$((15 * 1024 * 1024))   # under the 16 MB a file may have
log_cap="${LOG_CAP:-2000000}"     # bytes of one log kept in the tarball (its head and tail)
reserve=$((5 + budget / 50))      # seconds kept at the end for the tarball and the checks
end=$((t0 + budget - reserve))    # no step runs past this
sample_end=$(awk -v t="$t0" -v b="$budget" -v s="$share" 'BEGIN { printf "%d", t + b * s }')
[ "$sample_end" -gt "$end" ] && sample_end=$end
table_min=$((budget / 5 < 30 ? budget / 5 : 30))  # the table is not started with less than this
logs="$(mktemp -d)"
stage="$(mktemp -d)"
build=""
build_pid=""
env_pid=""
linked=""
problems=""                       # the steps that did not end well, for the last line
export PYTHONUNBUFFERED=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

now() { date +%s; }
elapsed() { echo $(( $(now) - t0 )); }
until_t() { local s=$(( $1 - $(now) )); [ "$s" -lt 0 ] && s=0; echo "$s"; }  # seconds until time $1
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
say() { echo "gpu_session: $*" | tee -a "$logs/session.log"; }
note() { [ "$2" -ne 0 ] && problems="${problems:+$problems, }$1 ($(how "$2" "${3:-?}"))"; return 0; }  # note STEP RC [LIMIT]

# bounded_copy SRC DST: SRC, or (over $log_cap bytes) its first eighth and last seven eighths of $log_cap
bounded_copy() {
  local size; size=$(stat -c %s "$1" 2>/dev/null || echo 0)
  if [ "$size" -le "$log_cap" ]; then cp "$1" "$2"; return; fi
  { head -c $((log_cap / 8)) "$1"
    printf '\n\n[gpu_session: %s bytes cut here; the file had %s bytes, its head and tail are kept]\n\n' \
      "$((size - log_cap))" "$size"
    tail -c $((log_cap - log_cap / 8)) "$1"; } > "$2"
}

# snapshot: $out/gpu_session.tar.gz from bounded copies of the logs (live files are not touched);
# a tarball over $max_bytes is made again with a quarter of the bytes per log
snapshot() {
  local f log_cap=$log_cap try
  for try in 1 2 3 4; do
    rm -rf "$stage/t" && mkdir -p "$stage/t" || return
    while IFS= read -r -d '' f; do
      mkdir -p "$stage/t/$(dirname "$f")" && bounded_copy "$logs/$f" "$stage/t/$f"
    done < <(cd "$logs" && find . -type f -print0)
    tar -czf "$stage/s.tar.gz" -C "$stage/t" . 2>/dev/null || return
    [ "$(stat -c %s "$stage/s.tar.gz")" -le "$max_bytes" ] && break
    log_cap=$((log_cap / 4))
  done
  mv -f "$stage/s.tar.gz" "$out/gpu_session.tar.gz"
}

# the stand-in GPU_SESSION_SIMULATE names for step $1 (a test hook), else nothing
simulated() {
  local s
  for s in ${GPU_SESSION_SIMULATE//,/ }; do  # (set -u: defaulted below)
    case "$s" in "$1="*) echo "${s#*=}" ;; esac
  done
}

# stand_in NAME CMD...: cmd=(CMD...), or the stand-in GPU_SESSION_SIMULATE names for step NAME
stand_in() {
  local name=$1; shift
  case "$(simulated "$name")" in
    fail) cmd=(sh -c "echo 'gpu_session: simulated failure of the $name step' >&2; exit 3") ;;
    hang) cmd=(sleep 100000) ;;
    spew) cmd=(sh -c "head -c 24000000 /dev/urandom | base64 -w 100; echo 'the last line of the $name step'; exit 1") ;;
    *) cmd=("$@") ;;
  esac
}

# limited NAME SECONDS CMD...: CMD (or its stand-in) under timeout: at SECONDS its process group
# gets SIGTERM, 5 s later SIGKILL (exit 124 or 137); under 1 s left it is not run (125).
limited() {
  local name=$1 secs=$2; shift 2
  stand_in "$name" "$@"
  if [ "$secs" -lt 1 ]; then echo "gpu_session: no time left for the $name step"; return 125; fi
  timeout -k 5 "$secs" "${cmd[@]}"
}

how() {  # how RC SECONDS: words for a step's exit status
  case "$1" in
    0) echo "exit 0" ;;
    124|137) echo "cut at its ${2} s limit (exit $1)" ;;
    125) echo "not run (no time left)" ;;
    *) echo "exit $1" ;;
  esac
}

finish() {
  local rc=$? n extra
  trap - EXIT INT TERM
  [ -n "$build_pid" ] && kill -TERM "$build_pid" 2>/dev/null   # (timeout passes it to the build's group)
  [ -n "$env_pid" ] && kill -TERM "$env_pid" 2>/dev/null
  [ -n "$linked" ] && rm -f "$linked"
  # at most $max_files plain files of at most $max_bytes in $out
  rm -f "$out"/*.tmp
  n=$(find "$out" -mindepth 1 -maxdepth 1 ! -name gpu_session.tar.gz | wc -l)
  if [ "$n" -ge "$max_files" ]; then  # (gpu_sample packs at most max_files - 1: not expected)
    mkdir -p "$logs/extra"
    for extra in $( (cd "$out" && ls -d -- *.npy 2>/dev/null; ls -S -r | grep -v '\.npy$') \
                    | grep -vx gpu_session.tar.gz | head -n $((n - max_files + 1))); do
      say "$extra: one file over the $max_files, moved into gpu_session.tar.gz"
      mv "$out/$extra" "$logs/extra/"
    done
  fi
  say "done at $(elapsed) s of $budget (exit $rc); card: ${card:-unknown}; ${problems:-every step ended well}"
  snapshot
  for extra in "$out"/*; do
    [ -f "$extra" ] || continue
    if [ "$(stat -c %s "$extra")" -gt "$max_bytes" ]; then
      echo "gpu_session: $(basename "$extra"): over $max_bytes bytes, cut to that (a cut .tar.gz still gives its first members)"
      truncate -s "$max_bytes" "$extra"
    fi
  done
  echo "gpu_session: $(ls "$out" | wc -l) files in $out:"
  ls -l "$out" | tail -n +2
  rm -rf "$logs" "$stage" ${build:+"$build"}
  exit "$rc"
}
trap finish EXIT
trap 'say "stopped by a signal"; exit 143' INT TERM

mkdir -p "$out" "$work" "$logs/gpu_check"
card="unknown"
say "budget ${budget} s (steps until $((end - t0)) s, sampling until $((sample_end - t0)) s), posterior ${posterior}," \
    "work ${work}, python ${py}${dry:+, dry run}"

# 0. facts, in the background (each bounded, and all of them together)
env_facts() {
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"; echo "uname: $(uname -a)"; echo "cpus: $(nproc)"
  free -g 2>&1 | head -3; df -h . /tmp 2>&1
  echo "python: $(command -v "$py")"
  timeout 30 "$py" -V 2>&1
  timeout 30 "$py" -m pip --version 2>&1
  echo "--- nvidia-smi"
  timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  timeout 20 nvidia-smi --query-gpu=compute_cap,clocks.max.sm,power.limit --format=csv 2>&1
  timeout 20 nvidia-smi 2>&1 | head -30
  echo "--- nvcc ($(command -v nvcc || echo 'not on PATH'); CUDA_HOME=${CUDA_HOME:-unset})"
  timeout 20 nvcc --version 2>&1 | tail -3
  echo "--- torch, triton"
  timeout 90 "$py" -c '
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print("triton: not importable:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("card:", p.name, "|", p.multi_processor_count, "SMs |", p.total_memory >> 20, "MiB | sm_%d%d" % (p.major, p.minor))
else:
    print("card: none (torch sees no CUDA device)")
' 2>&1
}
export -f env_facts
export py
timeout -k 2 "$(min 150 $((budget / 3)))" bash -c env_facts > "$logs/env.log" 2>&1 &
env_pid=$!

# 1. install (no compile, no network), then check that the Triton kernels are importable
if [ -n "$dry" ]; then install_args=(--dry-run); else install_args=(); fi
install_s=$(min 90 $((budget / 6)))
limited install "$install_s" env ETWEEDIE_NO_EXT=1 "$py" -m pip install --no-index \
  --no-deps --no-build-isolation --no-cache-dir --disable-pip-version-check ${install_args[@]+"${install_args[@]}"} -e . \
  > "$logs/install.log" 2>&1
rc=$?
say "install${dry:+ (pip --dry-run)}: $(how $rc "$install_s") at $(elapsed) s"; note install $rc "$install_s"
[ "$rc" -ne 0 ] && tail -5 "$logs/install.log"
kernels_check='import importlib.util, etweedie
s = importlib.util.find_spec("etweedie.kernels")
print("etweedie from", etweedie.__file__, "| etweedie.kernels from", s.submodule_search_locations if s else None)
print("backends", etweedie.backends.available())
raise SystemExit(0 if s else 1)'
(cd / && limited check "$(min 60 "$(until_t "$sample_end")")" "$py" -c "$kernels_check") > "$logs/kernels_check.log" 2>&1
rc=$?
if [ "$rc" -ne 0 ] && [ -z "$dry" ] && [ ! -e etweedie/kernels ]; then
  # the package is not installed: link the kernels where the source tree's etweedie finds them
  ln -s ../kernels etweedie/kernels && linked=etweedie/kernels
  note "kernels check" "$rc"
  limited check "$(min 60 "$(until_t "$sample_end")")" "$py" -c "$kernels_check" >> "$logs/kernels_check.log" 2>&1
  say "etweedie.kernels not importable from the install ($(how "$rc" ?)): linked etweedie/kernels -> ../kernels" \
      "for this session; from the source tree now: $(how $? ?)"
else
  say "etweedie.kernels importable from the installed package: $( [ "$rc" -eq 0 ] && echo yes || echo "no ($(how "$rc" ?))")"
  note "kernels check" "$rc"
fi
snapshot

# 1b. the CUDA extension, compiled in a copy of the tree on the CPUs while the GPU samples
build="$(mktemp -d)"
build_cut=$(( sample_end + 30 < end - table_min - 3 ? sample_end + 30 : end - table_min - 3 ))
build_s=$(until_t "$build_cut")
if [ -n "$dry" ]; then build_env=(ETWEEDIE_NO_EXT=1); else build_env=(FORCE_CUDA=1); fi
stand_in build bash -c '
  tar --exclude=__pycache__ --exclude="*.so" -cf - setup.py pyproject.toml README.md csrc etweedie kernels \
    | tar -xf - -C "$1" && cd "$1" && shift \
    && env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" "$@" setup.py build_ext --inplace' \
  _ "$build" "${build_env[@]}" "$py"
if [ "$build_s" -ge 1 ]; then
  timeout -k 5 "$build_s" "${cmd[@]}" > "$logs/build.log" 2>&1 &   # ($! is timeout's: killing it stops the build)
  build_pid=$!
  say "extension build started (limit ${build_s} s${dry:+; dry run: ETWEEDIE_NO_EXT=1, nothing compiled})"
else
  say "no time left for the extension build"
fi

# 2. sampling until its share of the budget; a process that did not pack is packed after it
if [ -n "$dry" ]; then
  sample_args=(--dry-run --no-bench --work "$work" --pack-dir "$out" --max-files $((max_files - 1)) --paths mnist_joint)
else
  sample_args=(--posterior "$posterior" --work "$work" --pack-dir "$out" --max-files $((max_files - 1)) --no-bench)
fi
sample_s=$(until_t "$sample_end")
pack_keep=$(min 10 $((budget / 10)))   # seconds kept for a --pack-only after a killed sampling
grace=$(min 15 $((budget / 20)))        # past its --deadline, gpu_sample is killed after this
hard_s=$(min $((sample_s + grace)) "$(until_t $((end - pack_keep)))")
touch "$stage/sample_start"
# (into a file, not a pipe: a child that outlived the kill would hold a pipe open and stall the session)
limited sample "$hard_s" "$py" -m experiments.mnist.gpu_sample "${sample_args[@]}" --deadline "$sample_s" \
  > "$logs/sample.log" 2>&1
rc=$?
tail -n 40 "$logs/sample.log"
say "sampling: $(how "$rc" "$hard_s") at $(elapsed) s"; note sampling "$rc" "$hard_s"
# gpu_sample packs what it finished, also after an error; not when killed or crashed before that
if [ "$out/sampling_log.json" -nt "$stage/sample_start" ] \
   && { [ "$out/parts.tar.gz" -nt "$stage/sample_start" ] || [ ! -d "$work/parts" ]; }; then
  say "sampling pack written by gpu_sample"
else
  pack_s=$(min 60 "$(until_t "$end")")
  limited pack "$pack_s" "$py" -m experiments.mnist.gpu_sample "${sample_args[@]}" --pack-only > "$logs/pack_only.log" 2>&1
  rc=$?
  say "no pack from gpu_sample: packed what ${work} holds (--pack-only): $(how $rc "$pack_s") at $(elapsed) s"
  note "pack" "$rc" "$pack_s"
fi
snapshot

# 3. the extension in, then the kernel table until the end
if [ -n "$build_pid" ]; then
  wait "$build_pid"; rc=$?; build_pid=""   # (bounded: the build runs under timeout)
  say "extension build: $(how "$rc" "$build_s") at $(elapsed) s"; note build "$rc" "$build_s"
  [ "$rc" -ne 0 ] && tail -5 "$logs/build.log"
  so=$(ls "$build"/etweedie/_C*.so 2>/dev/null | head -1)
  if [ -n "$dry" ]; then
    say "dry run: no compiled extension is copied into the tree"
  elif [ -n "$so" ] && cp "$so" etweedie/; then
    say "compiled extension copied in: etweedie/$(basename "$so")"
  else
    say "no compiled extension (the table runs the reference, compile and Triton rows)"
  fi
fi
wait "$env_pid" 2>/dev/null; env_pid=""   # (bounded: the facts run under one timeout)
card=$(sed -n 's/^card: //p' "$logs/env.log" | head -1)
say "card: ${card:-not read}"
snapshot
table_s=$(until_t "$end")
if [ "$table_s" -ge "$table_min" ]; then
  check_args=(--skip-build --skip-check-cuda --skip-cpu-table --out "$logs/gpu_check" --only "${ONLY:-et_score_,langevin,energy_score,student_t}")
  [ -n "$dry" ] && check_args+=(--dry-run)
  tests_s=0
  if [ -n "${GPU_TESTS:-}" ]; then
    tests_s=$(min "${GPU_TESTS_S:-90}" $((table_s / 2))); [ "$tests_s" -lt 1 ] && tests_s=1
    check_args+=(--pytest-args "$GPU_TESTS" --tests-timeout "$tests_s")
  else
    check_args+=(--skip-tests)
  fi
  # no row starts after --deadline; the whole step is killed at table_s
  row_deadline=$((table_s - 20 - tests_s)); [ "$row_deadline" -lt 1 ] && row_deadline=1
  limited table "$table_s" "$py" scripts/gpu_check.py "${check_args[@]}" --deadline "$row_deadline" \
    > "$logs/gpu_check.stdout" 2>&1
  rc=$?
  say "kernel table: $(how "$rc" "$table_s") at $(elapsed) s"; note table "$rc" "$table_s"
  grep -E "^\| |gpu-check:|cannot run|table stopped" "$logs/gpu_check.stdout" | awk '!seen[$0]++' | tail -60
  [ -f "$logs/gpu_check/results.json" ] || say "kernel table: no results.json (see gpu_check.stdout in the tarball)"
else
  say "no time left for the kernel table (${table_s} s)"; problems="${problems:+$problems, }table (no time left)"
fi
exit 0

#!/usr/bin/env bash
# One time-boxed session on a GPU machine whose python3 holds a CUDA torch (no network needed):
# the MNIST paths with the shipped paper-width posterior, then the kernel table, each under a
# deadline, packed into at most 8 files of at most 16 MB in OUTDIR.
#
#   scripts/gpu_session.sh OUTDIR [SECONDS]        # SECONDS: the whole budget (default 570)
#   GPU_SESSION_DRY=1 scripts/gpu_session.sh /tmp/s 120   # the same steps on a CPU (tiny sampling;
#                                                         # the kernel table then stops at its preflight)
#
# Steps, with the time each gets (experiments/mnist/RESULTS.md, "On a lent GPU"):
#   1. install the package without compiling (seconds; the Triton kernels come with it) and, in
#      the background on the CPUs, compile the CUDA extension in a copy of the tree (sm_90);
#   2. experiments.mnist.gpu_sample until SAMPLE_SHARE of the budget (default 0.65): the parts
#      continue in WORK (default runs/mnist_gpu; carry a pack's parts.tar.gz there to go on);
#   3. the compiled extension copied in, then scripts/gpu_check.py (table only) until the budget
#      ends less a reserve for the pack;
#   4. OUTDIR: the sampling pack (≤ 7 files: <path>.npy, progress.npz, sampling_log.json,
#      parts.tar.gz) and gpu_session.tar.gz (the kernel table's log and JSON, the build log).
set -uo pipefail

out="${1:?usage: scripts/gpu_session.sh OUTDIR [SECONDS]}"
budget="${2:-570}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
py="${PYTHON:-python3}"
work="${WORK:-runs/mnist_gpu}"
posterior="${POSTERIOR:-mnist_full}"
share="${SAMPLE_SHARE:-0.65}"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
logs="$(mktemp -d)"
build=""
trap 'rm -rf "$logs" ${build:+"$build"}' EXIT
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1

echo "gpu_session: budget ${budget} s, posterior ${posterior}, work ${work}"
if [ -z "${GPU_SESSION_DRY:-}" ]; then  # (a dry run uses the checkout's own install)
  ETWEEDIE_NO_EXT=1 "$py" -m pip install -q --no-build-isolation --no-deps -e . > "$logs/install.log" 2>&1 \
    || { echo "gpu_session: pip install failed:"; tail -5 "$logs/install.log"; }
  build="$(mktemp -d)"
  ( tar --exclude=./.git --exclude=./runs --exclude=./.venv -cf - . | tar -xf - -C "$build" && cd "$build" \
      && TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" FORCE_CUDA=1 "$py" setup.py build_ext --inplace ) \
    > "$logs/build.log" 2>&1 &
  build_pid=$!
fi

sample_s=$("$py" -c "print(int($budget * $share))")
if [ -n "${GPU_SESSION_DRY:-}" ]; then
  "$py" -m experiments.mnist.gpu_sample --dry-run --no-bench --work "$work" --pack-dir "$out" \
    --deadline "$sample_s" --paths mnist_joint
else
  "$py" -m experiments.mnist.gpu_sample --posterior "$posterior" --work "$work" --pack-dir "$out" \
    --deadline "$sample_s" --no-bench
fi
echo "gpu_session: sampling exit $? at $(elapsed) s"

if [ -n "${build_pid:-}" ]; then
  wait "$build_pid"; echo "gpu_session: extension build exit $? at $(elapsed) s"
  cp "$build"/etweedie/_C*.so etweedie/ 2>/dev/null || echo "gpu_session: no compiled extension (the table runs Triton only)"
fi
left=$(( budget - $(elapsed) - 20 ))
if [ "$left" -gt 30 ]; then
  timeout $(( left + 15 )) "$py" scripts/gpu_check.py --skip-build --skip-check-cuda --skip-tests --skip-cpu-table \
    --out "$logs/gpu_check" --deadline $(( left - 20 )) --only "${ONLY:-et_score_,langevin,energy_score,student_t}" \
    > "$logs/gpu_check.stdout" 2>&1
  echo "gpu_session: kernel table exit $? at $(elapsed) s"
  grep -E "^\| |gpu-check:|cannot run" "$logs/gpu_check.stdout" | tail -60
else
  echo "gpu_session: no time left for the kernel table"
fi
tar -czf "$out/gpu_session.tar.gz" -C "$logs" .
echo "gpu_session: done at $(elapsed) s; $(ls "$out" | wc -l) files in $out"

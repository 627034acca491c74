#!/usr/bin/env bash
# Compile-check every CUDA source with plain nvcc — no torch include paths — for each target
# architecture, and save the ptxas resource report (registers, spills, stack per kernel).
#
#   scripts/check_cuda.sh                 # sm_80 and sm_90 (override: CUDA_ARCHS="80 90")
#   NVCC=/path/to/nvcc scripts/check_cuda.sh
#   STRICT_SPILLS=1 scripts/check_cuda.sh # fail when a kernel spills
#
# Output: benchmarks/ptxas_report.txt (summary table, spilling kernels called out, then the raw
# ptxas log).  Exit status: non-zero when a source fails to compile (or spills, with
# STRICT_SPILLS=1).  Only the bindings (csrc/cuda/*_bindings.cpp) need a CUDA torch; they are
# not compiled here.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${NVCC:-nvcc}"
CUDA_ARCHS="${CUDA_ARCHS:-80 90}"
REPORT="${REPORT:-$root/benchmarks/ptxas_report.txt}"
PYTHON="${PYTHON:-python3}"
# Same device flags as setup.py's CUDAExtension.
FLAGS=(-O3 -std=c++17 --use_fast_math -lineinfo -I"$root/csrc" -Xptxas -v)

if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "check_cuda: $NVCC not found (set NVCC=... or put CUDA's bin/ on PATH)" >&2
  exit 2
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
raw="$tmp/ptxas.log"
: >"$raw"
status=0
shopt -s nullglob
sources=("$root"/csrc/cuda/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "check_cuda: no csrc/cuda/*.cu sources" >&2
  exit 2
fi
echo "check_cuda: $("$NVCC" --version | tail -n 2 | head -n 1)"
# One nvcc per (source, arch), in parallel; logs are concatenated in a fixed order.
pids=()
jobs_desc=()
for arch in $CUDA_ARCHS; do
  for src in "${sources[@]}"; do
    name="$(basename "$src" .cu)"
    log="$tmp/$name.sm_$arch.log"
    "$NVCC" "${FLAGS[@]}" -gencode "arch=compute_$arch,code=sm_$arch" -c "$src" -o "$tmp/$name.sm_$arch.o" >"$log" 2>&1 &
    pids+=($!)
    jobs_desc+=("$name sm_$arch")
  done
done
for i in "${!pids[@]}"; do
  read -r name arch <<<"${jobs_desc[$i]}"
  log="$tmp/$name.$arch.log"
  if wait "${pids[$i]}"; then
    printf '  %-28s %s ok\n' "$name.cu" "$arch"
  else
    printf '  %-28s %s FAILED\n' "$name.cu" "$arch"
    cat "$log" >&2
    status=1
  fi
  { echo "### $name.cu $arch"; cat "$log"; } >>"$raw"
done

mkdir -p "$(dirname "$REPORT")"
DEMANGLE="$(command -v cu++filt || command -v c++filt || true)"
py_status=0
"$PYTHON" - "$raw" "$REPORT" "$DEMANGLE" "$("$NVCC" --version | tail -n 2 | head -n 1)" <<'PY' || py_status=$?
import re, subprocess, sys

raw_path, report_path, demangler, version = sys.argv[1:5]
text = open(raw_path).read()
rows, source, arch, fn = [], None, None, None
for line in text.splitlines():
    m = re.match(r"### (\S+) (sm_\d+)", line)
    if m:
        source, arch = m.groups()
        continue
    m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
    if m:
        fn = m.group(1)
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and fn:
        stack, st, ld = map(int, m.groups())
        rows.append({"source": source, "arch": arch, "fn": fn, "stack": stack, "spill_st": st, "spill_ld": ld})
        continue
    m = re.search(r"Used (\d+) registers", line)
    if m and fn and rows and rows[-1]["fn"] == fn and "regs" not in rows[-1]:
        rows[-1]["regs"] = int(m.group(1))
        fn = None

def demangle(names):
    if not demangler or not names:
        return names
    out = subprocess.run([demangler], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names

def short(name):
    # etweedie::cuda::et_score_bwd_kernel<float, 2, 3>(...) -> et_score_bwd_kernel<float, 2, 3>
    name = name.split("(")[0]
    if name.startswith("void "):
        name = name[5:]
    return name.replace("etweedie::cuda::", "")

names = demangle([r["fn"] for r in rows])
for r, n in zip(rows, names):
    r["name"] = short(n)

spilling = [r for r in rows if r["spill_st"] or r["spill_ld"]]
lines = [
    "ptxas resource report for csrc/cuda/*.cu (scripts/check_cuda.sh; plain nvcc, no torch headers)",
    f"compiler: {version}",
    "flags: -O3 -std=c++17 --use_fast_math -lineinfo -Xptxas -v",
    "template arguments: <dtype[, draws' storage (score kernels: dtype, bf16, fp16)], metric kind (0 isotropic, 1 diagonal, 2 block), block size k[, langevin]>",
    "",
    f"{'kernel':<58} {'arch':<6} {'regs':>4} {'stack':>5} {'spill st':>8} {'spill ld':>8}",
]
for r in sorted(rows, key=lambda r: (r["source"], r["name"], r["arch"])):
    flag = "  <-- SPILLS" if (r["spill_st"] or r["spill_ld"]) else ""
    lines.append(f"{r['name']:<58} {r['arch']:<6} {r.get('regs', -1):>4} {r['stack']:>5} {r['spill_st']:>8} {r['spill_ld']:>8}{flag}")
lines.append("")
if spilling:
    lines.append(f"SPILLS: {len(spilling)} of {len(rows)} kernel instantiations spill registers to local memory:")
    for r in spilling:
        lines.append(f"  {r['name']} ({r['arch']}): {r['spill_st']} B stores / {r['spill_ld']} B loads, {r.get('regs')} registers")
else:
    lines.append(f"SPILLS: none ({len(rows)} kernel instantiations)")
lines += ["", "raw ptxas output:", text]
open(report_path, "w").write("\n".join(lines) + "\n")
summary = [l for l in lines if l.startswith("SPILLS") or l.startswith("  ") and "B stores" in l]
print("\n".join(summary))
print(f"check_cuda: report written to {report_path}")
sys.exit(3 if spilling else 0)
PY
if [ "$py_status" -eq 3 ] && [ "${STRICT_SPILLS:-0}" = "1" ]; then
  status=1
elif [ "$py_status" -ne 0 ] && [ "$py_status" -ne 3 ]; then
  status=1
fi
exit "$status"

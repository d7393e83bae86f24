#!/usr/bin/env bash
# The GPU check (issues 5 and 25), one script for a machine with one CUDA GPU (H100/H200 class), ~5 minutes:
#   1. attention backends against a float64 reference on CUDA (fp32 and bf16)
#   2. communication timing (issue 25): CommTimer's CUDA-event path on a collective of known length and on a
#      64 MiB NCCL all-reduce over a 1-rank group, against plain CUDA events and the α–β model; peak memory
#      per phase (forward, backward, sync, optimizer) for ddp vs zero2 (benchmarks/gpu_comm_check.py)
#   3. attention fwd+bwd, bf16, seq 1k–16k: labkit_triton vs flash_attn vs sdpa (and labkit_flash to 4k)
#   4. a short training run: bf16 + the best attention available + compile=verify, with MFU (it joins an
#      NCCL group and builds the (dp, pp, tp) device mesh on CUDA: labkit.parallel.mesh)
# and prints a short table last. A backend that cannot run (flash-attn not installed) is marked
# unavailable, not failed. Run from the repository root:  bash benchmarks/gpu_check.sh
#   SECTIONS="check comm bench train"  the sections to run (e.g. SECTIONS=comm: issue 25's check alone, ~1 min)
#   BUDGET=300                         seconds for the whole run: each section is bounded with `timeout` by its
#                                      own limit and by what the budget leaves after the later sections' shares
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${PY:-}" ]; then  # the interpreter that has torch (a GPU image may have only python3)
  for candidate in python python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then PY=$candidate; break; fi
  done
  PY=${PY:-python}
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export SECTIONS=${SECTIONS:-"check comm bench train"}
BUDGET=${BUDGET:-300}
START=$SECONDS
declare -A SHARE=([check]=45 [comm]=45 [bench]=60 [train]=60)  # the least each section is left
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
# limit NAME OWN: seconds section NAME may run: its own limit, or what the budget leaves after the shares
# of the wanted sections that follow it
limit() {
  local name=$1 own=$2 later=0 seen=0 s
  for s in check comm bench train; do
    if [ "$seen" = 1 ] && want "$s"; then later=$((later + SHARE[$s])); fi
    [ "$s" = "$name" ] && seen=1
  done
  local left=$((BUDGET - (SECONDS - START) - later))
  if [ "$left" -gt "$own" ]; then left=$own; fi
  echo $((left < 10 ? 0 : left))
}
skipped() { echo "skipped: $1 (the ${BUDGET} s budget is spent; BUDGET=... gives more)"; }
echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY - <<'PY'
import torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = "not installed"
try:
    import flash_attn; fv = flash_attn.__version__
except ImportError:
    fv = "not installed"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {tv}, flash-attn {fv}")
print(f"GPU: {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
PY

if want check; then
  echo "== 1. correctness"
  T=$(limit check 150)
  if [ "$T" -gt 0 ]; then timeout "$T" $PY benchmarks/gpu_attention.py check | tee "$OUT/check.jsonl"; else skipped check; fi
fi
if want comm; then
  echo "== 2. communication timing and memory per phase (issue 25)"
  T=$(limit comm 120)
  if [ "$T" -gt 0 ]; then
    timeout "$T" $PY benchmarks/gpu_comm_check.py --out "$OUT/comm_check.json" 2>&1
  else skipped comm; fi
fi
if want bench; then
  echo "== 3. attention benchmark"
  T=$(limit bench 200)
  if [ "$T" -gt 0 ]; then timeout "$T" $PY benchmarks/gpu_attention.py bench | tee "$OUT/bench.jsonl"; else skipped bench; fi
fi
if want train; then
  echo "== 4. training: bf16, attention auto, compile verify"
  RUNS="$OUT/runs"
  T=$(limit train 150)
  if [ "$T" -gt 0 ]; then
    timeout "$T" $PY -m labkit train configs/quickstart.yaml --nproc 1 --steps 200 \
      --set run.runs_dir="$RUNS" --set precision.mode=bf16 --set attention.backend=auto \
      --set run.compile=verify --set run.eval_every=0 --set model.n_layer=6 --set model.n_embd=384 \
      --set model.n_head=6 --set model.block_size=256 --set data.batch_size=32 --set data.micro_batch_size=32 \
      2>&1 | tail -5
  else skipped train; fi
fi
echo
echo "== summary"
echo "($((SECONDS - START)) s of the ${BUDGET} s budget; sections: $SECTIONS)"
$PY - "$OUT" <<'PY'
import glob, json, os, sys
out, sections = sys.argv[1], os.environ["SECTIONS"].split()
rows = [json.loads(l) for f in ("check.jsonl", "bench.jsonl") if os.path.exists(f"{out}/{f}")
        for l in open(f"{out}/{f}") if l.startswith("{")]
if "check" in sections:
    print(f"{'check':<14} {'dtype':<9} {'max rel. error':>15}  status")
for r in rows:
    if r["kind"] == "check":
        err = f"{max(r['errors']):.2e}" if "errors" in r else "-"
        print(f"{r['backend']:<14} {r['dtype']:<9} {err:>15}  {r['status']}")
if "bench" in sections:
    print(f"\n{'attention':<14} {'seq':>6} {'ms fwd+bwd':>11} {'peak MiB':>9} {'TFLOPS':>7}  status")
for r in rows:
    if r["kind"] == "bench":
        if r["status"] == "ok":
            print(f"{r['backend']:<14} {r['seq']:>6} {r['time_ms']:>11.2f} {r['peak_mib']:>9.0f} {r['tflops']:>7.1f}  ok")
        else:
            print(f"{r['backend']:<14} {r['seq']:>6} {'-':>11} {'-':>9} {'-':>7}  {r['status']}")
summaries = glob.glob(f"{out}/runs/*/summary.json")
for path in summaries:
    s = json.load(open(path))
    mfu = "n/a" if s.get("mfu") is None else f"{s['mfu']:.1%}"
    comp = s.get("compile") or {}
    print(f"\ntraining: {s.get('status')}, attention {s.get('attention_kernel')}, {s.get('tokens_per_s', 0):.0f} tokens/s, "
          f"MFU {mfu} (peak {s.get('peak_tflops')} TFLOPS, {s.get('peak_source')}); compile verify: "
          f"eager {1e3 * comp.get('eager_step_s', float('nan')):.1f} ms, compiled {1e3 * comp.get('compiled_step_s', float('nan')):.1f} ms, "
          f"kept {comp.get('kept')}; auto: {s.get('auto')}")
if not summaries and "train" in sections:
    print("\ntraining: no summary written (see the log above)")
print()
PY
if [ -f "$OUT/comm_check.json" ]; then
  $PY benchmarks/gpu_comm_check.py --table "$OUT/comm_check.json"
elif want comm; then
  echo "comm timing: no result written (see section 2 above)"
fi

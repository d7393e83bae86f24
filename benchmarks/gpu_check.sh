#!/usr/bin/env bash
# The GPU check (issue 5), one script for a machine with one CUDA GPU (H100/H200 class), ~8 minutes:
#   1. attention backends against a float64 reference on CUDA (fp32 and bf16)
#   2. attention fwd+bwd, bf16, seq 1k–16k: labkit_triton vs flash_attn vs sdpa (and labkit_flash to 4k)
#   3. a short training run: bf16 + the best attention available + compile=verify, with MFU (it joins an
#      NCCL group and builds the (dp, pp, tp) device mesh on CUDA: labkit.parallel.mesh)
# and prints a short table last. A backend that cannot run (flash-attn not installed) is marked
# unavailable, not failed. Run from the repository root:  bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
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

echo "== 1. correctness"
timeout 150 $PY benchmarks/gpu_attention.py check | tee "$OUT/check.jsonl"
echo "== 2. attention benchmark"
timeout 200 $PY benchmarks/gpu_attention.py bench | tee "$OUT/bench.jsonl"
echo "== 3. training: bf16, attention auto, compile verify"
RUNS="$OUT/runs"
timeout 150 $PY -m labkit train configs/quickstart.yaml --nproc 1 --steps 200 \
  --set run.runs_dir="$RUNS" --set precision.mode=bf16 --set attention.backend=auto \
  --set run.compile=verify --set run.eval_every=0 --set model.n_layer=6 --set model.n_embd=384 \
  --set model.n_head=6 --set model.block_size=256 --set data.batch_size=32 --set data.micro_batch_size=32 \
  2>&1 | tail -5

echo
echo "== summary"
$PY - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
rows = [json.loads(l) for f in ("check.jsonl", "bench.jsonl") for l in open(f"{out}/{f}") if l.startswith("{")] \
    if glob.glob(f"{out}/check.jsonl") else []
print(f"{'check':<14} {'dtype':<9} {'max rel. error':>15}  status")
for r in rows:
    if r["kind"] == "check":
        err = f"{max(r['errors']):.2e}" if "errors" in r else "-"
        print(f"{r['backend']:<14} {r['dtype']:<9} {err:>15}  {r['status']}")
print()
print(f"{'attention':<14} {'seq':>6} {'ms fwd+bwd':>11} {'peak MiB':>9} {'TFLOPS':>7}  status")
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
if not summaries:
    print("\ntraining: no summary written (see the log above)")
PY

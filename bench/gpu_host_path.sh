#!/usr/bin/env bash
# Issue 31's checks on a GPU, in one go (a lent GPU's time is short):
#   bash bench/gpu_host_path.sh OUT_DIR [BEFORE_SRC]
# OUT_DIR gets the JSON records and logs; BEFORE_SRC (a checkout's src/ of an older
# thinwire) adds a "before" run of the ResNet-18 table. Each step has its own time limit,
# so that one that hangs does not take the others' results with it. ONLY="a b" runs only
# the steps named (dgc-selection orthonormal ops r18-after r18-before r18-fused linear-after
# syncs-256 syncs-512 syncs-fused gpu-check tests; *-fused: a fused SGD given to thinwire,
# which refuses a step on the device); R18_METHODS narrows the ResNet-18 table.
set -u
out=${1:?usage: gpu_host_path.sh OUT_DIR [BEFORE_SRC]}
before=${2:-}
only=${ONLY:-}
mkdir -p "$out"
export PYTHONPATH=src:bench PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  if [ -n "$only" ] && [[ " $only " != *" $name "* ]]; then return; fi
  echo "== $name"
  local started=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "   exit $? after $((SECONDS - started)) s"
  tail -n 30 "$out/$name.log"
}
nvidia-smi -L
$py -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))'
r18=(--device cuda --model resnet18 --batch 32 --warmup 10 --steps 20 --rounds "${R18_ROUNDS:-3}"
     --methods "${R18_METHODS:-all}")
step tests 150 $py -m pytest -q -p no:cacheprovider tests/test_fused_selection.py \
  tests/test_gpu_sync.py tests/test_dgc_threshold.py tests/test_powersgd_bucket.py
step dgc-selection 120 $py bench/dgc_selection.py --device cuda --out "$out/dgc-selection.json"
step orthonormal 60 $py bench/orthonormal_cost.py --device cuda --out "$out/orthonormal.json"
step ops 150 $py bench/ops_per_step.py --device cuda --profile \
  --methods "${OPS_METHODS:-none,powersgd,dgc,onebit}" \
  --variant powersgd-stacks=powersgd:rank=2,layout=stacks --out "$out/ops.json"
step r18-after 200 $py bench/host_cost.py "${r18[@]}" \
  --variant powersgd-stacks=powersgd:rank=2,layout=stacks --out "$out/host-cost-r18-after.json"
if [ -n "$before" ]; then
  step r18-before 200 env PYTHONPATH="$before:bench" $py bench/host_cost.py "${r18[@]}" \
    --out "$out/host-cost-r18-before.json"
fi
step r18-fused 200 $py bench/host_cost.py "${r18[@]}" --fused --out "$out/host-cost-r18-fused.json"
step linear-after 90 $py bench/host_cost.py --device cuda --rounds 3 \
  --out "$out/host-cost-linear-after.json"
step syncs-256 90 $py bench/gpu_syncs.py --out "$out/syncs-256.json"
step syncs-512 90 $py bench/gpu_syncs.py --width 512 \
  --methods ddp,none,powersgd,dgc,topk,randomk,onebit,terngrad --out "$out/syncs-512.json"
step syncs-fused 90 $py bench/gpu_syncs.py --fused --out "$out/syncs-fused.json"
step gpu-check 200 $py bench/gpu_check.py --layouts ncclx1-cuda,gloox2-cuda --out "$out/gpu-check"

#!/usr/bin/env bash
# Issue 31's checks on a GPU, in one go (a lent GPU's time is short):
#   bash bench/gpu_host_path.sh OUT_DIR [BEFORE_SRC]
# OUT_DIR gets the JSON records and logs; BEFORE_SRC (a checkout's src/ of an older
# thinwire) adds a "before" run of the ResNet-18 table. Each step has its own time limit,
# so that one that hangs does not take the others' results with it.
set -u
out=${1:?usage: gpu_host_path.sh OUT_DIR [BEFORE_SRC]}
before=${2:-}
mkdir -p "$out"
export PYTHONPATH=src:bench PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  local started=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "   exit $? after $((SECONDS - started)) s"
  tail -n 25 "$out/$name.log"
}
nvidia-smi -L
$py -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'
step dgc-selection 120 $py bench/dgc_selection.py --device cuda --out "$out/dgc-selection.json"
step r18-after 200 $py bench/host_cost.py --device cuda --model resnet18 --batch 32 \
  --warmup 10 --steps 20 --rounds 3 --variant dgc-exact=dgc:density=0.01,selection=exact \
  --out "$out/host-cost-r18-after.json"
if [ -n "$before" ]; then
  step r18-before 200 env PYTHONPATH="$before:bench" $py bench/host_cost.py --device cuda \
    --model resnet18 --batch 32 --warmup 10 --steps 20 --rounds 3 \
    --out "$out/host-cost-r18-before.json"
fi
step linear-after 90 $py bench/host_cost.py --device cuda --rounds 3 \
  --out "$out/host-cost-linear-after.json"
step syncs-256 90 $py bench/gpu_syncs.py --out "$out/syncs-256.json"
step syncs-512 90 $py bench/gpu_syncs.py --width 512 \
  --methods ddp,none,powersgd,dgc,topk,randomk,onebit,terngrad --out "$out/syncs-512.json"
step gpu-check 200 $py bench/gpu_check.py --layouts ncclx1-cuda,gloox2-cuda --out "$out/gpu-check"
step tests 150 $py -m pytest -q -p no:cacheprovider tests/test_gpu_sync.py tests/test_dgc_threshold.py

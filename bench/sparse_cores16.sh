#!/usr/bin/env bash
# Issue 29's throughput target where every emulated host has a core of its own (a lent GPU
# machine's 16 CPUs): DGC gathered, partitioned, and partitioned with keep=4, alternated,
# 16 hosts at 100 Mbit/s, virtual accelerators (--compute sleep).
#   bash bench/sparse_cores16.sh OUT_DIR [ROUNDS]
# OUT_DIR gets one JSON record, one log and TCP's losses per run (NAME-ROUND.json, .log,
# .tcp: bench/tcp_losses.py). NAMES picks the runs and their order (gathered, partitioned,
# keep4, each unpaced; partitioned-paced and keep4-paced: with the all-to-alls paced,
# PACE_BYTES a rank in flight, default 131072). DATA_DIR names
# the Fashion-MNIST files where they are not at the Debian package's place (on a lent GPU
# machine: bench/fashion_subset.py's tiled copy); WORKERS and
# BANDWIDTH change the bed (16, 100mbit). Each run has its own time limit.
set -u
out=${1:?usage: sparse_cores16.sh OUT_DIR [ROUNDS]}
rounds=${2:-2}
mkdir -p "$out"
py=${PYTHON:-python3}
bed=(--task fashion --workers "${WORKERS:-16}" --bandwidth "${BANDWIDTH:-100mbit}" --latency 1ms
     --uplink-queue 256 --compute sleep --compute-speedup 50 --steps 30 --measure-from 10
     --no-eval --methods local,dgc)
if [ -n "${DATA_DIR:-}" ]; then
  bed+=(--task-options "{\"data_dir\": \"$DATA_DIR\"}")
fi
dgc='"warmup_steps": 0, "density": 0.01'
declare -A options=(
  [gathered]="{\"dgc\": {$dgc}}"
  [partitioned]="{\"dgc\": {$dgc, \"partitioned\": true, \"communicator\": \"direct\"}}"
  [keep4]="{\"dgc\": {$dgc, \"partitioned\": true, \"communicator\": \"direct\", \"keep\": 4}}"
)
nproc --all
for round in $(seq "$rounds"); do
  for name in ${NAMES:-gathered partitioned keep4}; do
    run=$name-$round
    started=$SECONDS
    scratch=$(mktemp -d)
    base=${name%-paced}
    pace=(THINWIRE_PACE_BYTES=0)  # NAME-paced: the same with the all-to-alls paced (comm/paced.py)
    [ "$base" != "$name" ] && pace=(THINWIRE_PACE_BYTES="${PACE_BYTES:-131072}")
    timeout "${RUN_LIMIT:-300}" env "${pace[@]}" $py -m thinwire.cli bench "${bed[@]}" \
      --options "${options[$base]}" --out "$scratch" >"$out/$run.log" 2>&1 &
    bench=$!
    $py bench/tcp_losses.py $bench --out "$out/$run.tcp" >>"$out/$run.log" 2>&1 &
    wait $bench
    echo "== $run: exit $? after $((SECONDS - started)) s"
    wait
    cp "$scratch"/*.json "$out/$run.json" 2>/dev/null
    rm -rf "$scratch"
    grep -E "^│ (local|dgc)|retransmitted" "$out/$run.log"
  done
done
$py - "$out" <<'SUMMARY'
import json, pathlib, statistics, sys
runs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    rows = {row["method"]: row for row in json.loads(path.read_text())}
    if "dgc" in rows:
        runs.setdefault(path.stem.rsplit("-", 1)[0], []).append((rows["dgc"], rows["local"]))
for name, pairs in runs.items():
    steps = [round(d["step_s_median"], 3) for d, _ in pairs]
    cpu = [round(d["cpu_s_per_step"] - loc["cpu_s_per_step"], 3) for d, loc in pairs]
    mb = pairs[0][0]["bytes_sent_per_step"] / 1e6
    files = sorted(pathlib.Path(sys.argv[1]).glob(name + "-[0-9]*.tcp"))
    tcp = [json.loads(path.read_text()) for path in files]
    resent = [t["TcpRetransSegs"] for t in tcp if t["namespaces"]]
    print(f"{name:12s} step s {steps}, MB sent {mb:.2f}, CPU s a rank over local's {cpu}, "
          f"TCP segments resent {resent}")
if "gathered" in runs:
    base = statistics.median(d["step_s_median"] for d, _ in runs["gathered"])
    for name, pairs in runs.items():
        ratio = base / statistics.median(d["step_s_median"] for d, _ in pairs)
        print(f"{name:12s} throughput over gathered's (median steps): {ratio:.2f}x")
SUMMARY

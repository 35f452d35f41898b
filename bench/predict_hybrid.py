"""Predicted against measured step times of ``thinwire bench --plans --compute sleep`` sweeps.

    python bench/predict_hybrid.py --links docs/results/links-2x4-10mbit.json \
        --results docs/results/hybrid-throughput-10mbit/results.json --out predicted.json

The links come from ``thinwire probe`` on the same emulated cluster (run apart from the
sweep); the stages are profiled on one process and cached in ``--cache``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from thinwire.bench.hybrid_predict import predict_sweep
from thinwire.plan.probe import LinkProbe


def main() -> None:
    """Print and save the table of predicted against measured steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", required=True, help="a thinwire probe JSON")
    parser.add_argument("--results", required=True, help="a sweep's results.json")
    parser.add_argument("--cache", default="runs/stage-profiles", help="profile cache folder")
    parser.add_argument("--out", default="", help="write the comparison here (JSON)")
    args = parser.parse_args()
    report = predict_sweep(Path(args.results), LinkProbe.load(args.links), Path(args.cache))
    print(f"{'plan':36} {'measured':>9} {'predicted':>9} {'error':>7}  breakdown")
    for row in report["rows"]:
        b = row["breakdown"]
        print(
            f"{row['plan']:36} {row['measured_s']:9.3f} {row['predicted_s']:9.3f} "
            f"{row['error']:+7.1%}  pipe {b['pipeline_s']:.2f} (compute {b['compute_s']:.2f} "
            f"tp {b['tensor_s']:.2f} bubble {b['bubble_s']:.2f}) dp {b['data_parallel_s']:.2f} "
            f"opt {b['optimizer_s']:.2f}"
        )
    print(
        f"median |error| {report['median_abs_error']:.1%}, max {report['max_abs_error']:.1%}, "
        f"Spearman {report['spearman'] or float('nan'):.3f}"
    )
    print(f"{'plan':36} saved activations per stage (error)  peak memory (error)")
    for row in report["rows"]:
        stages = row["memory"]["stages"]
        saved = " ".join(f"{s['activations_error']:+.1%}" for s in stages)
        print(f"{row['plan']:36} {saved:36} {row['memory']['peak_error']:+.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

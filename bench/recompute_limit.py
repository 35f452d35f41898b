"""The memory limit at which a pipeline must recompute every block, and the stage-aware
ratios under it: the plans of issue 28's throughput comparison.

    python bench/recompute_limit.py --plan 2x4x1/mb8 \
        --task-options '{"dim": 512, "layers": 8, "heads": 8, "seq_len": 128, "batch_size": 32}'

Profiles the task's model once (each part on the fake process group), then prints per
stage the bytes per rank without recomputation, with every block recomputed (the limit:
the most of those), and the least each stage recomputes under that limit; and the plan
specs to benchmark: uniform full recomputation under 1F1B (the baseline), the stage-aware
ratios under 1F1B and under shifted 1F1B, and uniform under shifted 1F1B.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from thinwire.parallel.layout import submodule
from thinwire.parallel.plan_spec import parse_plan, plan_label
from thinwire.parallel.stages import even_boundaries, stage_ranges
from thinwire.plan.block_profiles import profile_blocks
from thinwire.plan.recompute_choice import least_ratios, stage_memory
from thinwire.tasks import task


def main() -> None:
    """Print the limit, the ratios and the plans."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="degrees and micro-batches, e.g. 2x4x1/mb8")
    parser.add_argument("--task", default="gpt")
    parser.add_argument("--task-options", default="{}", help="JSON")
    parser.add_argument("--schedule", default="1f1b", help="whose in-flight counts set the limit")
    args = parser.parse_args()
    options = json.loads(args.task_options)
    plan = parse_plan(args.plan)
    job = task(args.task, **options)
    blocks = len(submodule(job.build_model(), "blocks"))
    ranges = stage_ranges(blocks, plan.stages or even_boundaries(blocks, plan.chunks))
    microbatch = job.batch_size // (plan.dp * plan.microbatches)
    parts = profile_blocks(args.task, options, plan, microbatch, repeats=1)
    m, count = plan.microbatches, len(ranges)
    none = stage_memory(parts, ranges, args.schedule, m, [0.0] * count)
    full = stage_memory(parts, ranges, args.schedule, m, [1.0] * count)
    limit = max(full)

    def held(stage: int, ratio: float) -> int:
        each = [ratio if t == stage else 0.0 for t in range(count)]
        return stage_memory(parts, ranges, args.schedule, m, each)[stage]

    ratios = least_ratios(held, [len(r) for r in ranges], limit)
    assert ratios is not None
    chosen = stage_memory(parts, ranges, args.schedule, m, ratios)
    mib = 2**20
    print("stage  blocks  no recompute  all recomputed  chosen ratio  chosen bytes")
    for s in range(count):
        print(f"{s:5}  {len(ranges[s]):6}  {none[s] / mib:9.1f} MiB  {full[s] / mib:11.1f} MiB"
              f"  {ratios[s]:12.3f}  {chosen[s] / mib:8.1f} MiB")  # fmt: skip
    print(f"limit: {limit / mib:.1f} MiB per rank ({limit} bytes)")
    variants = [("1f1b", (1.0,) * count), ("1f1b", ratios),
                ("shifted-1f1b", (1.0,) * count), ("shifted-1f1b", ratios)]  # fmt: skip
    specs = [
        plan_label(replace(plan, schedule=schedule, recompute=per_stage))
        for schedule, per_stage in variants
    ]
    print("plans:", " ".join(specs))


if __name__ == "__main__":
    main()

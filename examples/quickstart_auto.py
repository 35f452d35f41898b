"""Automatic hybrid parallelism quick start: thinwire measures the links between the ranks,
profiles the model's parts, searches every plan (degrees, micro-batches, schedule, stage
cuts, data-parallel method) under a memory limit, and runs the fastest.

    torchrun --nproc-per-node 4 examples/quickstart_auto.py
"""

import logging

import torch
import torch.distributed as dist

import thinwire
from thinwire.tasks import task

logging.basicConfig(level=logging.INFO)  # the planner logs its choice and its runner-up
dist.init_process_group("gloo")  # "nccl" on GPUs
gpt = task("gpt", dim=64, layers=4, heads=4, seq_len=32, batch_size=16,
           max_bytes=500_000, vocab=512)
trainer = thinwire.parallelize(gpt.build_model(), "auto", memory_limit="1GiB",
                               example_inputs=gpt.global_batch(0),
                               optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3))
for step in range(30):
    loss = trainer.step(*gpt.global_batch(step))
    if step % 10 == 0 and dist.get_rank() == 0:
        print(f"step {step} loss {loss:.3f}")
if dist.get_rank() == 0:  # run it again without planning: parallelize(model, "<plan>")
    print(f"plan {trainer.plan.spec()}")
trainer.close()
dist.destroy_process_group()

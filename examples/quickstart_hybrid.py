"""Hybrid parallelism quick start: a Llama-style model cut into 2 pipeline stages, each
layer split over 2 tensor-parallel ranks, and data parallel over the rest with PowerSGD.

    torchrun --nproc-per-node 8 examples/quickstart_hybrid.py   # dp=2 x pp=2 x tp=2
"""

import torch
import torch.distributed as dist

import thinwire
from thinwire.tasks import task

dist.init_process_group("gloo")  # "nccl" on GPUs
world = dist.get_world_size()
gpt = task("gpt", style="llama", dim=64, layers=4, heads=4, seq_len=32, batch_size=16,
           max_bytes=500_000, vocab=512)
plan = thinwire.ParallelPlan(dp=world // 4, pp=2, tp=2, microbatches=4,
                             dp_method="powersgd", dp_options={"rank": 4})
trainer = thinwire.parallelize(gpt.build_model(), plan,  # same seed on every rank
                               optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3))
for step in range(40):
    tokens, targets = gpt.global_batch(step)  # the same global batch on every rank
    loss = trainer.step(tokens, targets)      # each dp rank trains on its slice
    if step % 10 == 0 and dist.get_rank() == 0:
        print(f"step {step} loss {loss:.3f}")
trainer.save("quickstart-hybrid-ckpt")        # any plan can resume from it
perplexity = gpt.evaluate_parallel(trainer, chunk=16)
if dist.get_rank() == 0:
    print(f"plan {plan}: held-out perplexity {perplexity:.1f} after 40 steps")
trainer.close()
dist.destroy_process_group()

"""Hybrid parallelism: data x pipeline x tensor on one device mesh, with thinwire's
compressors on the data-parallel dimension.

    plan = thinwire.ParallelPlan(dp=2, pp=2, tp=2, microbatches=4, dp_method="powersgd")
    trainer = thinwire.parallelize(model, plan, optimizer=lambda p: torch.optim.AdamW(p))
    loss = trainer.step(tokens, targets)
"""

from thinwire.parallel.layout import ModelLayout, read_layout
from thinwire.parallel.parallelize import parallelize
from thinwire.parallel.plan import ParallelPlan
from thinwire.parallel.trainer import ParallelTrainer

__all__ = ["ModelLayout", "ParallelPlan", "ParallelTrainer", "parallelize", "read_layout"]

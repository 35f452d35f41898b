"""Training that survives a killed rank: torchrun restarts the job, it resumes exactly.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 4 \
        --max-restarts 3 examples/restartable.py --method dgc --checkpoints ckpt

Every ``--every`` steps all ranks save one checkpoint with ``thinwire.Checkpoints`` (model,
optimizer, thinwire's state, random generators; per rank, atomic). On every start, first
or after a restart, each rank restores the newest checkpoint that all ranks hold complete
and goes on from its step. Each rank draws its batches from a generator seeded by
(rank, step), so the resumed steps see the data the lost ones saw: the final weights equal
an uninterrupted run's bit for bit. ``--method``: ``dgc`` or ``powersgd`` (DDP hook),
``delayed`` (DelayedAveraging, DGC-compressed), ``ps`` (ParameterServer, synchronous, two
shards). ``--progress DIR``: each rank writes its pid and step there (for the drill that
kills ranks, ``bench/restart_drill.py``). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and a
c10d rendezvous (``--standalone`` on one machine, ``--rdzv-backend c10d`` on several): with
torchrun's default, its workers share its rendezvous store, and a restarted gloo group can
read the address of a worker of the attempt before and fail to connect (PyTorch issue
167288); every restart then fails the same way.
"""

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire
from thinwire.tasks.digits import DigitsMLP, load_digits_data, shard

parser = argparse.ArgumentParser()
parser.add_argument("--method", choices=["dgc", "powersgd", "delayed", "ps"], default="dgc")
parser.add_argument("--steps", type=int, default=120)
parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
parser.add_argument("--checkpoints", default="ckpt")
parser.add_argument("--out", default="final.pt")
parser.add_argument("--progress", default=None)
args = parser.parse_args()

# A dead peer must end the step with an error (and so a restart), never a long hang.
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
data = load_digits_data()
x, y = shard(data.train_x, data.train_y, rank, world)

torch.manual_seed(0)
model = DigitsMLP()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
if args.method in ("dgc", "powersgd"):
    model = DDP(model)
    dgc = {"density": 0.05, "momentum": 0.9, "warmup_steps": 5}
    options = dgc if args.method == "dgc" else {"rank": 2}
    stepper = opt
    front_end = thinwire.register(model, args.method, optimizer=opt, **options)
elif args.method == "delayed":
    stepper = front_end = thinwire.DelayedAveraging(opt, model, "dgc", delay=2, density=0.05)
else:
    stepper = front_end = thinwire.ParameterServer(opt, model, "none", mode="sync", servers=2)

checkpoints = thinwire.Checkpoints(args.checkpoints, keep=2)
start = checkpoints.restore(model=model, optimizer=opt, thinwire=front_end)
restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if rank == 0:
    print(f"restart {restarts}: resuming at step {start}", flush=True)

loss_fn = torch.nn.CrossEntropyLoss()
try:
    for step in range(start, args.steps):
        if args.progress:  # for the drill: who is where (written before the step's exchange)
            Path(args.progress, f"rank{rank}.json").write_text(
                json.dumps({"pid": os.getpid(), "step": step, "restarts": restarts})
            )
        draw = torch.Generator().manual_seed(rank * 100_003 + step)
        batch = torch.randint(len(y), (32,), generator=draw)
        stepper.zero_grad()
        loss_fn(model(x[batch]), y[batch]).backward()
        stepper.step()
        if (step + 1) % args.every == 0:
            checkpoints.save(step + 1, model=model, optimizer=opt, thinwire=front_end)
except Exception as error:  # say when and what, for whoever reads the logs; torchrun restarts
    print(f"rank {rank} failed at {time.time():.3f}: {type(error).__name__}: {error}", flush=True)
    raise

if args.method == "delayed":
    front_end.flush()  # the corrections still in flight: every rank ends on the same weights
weights = (model.module if isinstance(model, DDP) else model).state_dict()
if rank == 0:
    torch.save({"weights": weights, "restarts": restarts, "resumed_at": start}, args.out)
    accuracy = (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
    print(f"done: {args.steps} steps, held-out accuracy {accuracy:.3f}", flush=True)
if args.method == "ps":
    front_end.close()
dist.destroy_process_group()

"""thinwire's quick start: DDP whose gradients travel through DGC, on 2 CPU processes.

    torchrun --nproc-per-node 2 examples/quickstart_ddp.py

Trains a small perceptron on scikit-learn's bundled digits (nothing is downloaded), prints
each logged step's compression ratio, saves one checkpoint that holds every rank's thinwire
state, and resumes from it. On GPUs: init_process_group("nccl") and move model and data.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire
from thinwire.tasks.digits import DigitsMLP, load_digits_data, shard

dist.init_process_group("gloo")  # torchrun sets the rank, world size and address
rank, world = dist.get_rank(), dist.get_world_size()
data = load_digits_data()
x, y = shard(data.train_x, data.train_y, rank, world)  # this rank's share

torch.manual_seed(0)  # the same initial weights on every rank
model = DDP(DigitsMLP())
opt = torch.optim.SGD(model.parameters(), lr=0.1)  # momentum=0: DGC brings its own
engine = thinwire.register(model, "dgc", density=0.01, momentum=0.9, optimizer=opt,
                           warmup_steps=20)  # DGC's warm-up: 1000 steps unless told
loss_fn = torch.nn.CrossEntropyLoss()

for step in range(60):
    batch = slice(32 * step % len(x), 32 * step % len(x) + 32)
    opt.zero_grad()
    loss = loss_fn(model(x[batch]), y[batch])
    loss.backward()  # buckets are compressed and exchanged here; the step is closed
    opt.step()
    if rank == 0 and step % 20 == 19:
        stats = engine.last_step
        print(f"step {stats.step}: loss {loss.item():.3f}, "
              f"{stats.payload_bytes} bytes sent, {stats.compression_ratio:.0f}x compressed")

# One checkpoint for every rank: full_state_dict() gathers every rank's residuals and
# momenta (call it on every rank); rank 0 writes; every rank resumes from the same file.
state = {"model": model.state_dict(), "opt": opt.state_dict(),
         "thinwire": engine.full_state_dict()}
if rank == 0:
    torch.save(state, "quickstart-ckpt.pt")
dist.barrier()
engine.load_state_dict(torch.load("quickstart-ckpt.pt")["thinwire"])  # each takes its part

accuracy = (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
if rank == 0:
    print(f"held-out accuracy {accuracy:.3f} after {engine.step} steps")
dist.destroy_process_group()

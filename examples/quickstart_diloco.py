"""thinwire's DiLoCo quick start: 2 CPU processes that exchange every 10 steps, not every step.

    torchrun --nproc-per-node 2 examples/quickstart_diloco.py

Each rank trains the digits perceptron with AdamW on its own share; every 10 steps the ranks
average their pseudo-gradients (the weights the round started from, minus their own now),
compressed to 1/10 by top-k with error feedback, and an outer Nesterov step moves the
global weights. Prints the bytes sent per inner step and the held-out accuracy.
"""

import torch
import torch.distributed as dist

import thinwire
from thinwire.tasks.digits import DigitsMLP, load_digits_data, shard

dist.init_process_group("gloo")  # torchrun sets the rank, world size and address
rank, world = dist.get_rank(), dist.get_world_size()
data = load_digits_data()
x, y = shard(data.train_x, data.train_y, rank, world)  # this rank's share

torch.manual_seed(0)
model = DigitsMLP()
inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
opt = thinwire.DiLoCo(inner, model, "topk", density=0.1,  # the pseudo-gradient's compressor
                      sync_every=10, outer_lr=0.7, outer_momentum=0.9)
loss_fn = torch.nn.CrossEntropyLoss()

for step in range(100):
    batch = slice(32 * step % len(x), 32 * step % len(x) + 32)
    opt.zero_grad()
    loss = loss_fn(model(x[batch]), y[batch])
    loss.backward()
    opt.step()  # an inner step; every 10th also the exchange and the outer step
    if rank == 0 and opt.synced and step % 50 == 49:
        sent = sum(s.payload_bytes for s in opt.engine.history) / (step + 1)
        dense = 4 * sum(p.numel() for p in model.parameters())  # every gradient, every step
        print(f"step {step + 1}: loss {loss.item():.3f}, {sent:.0f} bytes sent per step "
              f"({dense / sent:.0f}x fewer than averaging every gradient)")

# after a round every rank holds the same weights: one checkpoint for all
state = {"model": model.state_dict(), "diloco": opt.state_dict()}
if rank == 0:
    torch.save(state, "diloco-ckpt.pt")
accuracy = (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
if rank == 0:
    print(f"held-out accuracy {accuracy:.3f} after {opt.inner_steps} inner steps")
dist.destroy_process_group()

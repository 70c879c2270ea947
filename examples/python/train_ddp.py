"""DDP over gloo, AdamW, an ironweave checkpoint every step in peers' memory.

    torchrun --standalone --nproc-per-node 4 --max-restarts 2 examples/python/train_ddp.py
"""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ironweave.torch import Checkpointer, deterministic_ddp, finish, init_process_group

init_process_group("gloo")  # torch.distributed's, restart-safe
rank = dist.get_rank()
torch.manual_seed(0)
model = deterministic_ddp(DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))))
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
steps = int(os.environ.get("STEPS", "50"))

with Checkpointer({"model": model, "optim": optim}).watch(model) as ckpt:
    info = ckpt.restore()  # None on a fresh start
    if info and rank == 0:
        print(f"restored step {info['step']} from {info['source']} in {info['seconds']:.3f} s")
    for step in range(info["step"] + 1 if info else 1, steps + 1):
        g = torch.Generator().manual_seed(step * 1000 + rank)  # the same batch after a restart
        x = torch.randn(64, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optim.zero_grad()
        loss.backward()
        optim.step()
        ckpt.save(step)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f} committed {ckpt.committed()}")
finish()  # destroys the process groups; see ironweave.torch.finish

"""The FSDP2 test's job (test_cluster.py): a model sharded by ``fully_shard`` (DTensor
parameters and optimizer state, gloo on CPU) checkpointed by ``ironweave.torch.Checkpointer``;
its local shards saved with their global place, restored in place on the same ranks, and (by
the test) loaded onto one process through ``PeerMemoryReader``.

Environment: OUT (a directory), KEEP (the keep directory)."""
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from ironweave.torch import Checkpointer, finish, init_process_group

torch.set_num_threads(1)
init_process_group("gloo")
rank = dist.get_rank()
out, keep = os.environ["OUT"], os.environ["KEEP"]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
fully_shard(model)
optim = torch.optim.AdamW(model.parameters(), lr=0.1)
ck = Checkpointer({"model": model, "optim": optim}, keep_dir=keep, job_id="fsdp-test", timeout_s=60)
for step in (1, 2, 3):
    g = torch.Generator().manual_seed(step * 10 + rank)
    model(torch.randn(4, 5, generator=g)).sum().backward()
    optim.step()
    optim.zero_grad()
    ck.save(step)
full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
avg = {id(p): optim.state[p]["exp_avg"].full_tensor().clone() for p in model.parameters()}
if rank == 0:
    torch.save(full, os.path.join(out, "ref.pt"))
local_bytes = sum(v.to_local().numel() * v.element_size() for v in model.state_dict().values())
stats = ck.stats()
ck.close(remove_kept=False)
# the shards are lost in place; a new checkpointer of the job restores them
with torch.no_grad():
    for p in model.parameters():
        p.to_local().zero_()
    for st in optim.state.values():
        st["exp_avg"].to_local().zero_()
ck = Checkpointer({"model": model, "optim": optim}, keep_dir=keep, job_id="fsdp-test", timeout_s=60)
info = ck.restore()
same = all(torch.equal(v.full_tensor(), full[k]) for k, v in model.state_dict().items())
same_optim = all(torch.equal(optim.state[p]["exp_avg"].full_tensor(), avg[id(p)]) for p in model.parameters())
ck.close(remove_kept=False)
with open(os.path.join(out, f"fsdp-{rank}.json"), "w") as f:
    json.dump({"restored": info, "same": same, "same_optim": same_optim, "state_bytes": stats["state_bytes"],
               "local_bytes": local_bytes}, f)
finish()

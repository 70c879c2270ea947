"""The tests' DCP job: torch.distributed.checkpoint through ironweave's peer-memory storage.

MODE=save (4 ranks): a model and AdamW trained the same on every rank (replicated, as under
data parallelism), a DTensor of 10 rows sharded over the ranks (3, 3, 3, 1 rows), a bf16 tensor,
a non-contiguous view, a bool mask and picklable values; ``dcp.save`` every step, the last step
with ``dcp.async_save`` on its own process group; the copies kept in KEEP; then ``dcp.load``
of them into a zeroed state on the same ranks. Rank 0 writes the expected state to OUT/ref.pt.

MODE=load (2 ranks): the same state with the DTensor sharded over 2 ranks (5, 5 rows: each
reads parts of two saved shards), loaded from KEEP with ``dcp.load`` and compared with ref.pt.

Each rank writes OUT/MODE-RANK.json: what matched, the step loaded, the bytes read and the
writer's counters.
"""
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ironweave.dcp import PeerMemoryReader, PeerMemoryWriter
from ironweave.torch import finish, init_process_group

torch.set_num_threads(1)
init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
mode, out, keep = os.environ["MODE"], os.environ["OUT"], os.environ["KEEP"]
steps = int(os.environ.get("STEPS", "4"))


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    base = torch.zeros(3, 5)
    state = {
        "dt": distribute_tensor(torch.zeros(10, 3), mesh, [Shard(0)]),
        "bf16": torch.zeros(4, 4, dtype=torch.bfloat16),
        "view": base.t(),  # (5, 3), not contiguous
        "mask": torch.zeros(6, dtype=torch.bool),
        "extras": {"epoch": 0, "tag": ""},
    }
    return model, optim, state


def as_dict(model, optim, state):
    msd, osd = get_state_dict(model, optim)  # the optimizer's state created, as DCP does
    return {"model": msd, "optim": osd, **state}


def train(model, optim, state, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    optim.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    with torch.no_grad():
        state["dt"].to_local().add_(step + rank)
        state["bf16"].add_(0.5)
        state["view"].add_(torch.arange(15.0).reshape(5, 3) * step)
        state["mask"][step % 6] = True
    state["extras"] = {"epoch": step, "tag": f"after step {step}"}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def expected(sd):
    full = dict(sd)
    full["dt"] = sd["dt"].full_tensor()
    return full


report = {"rank": rank}
if mode == "save":
    model, optim, state = build()
    writer = PeerMemoryWriter(keep_dir=keep, timeout_s=60, job_id="dcp-test")
    ckpt_group = dist.new_group(backend="gloo")  # async_save's collectives run beside training
    for step in range(1, steps + 1):
        train(model, optim, state, step)
        sd = as_dict(model, optim, state)
        if step < steps:
            dcp.save(sd, storage_writer=writer, checkpoint_id=step)
        else:
            dcp.async_save(sd, storage_writer=writer, checkpoint_id=step, process_group=ckpt_group).result()
    final = as_dict(model, optim, state)
    ref = expected(final)
    if rank == 0:
        torch.save(ref, os.path.join(out, "ref.pt"))
    report["committed"] = writer.committed()
    report["stats"] = writer.stats()
    writer.close(remove_kept=False)
    # load back on the same ranks into a zeroed state
    model2, optim2, state2 = build()
    for p in model2.parameters():
        p.data.zero_()
    sd2 = as_dict(model2, optim2, state2)
    reader = PeerMemoryReader(keep)
    dcp.load(sd2, storage_reader=reader)
    set_state_dict(model2, optim2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])
    got = expected(as_dict(model2, optim2, state2) | {"extras": sd2["extras"]})
    report["step"] = reader.step
    report["bytes_read"] = reader.bytes_read
    report["view_contiguous"] = state2["view"].is_contiguous()
    report["matched"] = {k: same(ref[k], got[k]) for k in ref}
else:
    ref = torch.load(os.path.join(out, "ref.pt"), weights_only=False)
    model, optim, state = build()
    sd = as_dict(model, optim, state)
    reader = PeerMemoryReader(keep)
    dcp.load(sd, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = expected(as_dict(model, optim, state) | {"extras": sd["extras"]})
    rows = sd["dt"].to_local().shape[0]
    report["step"] = reader.step
    report["bytes_read"] = reader.bytes_read
    report["dt_rows"] = rows
    report["matched"] = {k: same(ref[k], got[k]) for k in ref}
dist.barrier()
with open(os.path.join(out, f"{mode}-{rank}.json"), "w") as f:
    json.dump(report, f, default=str)
finish()  # destroys the process groups; see ironweave.torch.finish

"""The tests' DDP job: examples/python/train_ddp.py's loop with a fault and a digest.

Environment: STEPS; PLAIN_DDP=1 (DDP's bucket all-reduce, not deterministic_ddp); NO_WATCH=1
(the engine is not shown the step); FAIL_RANK and FAIL_STEP (that rank SIGKILLs itself after the backward of
that step, in the first attempt only); FAIL_HOST=1 (the failed rank's kept copies are deleted
before it comes back: its host was lost); FAIL_NODE=H (every rank whose IRONWEAVE_HOST is H
SIGKILLs itself at FAIL_STEP, and deletes its kept copies when it comes back: node H was lost); OUT (a directory: each rank writes rank-R.json with
its restore and its state digest); PROGRESS=1 (each rank writes progress-R.json after each save);
STEP_SLEEP (seconds each step lasts at least, so a test can act between steps); CORRUPT=own|all
(when it comes back, the failed rank flips a bit in its own kept copies, or in every kept copy of
its state); PERSIST_DIR and PERSIST_EVERY (the persistent tier).
"""
import hashlib
import json
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ironweave.torch import Checkpointer, deterministic_ddp, finish, init_process_group, keep_dir_for_job

torch.set_num_threads(1)
init_process_group("gloo")  # torch.distributed's, restart-safe
rank = dist.get_rank()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("IRONWEAVE_GENERATION", "0")))
fail_rank = int(os.environ.get("FAIL_RANK", "-1"))
fail_step = int(os.environ.get("FAIL_STEP", "0"))
fail_node = os.environ.get("FAIL_NODE")  # every rank of this node (IRONWEAVE_HOST) fails
on_failed_node = fail_node is not None and os.environ.get("IRONWEAVE_HOST") == fail_node
if attempt > 0 and (rank == fail_rank and os.environ.get("FAIL_HOST") == "1" or on_failed_node):
    keep = keep_dir_for_job()
    shutil.rmtree(os.path.join(keep, "checkpointer-0", f"holder-{rank:05d}"), ignore_errors=True)

corrupt = os.environ.get("CORRUPT")  # "own" | "all": the failed rank's copies fail their checks
if attempt > 0 and rank == fail_rank and corrupt:
    import glob

    import json

    holders = f"holder-{rank:05d}" if corrupt == "own" else "holder-*"
    # each kept copy of this rank's state: the segment its manifest names (holder/iter-N/rank-R.json)
    for m in glob.glob(os.path.join(keep_dir_for_job(), "checkpointer-0", holders, "*", f"rank-{rank:05d}.json")):
        with open(m) as fh:
            seg = json.load(fh).get("segment")
        f = os.path.join(os.path.dirname(os.path.dirname(m)), seg) if seg else m.replace(".json", ".safetensors")
        with open(f, "r+b") as fh:  # one bit of the last byte: the checksums no longer hold
            fh.seek(-1, os.SEEK_END)
            b = fh.read(1)
            fh.seek(-1, os.SEEK_END)
            fh.write(bytes([b[0] ^ 1]))

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
if os.environ.get("NO_DDP") == "1":
    model = net
elif os.environ.get("PLAIN_DDP") == "1":
    model = DDP(net)  # DDP's own bucket all-reduce (timed by watch unless NO_WATCH=1)
else:
    model = deterministic_ddp(DDP(net))
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
steps = int(os.environ.get("STEPS", "30"))

# the picklable value is put back into this dict by a restore
state = {"model": model, "optim": optim, "seen": 0}
ckpt = Checkpointer(state, timeout_s=60, persist_dir=os.environ.get("PERSIST_DIR"),
                    persist_every=int(os.environ.get("PERSIST_EVERY", "0")))
if os.environ.get("NO_WATCH") != "1":
    ckpt.watch(model)  # the engine sees layers and all-reduces
info = ckpt.restore()
for step in range(info["step"] + 1 if info else 1, steps + 1):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(64, 32, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optim.zero_grad()
    loss.backward()
    if model is net:
        flat = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        dist.all_reduce(flat)
        off = 0
        for p in net.parameters():
            p.grad.copy_(flat[off : off + p.numel()].view_as(p) / dist.get_world_size())
            off += p.numel()
    if attempt == 0 and (rank == fail_rank or on_failed_node) and step == fail_step:
        os.kill(os.getpid(), signal.SIGKILL)
    optim.step()
    state["seen"] += 1
    ckpt.save(step)
    if os.environ.get("PROGRESS") == "1":
        with open(os.path.join(os.environ["OUT"], f"progress-{rank}.json"), "w") as f:
            json.dump({"step": step, "attempt": attempt, "host": os.environ.get("IRONWEAVE_HOST")}, f)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))

h = hashlib.sha256()
for t in list(model.state_dict().values()) + [v for st in optim.state.values() for v in st.values()]:
    h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
stats = ckpt.stats()
ckpt.close()
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"digest": h.hexdigest(), "restored": info, "attempt": attempt, "seen": state["seen"], "stats": stats,
                   "host": os.environ.get("IRONWEAVE_HOST"),
                   # the handshake's secret, as the package set it from torchrun's store (a digest)
                   "secret": hashlib.sha256(os.environ.get("IRONWEAVE_SECRET", "").encode()).hexdigest()}, f)
finish()  # destroys the process groups; see ironweave.torch.finish

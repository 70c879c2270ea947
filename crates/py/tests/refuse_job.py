"""The refusal test's job (test_cluster.py): the last rank refuses in each case and stays alive
until every peer has its error; each rank writes refuse-R.json with what it raised.

Environment: OUT (a directory)."""
import json
import os
import time

import torch
import torch.distributed as dist

import ironweave
from ironweave.torch import Checkpointer, finish, init_process_group

torch.set_num_threads(1)
init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = os.environ["OUT"]
refuser = world - 1
model = torch.nn.Linear(4, 2)
optim = torch.optim.AdamW(model.parameters(), lr=0.1)
state = {"model": model, "optim": optim, "note": "small"}
ck = Checkpointer(state, timeout_s=20, extras_bytes=1024, keep_dir=None)
ck.save(1)


def flag(name):
    return os.path.join(out, name)


def case(name, refuse, act):
    """Every rank runs `act(refusing)`; each records the error it raised."""
    refusing = rank == refuser
    if refusing:
        refuse()
    try:
        act(refusing)
        got = {"type": None, "message": None}
    except ironweave.IronweaveError as e:
        got = {"type": type(e).__name__, "message": str(e), "is_value_error": isinstance(e, ValueError)}
    if refusing:
        # alive, as code that logs and cleans up is: it goes on only once every peer has its error
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(os.path.exists(flag(f"got-{name}-{r}")) for r in range(world - 1)):
            time.sleep(0.05)
        open(flag(f"went-on-{name}"), "w").close()
    else:
        got["before_refuser_went_on"] = not os.path.exists(flag(f"went-on-{name}"))
        open(flag(f"got-{name}-{rank}"), "w").close()
    dist.barrier()
    return got


def extra_buffer():
    model.register_buffer("added", torch.zeros(3))


def drop_buffer():
    model._buffers.pop("added", None)


cases = {}
cases["repeated step"] = case("repeated", lambda: None, lambda r: ck.save(1 if r else 2))
cases["negative step"] = case("negative", lambda: None, lambda r: ck.save(-1 if r else 2))
cases["changed state"] = case("changed", extra_buffer, lambda r: ck.save(2))
drop_buffer()
cases["over-size extra"] = case("extra", lambda: state.update(note="x" * 4096), lambda r: ck.save(2))
state["note"] = "small"
cases["restore mismatch"] = case("restore", extra_buffer, lambda r: ck.restore())
drop_buffer()
final = ck.save(100)
ck.close()
with open(os.path.join(out, f"refuse-{rank}.json"), "w") as f:
    json.dump({"cases": cases, "final_save": final}, f)
finish()

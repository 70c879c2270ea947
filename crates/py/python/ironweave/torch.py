"""PyTorch state checkpointed every step into peers' host memory by ironweave's engine.

    ckpt = Checkpointer({"model": model, "optim": optim})
    info = ckpt.restore()                  # None on a fresh start
    start = info["step"] + 1 if info else 1
    for step in range(start, steps + 1):
        ...                                # forward, backward, optimizer step
        ckpt.save(step)
    ckpt.close()

What this module does, and only this: it turns modules, optimizers, tensors and picklable
values into named byte buffers (each tensor viewed as bytes, no copy for contiguous CPU
tensors), and puts restored bytes back in place. Snapshots, replication, commit, recovery and
the copies that outlive the processes are the Rust library's (``ironweave._native``).
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any, Dict, List, Optional, Tuple

import torch

from ironweave import _native
from ironweave._native import ConfigurationError, StateMismatchError  # noqa: F401

__all__ = ["Checkpointer", "deterministic_ddp", "finish", "init_process_group", "keep_dir_for_job"]

_DTYPES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.uint8: "u8",
}

_EXTRAS = "ironweave.extras"


def _frame_into(buf: torch.Tensor, blob: bytes) -> None:
    """`blob` behind its 8-byte length at the start of the uint8 tensor `buf` (which has room)."""
    buf[:8] = torch.frombuffer(bytearray(struct.pack("<Q", len(blob))), dtype=torch.uint8)
    if blob:
        buf[8 : 8 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _unframe(buf: torch.Tensor, what: str) -> bytes:
    """The bytes `_frame_into` put in `buf`; a length that does not fit is a StateMismatchError."""
    if buf.numel() < 8:
        raise StateMismatchError(f"{what}: {buf.numel()} bytes, shorter than its length field")
    (n,) = struct.unpack("<Q", buf[:8].numpy().tobytes())
    if n > buf.numel() - 8:
        raise StateMismatchError(f"{what}: claims {n} bytes in a room of {buf.numel() - 8}")
    return buf[8 : 8 + n].numpy().tobytes()


def keep_dir_for_job() -> Optional[str]:
    """Where copies that must outlive the processes go: ``IRONWEAVE_KEEP_DIR`` if set, else
    under torchrun (which restarts every worker when one fails) ``/dev/shm/ironweave-<run id>``,
    else None (memory only)."""
    d = os.environ.get("IRONWEAVE_KEEP_DIR")
    if d:
        return d
    run = os.environ.get("TORCHELASTIC_RUN_ID") or (
        # `ironweave launch --restart-all` restarts every rank too; its job id outlives them
        os.environ.get("IRONWEAVE_JOB_ID") if "IRONWEAVE_RANK" in os.environ else None
    )
    if run and os.path.isdir("/dev/shm"):
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)
        return f"/dev/shm/ironweave-{safe}"
    return None


def init_process_group(backend: str = "gloo", timeout_s: float = 300.0) -> None:
    """``torch.distributed.init_process_group`` for a job torchrun (or ``ironweave launch
    --restart-all``) may restart: the process group's keys go under a prefix per restart attempt
    (``TORCHELASTIC_RESTART_COUNT``; under ironweave launch a file store per generation). Measured here
    with torch 2.15: after a restart, the default ``env://`` initialisation finds the failed
    attempt's addresses in torchrun's store and gloo's mesh fails with "Connection refused";
    with the prefix the restarted workers meet each other. Outside torchrun it is the plain call."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" not in os.environ and "IRONWEAVE_RANK" in os.environ:
        # under `ironweave launch`: the ranks meet in a file store on the job's board (a
        # directory every rank reaches), one per generation, so a restarted job never reads
        # the failed one's keys
        board = os.environ.get("IRONWEAVE_JOB_BOARD")
        if not board:
            raise ConfigurationError("IRONWEAVE_RANK is set but IRONWEAVE_JOB_BOARD is not: start the job with `ironweave launch`")
        rank, world = int(os.environ["IRONWEAVE_RANK"]), int(os.environ["IRONWEAVE_WORLD_SIZE"])
        gen = os.environ.get("IRONWEAVE_GENERATION", "0")
        store = dist.FileStore(os.path.join(board, f"torch-store-{gen}"), world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.PrefixStore(f"ironweave-attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", _torchrun_store(timeout_s))
    dist.init_process_group(
        backend, store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout
    )


def finish(code: int = 0) -> None:
    """Ends a torch.distributed worker: destroys the process groups, flushes stdout and stderr,
    and exits with ``code`` without finalizing the interpreter. Call it last, after the job's
    results are written and its checkpointers closed (``atexit`` handlers do not run).

    Why: with torch 2.15 a gloo worker thread may still be dropping a finished collective when
    the script ends (``destroy_process_group`` does not join gloo's threads). If that work holds
    tensors Python created, dropping them takes the GIL; during finalization that ends the
    thread and the process aborts ("terminate called without an active exception", SIGABRT),
    after all the job's work is done and reported — measured here in 4 of 78 torchrun jobs of
    the DCP test with both cores busy, 0 of 88 ending this way (docs/PYTORCH.md)."""
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _torchrun_store(timeout_s: float):
    """A client of torchrun's TCP store (at ``MASTER_ADDR:MASTER_PORT``)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


_OUR_PORT: Optional[str] = None  # the IRONWEAVE_CKPT_PORT this module set (a user's own is left alone)
_ENGINES = 0  # engines this process started under torchrun: names the next one's port in the store


def _agree_on_port(timeout_s: float) -> None:
    """Under torchrun, the checkpointer's port is one rank 0 finds free below the kernel's
    ephemeral range (``_native.free_port``, as ``ironweave launch`` picks its own: no outgoing
    connection can be handed it) and publishes in torchrun's store, and every rank reads it there
    before its engine starts. The Rust default (the master port + 1) collided once with another
    socket.
    The store is torchrun's TCP store, not a process group: no collective, safe on the thread
    DCP writes from. A port the user set (``IRONWEAVE_CKPT_PORT``) and ``ironweave launch`` (its
    own port) are left alone, as is a job outside torchrun (the Rust default stands)."""
    global _OUR_PORT, _ENGINES
    user = os.environ.get("IRONWEAVE_CKPT_PORT")
    if user is not None and user != _OUR_PORT:
        return
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "IRONWEAVE_RANK" in os.environ:
        return
    # every rank starts its engines in the same order (starting one is collective)
    key = f"ironweave-ckpt-port-{os.environ['TORCHELASTIC_RESTART_COUNT']}-{_ENGINES}"
    _ENGINES += 1
    store = _torchrun_store(timeout_s)
    if int(os.environ["RANK"]) == 0:
        store.set(key, str(_native.free_port()))
    port = store.get(key).decode()
    os.environ["IRONWEAVE_CKPT_PORT"] = port
    _OUR_PORT = port


class _HookState:
    """What a DDP communication hook of this module holds: the process group, and the
    checkpointer that times its all-reduces (set by ``Checkpointer.watch``)."""

    def __init__(self, group=None):
        self.group = group
        self.recorder: Optional["Checkpointer"] = None


def _timed(state: _HookState, fut, nbytes: int):
    """``fut`` again; when it completes, its span goes to the checkpointer watching (the link
    was busy with training bytes from launch to completion)."""
    rec = state.recorder
    if rec is None:
        return fut
    start = rec._now()

    def done(f):
        rec._comm_done(nbytes, start)
        return f.value()

    return fut.then(done)


def _per_gradient_allreduce(state: _HookState, bucket):
    import torch.distributed as dist

    grads = bucket.gradients()
    world = dist.get_world_size(state.group)
    futs = [
        _timed(state, dist.all_reduce(g, group=state.group, async_op=True).get_future(), g.numel() * g.element_size())
        for g in grads
    ]

    def done(_):
        buf = bucket.buffer()
        buf.copy_(torch.cat([g.reshape(-1) for g in grads]))
        return buf.div_(world)

    return torch.futures.collect_all(futs).then(done)


def _bucket_allreduce(state: _HookState, bucket):
    """DDP's own averaging (one all-reduce per bucket), timed."""
    import torch.distributed as dist

    buf = bucket.buffer()
    world = dist.get_world_size(state.group)
    fut = _timed(state, dist.all_reduce(buf, group=state.group, async_op=True).get_future(), buf.numel() * buf.element_size())
    return fut.then(lambda f: f.value()[0].div_(world))


def deterministic_ddp(model, group=None):
    """Makes a ``DistributedDataParallel`` model's gradient averages independent of its buckets, so
    a job restored from a checkpoint continues bit for bit as it would have without the failure.

    Why: DDP regroups its gradient buckets after the first iteration of every process (by the
    order the gradients became ready), and a ring all-reduce adds an element's contributions in
    an order that depends on where the element sits in its bucket: a restarted process sums in
    another order than the process it replaces, and the runs drift apart by rounding (measured
    here: the same restored step, another final digest). The hook all-reduces each gradient on
    its own, whatever bucket it is in. Returns the model."""
    model._ironweave_hook = _HookState(group)
    model.register_comm_hook(model._ironweave_hook, _per_gradient_allreduce)
    return model


def _materialize(optim: torch.optim.Optimizer) -> None:
    """Creates an optimizer's empty state (as DCP does: one step with zero gradients and a zero
    learning rate), then sets every ``step`` counter back to zero, so that the first real step
    computes exactly what it would have without the checkpointer (Adam, AdamW, SGD)."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    lrs = []
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    for g in optim.param_groups:
        lrs.append(g.get("lr"))
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, gr in zip(params, grads):
            p.grad = gr
    for st in optim.state.values():
        s = st.get("step")
        if isinstance(s, torch.Tensor):
            s.zero_()
        elif isinstance(s, (int, float)):
            st["step"] = type(s)(0)


class Checkpointer:
    """Checkpoints ``state`` every step into peers' host memory; restores it after a failure.

    ``state`` maps names to ``torch.nn.Module``s, ``torch.optim.Optimizer``s (their empty state
    is created now), tensors, and small picklable values (kept in ``extras_bytes``). Tensors
    must be on the CPU. Every rank must pass the same keys, dtypes and shapes (data
    parallelism); a difference raises ``StateMismatchError`` naming the key on every rank.

    ``strategy``: ``capricorn`` (chunks placed in the link's idle time), ``gemini``; ``replicas``:
    copies of each step's state including the rank's own; ``keep_dir``: a tmpfs directory the
    copies outlive the processes in (``"auto"``: ``keep_dir_for_job()``); ``persist_dir`` and
    ``persist_every``: also write every N steps to a file system.
    """

    def __init__(
        self,
        state: Dict[str, Any],
        *,
        replicas: int = 2,
        strategy: str = "capricorn",
        keep_dir: Optional[str] = "auto",
        persist_dir: Optional[str] = None,
        persist_every: int = 0,
        timeout_s: float = 300.0,
        extras_bytes: int = 1 << 16,
        job_id: Optional[str] = None,
    ) -> None:
        if not isinstance(state, dict) or not state:
            raise ConfigurationError("state: give a non-empty dict of modules, optimizers, tensors and picklable values")
        self._state = state
        for v in state.values():
            if isinstance(v, torch.optim.Optimizer):
                _materialize(v)
        dicts = self._dicts()
        self._names, tensors = self._tensors(dicts)
        self._extras_cap = int(extras_bytes)
        self._extras = torch.zeros(self._extras_cap + 8, dtype=torch.uint8)
        self._pack_extras(dicts)  # a state whose values do not fit fails now, not at the first save
        specs: List[Tuple[str, str, List[int]]] = []
        for name, t in zip(self._names, tensors):
            if t.dtype in _DTYPES:
                specs.append((name, _DTYPES[t.dtype], list(t.shape), None))
            else:
                # other dtypes travel as their bytes (bool, int8, int16, complex, ...)
                specs.append((name, "u8", [t.numel() * t.element_size()], None))
        specs.append((_EXTRAS, "u8", [self._extras_cap + 8], None))
        if keep_dir == "auto":
            keep_dir = keep_dir_for_job()
        self.keep_dir = keep_dir
        _agree_on_port(timeout_s)
        self._engine = _native.Engine(
            specs,
            strategy=strategy,
            replicas=replicas,
            keep_dir=keep_dir,
            persist_dir=persist_dir,
            persist_every=persist_every,
            timeout_s=timeout_s,
            job_id=job_id,
        )

    @property
    def rank(self) -> int:
        return self._engine.rank

    @property
    def world_size(self) -> int:
        return self._engine.world_size

    # -- the state as named tensors ---------------------------------------------------------

    def _dicts(self) -> Dict[str, Dict[str, Any]]:
        """Each module's and optimizer's state_dict, built once per save or restore: the tensors
        and the picklable values are both read from it."""
        return {
            key: obj.state_dict()
            for key, obj in self._state.items()
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))
        }

    def _tensors(self, dicts: Dict[str, Dict[str, Any]]) -> Tuple[List[str], List[torch.Tensor]]:
        names: List[str] = []
        tensors: List[torch.Tensor] = []
        for key, obj in self._state.items():
            if isinstance(obj, torch.nn.Module):
                for k, t in dicts[key].items():
                    names.append(f"{key}.{k}")
                    tensors.append(t)
            elif isinstance(obj, torch.optim.Optimizer):
                sd = dicts[key]
                for idx in sorted(sd["state"]):
                    for k, v in sorted(sd["state"][idx].items()):
                        if isinstance(v, torch.Tensor):
                            names.append(f"{key}.state.{idx}.{k}")
                            tensors.append(v)
            elif isinstance(obj, torch.Tensor):
                names.append(key)
                tensors.append(obj)
        for n, t in zip(names, tensors):
            if t.device.type != "cpu":
                raise ConfigurationError(
                    f"`{n}` is on {t.device}: this build checkpoints CPU tensors only (no GPU path); "
                    "keep the state on the CPU or copy it there before saving"
                )
        return names, tensors

    def _current(self, dicts: Dict[str, Dict[str, Any]]) -> List[torch.Tensor]:
        names, tensors = self._tensors(dicts)
        if names != self._names:
            missing = next((n for n in self._names if n not in names), None)
            added = next((n for n in names if n not in self._names), None)
            key = missing or added or "(order)"
            raise StateMismatchError(
                f"state mismatch on rank {self.rank}: `{key}` is "
                f"{'missing' if missing else 'new'}, expected the keys registered when the checkpointer was made"
            )
        return tensors

    def _extra_values(self, dicts: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, obj in self._state.items():
            if isinstance(obj, torch.optim.Optimizer):
                sd = dicts[key]
                out[key] = {
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]],
                    "state": {
                        idx: {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
                        for idx, st in sd["state"].items()
                    },
                }
            elif not isinstance(obj, (torch.nn.Module, torch.Tensor)):
                out[key] = obj
        return out

    def _pack_extras(self, dicts: Dict[str, Dict[str, Any]]) -> None:
        blob = pickle.dumps(self._extra_values(dicts), protocol=4)
        if len(blob) > self._extras_cap:
            raise ConfigurationError(
                f"the state's picklable values take {len(blob)} bytes, more than extras_bytes={self._extras_cap}: "
                "raise extras_bytes, or keep large values in tensors"
            )
        _frame_into(self._extras, blob)

    def _unpack_extras(self) -> None:
        values = pickle.loads(_unframe(self._extras, f"restored picklable values (extras_bytes={self._extras_cap})"))
        for key, v in values.items():
            obj = self._state.get(key)
            if isinstance(obj, torch.optim.Optimizer):
                for g, saved in zip(obj.param_groups, v["param_groups"]):
                    g.update(saved)
                # state_dict numbers the parameters in order across the groups
                params = [q for g in obj.param_groups for q in g["params"]]
                for idx, st in v["state"].items():
                    if st and 0 <= idx < len(params):
                        obj.state[params[idx]].update(st)
            else:
                self._state[key] = v

    @staticmethod
    def _bytes(t: torch.Tensor):
        return t.detach().reshape(-1).view(torch.uint8).numpy()

    # -- the API ----------------------------------------------------------------------------

    def save(self, step: int) -> int:
        """Snapshots the state after ``step``'s optimizer step (collective: every rank, every
        step it checkpoints); replication to peers goes on in the background."""
        dicts = self._dicts()
        tensors = self._current(dicts)
        self._pack_extras(dicts)
        bufs = [self._bytes(t if t.is_contiguous() else t.contiguous()) for t in tensors]
        bufs.append(self._bytes(self._extras))
        return self._engine.save(int(step), bufs)

    def restore(self) -> Optional[Dict[str, Any]]:
        """Restores the newest step every rank has a whole copy of, in place (collective; all or
        nothing). Returns ``{"step", "source" ("own memory" | "peer" | "persistent"), "peer",
        "bytes", "seconds"}``, or None when no rank holds any copy (a fresh start)."""
        tensors = self._current(self._dicts())
        staged: List[Tuple[torch.Tensor, torch.Tensor]] = []
        bufs = []
        for t in tensors:
            if t.is_contiguous():
                bufs.append(self._bytes(t))
            else:
                tmp = torch.empty(t.shape, dtype=t.dtype)
                staged.append((t, tmp))
                bufs.append(self._bytes(tmp))
        bufs.append(self._bytes(self._extras))
        with torch.no_grad():
            info = self._engine.restore(bufs)
            if info is None:
                return None
            for t, tmp in staged:
                t.copy_(tmp)
        self._unpack_extras()
        return info

    # -- what the engine sees of the training step ------------------------------------------

    def _now(self) -> int:
        return self._engine.now_ns()

    def _comm_done(self, nbytes: int, start: int) -> None:
        try:
            self._engine.record_comm(int(nbytes), start, self._engine.now_ns())
        except _native.ClosedError:
            pass

    def watch(self, model: torch.nn.Module) -> "Checkpointer":
        """Lets the engine see the training step: the forward and backward of each of
        ``model``'s layers (module hooks on the modules that hold parameters, numbered in
        forward order) and, for a ``DistributedDataParallel`` model, each gradient all-reduce
        (a DDP communication hook: DDP's bucket all-reduce timed, or ``deterministic_ddp``'s
        hook timed). From these the engine predicts when the link is free of training bytes and
        sends the checkpoint's chunks then (``strategy="capricorn"``). Call once, before the
        first step you want seen; returns the checkpointer."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        inner = model.module if isinstance(model, DDP) else model
        layers = [m for m in inner.modules() if any(True for _ in m.parameters(recurse=False))]
        starts: Dict[Tuple[int, str], int] = {}
        eng = self._engine

        def pre(i, phase):
            def hook(*_):
                starts[(i, phase)] = eng.now_ns()

            return hook

        def post(i, phase):
            def hook(*_):
                t0 = starts.pop((i, phase), None)
                if t0 is not None:
                    eng.record_layer(i, phase, t0, eng.now_ns())

            return hook

        for i, m in enumerate(layers):
            m.register_forward_pre_hook(pre(i, "forward"))
            m.register_forward_hook(post(i, "forward"))
            m.register_full_backward_pre_hook(pre(i, "backward"))
            m.register_full_backward_hook(post(i, "backward"))
        if isinstance(model, DDP):
            state = getattr(model, "_ironweave_hook", None)
            if state is None:
                state = model._ironweave_hook = _HookState(None)
                model.register_comm_hook(state, _bucket_allreduce)
            state.recorder = self
        return self

    def committed(self) -> Optional[int]:
        """The newest step whose every rank's state is replicated, as last agreed."""
        return self._engine.committed()

    def stats(self) -> Dict[str, Any]:
        """Counters: saves, exposed seconds, state and replica bytes, committed and kept steps;
        with ``watch``: steps profiled, training communications recorded, chunks released and
        those whose transfer lay in an idle window of the training link."""
        return self._engine.stats()

    def close(self, remove_kept: bool = True) -> None:
        """Replicates the last snapshot and stops (collective). ``remove_kept``: the job is over,
        so the copies kept for restarts are removed."""
        self._engine.close(remove_kept)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # after an error the peers may be gone: no collective call, the copies stay for the restart
        if exc_type is None:
            self.close(remove_kept=True)

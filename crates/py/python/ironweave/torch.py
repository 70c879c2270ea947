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

import operator
import os
import pickle
import re
import secrets
import struct
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from ironweave import _native
from ironweave._native import ConfigurationError, IronweaveError, StateMismatchError  # noqa: F401

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
    """The job's directory of copies that outlive the processes, where it is known before the
    job forms: ``IRONWEAVE_KEEP_DIR`` if set; else under torchrun with a run id of its own
    (``--rdzv-id``, or ``--standalone``'s) ``/dev/shm/ironweave-<run id>``; else under
    ``ironweave launch --restart-all`` ``/dev/shm/ironweave-<job id>``; else None (torchrun's
    shared ``none`` id: the id is derived when the job forms, see ``Checkpointer.keep_dir``).
    Each engine of the job keeps under its own subdirectory (``checkpointer-0``, ``dcp-0``)."""
    d = os.environ.get("IRONWEAVE_KEEP_DIR")
    if d:
        return d
    run = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run in ("", "none"):
        # `ironweave launch --restart-all` restarts every rank too; its job id outlives them
        run = os.environ.get("IRONWEAVE_JOB_ID", "").strip() if "IRONWEAVE_RANK" in os.environ else ""
    if run and os.path.isdir("/dev/shm"):
        return f"/dev/shm/ironweave-{_native.safe_name(run)}"
    return None


_LIVE: Dict[str, set] = {}  # the slots of each kind's open engines in this process: name each one's keep directory


def _release(kind: str, slot: int) -> None:
    _LIVE.get(kind, set()).discard(slot)


def _keep_choice(keep_dir: Any, kind: str, slot: Optional[List[int]] = None) -> Tuple[Optional[str], Optional[str]]:
    """(keep_dir, keep_name) for the native engine: an explicit directory as given; ``"auto"``
    under a launcher that restarts every process (torchrun, ``ironweave launch``) a
    subdirectory of the job's own directory, named per engine (``<kind>-<n>``, n the lowest slot
    no open engine of that kind in this process holds, so a restarted process finds its copies
    under the same name: a Checkpointer and a PeerMemoryWriter of one job never share files) —
    ``IRONWEAVE_KEEP_DIR/<name>``, else the engine's ``/dev/shm/ironweave-<job id>/<name>`` with
    the job id as the job forms it. ``slot``: receives the slot taken (release it on close)."""
    if keep_dir != "auto":
        return (os.fspath(keep_dir) if keep_dir is not None else None), None
    live = _LIVE.setdefault(kind, set())
    n = next(i for i in range(len(live) + 1) if i not in live)
    live.add(n)
    if slot is not None:
        slot.append(n)
    name = f"{kind}-{n}"
    d = os.environ.get("IRONWEAVE_KEEP_DIR")
    if d:
        return os.path.join(d, name), None
    if "TORCHELASTIC_RUN_ID" in os.environ or ("IRONWEAVE_RANK" in os.environ and "IRONWEAVE_JOB_ID" in os.environ):
        return None, name
    return None, None


def init_process_group(backend: str = "gloo", timeout_s: float = 300.0) -> None:
    """``torch.distributed.init_process_group`` for a job torchrun (or ``ironweave launch
    --restart-all``) may restart: under torchrun the process group meets in a store of the
    round's own (``_round_store``); under ironweave launch in a file store per generation. Measured here
    with torch 2.15: after a restart, the default ``env://`` initialisation finds the failed
    attempt's addresses in torchrun's store and gloo's mesh fails with "Connection refused";
    with a store of each round's own (``_round_store``) the restarted workers meet each other, also
    when a node was replaced by a new agent. Outside torchrun it is the plain call."""
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
    store = dist.PrefixStore("ironweave-pg", _round_store(timeout_s))
    dist.init_process_group(
        backend, store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout
    )


_ROUND = None  # this process's round store under torchrun (_round_store)


def _round_store(timeout_s: float):
    """A store fresh to this round of the job's workers, under torchrun: global rank 0 serves it
    (a TCPStore on a free port) and publishes ``MASTER_ADDR:port:nonce`` in torchrun's store;
    the others take the published address once a store answers there with that nonce.

    Why not a key prefix per ``TORCHELASTIC_RESTART_COUNT``: each agent counts its own restarts,
    so when a node is replaced by a new agent (count 0) beside agents that restarted (count 1),
    the counts differ and the ranks never meet. A stale address (the previous round's rank 0)
    has no server any more — every worker of a round is stopped before the next one starts — or
    another nonce, so it is passed over until rank 0 of this round publishes its own."""
    global _ROUND
    if _ROUND is not None:
        return _ROUND
    import datetime
    import socket
    import time

    import torch.distributed as dist

    agent = _torchrun_store(timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        srv = dist.TCPStore(os.environ["MASTER_ADDR"], 0, world, is_master=True, wait_for_workers=False, timeout=timeout)
        nonce = secrets.token_hex(8)
        srv.set("ironweave-round", nonce)
        agent.set("ironweave-round-store", f"{os.environ['MASTER_ADDR']}:{srv.port}:{nonce}")
        _ROUND = srv
        return srv
    deadline = time.monotonic() + timeout_s
    while True:
        host, port, nonce = agent.get("ironweave-round-store").decode().rsplit(":", 2)
        try:
            # a raw probe first: a dead address is refused at once, without the store's retries
            with socket.create_connection((host, int(port)), timeout=1.0):
                pass
            c = dist.TCPStore(host, int(port), world, is_master=False, timeout=datetime.timedelta(seconds=5))
            if c.get("ironweave-round").decode() == nonce:
                _ROUND = c
                return c
        except (OSError, RuntimeError):
            pass
        if time.monotonic() > deadline:
            raise _native.CheckpointTimeoutError(
                f"no store of this round answered at the address rank 0 publishes in torchrun's store within {timeout_s} s "
                f"(last: {host}:{port}): rank 0 did not start, or {host} is not reachable from this node"
            )
        time.sleep(0.2)


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


_STORE = None  # this process's client (or, without the agent's store, server) of torchrun's store


def _torchrun_store(timeout_s: float):
    """torchrun's TCP store at ``MASTER_ADDR:MASTER_PORT``: the agent's (torchrun's default,
    ``TORCHELASTIC_USE_AGENT_STORE=True``), or, where the agents do not share theirs
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), one global rank 0 serves for the round, as
    ``env://`` does (a client when something, e.g. the user's own ``env://`` group, already
    serves there)."""
    global _STORE
    if _STORE is not None:
        return _STORE
    import datetime

    import torch.distributed as dist

    addr, port, world = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and int(os.environ["RANK"]) == 0:
        try:
            _STORE = dist.TCPStore(addr, port, world, is_master=True, wait_for_workers=False, timeout=timeout)
            return _STORE
        except (RuntimeError, OSError):
            pass
    _STORE = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    return _STORE


_OUR_PORT: Optional[str] = None  # the IRONWEAVE_CKPT_PORT this module set (a user's own is left alone)
_OUR_SECRET: Optional[str] = None  # the IRONWEAVE_SECRET this module set
_ENGINES = 0  # engines this process started under torchrun: names the next one's port in the store


def _agree_on_port(timeout_s: float) -> None:
    """Under torchrun, the job's secret and the checkpointer's port come from torchrun's store.

    The secret: rank 0 publishes a random one once per job (``compare_set``: a restarted
    attempt reads the same), every rank sets ``IRONWEAVE_SECRET`` from it before its engine
    starts. The engine's handshake then refuses a peer that cannot prove it knows the secret,
    and every kept copy carries a MAC under it. A secret the user set is left alone.

    The port: one rank 0 finds free below the kernel's ephemeral range (``_native.free_port``,
    as ``ironweave launch`` picks its own: no outgoing connection can be handed it) and
    publishes in torchrun's store, and every rank reads it there before its engine starts. The
    Rust default (the master port + 1) collided once with another socket.
    The store is torchrun's TCP store, not a process group: no collective, safe on the thread
    DCP writes from. A port the user set (``IRONWEAVE_CKPT_PORT``) and ``ironweave launch`` (its
    own port and secret) are left alone, as is a job outside torchrun (the Rust default stands)."""
    global _OUR_PORT, _OUR_SECRET, _ENGINES
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "IRONWEAVE_RANK" in os.environ:
        return
    store = _torchrun_store(timeout_s)
    if os.environ.get("IRONWEAVE_SECRET") in (None, "", _OUR_SECRET):
        if int(os.environ["RANK"]) == 0:
            store.compare_set("ironweave-secret", "", secrets.token_hex(32))
        sec = store.get("ironweave-secret").decode()
        os.environ["IRONWEAVE_SECRET"] = _OUR_SECRET = sec
    user = os.environ.get("IRONWEAVE_CKPT_PORT")
    if user is not None and user != _OUR_PORT:
        return
    # every rank starts its engines in the same order (starting one is collective); the keys go
    # in this round's store, fresh whatever each agent counts
    key = f"ironweave-ckpt-port-{_ENGINES}"
    _ENGINES += 1
    rs = _round_store(timeout_s)
    if int(os.environ["RANK"]) == 0:
        rs.set(key, str(_native.free_port()))
    port = rs.get(key).decode()
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
        # a closure for the optimizers that need one (LBFGS); the others call it and ignore
        # the loss
        optim.step(lambda: torch.zeros(()))
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


class _Refused(Exception):
    """A refusal this rank found in its state, carried to the engine so that every rank raises
    it (``kind``: "config" or "mismatch")."""

    def __init__(self, kind: str, a: str, b: str = "", c: str = "") -> None:
        super().__init__(a)
        self.args4 = (kind, a, b, c)


def _stateful(obj: Any) -> bool:
    """Saved through ``state_dict()``/``load_state_dict()`` (LR schedulers, stateful data
    loaders), not pickled whole."""
    return (
        not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


class Checkpointer:
    """Checkpoints ``state`` every step into peers' host memory; restores it after a failure.

    ``state`` maps names to ``torch.nn.Module``s, ``torch.optim.Optimizer``s (their empty state
    is created now; their state is keyed by parameter names, as
    ``torch.distributed.checkpoint.state_dict`` keys it, so a changed parameter order restores
    correctly), tensors, objects with ``state_dict()``/``load_state_dict()`` (LR schedulers,
    stateful data loaders: saved and restored through them), and small picklable values (kept in
    ``extras_bytes``). Tensors are on the CPU, or on a CUDA device (copied to pinned host
    buffers on a side stream). Every rank must pass the same keys, dtypes and shapes (data
    parallelism); a difference raises ``StateMismatchError`` naming the key on every rank.

    A refusal on one rank (a step that does not increase, a state that changed, values that do
    not fit ``extras_bytes``) is agreed before anything is snapshot: every rank raises the same
    error at once, and the checkpointer stays usable.

    ``strategy``: ``capricorn`` (chunks placed in the link's idle time), ``gemini``; ``replicas``:
    copies of each step's state including the rank's own, placed on other nodes
    (``IRONWEAVE_HOST``, else the hostname, checked against torchrun's ``GROUP_RANK``);
    ``keep_dir``: a tmpfs directory the copies outlive the processes in (``"auto"``: under
    torchrun ``/dev/shm/ironweave-<job id>/checkpointer-<n>``, see ``keep_dir_for_job``;
    created 0700, checked for room before training); ``persist_dir`` and ``persist_every``: also
    write every N steps to a file system; ``job_id``: the job's identity (default: the
    launcher's run id, or one derived from the rendezvous and the command line).
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
        self._hooks: List[Any] = []
        self._watched: List[Any] = []
        self._extras_cap = int(extras_bytes)
        self._extras = torch.zeros(self._extras_cap + 8, dtype=torch.uint8)
        self._staging: Dict[str, torch.Tensor] = {}
        self._globals: Dict[str, Tuple[List[int], List[int]]] = {}  # a DTensor's global shape and offsets
        self._stream = None
        specs: List[Tuple[str, str, List[int], None]] = []
        refusal = None
        try:
            for v in state.values():
                if isinstance(v, torch.optim.Optimizer):
                    _materialize(v)
            dicts = self._dicts()
            self._names, tensors = self._tensors(dicts)
            self._pack_extras(dicts)  # a state whose values do not fit fails now, not at the first save
            me = os.environ.get("RANK", os.environ.get("IRONWEAVE_RANK", "0"))
            for name, t in zip(self._names, tensors):
                # each tensor names its place in the global tensor, so the copies load onto
                # another world size: a DTensor's local shard its offsets; a whole tensor (the
                # same on every rank in data parallelism) at zero, owned by rank 0 (the others'
                # are marked copies)
                shape, offsets = self._globals.get(name, (list(t.shape), [0] * t.dim()))
                owner = name in self._globals or me == "0"
                if t.dtype in _DTYPES:
                    specs.append((name, _DTYPES[t.dtype], list(t.shape), (name, shape, offsets, owner)))
                else:
                    # other dtypes travel as their bytes (bool, int8, int16, complex, ...)
                    n = t.numel() * t.element_size()
                    specs.append((name, "u8", [n], (name, [n], [0], owner) if name not in self._globals else None))
            # the picklable values are each rank's own: a global tensor per rank
            room = self._extras_cap + 8
            specs.append((_EXTRAS, "u8", [room], (f"{_EXTRAS}.rank{me}", [room], [0])))
        except IronweaveError as e:
            # agreed with the other ranks once joined: they raise it too, none waits for this one
            refusal, specs = ("config", str(e), "", ""), []
        self._slot: List[int] = []
        keep_dir, keep_name = _keep_choice(keep_dir, "checkpointer", self._slot)
        try:
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
                keep_name=keep_name,
                refusal=refusal,
                # sharded state (DTensors, FSDP2) has a layout of its own on each rank
                same_layout=not self._globals,
            )
        except BaseException:
            for n in self._slot:
                _release("checkpointer", n)
            raise
        self.keep_dir: Optional[str] = self._engine.keep_dir
        self.job_id: str = self._engine.job_id

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

    def _param_names(self) -> Dict[int, str]:
        """Each parameter's fully qualified name (``<key>.<name>``) by ``id``: the first name of
        a parameter two modules share."""
        names: Dict[int, str] = {}
        for key, obj in self._state.items():
            if isinstance(obj, torch.nn.Module):
                inner = getattr(obj, "module", obj)  # DDP's wrapped module: the names a user sees
                for n, p in inner.named_parameters(remove_duplicate=False):
                    names.setdefault(id(p), f"{key}.{n}")
        return names

    def _optim_keys(self, optim: torch.optim.Optimizer, sd: Dict[str, Any]) -> Dict[Any, str]:
        """The optimizer's state_dict indices by parameter name (its position when the
        parameter is in no module of the state)."""
        params = [p for g in optim.param_groups for p in g["params"]]
        names = self._param_names()
        return {idx: names.get(id(params[idx]), f"#{idx}") if isinstance(idx, int) and idx < len(params) else f"#{idx}" for idx in sd["state"]}

    def _tensors(self, dicts: Dict[str, Dict[str, Any]], registered: Optional[set] = None) -> Tuple[List[str], List[torch.Tensor]]:
        """Every tensor of the state by name: modules' (a tensor two keys share, tied weights,
        once), optimizers' state by parameter name, sorted. ``registered``: optimizer state
        tensors outside it are left to the picklable values (state an optimizer grows later,
        LBFGS's history)."""
        names: List[str] = []
        tensors: List[torch.Tensor] = []
        seen: Dict[Tuple, str] = {}
        for key, obj in self._state.items():
            if isinstance(obj, torch.nn.Module):
                for k, t in dicts[key].items():
                    if not isinstance(t, torch.Tensor):
                        continue
                    t = self._local(f"{key}.{k}", t)
                    ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
                    if t.numel() and ident in seen:
                        continue  # tied: the same memory as an earlier key, saved and restored once
                    seen[ident] = f"{key}.{k}"
                    names.append(f"{key}.{k}")
                    tensors.append(t)
            elif isinstance(obj, torch.optim.Optimizer):
                sd = dicts[key]
                by_name = self._optim_keys(obj, sd)
                entries = []
                for idx, st in sd["state"].items():
                    for k, v in st.items():
                        n = f"{key}.state.{by_name[idx]}.{k}"
                        if isinstance(v, torch.Tensor) and (registered is None or n in registered):
                            entries.append((n, self._local(n, v)))
                for n, v in sorted(entries, key=lambda e: e[0]):
                    names.append(n)
                    tensors.append(v)
            elif isinstance(obj, torch.Tensor):
                names.append(key)
                tensors.append(self._local(key, obj))
        for n, t in zip(names, tensors):
            if t.device.type == "cuda":
                if not torch.cuda.is_available():
                    raise ConfigurationError(f"`{n}` is on {t.device} but CUDA is not available in this process")
            elif t.device.type != "cpu":
                raise ConfigurationError(
                    f"`{n}` is on {t.device}: ironweave checkpoints CPU and CUDA tensors; copy it to one of them before saving"
                )
        return names, tensors

    def _local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A DTensor (FSDP2's parameters and optimizer state) as its local shard, its global
        shape and offsets noted; any other tensor as it is."""
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # a torch without DTensor has none to take apart
            return t
        if not isinstance(t, DTensor):
            return t
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        self._globals[name] = (list(t.shape), [int(o) for o in offsets])
        return t.to_local()

    def _current(self, dicts: Dict[str, Dict[str, Any]]) -> List[torch.Tensor]:
        names, tensors = self._tensors(dicts, set(self._names))
        if names != self._names:
            missing = next((n for n in self._names if n not in names), None)
            added = next((n for n in names if n not in self._names), None)
            key = missing or added or "(order)"
            raise _Refused(
                "mismatch",
                key,
                "the keys registered when the checkpointer was made",
                "missing" if missing else "new",
            )
        return tensors

    def _extra_values(self, dicts: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        registered = set(self._names)
        for key, obj in self._state.items():
            if isinstance(obj, torch.optim.Optimizer):
                sd = dicts[key]
                by_name = self._optim_keys(obj, sd)
                out[key] = {
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]],
                    # by parameter name; tensors not registered (grown later) travel here too
                    "state": {
                        by_name[idx]: {
                            k: v for k, v in st.items() if not (isinstance(v, torch.Tensor) and f"{key}.state.{by_name[idx]}.{k}" in registered)
                        }
                        for idx, st in sd["state"].items()
                    },
                }
            elif _stateful(obj):
                out[key] = ("state_dict", obj.state_dict())
            elif not isinstance(obj, (torch.nn.Module, torch.Tensor)):
                out[key] = ("value", obj)
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
        # the restored bytes carried a valid MAC under the job's secret (when it has one) and
        # passed their checksums before they reach pickle
        values = pickle.loads(_unframe(self._extras, f"restored picklable values (extras_bytes={self._extras_cap})"))
        names = self._param_names()
        for key, v in values.items():
            obj = self._state.get(key)
            if isinstance(obj, torch.optim.Optimizer):
                for g, saved in zip(obj.param_groups, v["param_groups"]):
                    g.update(saved)
                params = [q for g in obj.param_groups for q in g["params"]]
                by_name = {names.get(id(q), f"#{i}"): q for i, q in enumerate(params)}
                for name, st in v["state"].items():
                    if st and name in by_name:
                        obj.state[by_name[name]].update(st)
            elif isinstance(v, tuple) and len(v) == 2 and v[0] == "state_dict" and _stateful(obj):
                obj.load_state_dict(v[1])
            elif isinstance(v, tuple) and len(v) == 2 and v[0] == "value":
                self._state[key] = v[1]

    @staticmethod
    def _bytes(t: torch.Tensor):
        return t.detach().reshape(-1).view(torch.uint8).numpy()

    def _host(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A CUDA tensor's pinned host buffer (made once, reused every step)."""
        h = self._staging.get(name)
        if h is None:
            h = self._staging[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return h

    def _host_views(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Each tensor as CPU memory: CUDA tensors copied into their pinned buffers on a side
        stream (waited for before the engine reads them)."""
        out = []
        copies = False
        for n, t in zip(self._names, tensors):
            if t.device.type == "cuda":
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=t.device)
                h = self._host(n, t)
                self._stream.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(self._stream):
                    h.copy_(t.detach(), non_blocking=True)
                copies = True
                out.append(h)
            else:
                out.append(t if t.is_contiguous() else t.contiguous())
        if copies:
            self._stream.synchronize()
        return out

    # -- the API ----------------------------------------------------------------------------

    def save(self, step: int) -> int:
        """Snapshots the state after ``step``'s optimizer step (collective: every rank, every
        step it checkpoints); replication to peers goes on in the background. A refusal on any
        rank is every rank's error (raised at once, nothing saved)."""
        refusal = None
        bufs: List[Any] = []
        cause: Optional[BaseException] = None
        try:
            try:
                step = operator.index(step)
            except TypeError:
                raise ConfigurationError(f"step {step!r}: give an integer") from None
            if step < 0:
                raise ConfigurationError(f"step {step}: a step is not negative")
            dicts = self._dicts()
            tensors = self._current(dicts)
            self._pack_extras(dicts)
            bufs = [self._bytes(t) for t in self._host_views(tensors)]
            bufs.append(self._bytes(self._extras))
        except _Refused as e:
            refusal, cause = e.args4, e
        except IronweaveError as e:
            refusal, cause = ("config", str(e), "", ""), e
        try:
            return self._engine.save(step if refusal is None else 0, bufs, refusal)
        except IronweaveError as agreed:
            raise agreed from cause

    def restore(self) -> Optional[Dict[str, Any]]:
        """Restores the newest step every rank has a whole copy of, in place (collective; all or
        nothing). Returns ``{"step", "source" ("own memory" | "peer" | "persistent"), "peer",
        "bytes", "seconds"}``, or None when no rank holds any copy (a fresh start). Every kept
        copy is checked (checksums, and its MAC under the job's secret) before it is used."""
        refusal = None
        bufs: List[Any] = []
        staged: List[Tuple[torch.Tensor, torch.Tensor]] = []
        try:
            tensors = self._current(self._dicts())
            for n, t in zip(self._names, tensors):
                if t.device.type == "cuda":
                    h = self._host(n, t)
                    staged.append((t, h))
                    bufs.append(self._bytes(h))
                elif t.is_contiguous():
                    bufs.append(self._bytes(t))
                else:
                    tmp = torch.empty(t.shape, dtype=t.dtype)
                    staged.append((t, tmp))
                    bufs.append(self._bytes(tmp))
            bufs.append(self._bytes(self._extras))
        except _Refused as e:
            refusal, bufs = e.args4, []
        except IronweaveError as e:
            refusal, bufs = ("config", str(e), "", ""), []
        with torch.no_grad():
            info = self._engine.restore(bufs, refusal)
            if info is None:
                return None
            for t, tmp in staged:
                t.copy_(tmp)  # one host-to-device copy for a CUDA tensor
        self._unpack_extras()
        print(
            f"ironweave: rank {self.rank} restored step {info['step']} from {info['source']}"
            + (f" (rank {info['peer']}'s copy)" if info.get("peer") is not None else ""),
            file=sys.stderr,
            flush=True,
        )
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
        ``model``'s layers (forward hooks on the modules that hold parameters, numbered in
        forward order; a layer's backward runs from the gradient of its output to the last of
        its parameters' gradients — tensor hooks, so in-place operations stay allowed and torch
        warns of nothing) and, for a ``DistributedDataParallel`` model, each gradient
        all-reduce (a DDP communication hook: DDP's bucket all-reduce timed, or
        ``deterministic_ddp``'s hook timed). From these the engine predicts when the link is
        free of training bytes and sends the checkpoint's chunks then (``strategy="capricorn"``).
        Call once, before the first step you want seen; ``close()`` removes the hooks. Returns
        the checkpointer."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        inner = model.module if isinstance(model, DDP) else model
        layers = [m for m in inner.modules() if any(True for _ in m.parameters(recurse=False))]
        eng = self._engine
        me = self

        def record(i, phase, t0):
            if me._engine is None:
                return
            try:
                eng.record_layer(i, phase, t0, eng.now_ns())
            except _native.ClosedError:
                pass

        for i, m in enumerate(layers):
            params = [p for p in m.parameters(recurse=False) if p.requires_grad]
            state = {"fwd": 0, "bwd": None, "left": 0}

            def fwd_pre(_m, _args, state=state):
                state["fwd"] = eng.now_ns()

            def fwd_post(_m, _args, out, i=i, state=state, n=len(params)):
                record(i, "forward", state["fwd"])
                if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
                    def grad_in(_g, state=state, n=n):
                        state["bwd"], state["left"] = eng.now_ns(), n
                    out.register_hook(grad_in)

            def grad_done(_p, i=i, state=state):
                if state["bwd"] is None:
                    return
                state["left"] -= 1
                if state["left"] <= 0:
                    record(i, "backward", state["bwd"])
                    state["bwd"] = None

            self._hooks.append(m.register_forward_pre_hook(fwd_pre))
            self._hooks.append(m.register_forward_hook(fwd_post))
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(grad_done))
        if isinstance(model, DDP):
            state = getattr(model, "_ironweave_hook", None)
            if state is None:
                state = model._ironweave_hook = _HookState(None)
                model.register_comm_hook(state, _bucket_allreduce)
            state.recorder = self
            self._watched.append(state)
        return self

    def _unwatch(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for st in self._watched:
            if st.recorder is self:
                st.recorder = None
        self._watched.clear()

    def committed(self) -> Optional[int]:
        """The newest step whose every rank's state is replicated, as last agreed."""
        return self._engine.committed()

    def stats(self) -> Dict[str, Any]:
        """Counters: saves, exposed seconds, state and replica bytes (``replica_bytes_inter_host``:
        those that went to another node), memory passes per state byte as a sender and as a
        holder (``memory_passes_send``/``_recv``: bytes the engine read and wrote over state
        bytes; a copy is 2), kept copies adopted at start by mapping (``kept_bytes_mapped``) or
        reading (``kept_bytes_copied``), committed and kept steps; with ``watch``: steps
        profiled, training communications recorded, chunks released and those whose transfer
        lay in an idle window of the training link."""
        return self._engine.stats()

    def close(self, remove_kept: bool = True) -> None:
        """Replicates the last snapshot and stops (collective); removes ``watch``'s hooks.
        ``remove_kept``: the job is over, so the copies kept for restarts are removed."""
        self._unwatch()
        try:
            self._engine.close(remove_kept)
        finally:
            for n in self._slot:
                _release("checkpointer", n)
            self._slot = []

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # after an error the peers may be gone: no collective call, the copies stay for the restart
        if exc_type is None:
            self.close(remove_kept=True)
        else:
            self._unwatch()

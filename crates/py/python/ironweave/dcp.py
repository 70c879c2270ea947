"""PyTorch Distributed Checkpoint (DCP) storage in peers' host memory.

    writer = PeerMemoryWriter()                       # keeps copies in /dev/shm under torchrun
    for step in ...:
        ...
        dcp.save(state, storage_writer=writer, checkpoint_id=step)
        # or: fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=step,
        #                          process_group=ckpt_group)
    writer.close(remove_kept=False)                   # leave the copies for a later load
    ...
    dcp.load(state, storage_reader=PeerMemoryReader(writer.keep_dir))   # any world size

``PeerMemoryWriter`` is a DCP ``StorageWriter`` (and ``AsyncStager``): each rank's write items
go into ironweave's engine — a snapshot in the rank's memory, replicas in its peers' memory in
the background, a commit once every rank's items are replicated, and, with ``keep_dir``, copies
in a tmpfs that outlive the processes (the format of the persistent tier). ``PeerMemoryReader``
reads those copies back, whatever world size and layout wrote them: DCP's planner says which
part of which saved item each of the loader's tensors wants, and the project's resharding
(``ironweave.checkpointer::load_saved``) reads exactly those slices from whichever holder has
them, each checked against its checksum.

Each rank's copy also holds the whole save plan (every rank's write items, attached by the
coordinator), so one rank's copy is enough to rebuild DCP's metadata: there is no separate
metadata file to lose. Like DCP's own ``.metadata`` file it is a pickle: load only checkpoints
your job wrote.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.futures import Future
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from ironweave import _native
from ironweave._native import ConfigurationError, StateMismatchError
from ironweave.torch import _DTYPES as _TORCH_DTYPES
from ironweave.torch import _agree_on_port, _frame_into, _keep_choice, _release, _unframe

__all__ = ["PeerMemoryWriter", "PeerMemoryReader"]

# torch dtype -> the engine's; one-byte types travel as u8 with their shape (the real dtype is
# in the save plan every copy holds)
_DTYPES = {**_TORCH_DTYPES, torch.int8: "u8", torch.bool: "u8"}
_PLAN = "ironweave.dcp.plan"


def _plan_name(rank: int) -> str:
    return f"{_PLAN}.{rank:05}"


def _key(index: MetadataIndex) -> str:
    """The engine's name of one write item: its key, and where its chunk starts when it is a
    shard (a rank may hold several chunks of one tensor)."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def _dtype_name(fqn: str, dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigurationError(
            f"`{fqn}` is {dtype}: the peer-memory storage keeps {', '.join(str(d) for d in _DTYPES)}; "
            "convert it, or save it with another storage"
        ) from None


def _framed(blob: bytes, cap: int) -> torch.Tensor:
    """`blob` behind its 8-byte length in a buffer of `cap` + 8 bytes."""
    buf = torch.zeros(cap + 8, dtype=torch.uint8)
    _frame_into(buf, blob)
    return buf


def _bytes_of(t: torch.Tensor):
    return t.reshape(-1).view(torch.uint8).numpy()


def _step_of(checkpoint_id: Any) -> Optional[int]:
    if checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, int):
        step = checkpoint_id
    else:
        # DCP's ids are paths: "/ckpt/step_100", "ckpt/100", Path(...): the step is the number
        # the last component ends in
        base = os.path.basename(os.path.normpath(os.fspath(checkpoint_id)))
        m = re.search(r"(\d+)$", base)
        if m is None:
            raise ConfigurationError(
                f"checkpoint_id {checkpoint_id!r}: the peer-memory storage numbers checkpoints by step; "
                "pass the step (an integer, or a path whose last part ends in one, e.g. ckpt/step_100), "
                "or None for the previous step + 1"
            )
        step = int(m.group(1))
    if step < 0:
        raise ConfigurationError(f"checkpoint_id {checkpoint_id!r}: a step is not negative")
    return step


class PeerMemoryWriter(StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` into ironweave's engine (see the module docs).

    The engine starts at the first save (collective, on ironweave's own port, as
    ``ironweave.torch.Checkpointer``) with the layout of that save's plan; later saves must
    write the same items (a training loop saves the same state every step), else
    ``StateMismatchError`` names the first difference. ``checkpoint_id`` is the step;
    steps increase. ``bytes_capacity``: room for each non-tensor value (pickled by DCP), fixed
    at the first save as the larger of this and twice its size then.

    As an ``AsyncStager`` it copies the state into CPU buffers kept between saves, so
    ``dcp.async_save`` returns after that copy; run it on its own gloo process group (the save
    plan's collectives run in a background thread) with the thread executor (the engine lives
    in this process: the process executor is refused).
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        *,
        replicas: int = 2,
        strategy: str = "capricorn",
        keep_dir: Optional[str] = "auto",
        persist_dir: Optional[str] = None,
        persist_every: int = 0,
        timeout_s: float = 300.0,
        job_id: Optional[str] = None,
        bytes_capacity: int = 256,
    ) -> None:
        super().__init__()
        self._slot: List[int] = []
        self.keep_dir, keep_name = _keep_choice(keep_dir, "dcp", self._slot)
        self._opts = dict(
            strategy=strategy,
            replicas=replicas,
            keep_dir=self.keep_dir,
            keep_name=keep_name,
            persist_dir=persist_dir,
            persist_every=persist_every,
            timeout_s=timeout_s,
            job_id=job_id,
            same_layout=False,  # DCP spreads replicated items over the ranks: layouts differ
        )
        self._bytes_cap = int(bytes_capacity)
        self._engine: Optional[_native.Engine] = None
        self._specs: Optional[List[Tuple]] = None
        self._caps: Dict[str, int] = {}
        self._step: Optional[int] = None
        self._last: int = 0
        self._staged: Optional[Dict[str, Any]] = None
        self.metadata: Optional[Metadata] = None

    # -- StorageWriter ----------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        step = _step_of(checkpoint_id)
        self._step = self._last + 1 if step is None else step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            _step_of(checkpoint_id)
            return True
        except ConfigurationError:
            return False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        # every rank's copy carries the whole plan, so any one of them rebuilds the metadata
        whole = pickle.dumps([list(p.items) for p in plans], protocol=4)
        return [dataclasses.replace(p, storage_data=whole) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        if self._step is None:
            self.reset(None)
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        whole = plan.storage_data
        if not isinstance(whole, bytes):
            raise ConfigurationError("the save plan carries no global plan: use PeerMemoryWriter for the whole save")
        first = self._engine is None
        specs: List[Tuple] = []
        bufs = []
        results: List[WriteResult] = []
        keep = []  # tensors the buffers view, alive until the engine has copied them
        for item in plan.items:
            name = _key(item.index)
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                blob = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                if first:
                    self._caps[name] = max(self._bytes_cap, 2 * len(blob))
                cap = self._caps.get(name, 0)
                if len(blob) > cap:
                    raise ConfigurationError(
                        f"`{item.index.fqn}` takes {len(blob)} bytes now, more than the {cap} set at the first save: "
                        "raise bytes_capacity, or keep large values in tensors"
                    )
                t = _framed(blob, cap)
                specs.append((name, "u8", [cap + 8], (item.index.fqn, [cap + 8], [0])))
            else:
                t = planner.resolve_data(item).detach()
                if t.device.type != "cpu":
                    raise ConfigurationError(
                        f"`{item.index.fqn}` is on {t.device}: this build keeps CPU tensors only (no GPU path); "
                        "copy the state to the CPU before saving"
                    )
                td = item.tensor_data
                specs.append(
                    (
                        name,
                        _dtype_name(item.index.fqn, t.dtype),
                        list(td.chunk.sizes),
                        (item.index.fqn, list(td.size), [int(o) for o in td.chunk.offsets]),
                    )
                )
                t = t.contiguous()
            keep.append(t)
            bufs.append(_bytes_of(t))
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(), storage_data=name))
        if first:
            self._plan_cap = 2 * len(whole) + 64
        if len(whole) > self._plan_cap:
            raise StateMismatchError("the save plan grew since the first save: make a new PeerMemoryWriter for a new state")
        pbuf = _framed(whole, self._plan_cap)
        specs.append((_plan_name(rank), "u8", [self._plan_cap + 8], (_plan_name(rank), [self._plan_cap + 8], [0])))
        keep.append(pbuf)
        bufs.append(_bytes_of(pbuf))
        if first:
            _agree_on_port(self._opts.get("timeout_s", 300.0))
            self._engine = _native.Engine(specs, **self._opts)
            self.keep_dir = self._engine.keep_dir
            self._specs = specs
        elif specs != self._specs:
            diff = next(
                (f"`{a[0]}` {a[1:3]} now, {b[1:3]} at the first save" for a, b in zip(specs, self._specs) if a != b),
                f"{len(specs)} items now, {len(self._specs)} at the first save",
            )
            raise StateMismatchError(
                f"state mismatch on rank {rank}: {diff}; every save of one PeerMemoryWriter writes the same items"
            )
        self._engine.save(int(self._step), bufs)
        self._last, self._step = int(self._step), None
        del keep
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        # nothing to write: each rank's copy already holds the whole plan
        self.metadata = metadata

    # -- AsyncStager ------------------------------------------------------------------------

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self._staged is None:
            self._staged = _create_cpu_state_dict(state_dict)
        return _copy_state_dict(state_dict, self._staged)

    def synchronize_staging(self) -> None:
        pass

    def __getstate__(self):
        raise ConfigurationError(
            "a PeerMemoryWriter holds this process's engine and cannot move to another process: "
            "use dcp.async_save's thread executor (the default)"
        )

    # -- the engine -------------------------------------------------------------------------

    def committed(self) -> Optional[int]:
        """The newest step every rank's items of are replicated, as last agreed."""
        return self._engine.committed() if self._engine is not None else None

    def stats(self) -> Dict[str, Any]:
        """The engine's counters (see ``ironweave.torch.Checkpointer.stats``)."""
        return self._engine.stats() if self._engine is not None else {}

    def close(self, remove_kept: bool = True) -> None:
        """Replicates the last save and stops (collective). ``remove_kept=False`` leaves the
        copies in ``keep_dir`` for a later ``dcp.load`` (another job, another world size);
        remove them then with ``shutil.rmtree(keep_dir)``."""
        try:
            if self._engine is not None:
                self._engine.close(remove_kept)
        finally:
            for n in self._slot:
                _release("dcp", n)
            self._slot = []


class PeerMemoryReader(StorageReader):
    """A DCP ``StorageReader`` of the copies a ``PeerMemoryWriter`` left: a keep directory
    (``writer.keep_dir``) or a persistent tier (``persist_dir``). The newest step every writing
    rank left whole is loaded, onto any world size and layout (see the module docs); a
    ``checkpoint_id`` passed to ``dcp.load`` replaces the directory."""

    def __init__(self, path: Optional[str] = None) -> None:
        super().__init__()
        # a keep directory carries its writer's key (``mac-key``, 0600): every file's MAC is
        # checked with it before anything of it is used or unpickled
        self.path = os.fspath(path) if path is not None else None
        self.step: Optional[int] = None
        self.bytes_read = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.bytes_read = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return os.path.isdir(os.fspath(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if not self.path:
            raise ConfigurationError("PeerMemoryReader: give the directory the writer kept its copies in")
        step, tensors = _native.saved(self.path)
        shapes = {n: s for n, _, s in tensors}
        plan_name = next((n for n in sorted(shapes) if n.startswith(_PLAN + ".")), None)
        if plan_name is None:
            return self._metadata_of_tensors(step, tensors)
        buf = torch.empty(shapes[plan_name][0], dtype=torch.uint8)
        _native.load_saved(self.path, step, [(plan_name, "u8", [buf.numel()], (plan_name, [buf.numel()], [0]))], [_bytes_of(buf)])
        plans: List[List[WriteItem]] = pickle.loads(_unframe(buf, plan_name))
        sd_meta: Dict[str, Any] = {}
        storage: Dict[MetadataIndex, Tuple[str, int]] = {}
        for items in plans:
            for item in items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    sd_meta[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = ("bytes", shapes[fqn][0])
                else:
                    td = item.tensor_data
                    md = sd_meta.setdefault(fqn, TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[]))
                    md.chunks.append(td.chunk)
                    storage[MetadataIndex(fqn, td.chunk.offsets)] = ("tensor", 0)
        self.step = step
        return Metadata(state_dict_metadata=sd_meta, storage_data=storage)

    def _metadata_of_tensors(self, step: int, tensors) -> Metadata:
        """The metadata of copies an ``ironweave.torch.Checkpointer`` kept (no save plan): each
        global tensor whole, under the name the Checkpointer gave it (``<key>.<state_dict
        key>``, as DCP flattens ``{key: module.state_dict()}``); its own picklable values stay
        out."""
        by_name = {v: k for k, v in _TORCH_DTYPES.items()}
        sd_meta: Dict[str, Any] = {}
        storage: Dict[MetadataIndex, Tuple[str, int]] = {}
        for name, dtype, shape in tensors:
            if name.startswith("ironweave.") or dtype not in by_name:
                continue
            zero = torch.Size([0] * len(shape))
            sd_meta[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=by_name[dtype]),
                size=torch.Size(shape),
                chunks=[ChunkStorageMetadata(offsets=zero, sizes=torch.Size(shape))],
            )
            storage[MetadataIndex(name, zero)] = ("tensor", 0)
        self.step = step
        return Metadata(state_dict_metadata=sd_meta, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        md = self._metadata
        specs: List[Tuple] = []
        bufs: List[torch.Tensor] = []
        for i, ri in enumerate(plan.items):
            kind, cap = md.storage_data[ri.storage_index]
            fqn = ri.storage_index.fqn
            if kind == "bytes":
                specs.append((f"read.{i}", "u8", [cap], (fqn, [cap], [0])))
                bufs.append(torch.empty(cap, dtype=torch.uint8))
            else:
                tmd = md.state_dict_metadata[fqn]
                start = [int(c) + int(o) for c, o in zip(ri.storage_index.offset, ri.storage_offsets)]
                dtype = tmd.properties.dtype
                lengths = [int(n) for n in ri.lengths]
                specs.append((f"read.{i}", _dtype_name(fqn, dtype), lengths, (fqn, [int(n) for n in tmd.size], start)))
                bufs.append(torch.empty(lengths, dtype=dtype))
        self.bytes_read += _native.load_saved(self.path, self.step, specs, [_bytes_of(b) for b in bufs])
        with torch.no_grad():
            for ri, b in zip(plan.items, bufs):
                if ri.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(ri, io.BytesIO(_unframe(b, ri.storage_index.fqn)))
                else:
                    target = planner.resolve_tensor(ri).detach()
                    if target.shape != b.shape:
                        raise StateMismatchError(
                            f"`{ri.dest_index.fqn}`: {list(target.shape)} wanted, {list(b.shape)} saved"
                        )
                    target.copy_(b)
                    planner.commit_tensor(ri, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

"""ironweave: per-iteration checkpoints in peers' host memory, restored after a process or a
host is lost.

The engine (Capricorn-style snapshots, replication, commit, recovery) is the Rust library's,
reached through ``ironweave._native``; ``ironweave.torch`` adapts PyTorch state (modules,
optimizers, tensors, picklable values) to it. See docs/PYTORCH.md.
"""

from ironweave._native import (  # noqa: F401
    CheckpointTimeoutError,
    ClosedError,
    ConfigurationError,
    IronweaveError,
    NothingToRestoreError,
    StateMismatchError,
    __version__,
)

__all__ = [
    "CheckpointTimeoutError",
    "ClosedError",
    "ConfigurationError",
    "IronweaveError",
    "NothingToRestoreError",
    "StateMismatchError",
    "__version__",
]

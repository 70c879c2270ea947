//! ironweave-ckpt: Capricorn-style in-memory checkpointing, framework-agnostic.
//!
//! - [`registry`]: named buffers (dtype, shape, bytes) the trainer registers; no tensor library.
//! - [`snapshot`]: host snapshots in up to three warm buffers (the newest committed iteration
//!   is never refilled), copied by several threads at memory speed, with per-chunk xxh3
//!   checksums.
//! - [`partition`]: chunks sized to predicted idle windows (Capricorn) or fixed (Gemini).
//! - [`schedule`]: when each chunk may go (after the communication that opens its window, or
//!   by the clock for Gemini).
//! - [`persist`]: the persistent tier, `safetensors` + JSON manifest, written atomically.
//! - [`engine`]: replication to peers' host memory (Gemini's mixed placement), the commit
//!   protocol and recovery.
//!
//! Where it sits: above `ironweave-transport` (replication to peers) and `ironweave-profile`
//! (windows, expert-load drift), below the trainer.
//!
//! ```
//! use std::sync::Arc;
//! use ironweave_ckpt::{DType, Registry, SnapshotBuffers, TensorSpec};
//! // a rank's state as named buffers, copied into a checksummed host snapshot
//! let reg = Arc::new(Registry::new(&[TensorSpec::new("w", DType::F32, &[4]), TensorSpec::new("step", DType::I64, &[])])?);
//! let w: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|x| x.to_le_bytes()).collect();
//! let step = 7i64.to_le_bytes();
//! let mut buffers = SnapshotBuffers::new(2, 4096);
//! // iteration 7's state; every held iteration is kept (nothing committed yet)
//! let snap = buffers.take(7, 0, &reg, &[&w, &step])?;
//! assert_eq!(snap.tensor("step"), Some(&step[..]));
//! # Ok::<(), ironweave_ckpt::CkptError>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod engine;
mod error;
pub mod fault;
pub mod layout;
pub mod partition;
pub mod persist;
pub mod registry;
pub mod schedule;
pub mod segment;
pub mod snapshot;
pub mod wire;

pub use engine::{
    placement, placement_on_hosts, CheckpointReport, Counters, Engine, EngineConfig, MemoryPasses, Restored, Source,
};
pub use error::{CkptError, Result};
pub use registry::{DType, GlobalSlice, Registry, TensorMeta, TensorSpec};
pub use segment::Segment;
pub use snapshot::{ChunkSum, Snapshot, SnapshotBuffers, SNAPSHOT_BUFFERS};

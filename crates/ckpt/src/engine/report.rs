//! What the engine tells its caller: where a restore came from and what a checkpoint and an
//! iteration cost.

use super::*;

/// Where a restored state came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    /// This rank's own snapshot.
    Local,
    /// The replica held by this rank.
    Peer(usize),
    /// The persistent tier.
    Persistent,
}

/// The outcome of `restore_latest`.
#[derive(Debug, Clone)]
pub struct Restored {
    /// The iteration every rank restored.
    pub iter: u64,
    /// The state.
    pub snapshot: Arc<Snapshot>,
    /// Where it came from.
    pub source: Source,
}

/// What one `checkpoint` call did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointReport {
    /// Iteration.
    pub iter: u64,
    /// Bytes of state.
    pub bytes: u64,
    /// Time the training thread spent in the call (snapshot copy, waits, synchronous writes), seconds.
    pub blocking_s: f64,
    /// Whether the persistent tier was written (or, for `async`, handed to the writer).
    pub persisted: bool,
}

/// What happened to checkpoint traffic during one iteration (`end_iteration`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct IterationReport {
    /// Iteration.
    pub iter: u64,
    /// Strategy.
    pub strategy: String,
    /// Checkpoint bytes sent during the iteration (all holders).
    pub bytes_sent: u64,
    /// Chunk transfers the iteration released (chunks x holders), leftovers included.
    pub chunks: u32,
    /// Of which finished within the iteration, not as leftovers, while no training
    /// communication was on the link.
    pub chunks_in_window: u32,
    /// `chunks_in_window / chunks` (None without chunks; see `partition::partition_accuracy`).
    pub partition_accuracy: Option<f64>,
    /// Replica chunks this rank received as a holder since the last report, and of them those
    /// whose time on the wire fell inside an idle window of this rank's link (see
    /// `partition::wire_accuracy`): the partition's accuracy as the link saw it.
    pub wire_chunks: (u64, u64),
    /// Whether profiling ran this iteration.
    pub profiled: bool,
    /// Duration of the iteration, seconds.
    pub iter_s: f64,
    /// Time the training thread spent inside the engine since the previous report (snapshot
    /// copy, waits for buffers or writers, synchronous writes, commit waits): the checkpoint's
    /// exposed cost, seconds.
    pub exposed_s: f64,
}

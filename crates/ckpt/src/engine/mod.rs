//! The engine: snapshot after the optimizer step, replicate to peers' host memory, agree on
//! the newest committed iteration, restore it.
//!
//! The engine is split by job: its setup (`config.rs`: [`Strategy`], [`EngineConfig`]), what it
//! reports (`report.rs`), its threads' life (`lifecycle.rs`), each iteration (`iteration.rs`),
//! the test hooks (`hooks.rs`, feature `test-hooks`), [`mod@placement`] (which ranks hold a rank's replicas),
//! [`replicate`] (the sender and receiver threads and their wire format), [`commit`] (agreeing on
//! the newest iteration whose every replica is verified) and [`recovery`] (choosing, per rank,
//! where the newest complete iteration comes from). This module drives them per iteration:
//! snapshot, plan the chunks over the predicted windows ([`crate::schedule`]), release them as
//! the training communications end, and measure what happened.
//!
//! Time is read through the profiler's [`ironweave_profile::Clock`] (the same clock that timed
//! the windows); only deadlines handed to the transport are `Instant`s.

use ironweave_units::Locked;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ironweave_transport::{Communicator, SpeedSource};
use serde::{Deserialize, Serialize};

use ironweave_profile::{
    idle_windows, CommKind, ExpertLoad, MonotonicClock, Profiler, SpeculativeActivation, Window, WindowPredictor,
};

use crate::error::{CkptError, Result};
use crate::partition::{partition_accuracy, wire_accuracy, ChunkSpan};
use crate::persist::{self, TokenBucket};
use crate::registry::Registry;
use crate::schedule::{self, Releaser};
use crate::snapshot::{Snapshot, SnapshotBuffers};

pub mod commit;
mod config;
#[cfg(feature = "test-hooks")]
mod hooks;
mod iteration;
mod keep;
mod lifecycle;
pub mod placement;
pub mod recovery;
pub mod replicate;
mod report;

pub use config::{EngineConfig, Strategy};
pub use keep::holder_dir;
pub use report::{CheckpointReport, IterationReport, Restored, Source};

pub use placement::{placement, placement_on_hosts};
pub use replicate::Counters;
use replicate::{spawn, Job, Sched, SenderCtx, Shared};

/// Memory traffic of the engine's copies ([`Engine::memory_passes`]): bytes read and written
/// in memory by the engine's own code, on each side, beside the state bytes they were for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryPasses {
    /// State bytes snapshotted.
    pub snapshot_bytes: u64,
    /// Bytes read and written for them on the sending side.
    pub send_pass_bytes: u64,
    /// Replica bytes received as a holder.
    pub received_bytes: u64,
    /// Bytes read and written for them on the receiving side.
    pub recv_pass_bytes: u64,
}

impl MemoryPasses {
    /// Memory passes per state byte on the sender (a copy is 2: one read, one write); none
    /// before a snapshot.
    pub fn send(&self) -> Option<f64> {
        (self.snapshot_bytes > 0).then(|| self.send_pass_bytes as f64 / self.snapshot_bytes as f64)
    }

    /// Memory passes per received replica byte on the holder; none before a replica arrived.
    pub fn recv(&self) -> Option<f64> {
        (self.received_bytes > 0).then(|| self.recv_pass_bytes as f64 / self.received_bytes as f64)
    }
}

/// A snapshot waiting for the iterations that replicate it.
#[derive(Debug)]
struct Pending {
    snap: Arc<Snapshot>,
    /// The next part to release (of [`Engine::spread`]).
    part: u64,
    /// Its `Begin` went to the holders (with the first part).
    begun: bool,
}

impl Pending {
    fn new(snap: Arc<Snapshot>) -> Self {
        Pending { snap, part: 0, begun: false }
    }
}

/// Byte range `[start, end)` of part `k` of `parts` over `total` bytes (equal parts, the last
/// one ending at `total`).
pub fn part_range(total: u64, parts: u64, k: u64) -> (u64, u64) {
    let parts = parts.max(1) as u128;
    let at = |k: u64| ((total as u128 * (k as u128).min(parts)) / parts) as u64;
    (at(k), at(k + 1))
}

/// The checkpoint engine of one rank.
pub struct Engine {
    comm: Arc<Communicator>,
    cfg: EngineConfig,
    /// The layout and job every manifest of the persistent tier names.
    written: Arc<persist::Written>,
    registry: Arc<Registry>,
    snaps: SnapshotBuffers,
    holders: Vec<usize>,
    /// Every rank's host key (from `EngineConfig::host`), as exchanged at start.
    hosts: Vec<u64>,
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    senders: Vec<(usize, JoinHandle<()>)>,
    services: Vec<JoinHandle<()>>,
    last_sent: Option<u64>,
    committed: Option<u64>,
    corrupt_in_transit: Arc<AtomicU64>,
    /// Test hook: the sender threads drop chunks and `End`s.
    stall_replication: Arc<AtomicBool>,
    profiler: Arc<Profiler<MonotonicClock>>,
    sched: Arc<Mutex<Sched>>,
    /// The snapshot whose chunks the coming iterations release (with `spread_iters > 1`, the
    /// parts not released yet).
    pending: Option<Pending>,
    /// Iteration of the snapshot this iteration replicates (its chunks' accuracy is measured).
    sending: Option<u64>,
    activation: SpeculativeActivation,
    predictor: WindowPredictor,
    gemini_spans: Option<Vec<Window>>,
    profiled_iters: u64,
    this_iter: Option<(u64, bool)>,
    writer: Option<JoinHandle<Result<u64>>>,
    durable: Option<u64>,
    /// (bytes, seconds) of finished chunk transfers per link slot.
    rate: Arc<Mutex<Vec<(f64, f64)>>>,
    /// Starting estimate of each slot's rate for this rank: the link's declared rate shared by
    /// the ranks of the host (0: unknown).
    declared: Vec<f64>,
    /// Profiler link index of each slot (slot 0: `cfg.link`).
    link_ids: Vec<u32>,
    counters: Arc<Counters>,
    storage: Option<Arc<Mutex<TokenBucket>>>,
    exposed_ns: u64,
    /// The newest iteration whose copies in the keep directory are whole.
    kept: Option<u64>,
    /// The first difference of a kept copy of this rank's state passed over for its layout.
    kept_mismatch: Option<(String, String, String)>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("rank", &self.comm.rank())
            .field("strategy", &self.cfg.strategy)
            .field("holders", &self.holders)
            .field("committed", &self.committed)
            .finish()
    }
}

impl Engine {
    /// The communicator the engine runs on.
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }

    /// The engine's settings (the keep directory as resolved).
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Who writes this engine's files: the job id, the layout, the MAC key.
    pub fn written(&self) -> &persist::Written {
        &self.written
    }

    /// The ranks holding this rank's replicas.
    pub fn holders(&self) -> &[usize] {
        &self.holders
    }

    /// Every rank's host key (equal keys: the same host), as the ranks said when the engine
    /// started.
    pub fn hosts(&self) -> &[u64] {
        &self.hosts
    }

    /// The layout.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The profiler: time layers with `profiler().layer(..)` and wrap training communication on
    /// the checkpoint link in `profiler().comm(link, CommKind::Training, bytes)`; the engine
    /// schedules its chunks by these events.
    pub fn profiler(&self) -> &Arc<Profiler<MonotonicClock>> {
        &self.profiler
    }

    /// Checkpoint bandwidth of the training link in use, bytes/s.
    pub fn link_rate(&self) -> f64 {
        self.slot_rate(0)
    }

    /// Checkpoint bandwidth of link slot `k` (0: the training link, then `extra_links`) for
    /// this rank, bytes/s: configured (slot 0), else measured from the engine's own transfers
    /// but never above the link's declared rate shared by the ranks of the host, else that
    /// share, else 1 GB/s.
    pub fn slot_rate(&self, k: usize) -> f64 {
        if let (0, Some(r)) = (k, self.cfg.link_bytes_per_s) {
            return r;
        }
        let (b, s) = self.rate.locked().get(k).copied().unwrap_or((0.0, 0.0));
        let declared = self.declared.get(k).copied().filter(|&d| d > 0.0);
        match (b > 0.0 && s > 0.0, declared) {
            // a send returns once the bytes are in the socket's buffer, so the measured rate
            // runs ahead of the wire; the link's own rate bounds it
            (true, Some(d)) => (b / s).min(d),
            (true, None) => b / s,
            (false, Some(d)) => d,
            (false, None) => 1e9,
        }
    }

    /// Bytes the engine moved so far (replicas, by destination and link; the persistent tier).
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// What the engine's copies cost in memory so far: bytes read and written per state byte,
    /// on the sending side (snapshot copy, any copy to send) and on the receiving side (landing,
    /// checksums no landed piece covered).
    pub fn memory_passes(&self) -> MemoryPasses {
        let c = &self.counters;
        let sh = self.shared.locked();
        MemoryPasses {
            snapshot_bytes: c.snapshot_bytes.load(Ordering::Relaxed),
            send_pass_bytes: c.send_pass_bytes.load(Ordering::Relaxed),
            received_bytes: sh.recv_bytes,
            recv_pass_bytes: sh.recv_pass_bytes,
        }
    }

    /// Profiler link index of each link slot chunks may go over (slot 0: the training link).
    pub fn link_ids(&self) -> &[u32] {
        &self.link_ids
    }

    /// Problems the background threads met (a holder that died, a corrupt transfer).
    pub fn failures(&self) -> Vec<String> {
        self.shared.locked().failures.clone()
    }

    /// Forget every snapshot, replica and acknowledgement (collectively, on every rank): the
    /// job starts over from its initial state because nothing was ever committed.
    pub fn start_over(&mut self) {
        // this job's own background writes end first: a resume or a reader of the persistent
        // tier that follows must not see a file half written (or one that appears later)
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        self.forget_memory();
        self.sched.locked().releaser = None;
        self.committed = None;
        self.durable = None;
        self.sending = None;
    }

    /// Forgets everything held in memory (as a restarted process would have nothing).
    fn forget_memory(&mut self) {
        self.snaps.clear();
        self.pending = None;
        self.last_sent = None;
        let mut sh = self.shared.locked();
        sh.store.clear();
        sh.acks.clear();
    }
}

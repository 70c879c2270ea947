//! The engine: snapshot after the optimizer step, replicate to peers' host memory, agree on
//! the newest committed iteration, restore it.
//!
//! The engine is split by job: [`mod@placement`] (which ranks hold a rank's replicas),
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
pub mod placement;
pub mod recovery;
pub mod replicate;

pub use placement::{placement, placement_on_hosts};
pub use replicate::Counters;
use replicate::{spawn, Job, Sched, SenderCtx, Shared};

/// How checkpoints are taken (one engine, five strategies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// No checkpoints.
    None,
    /// Stop after the optimizer step and write to storage (torch.save-like).
    Blocking,
    /// Snapshot to host, write to storage in the background, no traffic control (TorchSnapshot-like).
    Async,
    /// In-memory replication; fixed-size chunks at the time offsets of idle spans profiled once.
    Gemini,
    /// In-memory replication; chunks sized to the predicted windows of each iteration, released
    /// when the communication before the window ends; re-profiling only on expert-load drift.
    #[default]
    Capricorn,
}

impl Strategy {
    /// All five, in table order.
    pub const ALL: [Strategy; 5] = [Strategy::None, Strategy::Blocking, Strategy::Async, Strategy::Gemini, Strategy::Capricorn];

    /// Name as in configs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::Blocking => "blocking",
            Strategy::Async => "async",
            Strategy::Gemini => "gemini",
            Strategy::Capricorn => "capricorn",
        }
    }
    /// Parse a name.
    pub fn parse(s: &str) -> Result<Self> {
        Strategy::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| CkptError::Invalid(format!("unknown strategy `{s}` (none, blocking, async, gemini, capricorn)")))
    }
    /// Whether snapshots are replicated to peers' memory (Gemini, Capricorn).
    pub fn in_memory(self) -> bool {
        matches!(self, Strategy::Gemini | Strategy::Capricorn)
    }
}

/// Engine settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Strategy.
    pub strategy: Strategy,
    /// Copies of each snapshot in host memory, including the rank's own (Gemini's m).
    pub replicas: u32,
    /// Bytes per replication message.
    pub chunk_bytes: u64,
    /// Bytes per checksum (small enough that hashing reads what the copy just left in cache).
    pub checksum_bytes: u64,
    /// Snapshot copy threads (0: all cores).
    pub copy_threads: usize,
    /// Persistent tier directory (none: memory only). Required by `blocking` and `async`.
    pub persist_dir: Option<PathBuf>,
    /// In-memory strategies: also write to the persistent tier every this many iterations (0: never).
    pub persist_every: u64,
    /// Bound on every wait of the engine.
    pub timeout: Duration,
    /// Index of the link checkpoint traffic shares with training (whose windows are used).
    pub link: u32,
    /// Bandwidth of that link for checkpoint traffic, bytes/s (e.g. from `ironweave cluster
    /// probe`); `None`: estimated from the engine's own transfers, bounded by the link's declared
    /// rate shared by the ranks of the host (see [`Engine::slot_rate`]).
    pub link_bytes_per_s: Option<f64>,
    /// Capricorn fills this fraction of a predicted window.
    pub window_fill: f64,
    /// Capricorn re-profiles when the drift of the smoothed expert load (EWMA, see
    /// `ironweave_profile::SpeculativeActivation`) since the last profiled iteration exceeds this
    /// (0: every iteration, the always-on reference).
    pub drift_threshold: f64,
    /// Gemini's fixed chunk size, bytes (0: sized from the profiled spans and the state, so
    /// that whole chunks fill the spans best without overfilling any).
    pub gemini_chunk_bytes: u64,
    /// Async skips an iteration's checkpoint while the previous write is still running,
    /// instead of waiting for it: it checkpoints at the interval its storage sustains (the
    /// training never blocks on the disk; a failure loses more iterations).
    pub async_skip_busy: bool,
    /// Gemini fills this fraction of each profiled span (1: the whole span, the paper's rule;
    /// a lower fill leaves room for the spans' variation, as Capricorn's `window_fill` does).
    pub gemini_fill: f64,
    /// Gemini profiles this many iterations at the start (the spans of the last one are
    /// used), then never again.
    pub gemini_profile_iters: u64,
    /// Windows shorter than this are ignored, ns.
    pub min_window_ns: u64,
    /// Which host this rank runs on (any string equal on the ranks of one host and different
    /// between hosts: `ironweave_transport::rendezvous::host_name()`); replicas go to other
    /// hosts when there are several. Empty on every rank: one host.
    pub host: String,
    /// Further links (transport link indices) Capricorn may route chunks over besides `link`
    /// (each chunk takes the link whose predicted window opens first; beyond the paper).
    /// Ignored by the other strategies.
    pub extra_links: Vec<u32>,
    /// Bandwidth of the persistent tier for this rank, bytes/s, enforced by a token bucket in
    /// the writer (emulated remote storage: a host's share of a file system); `None`: as fast
    /// as the local disk goes.
    pub storage_bytes_per_s: Option<f64>,
    /// Capricorn replicates one snapshot over this many iterations, a `1/spread_iters` part
    /// per iteration, and takes the next snapshot when the last part has gone (1: a snapshot
    /// every iteration, whole). Fewer bytes per iteration; a recovery restores the newest
    /// complete snapshot and replays the iterations since (up to `2 * spread_iters - 1`),
    /// which is bit-identical because training is deterministic. Ignored by the other
    /// strategies.
    pub spread_iters: u64,
    /// The parallel layout this rank's state belongs to (`world`, `kind`, degrees: names of the
    /// trainer's choosing), written into every manifest of the persistent tier.
    pub layout: std::collections::BTreeMap<String, String>,
    /// The job this state belongs to, written into every manifest of the persistent tier:
    /// recovery takes only this job's files, so a new job that reuses a directory never
    /// restores an old job's iteration. None: the launcher's id from the environment
    /// (`ironweave_transport::rendezvous::job_id_from_env`: unique per `ironweave launch`,
    /// torchrun's `--rdzv-id`, the SLURM job), the same in a restarted process.
    pub job_id: Option<String>,
    /// Recovery may also take files another job wrote into `persist_dir`: set it to continue an
    /// earlier job from its persistent tier (off: those files are passed over and named in
    /// the `NothingToRestore` error).
    pub restore_other_jobs: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            strategy: Strategy::Capricorn,
            replicas: 2,
            chunk_bytes: 4 << 20,
            checksum_bytes: 256 << 10,
            copy_threads: 0,
            persist_dir: None,
            persist_every: 0,
            timeout: Duration::from_secs(300),
            link: 0,
            link_bytes_per_s: None,
            window_fill: 0.9,
            drift_threshold: 0.3,
            gemini_chunk_bytes: 0,
            gemini_fill: 1.0,
            async_skip_busy: false,
            gemini_profile_iters: 3,
            min_window_ns: 50_000,
            host: String::new(),
            extra_links: Vec::new(),
            storage_bytes_per_s: None,
            spread_iters: 1,
            layout: Default::default(),
            job_id: None,
            restore_other_jobs: false,
        }
    }
}

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
    /// Start the engine for `registry` on `comm` (all ranks call this together).
    pub fn new(comm: Arc<Communicator>, registry: Registry, cfg: EngineConfig) -> Result<Self> {
        if cfg.replicas == 0 || cfg.chunk_bytes == 0 || cfg.checksum_bytes == 0 {
            return Err(CkptError::Invalid(
                "replicas, chunk_bytes and checksum_bytes must be at least 1 (gemini_chunk_bytes 0: sized from the spans)".into(),
            ));
        }
        if !(cfg.window_fill > 0.0 && cfg.window_fill <= 1.0) {
            return Err(CkptError::Invalid(format!("window_fill {} must be in (0, 1]", cfg.window_fill)));
        }
        if !(cfg.gemini_fill > 0.0 && cfg.gemini_fill <= 1.0) {
            return Err(CkptError::Invalid(format!("gemini_fill {} must be in (0, 1]", cfg.gemini_fill)));
        }
        if matches!(cfg.strategy, Strategy::Blocking | Strategy::Async) && cfg.persist_dir.is_none() {
            return Err(CkptError::Invalid(format!("strategy `{}` writes to storage: set persist_dir", cfg.strategy.name())));
        }
        if cfg.spread_iters == 0 {
            return Err(CkptError::Invalid("spread_iters must be at least 1 (1: a whole snapshot every iteration)".into()));
        }
        if let Some(r) = cfg.storage_bytes_per_s {
            if !(r.is_finite() && r > 0.0) {
                return Err(CkptError::Invalid(format!("storage_bytes_per_s {r} must be a positive rate")));
            }
        }
        let n_links = comm.links().len() as u32;
        let mut link_ids = vec![cfg.link];
        for &l in &cfg.extra_links {
            if l >= n_links || link_ids.contains(&l) {
                return Err(CkptError::Invalid(format!(
                    "extra link {l}: the communicator has links 0..{n_links} and each may be named once (the training link is {})",
                    cfg.link
                )));
            }
            link_ids.push(l);
        }
        if cfg.strategy != Strategy::Capricorn {
            link_ids.truncate(1);
        }
        let mut snaps = SnapshotBuffers::new(cfg.copy_threads, cfg.checksum_bytes);
        snaps.set_wait(cfg.timeout);
        // a bucket of one write block: the declared rate holds from the first block on
        let storage = cfg.storage_bytes_per_s.map(|r| Arc::new(Mutex::new(TokenBucket::new(r, persist::PACE_BLOCK as u64))));
        let written = Arc::new(persist::Written {
            layout: cfg.layout.clone(),
            job: cfg.job_id.clone().unwrap_or_else(ironweave_transport::rendezvous::job_id_from_env),
        });
        let mut e = Engine {
            written,
            comm,
            activation: SpeculativeActivation::new(cfg.drift_threshold),
            predictor: WindowPredictor::new(0.5),
            registry: Arc::new(registry),
            snaps,
            holders: Vec::new(),
            hosts: Vec::new(),
            shared: Arc::new(Mutex::new(Shared::default())),
            stop: Arc::new(AtomicBool::new(false)),
            senders: Vec::new(),
            services: Vec::new(),
            last_sent: None,
            committed: None,
            corrupt_in_transit: Arc::new(AtomicU64::new(u64::MAX)),
            profiler: Arc::new(Profiler::new(MonotonicClock::default(), 8)),
            sched: Arc::new(Mutex::new(Sched::default())),
            pending: None,
            sending: None,
            gemini_spans: None,
            profiled_iters: 0,
            this_iter: None,
            writer: None,
            durable: None,
            rate: Arc::new(Mutex::new(vec![(0.0, 0.0); link_ids.len()])),
            declared: vec![0.0; link_ids.len()],
            counters: Arc::new(Counters::new(link_ids.len())),
            link_ids,
            storage,
            exposed_ns: 0,
            cfg,
        };
        e.start_threads()?;
        Ok(e)
    }

    /// Now, on the profiler's clock, ns.
    fn now_ns(&self) -> u64 {
        self.profiler.now_ns()
    }

    /// Move the engine to a new communicator over the same ranks (after a failure, once the
    /// job has re-formed with a restarted rank). Snapshots and replicas held in memory are
    /// kept; transfers in flight are dropped (those iterations are not committed).
    pub fn rebind(&mut self, comm: Arc<Communicator>) -> Result<()> {
        if comm.size() != self.comm.size() || comm.rank() != self.comm.rank() {
            return Err(CkptError::Invalid(format!(
                "rebind to rank {} of {} from rank {} of {}: the engine's replicas are laid out for the old ranks",
                comm.rank(),
                comm.size(),
                self.comm.rank(),
                self.comm.size()
            )));
        }
        self.stop_threads();
        self.comm = comm;
        {
            let mut sh = self.shared.locked();
            sh.acks.clear();
            sh.failures.clear();
            sh.lost_holders.clear();
            for v in sh.store.values_mut() {
                v.retain(|r| r.verified);
            }
        }
        self.pending = None;
        self.last_sent = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        self.start_threads()
    }

    fn stop_threads(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        {
            let mut s = self.sched.locked();
            s.txs.clear();
            s.releaser = None;
            s.open = false;
        }
        for (_, t) in self.senders.drain(..) {
            let _ = t.join();
        }
        for t in self.services.drain(..) {
            let _ = t.join();
        }
    }

    fn start_threads(&mut self) -> Result<()> {
        let comm = self.comm.clone();
        let world = comm.size();
        let me = comm.rank();
        // every rank's host, to put replicas on other hosts (a collective: every rank starts
        // or re-binds its engine at the same point)
        let key = xxhash_rust::xxh3::xxh3_64(self.cfg.host.as_bytes()).to_le_bytes();
        let mut keys = vec![0u8; 8 * world];
        if world > 1 {
            comm.all_gather(&key, &mut keys)?;
        }
        let hosts: Vec<&[u8]> = keys.chunks_exact(8).collect();
        let place = placement_on_hosts(&hosts, self.cfg.replicas as usize);
        self.hosts = hosts.iter().map(|h| u64::from_le_bytes((*h).try_into().unwrap_or([0; 8]))).collect();
        let on_my_host = self.hosts.iter().filter(|&&h| h == self.hosts[me]).count().max(1);
        let infos = comm.links();
        self.declared = self
            .link_ids
            .iter()
            .map(|&l| {
                infos.get(l as usize).filter(|i| i.speed_source != SpeedSource::Unknown).map_or(0.0, |i| {
                    // the ranks of a host share its link
                    i.bandwidth_bytes_per_s / on_my_host as f64
                })
            })
            .collect();
        let in_mem = self.cfg.strategy.in_memory();
        self.holders = if in_mem { place[me].clone() } else { Vec::new() };
        let sources: Vec<usize> = if in_mem { (0..world).filter(|&s| place[s].contains(&me)).collect() } else { Vec::new() };
        // slot 0: the engine's communicator as given; further slots: views on the extra links
        let mut slots: Vec<Arc<Communicator>> = vec![comm.clone()];
        for &l in &self.link_ids[1..] {
            slots.push(Arc::new(comm.on_link(l as usize)?));
        }
        self.stop = Arc::new(AtomicBool::new(false));
        let (shared, stop, profiler) = (self.shared.clone(), self.stop.clone(), self.profiler.clone());
        let limit = replicate::replica_limit(self.registry.total);
        for &s in &sources {
            for (k, c) in slots.iter().enumerate() {
                let (c, ack, shared, stop) = (c.clone(), comm.clone(), shared.clone(), stop.clone());
                let (counters, prof, link) = (self.counters.clone(), profiler.clone(), self.link_ids[k]);
                self.services.push(spawn(format!("ckpt-in-{s}.{k}"), move || {
                    let meter = replicate::Meter { cpu: &counters.replica_recv_cpu_ns, arrived: Some((&prof, link)) };
                    replicate::receive_replicas(&c, &ack, s, limit, &shared, &stop, meter)
                })?);
            }
        }
        for &h in &self.holders {
            let (comm, shared, stop) = (comm.clone(), shared.clone(), stop.clone());
            self.services.push(spawn(format!("ckpt-ack-{h}"), move || replicate::receive_acks(&comm, h, &shared, &stop))?);
        }
        // one sender thread per holder and link slot, so a long transfer on one link does not
        // hold back chunks due on another
        let mut txs = Vec::new();
        for &h in &self.holders {
            let mut per_slot = Vec::new();
            for (k, c) in slots.iter().enumerate() {
                let (tx, rx) = channel::<Job>();
                let cx = SenderCtx {
                    holder: h,
                    slot: k,
                    remote: self.hosts[h] != self.hosts[me],
                    comm: c.clone(),
                    first: comm.clone(),
                    link_id: self.link_ids[k],
                    rank: me as u32,
                    world: world as u32,
                    chunk: self.cfg.chunk_bytes as usize,
                    shared: shared.clone(),
                    counters: self.counters.clone(),
                    corrupt: self.corrupt_in_transit.clone(),
                    prof: profiler.clone(),
                    rate: self.rate.clone(),
                };
                self.senders.push((h, spawn(format!("ckpt-out-{h}.{k}"), move || replicate::send_loop(cx, rx))?));
                per_slot.push(tx);
            }
            txs.push(per_slot);
        }
        {
            let mut s = self.sched.locked();
            *s = Sched { txs, ..Default::default() };
        }
        // Capricorn: a window opens when a training communication on the link ends.
        {
            let sched = self.sched.clone();
            let link = self.cfg.link;
            profiler.set_comm_hook(Some(Arc::new(move |span: &ironweave_profile::CommSpan| {
                if span.link != link || span.kind != CommKind::Training {
                    return;
                }
                let mut s = sched.locked();
                let k = s.comms;
                s.comms += 1;
                if let Some(r) = s.releaser.as_mut() {
                    let rel = r.comm_done(k);
                    s.dispatch(rel);
                }
            })));
        }
        // Gemini: chunks go by the clock.
        if self.cfg.strategy == Strategy::Gemini {
            let (sched, stop, prof) = (self.sched.clone(), stop.clone(), profiler.clone());
            self.services.push(spawn("ckpt-timer".into(), move || {
                while !stop.load(Ordering::SeqCst) {
                    {
                        let mut s = sched.locked();
                        let now = prof.now_ns();
                        if let (Some(start), Some(r)) = (s.iter_start_ns, s.releaser.as_mut()) {
                            let rel = r.tick(now.saturating_sub(start));
                            s.dispatch(rel);
                        }
                    }
                    std::thread::sleep(Duration::from_micros(250));
                }
            })?);
        }
        Ok(())
    }

    /// The communicator the engine runs on.
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
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

    /// Profiler link index of each link slot chunks may go over (slot 0: the training link).
    pub fn link_ids(&self) -> &[u32] {
        &self.link_ids
    }

    /// Start iteration `iter`. `load` is the expert load the trainer expects (e.g. the last
    /// iteration's); Capricorn profiles only when it drifted. Returns whether this iteration is
    /// profiled (layer timers on). Releases the chunks of the previous snapshot planned for
    /// this iteration's windows.
    pub fn begin_iteration(&mut self, iter: u64, load: Option<&ExpertLoad>) -> bool {
        let profile = match self.cfg.strategy {
            Strategy::Capricorn if self.cfg.drift_threshold <= 0.0 => true,
            Strategy::Capricorn => match load {
                // the load of the iteration profiled first (before any load was known) is
                // the reference; later ones decide
                Some(l) if !self.activation.primed() && self.profiled_iters > 0 => {
                    self.activation.prime(l);
                    false
                }
                Some(l) => self.activation.decide(l),
                None => self.profiled_iters == 0,
            },
            Strategy::Gemini => self.profiled_iters < self.cfg.gemini_profile_iters,
            _ => false,
        };
        self.profiler.set_detailed(profile);
        self.profiler.begin_iteration(iter);
        self.this_iter = Some((iter, profile));
        let now = self.now_ns();
        let mut s = self.sched.locked();
        s.comms = 0;
        s.iter_start_ns = Some(now);
        if let Some(mut p) = self.pending.take() {
            let parts = self.spread();
            let (from, to) = part_range(p.snap.data.len() as u64, parts, p.part);
            let total = to - from;
            let plan = match self.cfg.strategy {
                Strategy::Capricorn => {
                    let windows: Vec<Vec<Window>> = self.link_ids.iter().map(|&l| self.predictor.predict(l)).collect();
                    if windows[0].is_empty() {
                        // nothing profiled yet: everything after the iteration's traffic
                        schedule::capricorn(total, &[], 1.0, 1.0, 1, self.cfg.chunk_bytes)
                    } else {
                        let links: Vec<(&[Window], f64)> =
                            windows.iter().enumerate().map(|(k, w)| (w.as_slice(), self.slot_rate(k))).collect();
                        schedule::capricorn_links(
                            total,
                            &links,
                            self.cfg.window_fill,
                            self.cfg.chunk_bytes.min(1 << 20),
                            self.cfg.chunk_bytes,
                        )
                    }
                }
                _ => {
                    let rate = self.link_rate();
                    match &self.gemini_spans {
                        Some(spans) => schedule::gemini(total, spans, rate, self.cfg.gemini_chunk_bytes, self.cfg.gemini_fill),
                        None => schedule::gemini(total, &[], rate, self.cfg.gemini_chunk_bytes, self.cfg.gemini_fill),
                    }
                }
            };
            let plan = schedule::shifted(plan, from);
            if !p.begun {
                s.begin(&p.snap);
                p.begun = true;
            }
            s.more_parts = p.part + 1 < parts;
            s.releaser = Some(Releaser::new(plan));
            s.released = 0;
            self.sending = Some(p.snap.iter);
            if s.more_parts {
                p.part += 1;
                self.pending = Some(p);
            } else {
                self.last_sent = Some(p.snap.iter);
            }
            let rel = s.releaser.as_mut().map(|r| r.start()).unwrap_or_default();
            s.dispatch(rel);
        }
        profile
    }

    /// Iterations one snapshot is replicated over (`spread_iters` for Capricorn, else 1).
    fn spread(&self) -> u64 {
        if self.cfg.strategy == Strategy::Capricorn {
            self.cfg.spread_iters.max(1)
        } else {
            1
        }
    }

    /// Whether an in-memory strategy writes iteration `iter`'s snapshot to the persistent tier:
    /// every `persist_every` iterations; with snapshots every `spread` iterations, the snapshot
    /// of the `spread` iterations that include a multiple of `persist_every`.
    fn persist_due(&self, iter: u64) -> bool {
        let every = self.cfg.persist_every;
        if self.cfg.persist_dir.is_none() || every == 0 {
            return false;
        }
        let k = self.spread();
        if k == 1 {
            iter % every == 0
        } else {
            iter / every != iter.saturating_sub(k) / every
        }
    }

    /// End the current iteration (after the optimizer step): leftover chunks go now; a
    /// profiled iteration's windows feed the predictor.
    pub fn end_iteration(&mut self) -> IterationReport {
        // leftovers go now, marked as such: they count as outside every window
        let released = {
            let mut s = self.sched.locked();
            s.flush();
            let n = s.released * s.txs.len();
            s.released = 0;
            n
        };
        let sending = self.sending.take();
        let prof = self.profiler.end_iteration();
        let (iter, profiled) = self.this_iter.take().unwrap_or((0, false));
        let mut rep = IterationReport {
            iter,
            strategy: self.cfg.strategy.name().into(),
            profiled,
            exposed_s: std::mem::take(&mut self.exposed_ns) as f64 * 1e-9,
            ..Default::default()
        };
        if let Some(p) = prof {
            rep.iter_s = p.duration_ns() as f64 * 1e-9;
            let training: Vec<(u32, u64, u64)> =
                p.comms.iter().filter(|c| c.kind == CommKind::Training).map(|c| (c.link, c.start_ns, c.end_ns)).collect();
            rep.bytes_sent = p.comms.iter().filter(|c| c.kind == CommKind::Checkpoint).map(|c| c.bytes).sum();
            // this iteration's snapshot's transfers, by the iteration that released them;
            // older entries go (late ones of this snapshot are dropped at the next report)
            let spans: Vec<ChunkSpan> = {
                let mut sh = self.shared.locked();
                let v = sh.chunk_log.iter().filter(|c| Some(c.snapshot) == sending).copied().collect();
                sh.chunk_log.retain(|c| sending.is_some_and(|i| c.snapshot > i));
                v
            };
            rep.partition_accuracy = partition_accuracy(&training, &spans, released, p.end_ns);
            // what this rank received as a holder, judged on its own training traffic
            let arrivals = std::mem::take(&mut self.shared.locked().arrivals);
            let rate = |link: u32| self.link_ids.iter().position(|&l| l == link).map_or(0.0, |k| self.slot_rate(k));
            let (inside, n) = wire_accuracy(&training, &arrivals, rate, p.start_ns, p.end_ns);
            rep.wire_chunks = (inside, n);
            self.counters.wire_chunks.fetch_add(n, Ordering::Relaxed);
            self.counters.wire_chunks_in_window.fetch_add(inside, Ordering::Relaxed);
            rep.chunks = released as u32;
            rep.chunks_in_window = rep.partition_accuracy.map_or(0, |a| (a * released as f64).round() as u32);
            if profiled {
                let w = idle_windows(&p, self.cfg.link, self.cfg.min_window_ns);
                // every link chunks may take (a link without training traffic: one window, the
                // whole iteration)
                let all: Vec<Window> = self
                    .link_ids
                    .iter()
                    .flat_map(|&l| if l == self.cfg.link { w.clone() } else { idle_windows(&p, l, self.cfg.min_window_ns) })
                    .collect();
                self.predictor.observe(&all);
                // Gemini keeps the spans of its last profiled iteration (the first is cold)
                if self.cfg.strategy == Strategy::Gemini {
                    self.gemini_spans = Some(w);
                }
                self.profiled_iters += 1;
            }
        }
        rep
    }

    /// Snapshot the state after iteration `iter`'s optimizer step. In-memory strategies
    /// replicate it during the next iteration's windows (or at once on `commit(true)`);
    /// `blocking` writes it to storage now; `async` hands it to a background writer.
    pub fn checkpoint(&mut self, iter: u64, bufs: &[&[u8]]) -> Result<CheckpointReport> {
        let t0 = self.now_ns();
        let r = self.checkpoint_inner(iter, bufs);
        self.exposed_ns += self.now_ns().saturating_sub(t0);
        r
    }

    /// Writes `snap` to the persistent tier through the storage bucket (if any), counting the
    /// bytes.
    fn write_persistent(&self, snap: &Snapshot) -> Result<PathBuf> {
        write_paced(
            self.cfg.persist_dir.as_deref().expect("checked by the caller"),
            snap,
            &self.comm,
            self.storage.as_deref(),
            &self.counters,
            &self.written,
        )
    }

    fn checkpoint_inner(&mut self, iter: u64, bufs: &[&[u8]]) -> Result<CheckpointReport> {
        if let Some(last) = self.snaps.latest().map(|s| s.iter) {
            if iter <= last {
                return Err(CkptError::Invalid(format!("iteration {iter} is not after the last checkpointed iteration {last}")));
            }
        }
        let t0 = self.now_ns();
        let mut persisted = false;
        match self.cfg.strategy {
            Strategy::None => {
                return Ok(CheckpointReport { iter, bytes: 0, blocking_s: 0.0, persisted: false });
            }
            Strategy::Blocking => {
                let snap = self.snaps.take(iter, &self.registry, bufs)?;
                self.write_persistent(&snap)?;
                self.durable = Some(iter);
                persisted = true;
            }
            Strategy::Async => {
                if self.cfg.async_skip_busy && self.writer.as_ref().is_some_and(|w| !w.is_finished()) {
                    // the storage is still busy with an earlier iteration: skip this one
                    return Ok(CheckpointReport { iter, bytes: 0, blocking_s: 0.0, persisted: false });
                }
                // the next snapshot waits for the previous write (one host buffer in flight)
                self.join_writer()?;
                let snap = self.snaps.take(iter, &self.registry, bufs)?;
                let dir = self.cfg.persist_dir.clone().expect("checked in new");
                let (bucket, counters) = (self.storage.clone(), self.counters.clone());
                let (comm, written) = (self.comm.clone(), self.written.clone());
                self.writer = Some(spawn("ckpt-writer".into(), move || {
                    write_paced(&dir, &snap, &comm, bucket.as_deref(), &counters, &written).map(|_| snap.iter)
                })?);
                persisted = true;
            }
            Strategy::Gemini | Strategy::Capricorn => {
                if self.pending.is_some() && self.spread() > 1 {
                    // the parts of an earlier snapshot are still going out: no snapshot now
                    return Ok(CheckpointReport { iter, bytes: 0, blocking_s: 0.0, persisted: false });
                }
                // whatever of the previous snapshot was not sent yet goes now
                self.flush_pending();
                let snap = self.snaps.take(iter, &self.registry, bufs)?;
                if self.persist_due(iter) {
                    // the persistent tier backs the in-memory replicas up: a full or failing
                    // disk must not stop training (said once; counted every time)
                    match self.write_persistent(&snap) {
                        Ok(_) => persisted = true,
                        Err(e) => {
                            if self.counters.storage_failures.fetch_add(1, Ordering::Relaxed) == 0 {
                                eprintln!(
                                    "rank {}: warning: writing iteration {iter} to the persistent tier failed ({e}); in-memory checkpoints go on, the persistent tier is retried every {} iterations",
                                    self.comm.rank(),
                                    self.cfg.persist_every
                                );
                            }
                            let mut sh = self.shared.locked();
                            if sh.failures.len() < 64 {
                                sh.failures.push(format!("persistent write of iteration {iter}: {e}"));
                            }
                        }
                    }
                }
                if self.holders.is_empty() {
                    self.last_sent = Some(iter);
                } else {
                    self.pending = Some(Pending::new(snap));
                }
            }
        }
        Ok(CheckpointReport {
            iter,
            bytes: self.registry.total,
            blocking_s: self.now_ns().saturating_sub(t0) as f64 * 1e-9,
            persisted,
        })
    }

    /// Release every chunk still held back: the rest of the plan in progress, then the parts
    /// of a snapshot not released yet.
    fn flush_pending(&mut self) {
        self.sched.locked().flush();
        if let Some(prev) = self.pending.take() {
            self.release_rest(prev);
        }
    }

    /// Send what is left of a snapshot now, back to back.
    fn release_rest(&mut self, p: Pending) {
        let mut s = self.sched.locked();
        if !p.begun {
            s.begin(&p.snap);
        }
        let total = p.snap.data.len() as u64;
        let from = part_range(total, self.spread(), p.part).0;
        let plan = schedule::capricorn(total - from, &[], 1.0, 1.0, 1, self.cfg.chunk_bytes);
        s.more_parts = false;
        s.releaser = Some(Releaser::new(schedule::shifted(plan, from)));
        let rel = s.releaser.as_mut().map(|r| r.end()).unwrap_or_default();
        s.dispatch(rel);
        self.last_sent = Some(p.snap.iter);
    }

    /// Write the newest snapshot to the persistent tier now.
    pub fn persist_now(&self) -> Result<Option<PathBuf>> {
        let (Some(_), Some(s)) = (&self.cfg.persist_dir, self.snaps.latest()) else { return Ok(None) };
        Ok(Some(self.write_persistent(s)?))
    }

    /// Problems the background threads met (a holder that died, a corrupt transfer).
    pub fn failures(&self) -> Vec<String> {
        self.shared.locked().failures.clone()
    }

    /// Forget every snapshot, replica and acknowledgement (collectively, on every rank): the
    /// job starts over from its initial state because nothing was ever committed.
    pub fn start_over(&mut self) {
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

    /// Test hook: forget everything held in memory (as a restarted process would).
    #[cfg(feature = "test-hooks")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-hooks")))]
    pub fn forget_memory_for_test(&mut self) {
        self.forget_memory();
    }

    /// Test hook: flip a bit of iteration `iter`'s first chunk on its way to every holder.
    #[cfg(feature = "test-hooks")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-hooks")))]
    pub fn corrupt_in_transit_for_test(&self, iter: u64) {
        self.corrupt_in_transit.store(iter, Ordering::SeqCst);
    }

    /// Test hook: flip a byte of the replica of `src`'s iteration `iter` held here.
    #[cfg(feature = "test-hooks")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-hooks")))]
    pub fn corrupt_replica_for_test(&self, src: usize, iter: u64, offset: usize) -> bool {
        let mut sh = self.shared.locked();
        if let Some(r) = sh.store.get_mut(&src).and_then(|v| v.iter_mut().find(|r| r.manifest.iter == iter)) {
            if let Some(b) = r.data.get_mut(offset) {
                *b ^= 0x20;
                return true;
            }
        }
        false
    }

    /// Flush replication, wait for the acknowledgements (bounded), stop the threads
    /// (collective: every rank calls it).
    pub fn shutdown(mut self) -> Result<()> {
        let _ = self.commit(true)?;
        {
            let mut s = self.sched.locked();
            s.txs.clear();
        }
        for (_, t) in self.senders.drain(..) {
            let _ = t.join();
        }
        self.comm.barrier()?;
        self.stop_threads();
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.profiler.set_comm_hook(None);
        self.sched.locked().txs.clear();
    }
}

/// Writes `snap` of `comm`'s rank under `dir`, paced by `bucket` (the emulated storage's
/// bandwidth) when given; counts the bytes written.
fn write_paced(
    dir: &std::path::Path,
    snap: &Snapshot,
    comm: &Communicator,
    bucket: Option<&Mutex<TokenBucket>>,
    counters: &Counters,
    written: &persist::Written,
) -> Result<PathBuf> {
    let p = persist::write_layout(dir, snap, comm.rank() as u32, comm.size() as u32, bucket, written)?;
    counters.storage_bytes.fetch_add(snap.data.len() as u64, Ordering::Relaxed);
    Ok(p)
}

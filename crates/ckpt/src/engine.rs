//! The engine: snapshot after the optimizer step, replicate to peers' host memory, agree on
//! the newest committed iteration, restore it.
//!
//! **Placement** (Gemini's "mixed" placement across machines): every rank says which host it is
//! on (`EngineConfig::host`, exchanged when the engine starts); with more than one host, each
//! replica of a rank goes to *another* host (the rank with the same place on the next hosts), so
//! losing a whole host loses no in-memory copy of its ranks. On one host, ranks form groups of
//! `m` consecutive ranks and each rank's snapshot is held by the other members of its group;
//! ranks left over when the world is not a multiple of `m` use ring placement (the next `m - 1`
//! ranks).
//!
//! **Replication**: one sender thread per holder streams `Begin` (the manifest: layout and
//! chunk checksums), the chunks, and `End`. One receiver thread per source stores the chunks
//! in the replica store, verifies every checksum at `End` and acknowledges with the outcome.
//!
//! **Commit protocol**: iteration `i` of rank `r` is *replicated* when every holder of `r` has
//! acknowledged a verified copy of it. `commit` takes, on every rank, the newest replicated
//! iteration, and the minimum over all ranks (an all-reduce) is the newest *committed*
//! iteration: every chunk of every rank's state has arrived and been verified on every
//! replica. A torn iteration is never committed.
//!
//! **Recovery** (`restore_latest`, collective): every rank verifies what it holds (its own
//! snapshots, replicas of others, its files in the persistent tier) and all ranks exchange the
//! lists; they choose the newest iteration for which every rank's state exists somewhere valid,
//! preferring the rank's own memory, then a replica (lowest holder first), then the persistent
//! tier. Providers send the state to ranks that lack it; receivers verify it again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ironweave_transport::{Communicator, ReduceOp};
use serde::{Deserialize, Serialize};

use ironweave_profile::{
    idle_windows, CommKind, ExpertLoad, MonotonicClock, Profiler, SpeculativeActivation, Window, WindowPredictor,
};

use crate::error::{CkptError, Result};
use crate::partition::{partition_accuracy, ChunkSpan};
use crate::persist::{self, Manifest};
use crate::registry::Registry;
use crate::schedule::{self, Releaser, Scheduled};
use crate::snapshot::{Snapshot, SnapshotBuffers};

const TAG_DATA: u32 = 0x4943_4b01;
const TAG_ACK: u32 = 0x4943_4b02;
const TAG_RESTORE: u32 = 0x4943_4b03;
const MSG_BEGIN: u8 = 0;
const MSG_CHUNK: u8 = 1;
const MSG_END: u8 = 2;
/// Iterations each rank advertises per owner during recovery.
const ADVERTISE: usize = 4;

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
        [Strategy::None, Strategy::Blocking, Strategy::Async, Strategy::Gemini, Strategy::Capricorn]
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| CkptError::Invalid(format!("unknown strategy `{s}` (none, blocking, async, gemini, capricorn)")))
    }
    fn in_memory(self) -> bool {
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
    /// probe`); `None`: estimated from the engine's own transfers (starting at 1 GB/s).
    pub link_bytes_per_s: Option<f64>,
    /// Capricorn fills this fraction of a predicted window.
    pub window_fill: f64,
    /// Capricorn re-profiles when the drift of the smoothed expert load (EWMA, see
    /// `ironweave_profile::SpeculativeActivation`) since the last profiled iteration exceeds this.
    pub drift_threshold: f64,
    /// Gemini's fixed chunk size, bytes (0: sized from the profiled spans and the state, so
    /// that whole chunks fill the spans best without overfilling any).
    pub gemini_chunk_bytes: u64,
    /// Gemini profiles this many iterations at the start (the spans of the last one are
    /// used), then never again.
    pub gemini_profile_iters: u64,
    /// Windows shorter than this are ignored, ns.
    pub min_window_ns: u64,
    /// Which host this rank runs on (any string equal on the ranks of one host and different
    /// between hosts: `ironweave_transport::rendezvous::host_name()`); replicas go to other
    /// hosts when there are several. Empty on every rank: one host.
    pub host: String,
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
            gemini_profile_iters: 3,
            min_window_ns: 50_000,
            host: String::new(),
        }
    }
}

/// Ranks holding a replica of each rank (excluding itself).
pub fn placement(world: usize, m: usize) -> Vec<Vec<usize>> {
    let m = m.clamp(1, world.max(1));
    let full = (world / m) * m;
    (0..world)
        .map(|r| {
            if r < full {
                let g = r / m * m;
                (g..g + m).filter(|&x| x != r).collect()
            } else {
                (1..m).map(|k| (r + k) % world).collect()
            }
        })
        .collect()
}

/// Ranks holding a replica of each rank when rank `r` runs on host `hosts[r]`: with several
/// hosts, every holder is on another host — replica `t` of a rank at place `i` on host `h` goes
/// to place `i` (shifted by the round when hosts run out) on the `t`-th next host; with one
/// host, [`placement`]. A host with fewer ranks takes the place modulo its count; a rank never
/// holds the same replica twice.
pub fn placement_on_hosts<H: PartialEq>(hosts: &[H], m: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<&H> = Vec::new();
    for h in hosts {
        if !order.contains(&h) {
            order.push(h);
        }
    }
    if order.len() <= 1 {
        return placement(hosts.len(), m);
    }
    let n_hosts = order.len();
    let ranks_on: Vec<Vec<usize>> = order.iter().map(|h| (0..hosts.len()).filter(|&r| hosts[r] == **h).collect()).collect();
    (0..hosts.len())
        .map(|r| {
            let hi = order.iter().position(|h| **h == hosts[r]).unwrap_or(0);
            let place = ranks_on[hi].iter().position(|&x| x == r).unwrap_or(0);
            let mut holders = Vec::new();
            for t in 0..m.saturating_sub(1) {
                let other = (hi + 1 + t % (n_hosts - 1)) % n_hosts;
                let round = t / (n_hosts - 1);
                let on = &ranks_on[other];
                let h = on[(place + round) % on.len()];
                if !holders.contains(&h) {
                    holders.push(h);
                }
            }
            holders
        })
        .collect()
}

/// A replica of another rank's snapshot.
#[derive(Debug)]
struct Replica {
    manifest: Manifest,
    data: Vec<u8>,
    received: u64,
    verified: bool,
}

#[derive(Debug, Default)]
struct Shared {
    /// source rank → replicas (newest last, at most 2 complete + 1 in progress)
    store: BTreeMap<usize, Vec<Replica>>,
    /// iteration → holders that acknowledged it (true: verified)
    acks: BTreeMap<u64, BTreeMap<usize, bool>>,
    /// failures seen by service threads
    failures: Vec<String>,
    /// holders we can no longer send to or hear from
    lost_holders: BTreeSet<usize>,
    /// chunk transfers the sender threads finished, for the partition accuracy
    chunk_log: Vec<ChunkSpan>,
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
    /// Whether profiling ran this iteration.
    pub profiled: bool,
    /// Duration of the iteration, seconds.
    pub iter_s: f64,
    /// Time the training thread spent inside the engine since the previous report (snapshot
    /// copy, waits for buffers or writers, synchronous writes, commit waits): the checkpoint's
    /// exposed cost, seconds.
    pub exposed_s: f64,
}

enum Job {
    Begin(Arc<Snapshot>),
    /// Offset, length, and whether it is a leftover (released when the iteration ended).
    Chunk(u64, u64, bool),
    End,
}

/// Chunk release state, shared with the profiler's communication hook and the timer thread.
#[derive(Default)]
struct Sched {
    releaser: Option<Releaser>,
    iter_start: Option<Instant>,
    comms: u32,
    txs: Vec<Sender<Job>>,
    open: bool,
    /// Chunks released for the snapshot being sent (each goes to every holder).
    released: usize,
    /// `flush` is releasing: what goes now is a leftover.
    flushing: bool,
}

impl Sched {
    fn dispatch(&mut self, released: Vec<Scheduled>) {
        self.released += released.len();
        for s in released {
            for tx in &self.txs {
                let _ = tx.send(Job::Chunk(s.chunk.offset, s.chunk.len, self.flushing));
            }
        }
        if self.open && self.releaser.as_ref().is_some_and(|r| r.pending() == 0) {
            for tx in &self.txs {
                let _ = tx.send(Job::End);
            }
            self.open = false;
            self.releaser = None;
        }
    }
    /// Release everything still held back (before the buffer is needed again, or on commit).
    fn flush(&mut self) {
        if let Some(r) = self.releaser.as_mut() {
            let rel = r.end();
            self.flushing = true;
            self.dispatch(rel);
            self.flushing = false;
        }
    }
}

fn lock_sched(m: &Mutex<Sched>) -> std::sync::MutexGuard<'_, Sched> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The checkpoint engine of one rank.
pub struct Engine {
    comm: Arc<Communicator>,
    cfg: EngineConfig,
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
    corrupt_in_transit: Arc<std::sync::atomic::AtomicU64>,
    profiler: Arc<Profiler<MonotonicClock>>,
    sched: Arc<Mutex<Sched>>,
    pending: Option<Arc<Snapshot>>,
    /// Iteration of the snapshot this iteration replicates (its chunks' accuracy is measured).
    sending: Option<u64>,
    activation: SpeculativeActivation,
    predictor: WindowPredictor,
    gemini_spans: Option<Vec<Window>>,
    profiled_iters: u64,
    this_iter: Option<(u64, bool)>,
    writer: Option<JoinHandle<Result<u64>>>,
    durable: Option<u64>,
    rate: Arc<Mutex<(f64, f64)>>,
    exposed: Duration,
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

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn encode_chunk(iter: u64, offset: u64, bytes: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(17 + bytes.len());
    v.push(MSG_CHUNK);
    v.extend_from_slice(&iter.to_le_bytes());
    v.extend_from_slice(&offset.to_le_bytes());
    v.extend_from_slice(bytes);
    v
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at + 8).map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
}

fn spawn<T: Send + 'static>(name: String, f: impl FnOnce() -> T + Send + 'static) -> Result<JoinHandle<T>> {
    std::thread::Builder::new().name(name).spawn(f).map_err(|e| CkptError::Invalid(format!("cannot start a thread: {e}")))
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
        if matches!(cfg.strategy, Strategy::Blocking | Strategy::Async) && cfg.persist_dir.is_none() {
            return Err(CkptError::Invalid(format!("strategy `{}` writes to storage: set persist_dir", cfg.strategy.name())));
        }
        let mut snaps = SnapshotBuffers::new(cfg.copy_threads, cfg.checksum_bytes);
        snaps.set_wait(cfg.timeout);
        let mut e = Engine {
            comm,
            activation: SpeculativeActivation::new(cfg.drift_threshold),
            predictor: WindowPredictor::new(0.5),
            cfg,
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
            corrupt_in_transit: Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX)),
            profiler: Arc::new(Profiler::new(MonotonicClock::default(), 8)),
            sched: Arc::new(Mutex::new(Sched::default())),
            pending: None,
            sending: None,
            gemini_spans: None,
            profiled_iters: 0,
            this_iter: None,
            writer: None,
            durable: None,
            rate: Arc::new(Mutex::new((0.0, 0.0))),
            exposed: Duration::ZERO,
        };
        e.start_threads()?;
        Ok(e)
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
            let mut sh = lock(&self.shared);
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
            let mut s = lock_sched(&self.sched);
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
        let in_mem = self.cfg.strategy.in_memory();
        self.holders = if in_mem { place[me].clone() } else { Vec::new() };
        let sources: Vec<usize> = if in_mem { (0..world).filter(|&s| place[s].contains(&me)).collect() } else { Vec::new() };
        self.stop = Arc::new(AtomicBool::new(false));
        let (shared, stop, profiler, rate) = (self.shared.clone(), self.stop.clone(), self.profiler.clone(), self.rate.clone());
        for &s in &sources {
            let (comm, shared, stop) = (comm.clone(), shared.clone(), stop.clone());
            self.services.push(spawn(format!("ckpt-in-{s}"), move || receive_replicas(&comm, s, &shared, &stop))?);
        }
        for &h in &self.holders {
            let (comm, shared, stop) = (comm.clone(), shared.clone(), stop.clone());
            self.services.push(spawn(format!("ckpt-ack-{h}"), move || receive_acks(&comm, h, &shared, &stop))?);
        }
        let mut txs = Vec::new();
        for &h in &self.holders {
            let (tx, rx) = channel::<Job>();
            let (comm, shared, corrupt, prof, rate) =
                (comm.clone(), shared.clone(), self.corrupt_in_transit.clone(), profiler.clone(), rate.clone());
            let (rank, world_n, chunk, link) = (me as u32, world as u32, self.cfg.chunk_bytes as usize, self.cfg.link);
            let t = spawn(format!("ckpt-out-{h}"), move || {
                let mut cur: Option<Arc<Snapshot>> = None;
                while let Ok(job) = rx.recv() {
                    let r = (|| -> Result<()> {
                        match job {
                            Job::Begin(snap) => {
                                let man = serde_json::to_vec(&Manifest::of(&snap, rank, world_n))
                                    .map_err(|e| CkptError::Invalid(e.to_string()))?;
                                let mut begin = vec![MSG_BEGIN];
                                begin.extend_from_slice(&man);
                                comm.send_bytes(h, TAG_DATA, &begin)?;
                                cur = Some(snap);
                            }
                            Job::Chunk(off, len, leftover) => {
                                let Some(snap) = &cur else { return Ok(()) };
                                let _span = prof.comm(link, CommKind::Checkpoint, len);
                                let start_ns = prof.now_ns();
                                let t0 = Instant::now();
                                for (k, piece) in snap.data[off as usize..(off + len) as usize].chunks(chunk).enumerate() {
                                    let at = off + (k * chunk) as u64;
                                    let mut msg = encode_chunk(snap.iter, at, piece);
                                    if at == 0 && corrupt.load(Ordering::SeqCst) == snap.iter && msg.len() > 17 {
                                        msg[17] ^= 0x80; // test hook: a bit flipped on the wire
                                    }
                                    comm.send_bytes(h, TAG_DATA, &msg)?;
                                }
                                let end_ns = prof.now_ns();
                                lock(&shared).chunk_log.push(ChunkSpan { snapshot: snap.iter, leftover, start_ns, end_ns });
                                let mut r = rate.lock().unwrap_or_else(|e| e.into_inner());
                                r.0 += len as f64;
                                r.1 += t0.elapsed().as_secs_f64();
                            }
                            Job::End => {
                                let Some(snap) = cur.take() else { return Ok(()) };
                                let mut end = vec![MSG_END];
                                end.extend_from_slice(&snap.iter.to_le_bytes());
                                comm.send_bytes(h, TAG_DATA, &end)?;
                            }
                        }
                        Ok(())
                    })();
                    if let Err(e) = r {
                        let mut sh = lock(&shared);
                        sh.failures.push(format!("replicating to rank {h}: {e}"));
                        sh.lost_holders.insert(h);
                        return;
                    }
                }
            })?;
            self.senders.push((h, t));
            txs.push(tx);
        }
        {
            let mut s = lock_sched(&self.sched);
            *s = Sched { txs, ..Default::default() };
        }
        // Capricorn: a window opens when a training communication on the link ends.
        {
            let sched = self.sched.clone();
            let link = self.cfg.link;
            profiler.set_comm_hook(Some(Arc::new(move |span: &ironweave_profile::CommSpan| {
                if span.link != link {
                    return;
                }
                let mut s = lock_sched(&sched);
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
            let (sched, stop) = (self.sched.clone(), stop.clone());
            self.services.push(spawn("ckpt-timer".into(), move || {
                while !stop.load(Ordering::SeqCst) {
                    {
                        let mut s = lock_sched(&sched);
                        if let (Some(start), Some(r)) = (s.iter_start, s.releaser.as_mut()) {
                            let rel = r.tick(start.elapsed().as_nanos() as u64);
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

    /// Checkpoint link bandwidth in use, bytes/s.
    pub fn link_rate(&self) -> f64 {
        if let Some(r) = self.cfg.link_bytes_per_s {
            return r;
        }
        let (b, s) = *self.rate.lock().unwrap_or_else(|e| e.into_inner());
        if b > 0.0 && s > 0.0 {
            b / s
        } else {
            1e9
        }
    }

    /// Start iteration `iter`. `load` is the expert load the trainer expects (e.g. the last
    /// iteration's); Capricorn profiles only when it drifted. Returns whether this iteration is
    /// profiled (layer timers on). Releases the chunks of the previous snapshot planned for
    /// this iteration's windows.
    pub fn begin_iteration(&mut self, iter: u64, load: Option<&ExpertLoad>) -> bool {
        let profile = match self.cfg.strategy {
            Strategy::Capricorn => match load {
                Some(l) => self.activation.decide(l),
                None => self.profiled_iters == 0,
            },
            Strategy::Gemini => self.profiled_iters < self.cfg.gemini_profile_iters,
            _ => false,
        };
        self.profiler.set_detailed(profile);
        self.profiler.begin_iteration(iter);
        self.this_iter = Some((iter, profile));
        let mut s = lock_sched(&self.sched);
        s.comms = 0;
        s.iter_start = Some(Instant::now());
        if let Some(snap) = self.pending.take() {
            let total = snap.data.len() as u64;
            let rate = self.link_rate();
            let plan = match self.cfg.strategy {
                Strategy::Capricorn => {
                    let w = self.predictor.predict(self.cfg.link);
                    if w.is_empty() {
                        schedule::capricorn(total, &[], rate, 1.0, 1, self.cfg.chunk_bytes)
                    } else {
                        schedule::capricorn(
                            total,
                            &w,
                            rate,
                            self.cfg.window_fill,
                            self.cfg.chunk_bytes.min(1 << 20),
                            self.cfg.chunk_bytes,
                        )
                    }
                }
                _ => match &self.gemini_spans {
                    Some(spans) => schedule::gemini(total, spans, rate, self.cfg.gemini_chunk_bytes),
                    None => schedule::gemini(total, &[], rate, self.cfg.gemini_chunk_bytes),
                },
            };
            for tx in &s.txs {
                let _ = tx.send(Job::Begin(snap.clone()));
            }
            s.open = true;
            s.releaser = Some(Releaser::new(plan));
            s.released = 0;
            self.sending = Some(snap.iter);
            self.last_sent = Some(snap.iter);
            let rel = s.releaser.as_mut().map(|r| r.start()).unwrap_or_default();
            s.dispatch(rel);
        }
        profile
    }

    /// End the current iteration (after the optimizer step): leftover chunks go now; a
    /// profiled iteration's windows feed the predictor.
    pub fn end_iteration(&mut self) -> IterationReport {
        // leftovers go now, marked as such: they count as outside every window
        let released = {
            let mut s = lock_sched(&self.sched);
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
            exposed_s: std::mem::take(&mut self.exposed).as_secs_f64(),
            ..Default::default()
        };
        if let Some(p) = prof {
            rep.iter_s = p.duration_ns() as f64 * 1e-9;
            let training: Vec<(u64, u64)> = p
                .comms
                .iter()
                .filter(|c| c.link == self.cfg.link && c.kind == CommKind::Training)
                .map(|c| (c.start_ns, c.end_ns))
                .collect();
            rep.bytes_sent = p.comms.iter().filter(|c| c.kind == CommKind::Checkpoint).map(|c| c.bytes).sum();
            // this iteration's snapshot's transfers, by the iteration that released them;
            // older entries go (late ones of this snapshot are dropped at the next report)
            let spans: Vec<ChunkSpan> = {
                let mut sh = lock(&self.shared);
                let v = sh.chunk_log.iter().filter(|c| Some(c.snapshot) == sending).copied().collect();
                sh.chunk_log.retain(|c| sending.is_some_and(|i| c.snapshot > i));
                v
            };
            rep.partition_accuracy = partition_accuracy(&training, &spans, released, p.end_ns);
            rep.chunks = released as u32;
            rep.chunks_in_window = rep.partition_accuracy.map_or(0, |a| (a * released as f64).round() as u32);
            if profiled {
                let w = idle_windows(&p, self.cfg.link, self.cfg.min_window_ns);
                self.predictor.observe(&w);
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
        let t0 = Instant::now();
        let r = self.checkpoint_inner(iter, bufs);
        self.exposed += t0.elapsed();
        r
    }

    fn checkpoint_inner(&mut self, iter: u64, bufs: &[&[u8]]) -> Result<CheckpointReport> {
        if let Some(last) = self.snaps.latest().map(|s| s.iter) {
            if iter <= last {
                return Err(CkptError::Invalid(format!("iteration {iter} is not after the last checkpointed iteration {last}")));
            }
        }
        let t0 = Instant::now();
        let (rank, world) = (self.comm.rank() as u32, self.comm.size() as u32);
        let mut persisted = false;
        match self.cfg.strategy {
            Strategy::None => {
                return Ok(CheckpointReport { iter, bytes: 0, blocking_s: 0.0, persisted: false });
            }
            Strategy::Blocking => {
                let snap = self.snaps.take(iter, &self.registry, bufs)?;
                let dir = self.cfg.persist_dir.clone().expect("checked in new");
                persist::write(&dir, &snap, rank, world)?;
                self.durable = Some(iter);
                persisted = true;
            }
            Strategy::Async => {
                // the next snapshot waits for the previous write (one host buffer in flight)
                if let Some(w) = self.writer.take() {
                    let done = w.join().map_err(|_| CkptError::Invalid("the background writer panicked".into()))??;
                    self.durable = Some(done);
                }
                let snap = self.snaps.take(iter, &self.registry, bufs)?;
                let dir = self.cfg.persist_dir.clone().expect("checked in new");
                self.writer =
                    Some(spawn("ckpt-writer".into(), move || persist::write(&dir, &snap, rank, world).map(|_| snap.iter))?);
                persisted = true;
            }
            Strategy::Gemini | Strategy::Capricorn => {
                // whatever of the previous snapshot was not sent yet goes now
                self.flush_pending();
                let snap = self.snaps.take(iter, &self.registry, bufs)?;
                if let Some(dir) = &self.cfg.persist_dir {
                    if self.cfg.persist_every > 0 && iter % self.cfg.persist_every == 0 {
                        persist::write(dir, &snap, rank, world)?;
                        persisted = true;
                    }
                }
                if self.holders.is_empty() {
                    self.last_sent = Some(iter);
                } else {
                    self.pending = Some(snap);
                }
            }
        }
        Ok(CheckpointReport { iter, bytes: self.registry.total, blocking_s: t0.elapsed().as_secs_f64(), persisted })
    }

    /// Release every chunk still held back: the rest of the plan in progress, then a snapshot
    /// whose iteration has not begun.
    fn flush_pending(&mut self) {
        lock_sched(&self.sched).flush();
        if let Some(prev) = self.pending.take() {
            self.release_all(prev);
        }
    }

    /// Send a whole snapshot now, back to back.
    fn release_all(&mut self, snap: Arc<Snapshot>) {
        let mut s = lock_sched(&self.sched);
        for tx in &s.txs {
            let _ = tx.send(Job::Begin(snap.clone()));
        }
        s.open = true;
        let total = snap.data.len() as u64;
        s.releaser = Some(Releaser::new(schedule::capricorn(total, &[], 1.0, 1.0, 1, self.cfg.chunk_bytes)));
        let rel = s.releaser.as_mut().map(|r| r.end()).unwrap_or_default();
        s.dispatch(rel);
        self.last_sent = Some(snap.iter);
    }

    /// Write the newest snapshot to the persistent tier now.
    pub fn persist_now(&self) -> Result<Option<PathBuf>> {
        let (Some(dir), Some(s)) = (&self.cfg.persist_dir, self.snaps.latest()) else { return Ok(None) };
        Ok(Some(persist::write(dir, s, self.comm.rank() as u32, self.comm.size() as u32)?))
    }

    /// Problems the background threads met (a holder that died, a corrupt transfer).
    pub fn failures(&self) -> Vec<String> {
        lock(&self.shared).failures.clone()
    }

    fn replicated_upto(&self) -> Option<u64> {
        match self.cfg.strategy {
            Strategy::None => None,
            Strategy::Blocking | Strategy::Async => self.durable,
            _ if self.holders.is_empty() => self.last_sent,
            _ => {
                let sh = lock(&self.shared);
                sh.acks.iter().rev().find(|(_, a)| self.holders.iter().all(|h| a.get(h) == Some(&true))).map(|(&i, _)| i)
            }
        }
    }

    /// Agree on the newest committed iteration (collective). With `wait`, first send whatever
    /// is held back and wait (bounded) until this rank's newest snapshot is acknowledged by all
    /// its holders (or written, for the storage strategies).
    pub fn commit(&mut self, wait: bool) -> Result<Option<u64>> {
        let t0 = Instant::now();
        let r = self.commit_inner(wait);
        self.exposed += t0.elapsed();
        r
    }

    fn commit_inner(&mut self, wait: bool) -> Result<Option<u64>> {
        if wait {
            if self.cfg.strategy == Strategy::Async {
                if let Some(w) = self.writer.take() {
                    let done = w.join().map_err(|_| CkptError::Invalid("the background writer panicked".into()))??;
                    self.durable = Some(done);
                }
            }
            self.flush_pending();
            if let (true, Some(want)) = (self.cfg.strategy.in_memory(), self.last_sent) {
                // half the timeout, so that peers already in the all-reduce below do not time out first
                let deadline = Instant::now() + self.cfg.timeout / 2;
                let answered = |sh: &Shared| sh.acks.get(&want).is_some_and(|a| self.holders.iter().all(|h| a.contains_key(h)));
                while !answered(&lock(&self.shared)) && Instant::now() < deadline {
                    if !lock(&self.shared).lost_holders.is_empty() {
                        break;
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        } else if self.cfg.strategy == Strategy::Async && self.writer.as_ref().is_some_and(|w| w.is_finished()) {
            if let Some(w) = self.writer.take() {
                let done = w.join().map_err(|_| CkptError::Invalid("the background writer panicked".into()))??;
                self.durable = Some(done);
            }
        }
        let mine: [i64; 1] = [self.replicated_upto().map(|i| i as i64).unwrap_or(-1)];
        let mut v = mine;
        self.comm.all_reduce(&mut v, ReduceOp::Min)?;
        self.committed = (v[0] >= 0).then_some(v[0] as u64);
        Ok(self.committed)
    }

    /// The last agreed committed iteration.
    pub fn committed(&self) -> Option<u64> {
        self.committed
    }

    /// Verified copies this rank holds: (owner rank, iteration, in memory?).
    fn holdings(&self) -> Vec<(usize, u64, bool)> {
        let me = self.comm.rank();
        let mut out = Vec::new();
        for s in self.snaps.held() {
            if Snapshot::verify(&s.data, s.sums(), "local snapshot").is_ok() {
                out.push((me, s.iter, true));
            }
        }
        {
            let sh = lock(&self.shared);
            for (&src, reps) in &sh.store {
                for r in reps.iter().filter(|r| r.verified) {
                    if Snapshot::verify(&r.data, &r.manifest.sums, "replica").is_ok() {
                        out.push((src, r.manifest.iter, true));
                    }
                }
            }
        }
        if let Some(dir) = &self.cfg.persist_dir {
            for it in persist::iterations(dir, me as u32).into_iter().take(ADVERTISE) {
                if persist::load(dir, it, me as u32).is_ok() {
                    out.push((me, it, false));
                }
            }
        }
        out
    }

    /// Restore the newest iteration every rank can get a valid copy of (collective).
    pub fn restore_latest(&mut self) -> Result<Restored> {
        let world = self.comm.size();
        let me = self.comm.rank();
        // Advertise: for each owner, up to ADVERTISE iterations held in memory and on disk.
        let hold = self.holdings();
        let width = world * ADVERTISE * 2;
        let mut mine = vec![-1i64; width];
        for owner in 0..world {
            let mut mem: Vec<u64> = hold.iter().filter(|h| h.0 == owner && h.2).map(|h| h.1).collect();
            let mut disk: Vec<u64> = hold.iter().filter(|h| h.0 == owner && !h.2).map(|h| h.1).collect();
            mem.sort_unstable_by(|a, b| b.cmp(a));
            disk.sort_unstable_by(|a, b| b.cmp(a));
            for (k, it) in mem.iter().take(ADVERTISE).enumerate() {
                mine[(owner * ADVERTISE + k) * 2] = *it as i64;
            }
            for (k, it) in disk.iter().take(ADVERTISE).enumerate() {
                mine[(owner * ADVERTISE + k) * 2 + 1] = *it as i64;
            }
        }
        let mut all = vec![0i64; width * world];
        self.comm.all_gather(&mine, &mut all)?;
        // who has what: (owner, iter) → [(holder, in memory)]
        let mut have: BTreeMap<(usize, u64), Vec<(usize, bool)>> = BTreeMap::new();
        for holder in 0..world {
            let row = &all[holder * width..(holder + 1) * width];
            for owner in 0..world {
                for k in 0..ADVERTISE {
                    for (slot, mem) in [(0, true), (1, false)] {
                        let v = row[(owner * ADVERTISE + k) * 2 + slot];
                        if v >= 0 {
                            have.entry((owner, v as u64)).or_default().push((holder, mem));
                        }
                    }
                }
            }
        }
        let candidates: BTreeSet<u64> = have.keys().map(|k| k.1).collect();
        let chosen = candidates.iter().rev().copied().find(|&it| (0..world).all(|o| have.contains_key(&(o, it))));
        let Some(iter) = chosen else {
            let tried: Vec<String> = (0..world)
                .map(|o| {
                    let its: Vec<String> =
                        have.iter().filter(|(k, _)| k.0 == o).map(|(k, v)| format!("{} (on {:?})", k.1, v)).collect();
                    format!(
                        "rank {o}: {}",
                        if its.is_empty() { "nothing valid in any memory or file".to_string() } else { its.join(", ") }
                    )
                })
                .collect();
            return Err(CkptError::NothingToRestore {
                tried: format!("own memory, replicas on peers and the persistent tier ({}); found {}", self.cfg.persist_dir.as_ref().map(|d| d.display().to_string()).unwrap_or_else(|| "not configured".into()), tried.join("; ")),
                hint: "no iteration has a valid copy of every rank's state; restart from scratch or from an older persistent checkpoint".into(),
            });
        };
        // provider per owner: own memory, then lowest replica holder, then own persistent file
        let provider = |o: usize| -> (usize, bool) {
            let v = &have[&(o, iter)];
            if v.contains(&(o, true)) {
                (o, true)
            } else if let Some(&(h, _)) = v.iter().filter(|(h, m)| *m && *h != o).min() {
                (h, true)
            } else {
                (o, false)
            }
        };
        // serve others first without blocking (two providers may serve each other), then get
        // mine, then wait for the sends
        let mut sends = Vec::new();
        for o in 0..world {
            let (p, in_mem) = provider(o);
            if p == me && o != me && in_mem {
                let (man, data) = {
                    let sh = lock(&self.shared);
                    let r = sh.store.get(&o).and_then(|v| v.iter().find(|r| r.verified && r.manifest.iter == iter)).ok_or_else(
                        || CkptError::Invalid(format!("replica of rank {o} iteration {iter} vanished while restoring")),
                    )?;
                    (serde_json::to_vec(&r.manifest).map_err(|e| CkptError::Invalid(e.to_string()))?, r.data.clone())
                };
                sends.push(self.comm.isend_bytes(o, TAG_RESTORE, man)?);
                sends.push(self.comm.isend_bytes(o, TAG_RESTORE, data)?);
            }
        }
        let (p, in_mem) = provider(me);
        let (snapshot, source) = if p == me && in_mem {
            (
                self.snaps
                    .get(iter)
                    .cloned()
                    .ok_or_else(|| CkptError::Invalid(format!("own snapshot of iteration {iter} vanished")))?,
                Source::Local,
            )
        } else if p == me {
            let dir = self.cfg.persist_dir.as_ref().expect("advertised a file, so a directory is configured");
            (Arc::new(persist::load(dir, iter, me as u32)?), Source::Persistent)
        } else {
            let man = self.comm.recv_bytes(p, TAG_RESTORE)?;
            let data = self.comm.recv_bytes(p, TAG_RESTORE)?;
            let man: Manifest = serde_json::from_slice(&man)
                .map_err(|e| CkptError::Corrupt { what: format!("manifest from rank {p}"), detail: e.to_string() })?;
            if man.iter != iter || man.rank as usize != me {
                return Err(CkptError::Corrupt {
                    what: format!("state from rank {p}"),
                    detail: format!("got rank {} iteration {}", man.rank, man.iter),
                });
            }
            Snapshot::verify(&data, &man.sums, &format!("state of rank {me} from rank {p}"))?;
            (Arc::new(Snapshot::with_sums(iter, Arc::new(man.registry), data, man.sums)), Source::Peer(p))
        };
        let deadline = Instant::now() + self.cfg.timeout;
        for h in sends {
            h.wait(deadline)?;
        }
        if *snapshot.registry != *self.registry {
            return Err(CkptError::Invalid(format!(
                "the restored state's layout differs from the registered one (iteration {iter})"
            )));
        }
        // Everything newer than the restored iteration is void; replication restarts from here.
        self.snaps.clear();
        self.pending = None;
        lock_sched(&self.sched).releaser = None;
        {
            let mut sh = lock(&self.shared);
            sh.acks.retain(|&i, _| i <= iter);
            for v in sh.store.values_mut() {
                v.retain(|r| r.manifest.iter <= iter);
            }
        }
        self.last_sent = None;
        self.comm.barrier()?;
        self.committed = Some(iter);
        Ok(Restored { iter, snapshot, source })
    }

    /// Test hook: forget everything held in memory (as a restarted process would).
    #[doc(hidden)]
    pub fn forget_memory_for_test(&mut self) {
        self.snaps.clear();
        self.pending = None;
        self.last_sent = None;
        let mut sh = lock(&self.shared);
        sh.store.clear();
        sh.acks.clear();
    }

    /// Test hook: flip a bit of iteration `iter`'s first chunk on its way to every holder.
    #[doc(hidden)]
    pub fn corrupt_in_transit_for_test(&self, iter: u64) {
        self.corrupt_in_transit.store(iter, Ordering::SeqCst);
    }

    /// Test hook: flip a byte of the replica of `src`'s iteration `iter` held here.
    #[doc(hidden)]
    pub fn corrupt_replica_for_test(&self, src: usize, iter: u64, offset: usize) -> bool {
        let mut sh = lock(&self.shared);
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
            let mut s = lock_sched(&self.sched);
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
        lock_sched(&self.sched).txs.clear();
    }
}

fn poll_loop(
    comm: &Communicator,
    peer: usize,
    tag: u32,
    stop: &AtomicBool,
    mut on: impl FnMut(Vec<u8>) -> Result<()>,
) -> Result<()> {
    let mut h = comm.irecv_bytes(peer, tag)?;
    loop {
        match h.poll_until(Instant::now() + Duration::from_millis(50))? {
            Some(buf) => {
                on(buf.into_vec())?;
                h = comm.irecv_bytes(peer, tag)?;
            }
            None if stop.load(Ordering::SeqCst) => return Ok(()),
            None => {}
        }
    }
}

fn receive_replicas(comm: &Communicator, src: usize, shared: &Mutex<Shared>, stop: &AtomicBool) {
    let r = poll_loop(comm, src, TAG_DATA, stop, |msg| {
        match msg.first() {
            Some(&MSG_BEGIN) => {
                let man: Manifest = serde_json::from_slice(&msg[1..])
                    .map_err(|e| CkptError::Corrupt { what: format!("manifest from rank {src}"), detail: e.to_string() })?;
                let total = man.registry.total as usize;
                let mut sh = lock(shared);
                let reps = sh.store.entry(src).or_default();
                // keep the two newest complete replicas; reuse the oldest buffer
                reps.retain(|r| r.verified);
                let mut data = if reps.len() >= 2 { reps.remove(0).data } else { Vec::new() };
                data.resize(total, 0);
                reps.push(Replica { manifest: man, data, received: 0, verified: false });
            }
            Some(&MSG_CHUNK) => {
                let (Some(iter), Some(off)) = (u64_at(&msg, 1), u64_at(&msg, 9)) else {
                    return Err(CkptError::Corrupt { what: format!("chunk from rank {src}"), detail: "short header".into() });
                };
                let bytes = &msg[17..];
                let mut sh = lock(shared);
                let r = sh.store.get_mut(&src).and_then(|v| v.last_mut()).filter(|r| r.manifest.iter == iter && !r.verified);
                let Some(r) = r else {
                    return Err(CkptError::Corrupt {
                        what: format!("chunk from rank {src}"),
                        detail: format!("iteration {iter} was not begun"),
                    });
                };
                let end = off as usize + bytes.len();
                if end > r.data.len() {
                    return Err(CkptError::Corrupt {
                        what: format!("chunk from rank {src}"),
                        detail: format!("bytes {off}..{end} beyond {}", r.data.len()),
                    });
                }
                r.data[off as usize..end].copy_from_slice(bytes);
                r.received += bytes.len() as u64;
            }
            Some(&MSG_END) => {
                let iter = u64_at(&msg, 1).unwrap_or(u64::MAX);
                let ok = {
                    let mut sh = lock(shared);
                    match sh.store.get_mut(&src).and_then(|v| v.last_mut()).filter(|r| r.manifest.iter == iter) {
                        Some(r) => {
                            r.verified = r.received == r.data.len() as u64
                                && Snapshot::verify(&r.data, &r.manifest.sums, &format!("replica of rank {src}")).is_ok();
                            let ok = r.verified;
                            if !ok {
                                sh.failures.push(format!("replica of rank {src} iteration {iter} failed verification"));
                            }
                            ok
                        }
                        None => false,
                    }
                };
                let mut ack = iter.to_le_bytes().to_vec();
                ack.push(u8::from(ok));
                comm.send_bytes(src, TAG_ACK, &ack)?;
            }
            _ => return Err(CkptError::Corrupt { what: format!("message from rank {src}"), detail: "unknown kind".into() }),
        }
        Ok(())
    });
    if let Err(e) = r {
        lock(shared).failures.push(format!("receiving replicas from rank {src}: {e}"));
    }
}

fn receive_acks(comm: &Communicator, holder: usize, shared: &Mutex<Shared>, stop: &AtomicBool) {
    let r = poll_loop(comm, holder, TAG_ACK, stop, |msg| {
        let (Some(iter), Some(&ok)) = (u64_at(&msg, 0), msg.get(8)) else {
            return Err(CkptError::Corrupt { what: format!("acknowledgement from rank {holder}"), detail: "short".into() });
        };
        let mut sh = lock(shared);
        sh.acks.entry(iter).or_default().insert(holder, ok == 1);
        // keep the table small
        while sh.acks.len() > 64 {
            let first = *sh.acks.keys().next().expect("non-empty");
            sh.acks.remove(&first);
        }
        Ok(())
    });
    if let Err(e) = r {
        let mut sh = lock(shared);
        sh.failures.push(format!("acknowledgements from rank {holder}: {e}"));
        sh.lost_holders.insert(holder);
    }
}

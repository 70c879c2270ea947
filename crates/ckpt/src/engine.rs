//! The engine: snapshot after the optimizer step, replicate to peers' host memory, agree on
//! the newest committed iteration, restore it.
//!
//! **Placement** (Gemini's "mixed" placement): ranks form groups of `m` consecutive ranks and
//! each rank's snapshot is held by the other members of its group; ranks left over when the
//! world is not a multiple of `m` use ring placement (the next `m - 1` ranks).
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

use crate::error::{CkptError, Result};
use crate::persist::{self, Manifest};
use crate::registry::Registry;
use crate::snapshot::{Snapshot, SnapshotBuffers};

const TAG_DATA: u32 = 0x4943_4b01;
const TAG_ACK: u32 = 0x4943_4b02;
const TAG_RESTORE: u32 = 0x4943_4b03;
const MSG_BEGIN: u8 = 0;
const MSG_CHUNK: u8 = 1;
const MSG_END: u8 = 2;
/// Iterations each rank advertises per owner during recovery.
const ADVERTISE: usize = 4;

/// Engine settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Copies of each snapshot in host memory, including the rank's own (Gemini's m).
    pub replicas: u32,
    /// Bytes per replication message (and per checksum).
    pub chunk_bytes: u64,
    /// Snapshot copy threads (0: all cores).
    pub copy_threads: usize,
    /// Persistent tier directory (none: memory only).
    pub persist_dir: Option<PathBuf>,
    /// Write to the persistent tier every this many iterations (0: only on demand).
    pub persist_every: u64,
    /// Bound on every wait of the engine.
    pub timeout: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            replicas: 2,
            chunk_bytes: 4 << 20,
            copy_threads: 0,
            persist_dir: None,
            persist_every: 0,
            timeout: Duration::from_secs(300),
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
    /// Time the training thread spent (snapshot copy; persistent write when due), seconds.
    pub blocking_s: f64,
    /// Whether the persistent tier was written.
    pub persisted: bool,
}

enum Job {
    Send(Arc<Snapshot>),
}

/// The checkpoint engine of one rank.
#[derive(Debug)]
pub struct Engine {
    comm: Arc<Communicator>,
    cfg: EngineConfig,
    registry: Arc<Registry>,
    snaps: SnapshotBuffers,
    holders: Vec<usize>,
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    senders: Vec<(usize, Sender<Job>, JoinHandle<()>)>,
    services: Vec<JoinHandle<()>>,
    last_sent: Option<u64>,
    committed: Option<u64>,
    corrupt_in_transit: Arc<std::sync::atomic::AtomicU64>,
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

impl Engine {
    /// Start the engine for `registry` on `comm` (all ranks call this together).
    pub fn new(comm: Arc<Communicator>, registry: Registry, cfg: EngineConfig) -> Result<Self> {
        if cfg.replicas == 0 || cfg.chunk_bytes == 0 {
            return Err(CkptError::Invalid("replicas and chunk_bytes must be at least 1".into()));
        }
        let world = comm.size();
        let me = comm.rank();
        let place = placement(world, cfg.replicas as usize);
        let holders = place[me].clone();
        let sources: Vec<usize> = (0..world).filter(|&s| place[s].contains(&me)).collect();
        let mut snaps = SnapshotBuffers::new(cfg.copy_threads, cfg.chunk_bytes);
        snaps.set_wait(cfg.timeout);
        let shared = Arc::new(Mutex::new(Shared::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut services = Vec::new();
        for &s in &sources {
            let (comm, shared, stop) = (comm.clone(), shared.clone(), stop.clone());
            services.push(
                std::thread::Builder::new()
                    .name(format!("ckpt-in-{s}"))
                    .spawn(move || receive_replicas(&comm, s, &shared, &stop))
                    .map_err(|e| CkptError::Invalid(format!("cannot start a thread: {e}")))?,
            );
        }
        for &h in &holders {
            let (comm, shared, stop) = (comm.clone(), shared.clone(), stop.clone());
            services.push(
                std::thread::Builder::new()
                    .name(format!("ckpt-ack-{h}"))
                    .spawn(move || receive_acks(&comm, h, &shared, &stop))
                    .map_err(|e| CkptError::Invalid(format!("cannot start a thread: {e}")))?,
            );
        }
        let mut senders = Vec::new();
        let corrupt_in_transit = Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
        for &h in &holders {
            let (tx, rx) = channel::<Job>();
            let (comm, shared, corrupt) = (comm.clone(), shared.clone(), corrupt_in_transit.clone());
            let (rank, world_n, chunk) = (me as u32, world as u32, cfg.chunk_bytes as usize);
            let t = std::thread::Builder::new()
                .name(format!("ckpt-out-{h}"))
                .spawn(move || {
                    while let Ok(Job::Send(snap)) = rx.recv() {
                        let r = (|| -> Result<()> {
                            let man = serde_json::to_vec(&Manifest::of(&snap, rank, world_n))
                                .map_err(|e| CkptError::Invalid(e.to_string()))?;
                            let mut begin = vec![MSG_BEGIN];
                            begin.extend_from_slice(&man);
                            comm.send_bytes(h, TAG_DATA, &begin)?;
                            for (k, c) in snap.data.chunks(chunk).enumerate() {
                                let mut msg = encode_chunk(snap.iter, (k * chunk) as u64, c);
                                if k == 0 && corrupt.load(Ordering::SeqCst) == snap.iter && msg.len() > 17 {
                                    msg[17] ^= 0x80; // test hook: a bit flipped on the wire
                                }
                                comm.send_bytes(h, TAG_DATA, &msg)?;
                            }
                            let mut end = vec![MSG_END];
                            end.extend_from_slice(&snap.iter.to_le_bytes());
                            comm.send_bytes(h, TAG_DATA, &end)?;
                            Ok(())
                        })();
                        if let Err(e) = r {
                            let mut sh = lock(&shared);
                            sh.failures.push(format!("replicating iteration {} to rank {h}: {e}", snap.iter));
                            sh.lost_holders.insert(h);
                            return;
                        }
                    }
                })
                .map_err(|e| CkptError::Invalid(format!("cannot start a thread: {e}")))?;
            senders.push((h, tx, t));
        }
        Ok(Engine {
            comm,
            cfg,
            registry: Arc::new(registry),
            snaps,
            holders,
            shared,
            stop,
            senders,
            services,
            last_sent: None,
            committed: None,
            corrupt_in_transit,
        })
    }

    /// The ranks holding this rank's replicas.
    pub fn holders(&self) -> &[usize] {
        &self.holders
    }

    /// The layout.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Snapshot the state after iteration `iter`'s optimizer step and start replicating it.
    pub fn checkpoint(&mut self, iter: u64, bufs: &[&[u8]]) -> Result<CheckpointReport> {
        if let Some(last) = self.snaps.latest().map(|s| s.iter) {
            if iter <= last {
                return Err(CkptError::Invalid(format!("iteration {iter} is not after the last checkpointed iteration {last}")));
            }
        }
        let t0 = Instant::now();
        let snap = self.snaps.take(iter, &self.registry, bufs)?;
        let mut persisted = false;
        if let Some(dir) = &self.cfg.persist_dir {
            if self.cfg.persist_every > 0 && iter % self.cfg.persist_every == 0 {
                persist::write(dir, &snap, self.comm.rank() as u32, self.comm.size() as u32)?;
                persisted = true;
            }
        }
        let blocking_s = t0.elapsed().as_secs_f64();
        for (h, tx, _) in &self.senders {
            tx.send(Job::Send(snap.clone()))
                .map_err(|_| CkptError::Invalid(format!("the replication thread for rank {h} has stopped; see `failures()`")))?;
        }
        self.last_sent = Some(iter);
        Ok(CheckpointReport { iter, bytes: self.registry.total, blocking_s, persisted })
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
        if self.holders.is_empty() {
            return self.last_sent;
        }
        let sh = lock(&self.shared);
        sh.acks.iter().rev().find(|(_, a)| self.holders.iter().all(|h| a.get(h) == Some(&true))).map(|(&i, _)| i)
    }

    /// Agree on the newest committed iteration (collective). With `wait`, first wait (bounded)
    /// until this rank's newest snapshot is acknowledged by all its holders.
    pub fn commit(&mut self, wait: bool) -> Result<Option<u64>> {
        if wait {
            if let Some(want) = self.last_sent {
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
            if Snapshot::verify(&s.data, &s.sums, "local snapshot").is_ok() {
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
            (Arc::new(Snapshot { iter, registry: Arc::new(man.registry), data, sums: man.sums }), Source::Peer(p))
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
        for (_, tx, t) in self.senders.drain(..) {
            drop(tx);
            let _ = t.join();
        }
        let _ = self.commit(true)?;
        self.comm.barrier()?;
        self.stop.store(true, Ordering::SeqCst);
        for t in self.services.drain(..) {
            let _ = t.join();
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.senders.clear();
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

//! Replication to peers' host memory: one sender thread per holder streams `Begin` (the
//! manifest: layout and chunk checksums), the chunks and `End`; one receiver thread per source
//! and link stores the chunks in the replica store, verifies every checksum once `End` and
//! every byte have arrived (in either order: chunks may travel over several links) and
//! acknowledges with the outcome.
//!
//! The messages and their checks are in [`crate::wire`].

use ironweave_units::Locked;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ironweave_profile::{CommKind, MonotonicClock, Profiler};
use ironweave_transport::{Communicator, RecvBuf};

use crate::error::{CkptError, Result};
use crate::partition::{Arrival, ChunkSpan};
use crate::persist::Manifest;
use crate::schedule::{Releaser, Scheduled};
use crate::segment::Segment;
use crate::snapshot::Snapshot;
use xxhash_rust::xxh3::xxh3_64;

use crate::wire::{chunk_range, Ack, ReplicaMsg, CHUNK_HEADER};
pub(crate) use crate::wire::{TAG_ACK, TAG_DATA};

/// A replica of another rank's snapshot.
#[derive(Debug)]
pub(crate) struct Replica {
    pub(crate) manifest: Manifest,
    pub(crate) data: Segment,
    received: u64,
    /// `End` arrived (the sender released every chunk).
    ended: bool,
    /// Verified and acknowledged (or failed and acknowledged as such).
    done: bool,
    pub(crate) verified: bool,
    /// Per checksum chunk of the manifest: 0 not checked yet, 1 matched, 2 differed (checked
    /// as a chunk that covers it landed, while its bytes were in cache).
    checked: Vec<u8>,
    /// The kept manifest that names this replica's segment (removed before the segment is
    /// dropped or refilled).
    pub(crate) claim: Option<PathBuf>,
    /// Checksum chunks a landed piece began but did not finish: where the next piece must
    /// start for the hash to go on, and the hash so far (a window-sized chunk rarely ends on
    /// the checksum grid; pieces that arrive in order still hash every byte once, in cache).
    open: BTreeMap<usize, (usize, Hashing)>,
}

/// A checksum chunk's hash in progress.
struct Hashing(Box<xxhash_rust::xxh3::Xxh3>);

impl std::fmt::Debug for Hashing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hashing(..)")
    }
}

impl Replica {
    /// A whole, verified replica adopted from the keep directory (`claim`: its manifest).
    pub(crate) fn kept(manifest: Manifest, data: Segment, claim: Option<PathBuf>) -> Self {
        let checked = vec![1; manifest.sums.len()];
        Replica {
            manifest,
            received: data.len() as u64,
            data,
            ended: true,
            done: true,
            verified: true,
            checked,
            claim,
            open: BTreeMap::new(),
        }
    }

    fn arriving(manifest: Manifest, data: Segment) -> Self {
        let checked = vec![0; manifest.sums.len()];
        Replica {
            manifest,
            data,
            received: 0,
            ended: false,
            done: false,
            verified: false,
            checked,
            claim: None,
            open: BTreeMap::new(),
        }
    }

    /// Lands a chunk at `at` from `parts` (offset in the chunk, bytes; together they cover it),
    /// checking each checksum chunk it covers whole right after copying it, while its bytes are
    /// in cache; returns the bytes the engine read and wrote (the copy: a read and a write).
    fn land(&mut self, at: std::ops::Range<usize>, parts: &[(usize, &[u8])]) -> u64 {
        let (a, b) = (at.start, at.end);
        // the copy of [x, y) of the replica from the parts that cover it
        let copy = |data: &mut [u8], x: usize, y: usize| {
            for &(o, p) in parts {
                let (s, e) = ((a + o).max(x), (a + o + p.len()).min(y));
                if s < e {
                    data[s..e].copy_from_slice(&p[s - a - o..e - a - o]);
                }
            }
        };
        let sums = &self.manifest.sums;
        let mut done = a;
        let first = sums.partition_point(|c| c.offset.saturating_add(c.len) <= a as u64);
        for (i, c) in sums.iter().enumerate().skip(first) {
            let (s, e) = (c.offset as usize, c.offset.saturating_add(c.len) as usize);
            if s >= b {
                break;
            }
            let (x, y) = (s.max(a), e.min(b));
            copy(&mut self.data, done, y);
            done = y;
            if s >= a && e <= b {
                let ok = xxh3_64(&self.data[s..e]) == c.xxh3;
                self.checked[i] = if ok { 1 } else { 2 };
            } else if s >= a {
                // the piece ends inside this checksum chunk: its hash starts here
                let mut h = Hashing(Box::new(xxhash_rust::xxh3::Xxh3::new()));
                h.0.update(&self.data[s..y]);
                self.open.insert(i, (y, h));
            } else {
                // the piece starts inside it: the hash goes on if the earlier bytes were hashed
                // up to here, else the chunk is checked once whole (`verify_rest`)
                match self.open.remove(&i) {
                    Some((next, mut h)) if next == x => {
                        h.0.update(&self.data[x..y]);
                        if y == e {
                            self.checked[i] = if h.0.digest() == c.xxh3 { 1 } else { 2 };
                        } else {
                            self.open.insert(i, (y, h));
                        }
                    }
                    _ => {}
                }
            }
        }
        if done < b {
            copy(&mut self.data, done, b);
        }
        self.received += (b - a) as u64;
        2 * (b - a) as u64
    }

    /// Whether every checksum holds: the chunks checked on landing by their verdict, the rest
    /// (those no single landed piece covered) now. Returns (verdict, bytes read now).
    fn verify_rest(&mut self) -> (bool, u64) {
        let mut read = 0u64;
        let mut ok = self.received == self.data.len() as u64 && self.checked.len() == self.manifest.sums.len();
        let mut end = 0u64;
        for (i, c) in self.manifest.sums.iter().enumerate() {
            let stop = c.offset.saturating_add(c.len);
            if c.offset != end || stop > self.data.len() as u64 {
                return (false, read);
            }
            end = stop;
            if self.checked[i] == 0 {
                read += c.len;
                self.checked[i] = if xxh3_64(&self.data[c.offset as usize..stop as usize]) == c.xxh3 { 1 } else { 2 };
            }
            ok &= self.checked[i] == 1;
        }
        (ok && end == self.data.len() as u64, read)
    }

    /// Lets go of the replica: its kept manifest goes first, then its segment (kept as `spare`
    /// for the next replica of `want` bytes when it can be, else removed).
    fn release(self, spare: &mut Option<Segment>, want: usize) {
        if let Some(m) = &self.claim {
            let _ = std::fs::remove_file(m);
        }
        if self.done && self.data.len() == want && spare.is_none() {
            *spare = Some(self.data);
        } else {
            self.data.discard();
        }
    }
}

/// What the service threads share with the engine.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// source rank → replicas (newest last: those from the source's committed iteration on, at
    /// most [`KEPT_REPLICAS`] complete, and up to 2 in progress)
    pub(crate) store: BTreeMap<usize, Vec<Replica>>,
    /// iteration → holders that acknowledged it (true: verified)
    pub(crate) acks: BTreeMap<u64, BTreeMap<usize, bool>>,
    /// failures seen by service threads
    pub(crate) failures: Vec<String>,
    /// holders we can no longer send to or hear from
    pub(crate) lost_holders: BTreeSet<usize>,
    /// chunk transfers the sender threads finished, for the partition accuracy
    pub(crate) chunk_log: Vec<ChunkSpan>,
    /// chunks this rank received as a holder since the last iteration's report (their wire
    /// accuracy is judged on this rank's own training traffic)
    pub(crate) arrivals: Vec<Arrival>,
    /// Where replica segments are made (the holder directory of the keep directory; none:
    /// heap memory), and the files there not to be made anew (named by kept manifests this
    /// process did not adopt).
    pub(crate) seg_dir: Option<(PathBuf, BTreeSet<PathBuf>)>,
    /// Replica bytes received (chunk payloads landed).
    pub(crate) recv_bytes: u64,
    /// Bytes the receivers read and wrote in memory for them: the landing copy (read and
    /// write), and the checksum reads of chunks no landed piece covered whole.
    pub(crate) recv_pass_bytes: u64,
}

impl Shared {
    /// Memory for a replica of `total` bytes from `src`: a segment file of the holder directory
    /// (`rep-SRC-K.seg`, a name no held replica or reserved file has), else heap memory.
    fn replica_memory(&self, src: usize, total: usize) -> Result<Segment> {
        let Some((dir, reserved)) = &self.seg_dir else { return Ok(Segment::from(vec![0u8; total])) };
        let used: BTreeSet<&std::path::Path> = self.store.values().flatten().filter_map(|r| r.data.path()).collect();
        Segment::create_free(dir, &format!("rep-{src:05}"), total, |p| used.contains(p) || reserved.contains(p))
    }
}

/// Complete replicas of one source a holder keeps besides the one arriving: the source's
/// newest committed iteration and one newer (a source keeps no more itself, see
/// [`crate::snapshot::SNAPSHOT_BUFFERS`]).
pub const KEPT_REPLICAS: usize = 2;

/// At most this many arrivals wait for an iteration's report (a rank that stopped reporting
/// must not grow the list without bound).
pub(crate) const MAX_ARRIVALS: usize = 1 << 16;

/// Bytes the engine moved, by where they went (read by reports and benchmarks).
#[derive(Debug, Default)]
pub struct Counters {
    /// Replica bytes sent to holders (chunk payloads, every holder counted).
    pub replica_bytes: AtomicU64,
    /// Of which to holders on another host.
    pub replica_bytes_inter_host: AtomicU64,
    /// Replica bytes sent per link slot (slot 0: the training link, then
    /// `EngineConfig::extra_links` in order).
    pub replica_bytes_per_link: Vec<AtomicU64>,
    /// Bytes written to the persistent tier.
    pub storage_bytes: AtomicU64,
    /// Persistent-tier writes that failed (a full disk) while in-memory replicas went on.
    pub storage_failures: AtomicU64,
    /// CPU time the replica sender threads spent sending (encoding, the transport's copies and
    /// system calls on those threads), ns: with [`Counters::replica_bytes`], the CPU each
    /// checkpoint byte costs the sender.
    pub replica_send_cpu_ns: AtomicU64,
    /// CPU time the replica receiver threads spent receiving (reading sockets, landing chunks,
    /// verifying checksums, acknowledging, waiting in a poll), ns.
    pub replica_recv_cpu_ns: AtomicU64,
    /// Replica chunks this rank received as a holder and judged (see
    /// [`crate::partition::wire_accuracy`]).
    pub wire_chunks: AtomicU64,
    /// Of which on the wire entirely inside an idle window of this rank's link.
    pub wire_chunks_in_window: AtomicU64,
    /// State bytes snapshotted (each snapshot's size, every snapshot counted).
    pub snapshot_bytes: AtomicU64,
    /// Bytes the engine read and wrote in memory on the sending side: the snapshot copy (read
    /// and write) and any copy made to send (a message built around a chunk). Over
    /// [`Counters::snapshot_bytes`]: the memory passes each state byte costs the sender. A
    /// checksum computed on a piece just copied reads the cache and is not counted; the kernel's
    /// copies into the socket are not the engine's.
    pub send_pass_bytes: AtomicU64,
    /// Kept copies adopted at start by mapping their segments (no copy: their checksums are read
    /// once).
    pub kept_bytes_mapped: AtomicU64,
    /// Kept copies adopted at start by reading a file (copies written before segments).
    pub kept_bytes_copied: AtomicU64,
    /// Snapshots not taken because the newest committed iteration and the ones after it
    /// filled every buffer and the oldest of those was not acknowledged in time (the links
    /// did not keep up with one checkpoint per iteration).
    pub snapshots_skipped: AtomicU64,
}

/// CPU time the calling thread has used, ns (0 where the clock cannot be read).
pub fn thread_cpu_ns() -> u64 {
    ironweave_transport::threads::this_thread_cpu_ns()
}

impl Counters {
    /// Zeroed counters for `links` link slots.
    pub fn new(links: usize) -> Self {
        Counters { replica_bytes_per_link: (0..links).map(|_| AtomicU64::new(0)).collect(), ..Default::default() }
    }
}

/// One job of a sender thread.
pub(crate) enum Job {
    /// A snapshot, and from which iteration on the holder keeps replicas.
    Begin(Arc<Snapshot>, u64),
    /// Offset, length, and whether it is a leftover (released when the iteration ended).
    Chunk {
        off: u64,
        len: u64,
        leftover: bool,
    },
    End,
}

/// Chunk release state, shared with the profiler's communication hook and the timer thread.
#[derive(Default)]
pub(crate) struct Sched {
    pub(crate) releaser: Option<Releaser>,
    /// When the iteration began, on the profiler's clock.
    pub(crate) iter_start_ns: Option<u64>,
    pub(crate) comms: u32,
    /// Sender threads: per holder, per link slot.
    pub(crate) txs: Vec<Vec<Sender<Job>>>,
    pub(crate) open: bool,
    /// Chunks released for the snapshot being sent (each goes to every holder).
    pub(crate) released: usize,
    /// `flush` is releasing: what goes now is a leftover.
    pub(crate) flushing: bool,
    /// The plan in progress is one part of the snapshot and more follow in later iterations:
    /// no `End` when it runs out.
    pub(crate) more_parts: bool,
}

impl Sched {
    /// A snapshot starts: every sender thread (each holder, each link) announces it; holders
    /// keep replicas from `keep_from` on (the newest committed iteration).
    pub(crate) fn begin(&mut self, snap: &Arc<Snapshot>, keep_from: u64) {
        for tx in self.txs.iter().flatten() {
            let _ = tx.send(Job::Begin(snap.clone(), keep_from));
        }
        self.open = true;
    }

    pub(crate) fn dispatch(&mut self, released: Vec<Scheduled>) {
        self.released += released.len();
        for s in released {
            for per_slot in &self.txs {
                let tx = per_slot.get(s.link as usize).or(per_slot.first());
                if let Some(tx) = tx {
                    let _ = tx.send(Job::Chunk { off: s.chunk.offset, len: s.chunk.len, leftover: self.flushing });
                }
            }
        }
        if self.open && self.releaser.as_ref().is_some_and(|r| r.pending() == 0) {
            self.releaser = None;
            if self.more_parts {
                return;
            }
            // End goes on the first link (the holder acknowledges once it has every byte too);
            // the other links' threads let go of the snapshot, so its buffer can be reused
            for tx in self.txs.iter().flatten() {
                let _ = tx.send(Job::End);
            }
            self.open = false;
        }
    }
    /// Release everything still held back (before the buffer is needed again, or on commit).
    pub(crate) fn flush(&mut self) {
        if let Some(r) = self.releaser.as_mut() {
            let rel = r.end();
            self.flushing = true;
            self.dispatch(rel);
            self.flushing = false;
        }
    }
}

pub(crate) fn spawn<T: Send + 'static>(name: String, f: impl FnOnce() -> T + Send + 'static) -> Result<JoinHandle<T>> {
    std::thread::Builder::new().name(name).spawn(f).map_err(|e| CkptError::Invalid(format!("cannot start a thread: {e}")))
}

/// Everything one sender thread needs.
pub(crate) struct SenderCtx {
    /// Holder rank.
    pub(crate) holder: usize,
    /// Link slot this thread sends on (0: the training link).
    pub(crate) slot: usize,
    /// Whether the holder is on another host (counted as inter-host bytes).
    pub(crate) remote: bool,
    /// The communicator of this slot's link.
    pub(crate) comm: Arc<Communicator>,
    /// The first slot's communicator (where `End` goes).
    pub(crate) first: Arc<Communicator>,
    /// Profiler link index of this slot.
    pub(crate) link_id: u32,
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) chunk: usize,
    pub(crate) shared: Arc<Mutex<Shared>>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) corrupt: Arc<AtomicU64>,
    /// Test hook: while set, chunks and `End`s are dropped (a link that delivers nothing).
    pub(crate) stalled: Arc<AtomicBool>,
    pub(crate) prof: Arc<Profiler<MonotonicClock>>,
    /// (bytes, seconds) of finished transfers per slot: the measured rate of each link.
    pub(crate) rate: Arc<Mutex<Vec<(f64, f64)>>>,
}

/// The body of a sender thread: runs jobs until the channel closes or a send fails.
pub(crate) fn send_loop(cx: SenderCtx, rx: Receiver<Job>) {
    let h = cx.holder;
    let mut cur: Option<Arc<Snapshot>> = None;
    while let Ok(job) = rx.recv() {
        let cpu0 = thread_cpu_ns();
        let r = (|| -> Result<()> {
            match job {
                Job::Begin(snap, keep_from) => {
                    let begin = ReplicaMsg::encode_begin(&Manifest::of(&snap, cx.rank, cx.world), keep_from)?;
                    // every link that may carry a chunk announces the replica first (a link
                    // delivers in order; two links do not)
                    cx.comm.send_bytes(h, TAG_DATA, &begin)?;
                    cur = Some(snap);
                }
                Job::Chunk { .. } | Job::End if cx.stalled.load(Ordering::SeqCst) => {}
                Job::Chunk { off, len, leftover } => {
                    let Some(snap) = &cur else { return Ok(()) };
                    let _span = cx.prof.comm(cx.link_id, CommKind::Checkpoint, len);
                    let start_ns = cx.prof.now_ns();
                    for (k, piece) in snap.data[off as usize..(off + len) as usize].chunks(cx.chunk).enumerate() {
                        let at = off + (k * cx.chunk) as u64;
                        let copied = if at == 0 && cx.corrupt.load(Ordering::SeqCst) == snap.iter && !piece.is_empty() {
                            // test hook: a bit flipped on the wire (in a copy: the snapshot stays)
                            let mut msg = ReplicaMsg::encode_chunk(snap.iter, at, piece);
                            msg[CHUNK_HEADER] ^= 0x80;
                            cx.comm.send_bytes(h, TAG_DATA, &msg)?;
                            true
                        } else {
                            // header and payload as one message, the payload sent from the
                            // snapshot where it lies
                            cx.comm.send_bytes_parts(h, TAG_DATA, &[&ReplicaMsg::chunk_header(snap.iter, at), piece])?
                        };
                        if copied {
                            cx.counters.send_pass_bytes.fetch_add(2 * piece.len() as u64, Ordering::Relaxed);
                        }
                        // a campaign's kill in the middle of a replica transfer
                        crate::fault::hit("replica", cx.rank as usize, snap.iter);
                    }
                    let end_ns = cx.prof.now_ns();
                    cx.shared.locked().chunk_log.push(ChunkSpan {
                        snapshot: snap.iter,
                        leftover,
                        link: cx.link_id,
                        start_ns,
                        end_ns,
                    });
                    cx.counters.replica_bytes.fetch_add(len, Ordering::Relaxed);
                    if cx.remote {
                        cx.counters.replica_bytes_inter_host.fetch_add(len, Ordering::Relaxed);
                    }
                    if let Some(c) = cx.counters.replica_bytes_per_link.get(cx.slot) {
                        c.fetch_add(len, Ordering::Relaxed);
                    }
                    let mut r = cx.rate.locked();
                    if let Some(x) = r.get_mut(cx.slot) {
                        x.0 += len as f64;
                        x.1 += end_ns.saturating_sub(start_ns) as f64 * 1e-9;
                    }
                }
                Job::End => {
                    let Some(snap) = cur.take() else { return Ok(()) };
                    if cx.slot != 0 {
                        return Ok(());
                    }
                    cx.first.send_bytes(h, TAG_DATA, &ReplicaMsg::encode_end(snap.iter))?;
                }
            }
            Ok(())
        })();
        cx.counters.replica_send_cpu_ns.fetch_add(thread_cpu_ns().saturating_sub(cpu0), Ordering::Relaxed);
        if let Err(e) = r {
            let mut sh = cx.shared.locked();
            sh.failures.push(format!("replicating to rank {h}: {e}"));
            sh.lost_holders.insert(h);
            return;
        }
    }
}

fn poll_loop(
    comm: &Communicator,
    peer: usize,
    tag: u32,
    stop: &AtomicBool,
    mut on: impl FnMut(RecvBuf) -> Result<()>,
) -> Result<()> {
    let mut h = comm.irecv_bytes(peer, tag)?;
    loop {
        match h.poll_until(Instant::now() + Duration::from_millis(50))? {
            Some(buf) => {
                on(buf)?;
                h = comm.irecv_bytes(peer, tag)?;
            }
            None if stop.load(Ordering::SeqCst) => return Ok(()),
            None => {}
        }
    }
}

/// Verifies and acknowledges the replica of `src` for `iter` once `End` and every byte are
/// in; `ack` is the first link's communicator.
fn finish_if_complete(ack: &Communicator, src: usize, iter: u64, shared: &Mutex<Shared>) -> Result<()> {
    let ok = {
        let mut sh = shared.locked();
        let Some(r) = sh.store.get_mut(&src).and_then(|v| v.iter_mut().rev().find(|r| r.manifest.iter == iter)) else {
            return Ok(());
        };
        if r.done || !r.ended || r.received < r.data.len() as u64 {
            return Ok(());
        }
        r.done = true;
        let (ok, read) = r.verify_rest();
        r.verified = ok;
        sh.recv_pass_bytes += read;
        if !ok {
            sh.failures.push(format!("replica of rank {src} iteration {iter} failed verification"));
        }
        ok
    };
    ack.send_bytes(src, TAG_ACK, &Ack { iter, verified: ok }.encode())?;
    Ok(())
}

/// The most bytes a peer's replica may claim on a rank whose own state is `own` bytes: peers
/// hold states of like size (16x is room for uneven experts), and at least 1 GiB.
pub(crate) fn replica_limit(own: u64) -> u64 {
    own.saturating_mul(16).max(1 << 30)
}

/// What a receiver thread measures: its CPU (added to `cpu` after each message) and, with a
/// clock and the link's profiler index, when each chunk arrived (for the wire accuracy).
#[derive(Clone, Copy)]
pub(crate) struct Meter<'a> {
    pub(crate) cpu: &'a AtomicU64,
    pub(crate) arrived: Option<(&'a Profiler<MonotonicClock>, u32)>,
}

/// Receives what `src` sends on `comm` (one link); acknowledgements go on `ack`.
/// `limit`: the most bytes one replica may claim (see [`replica_limit`]); `meter`: what the
/// thread measures.
pub(crate) fn receive_replicas(
    comm: &Communicator,
    ack: &Communicator,
    src: usize,
    limit: u64,
    shared: &Mutex<Shared>,
    stop: &AtomicBool,
    meter: Meter<'_>,
) {
    let Meter { cpu, arrived } = meter;
    // a replica arrives over many milliseconds: sleep between messages, never poll the
    // sockets on the training cores
    ironweave_transport::set_background_thread(true);
    let mut last = thread_cpu_ns();
    let r = poll_loop(comm, src, TAG_DATA, stop, |msg| {
        // the last byte is in: when, for the wire accuracy
        let in_ns = arrived.map(|(p, _)| p.now_ns());
        let r = receive_msg(ack, src, limit, shared, &msg);
        if let (Some((_, link)), Some(end_ns), Ok(true)) = (arrived, in_ns, &r) {
            let a = Arrival { link, end_ns, len: msg.len().saturating_sub(CHUNK_HEADER) as u64 };
            let mut sh = shared.locked();
            if sh.arrivals.len() < MAX_ARRIVALS {
                sh.arrivals.push(a);
            }
        }
        let now = thread_cpu_ns();
        cpu.fetch_add(now.saturating_sub(last), Ordering::Relaxed);
        last = now;
        r.map(|_| ())
    });
    if let Err(e) = r {
        shared.locked().failures.push(format!("receiving replicas from rank {src}: {e}"));
    }
}

/// One message of a replica stream from `src` as the link delivered it: in one part, or (a
/// chunk striped over several connections) in parts whose payloads land where they lie, never
/// joined first. Returns whether it was a chunk.
fn receive_msg(ack: &Communicator, src: usize, limit: u64, shared: &Mutex<Shared>, msg: &RecvBuf) -> Result<bool> {
    let parts: Vec<(usize, &[u8])> = msg.parts().collect();
    match parts.as_slice() {
        [] => receive_one(ack, src, limit, shared, &[]),
        [(0, one)] => receive_one(ack, src, limit, shared, one),
        [(0, first), ..] if first.len() >= CHUNK_HEADER => {
            let (iter, offset) = ReplicaMsg::decode_chunk_header(src, first)?;
            let payload: Vec<(usize, &[u8])> =
                parts.iter().map(|&(o, b)| if o == 0 { (0, &b[CHUNK_HEADER..]) } else { (o - CHUNK_HEADER, b) }).collect();
            receive_chunk(ack, src, shared, iter, offset, &payload)?;
            Ok(true)
        }
        _ => Err(CkptError::Corrupt { what: format!("message from rank {src}"), detail: "a first part without a header".into() }),
    }
}

/// Lands a chunk of `iter` at `off`, its payload in `parts` (offset in the payload, bytes),
/// checks the checksum chunks it covers, and finishes the replica if it is complete.
fn receive_chunk(
    ack: &Communicator,
    src: usize,
    shared: &Mutex<Shared>,
    iter: u64,
    off: u64,
    parts: &[(usize, &[u8])],
) -> Result<()> {
    let len: usize = parts.iter().map(|p| p.1.len()).sum();
    {
        let mut sh = shared.locked();
        let r = sh.store.get_mut(&src).and_then(|v| v.iter_mut().rev().find(|r| r.manifest.iter == iter && !r.done));
        let Some(r) = r else {
            return Err(CkptError::Corrupt {
                what: format!("chunk from rank {src}"),
                detail: format!("iteration {iter} was not begun"),
            });
        };
        let Some(at) = chunk_range(off, len, r.data.len()) else {
            return Err(CkptError::Corrupt {
                what: format!("chunk from rank {src}"),
                detail: format!("{len} bytes at {off} reach beyond {}", r.data.len()),
            });
        };
        if parts.iter().any(|(o, b)| o + b.len() > len) {
            return Err(CkptError::Corrupt { what: format!("chunk from rank {src}"), detail: "parts overlap".into() });
        }
        let passes = r.land(at, parts);
        sh.recv_pass_bytes += passes;
        sh.recv_bytes += len as u64;
    }
    finish_if_complete(ack, src, iter, shared)
}

/// One message of a replica stream from `src`: a Begin, a chunk landed in its buffer, an End.
/// Returns whether it was a chunk.
fn receive_one(ack: &Communicator, src: usize, limit: u64, shared: &Mutex<Shared>, msg: &[u8]) -> Result<bool> {
    match ReplicaMsg::decode(src, msg, limit)? {
        ReplicaMsg::Begin { manifest: man, keep_from } => {
            let total = man.registry.total as usize;
            let mut sh = shared.locked();
            let reps = sh.store.entry(src).or_default();
            // the same Begin arrives once per link
            if reps.iter().any(|r| r.manifest.iter == man.iter) {
                return Ok(false);
            }
            // Keep the sender's newest committed iteration and the complete ones after it
            // (a recovery may need any of them until a newer one commits), and those still
            // arriving over a slower link (an older one's last chunks may follow a newer
            // Begin); reuse a dropped segment of the right size.
            let mut spare: Option<Segment> = None;
            let mut drop_at = |reps: &mut Vec<Replica>, k: usize| reps.remove(k).release(&mut spare, total);
            while let Some(k) = reps.iter().position(|r| r.done && (!r.verified || r.manifest.iter < keep_from)) {
                drop_at(reps, k);
            }
            // at most one older replica still arriving (a sender that died leaves one behind)
            while reps.iter().filter(|r| !r.done).count() >= 2 {
                let k = reps.iter().position(|r| !r.done).expect("counted");
                drop_at(reps, k);
            }
            // a sender keeps no more itself: more is a peer outside the protocol, bounded here
            while reps.iter().filter(|r| r.verified).count() > KEPT_REPLICAS {
                let k = reps.iter().position(|r| r.verified).expect("counted");
                drop_at(reps, k);
            }
            let data = match spare {
                Some(d) => d,
                None => sh.replica_memory(src, total)?,
            };
            sh.store.entry(src).or_default().push(Replica::arriving(man, data));
        }
        ReplicaMsg::Chunk { iter, offset: off, bytes } => {
            receive_chunk(ack, src, shared, iter, off, &[(0, bytes)])?;
            return Ok(true);
        }
        ReplicaMsg::End { iter } => {
            let known = {
                let mut sh = shared.locked();
                match sh.store.get_mut(&src).and_then(|v| v.iter_mut().rev().find(|r| r.manifest.iter == iter)) {
                    Some(r) => {
                        r.ended = true;
                        true
                    }
                    None => false,
                }
            };
            if known {
                finish_if_complete(ack, src, iter, shared)?;
            } else {
                // an End for nothing begun: say so, the sender's commit must not wait
                ack.send_bytes(src, TAG_ACK, &Ack { iter, verified: false }.encode())?;
            }
        }
    }
    Ok(false)
}

/// Receives `holder`'s acknowledgements.
pub(crate) fn receive_acks(comm: &Communicator, holder: usize, shared: &Mutex<Shared>, stop: &AtomicBool) {
    // a few acknowledgements per iteration: sleep, do not poll
    ironweave_transport::set_background_thread(true);
    let r = poll_loop(comm, holder, TAG_ACK, stop, |msg| {
        let a = Ack::decode(holder, &msg.into_vec())?;
        let mut sh = shared.locked();
        sh.acks.entry(a.iter).or_default().insert(holder, a.verified);
        // keep the table small
        while sh.acks.len() > 64 {
            let first = *sh.acks.keys().next().expect("non-empty");
            sh.acks.remove(&first);
        }
        Ok(())
    });
    if let Err(e) = r {
        let mut sh = shared.locked();
        sh.failures.push(format!("acknowledgements from rank {holder}: {e}"));
        sh.lost_holders.insert(holder);
    }
}

#[cfg(test)]
mod hostile_peers {
    //! A peer sends well-framed but hostile replica messages: each is rejected with a typed error
    //! naming the peer, and nothing is allocated for what it merely claims.
    use super::*;
    use crate::persist::FORMAT;
    use crate::registry::{DType, Registry, TensorSpec};
    use crate::snapshot::ChunkSum;
    use ironweave_transport::{inproc, CommOptions};
    use xxhash_rust::xxh3::xxh3_64;

    fn pair() -> (Communicator, Communicator) {
        let mut v: Vec<Communicator> =
            inproc::world(2).into_iter().map(|l| Communicator::new(vec![l], CommOptions::default()).unwrap()).collect();
        let b = v.pop().unwrap();
        (v.pop().unwrap(), b)
    }

    fn manifest(rank: u32, bytes: u64, sums: Vec<ChunkSum>) -> Manifest {
        let registry = Registry::new(&[TensorSpec::new("w", DType::U8, &[bytes])]).unwrap();
        Manifest {
            format: FORMAT.into(),
            rank,
            world: 2,
            iter: 1,
            registry,
            sums,
            tensor_xxh3: vec![],
            layout: Default::default(),
            job: String::new(),
            mac: String::new(),
            segment: String::new(),
        }
    }

    fn begin(m: &Manifest) -> Vec<u8> {
        ReplicaMsg::encode_begin(m, 0).unwrap()
    }
    use ReplicaMsg as W;
    fn encode_chunk(iter: u64, offset: u64, bytes: &[u8]) -> Vec<u8> {
        W::encode_chunk(iter, offset, bytes)
    }

    /// Rank 1 receives from rank 0 until the messages are consumed (or its receiver stops on an
    /// error); returns what it recorded and rank 0's acknowledgements.
    fn deliver(msgs: Vec<Vec<u8>>, acks: usize) -> (Shared, Vec<Vec<u8>>) {
        let (a, b) = pair();
        let shared = Mutex::new(Shared::default());
        let stop = AtomicBool::new(false);
        let cpu = AtomicU64::new(0);
        let got = std::thread::scope(|s| {
            let rx = s.spawn(|| receive_replicas(&b, &b, 0, 1 << 20, &shared, &stop, Meter { cpu: &cpu, arrived: None }));
            for m in &msgs {
                a.send_bytes(1, TAG_DATA, m).unwrap();
            }
            let got: Vec<Vec<u8>> = (0..acks).map(|_| a.recv_bytes(1, TAG_ACK).unwrap()).collect();
            // let the receiver take what is left, then stop it
            std::thread::sleep(Duration::from_millis(200));
            stop.store(true, Ordering::SeqCst);
            rx.join().unwrap();
            got
        });
        (shared.into_inner().unwrap(), got)
    }

    fn failed_with(sh: &Shared, words: &str) {
        assert!(
            sh.failures.iter().any(|f| f.contains("rank 0") && f.contains(words)),
            "expected a failure naming rank 0 with {words:?}: {:?}",
            sh.failures
        );
    }

    /// A replica of 256 bytes checksummed per 64, landed in pieces that cut the checksum grid.
    fn landed(order: &[(usize, usize)], flip: Option<usize>) -> (bool, u64, u64) {
        let data: Vec<u8> = (0..256u32).map(|i| (i * 7) as u8).collect();
        let sums =
            data.chunks(64).enumerate().map(|(k, d)| ChunkSum { offset: k as u64 * 64, len: 64, xxh3: xxh3_64(d) }).collect();
        let mut r = Replica::arriving(manifest(0, 256, sums), Segment::from(vec![0u8; 256]));
        let mut passes = 0;
        for &(a, b) in order {
            let mut piece = data[a..b].to_vec();
            if let Some(k) = flip.filter(|k| (a..b).contains(k)) {
                piece[k - a] ^= 1;
            }
            // each piece in two parts, as a striped message arrives
            let mid = (b - a) / 2;
            passes += r.land(a..b, &[(0, &piece[..mid]), (mid, &piece[mid..])]);
        }
        let (ok, read) = r.verify_rest();
        (ok, passes, read)
    }

    #[test]
    fn a_replica_is_checked_as_it_lands_even_where_pieces_cut_the_checksum_grid() {
        // in order: every checksum chunk hashed as its bytes land, nothing read again
        assert_eq!(landed(&[(0, 100), (100, 200), (200, 256)], None), (true, 512, 0));
        // out of order: the chunks whose start arrived late are read once more at the end
        let (ok, passes, read) = landed(&[(100, 200), (0, 100), (200, 256)], None);
        assert!(ok && passes == 512 && read > 0 && read < 256, "{read}");
        // a flipped bit in either case is caught
        assert!(!landed(&[(0, 100), (100, 200), (200, 256)], Some(130)).0);
        assert!(!landed(&[(100, 200), (0, 100), (200, 256)], Some(70)).0);
    }

    #[test]
    fn an_absurd_size_is_refused_before_allocating() {
        // 1 TiB claimed: over the holder's limit, nothing stored
        let (sh, _) = deliver(vec![begin(&manifest(0, 1 << 40, vec![]))], 0);
        failed_with(&sh, "over this holder's limit");
        assert!(sh.store.values().all(|v| v.is_empty()));
    }

    #[test]
    fn a_layout_that_does_not_follow_from_its_shapes_is_refused() {
        let mut m = manifest(0, 64, vec![]);
        m.registry.total = 1 << 20;
        let (sh, _) = deliver(vec![begin(&m)], 0);
        failed_with(&sh, "do not follow from the shapes");
        let (sh, _) = deliver(vec![begin(&manifest(1, 64, vec![]))], 0);
        failed_with(&sh, "says it is rank 1's");
    }

    #[test]
    fn chunks_out_of_place_are_refused() {
        // a chunk of an iteration never begun
        let (sh, _) = deliver(vec![encode_chunk(9, 0, &[1, 2, 3])], 0);
        failed_with(&sh, "iteration 9 was not begun");
        // a chunk beyond the replica's end
        let m = manifest(0, 64, vec![]);
        let (sh, _) = deliver(vec![begin(&m), encode_chunk(1, 60, &[0; 16])], 0);
        failed_with(&sh, "reach beyond 64");
        // an offset chosen to wrap around
        let (sh, _) = deliver(vec![begin(&m), encode_chunk(1, u64::MAX - 3, &[0; 16])], 0);
        failed_with(&sh, "reach beyond 64");
        // a header too short, an unknown kind
        let (sh, _) = deliver(vec![vec![1, 1, 2]], 0);
        failed_with(&sh, "short header");
        let (sh, _) = deliver(vec![vec![77]], 0);
        failed_with(&sh, "unknown kind");
    }

    #[test]
    fn a_checksum_for_other_data_is_answered_not_verified() {
        let data = vec![7u8; 64];
        let other = vec![8u8; 64];
        let m = manifest(0, 64, vec![ChunkSum { offset: 0, len: 64, xxh3: xxh3_64(&other) }]);
        let end = W::encode_end(1);
        let (sh, acks) = deliver(vec![begin(&m), encode_chunk(1, 0, &data), end], 1);
        assert_eq!(acks, vec![[1u64.to_le_bytes().as_slice(), &[0]].concat()], "the holder must say it holds no valid copy");
        failed_with(&sh, "failed verification");
        assert!(sh.store[&0].iter().all(|r| !r.verified));
    }

    #[test]
    fn a_malformed_acknowledgement_loses_the_holder_not_the_job() {
        for bad in [vec![1u8, 2, 3], [5u64.to_le_bytes().as_slice(), &[7]].concat(), vec![0; 64]] {
            let (a, b) = pair();
            let shared = Mutex::new(Shared::default());
            let stop = AtomicBool::new(false);
            std::thread::scope(|s| {
                // rank 0 hears holder 1's acknowledgements
                let rx = s.spawn(|| receive_acks(&a, 1, &shared, &stop));
                b.send_bytes(0, TAG_ACK, &bad).unwrap();
                // the receiver stops on its own at the bad message; `stop` is a backstop
                let t0 = Instant::now();
                while !rx.is_finished() && t0.elapsed() < Duration::from_secs(5) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                stop.store(true, Ordering::SeqCst);
                rx.join().unwrap();
            });
            let sh = shared.into_inner().unwrap();
            assert!(sh.failures.iter().any(|f| f.contains("acknowledgement from rank 1")), "{:?}", sh.failures);
            assert!(sh.lost_holders.contains(&1) && sh.acks.is_empty(), "nothing acknowledged by a malformed message");
        }
    }
}

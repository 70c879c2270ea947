//! Host snapshots in a few warm buffers: the state is copied after the optimizer step, by
//! several threads, into a buffer that holds no iteration the caller must keep (the newest
//! committed one and those after it: one may still be on its way to the replicas, one may be
//! the only copy a recovery finds).

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::{CkptError, Result};
use crate::registry::Registry;
use crate::segment::Segment;

/// Checksum of one chunk of a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkSum {
    /// Offset in the snapshot.
    pub offset: u64,
    /// Length.
    pub len: u64,
    /// xxh3-64 of the bytes.
    pub xxh3: u64,
}

/// One iteration's state in host memory.
#[derive(Debug)]
pub struct Snapshot {
    /// Iteration whose optimizer step produced the state.
    pub iter: u64,
    /// Layout.
    pub registry: Arc<Registry>,
    /// The bytes, laid out as the registry says (heap memory, or a segment of the keep
    /// directory: then the snapshot is the kept copy itself).
    pub data: Segment,
    /// Checksums of fixed-size chunks, computed on first use: off the training thread's
    /// critical path (the replication thread or the persistent writer computes them).
    sums: std::sync::OnceLock<Vec<ChunkSum>>,
    sum_chunk: u64,
}

impl Snapshot {
    /// A snapshot of `data` laid out as `registry`, its checksums computed on first use.
    pub fn new(iter: u64, registry: Arc<Registry>, data: impl Into<Segment>) -> Self {
        Snapshot { iter, registry, data: data.into(), sums: std::sync::OnceLock::new(), sum_chunk: 256 << 10 }
    }

    /// A snapshot whose checksums are already known (received or loaded).
    pub fn with_sums(iter: u64, registry: Arc<Registry>, data: impl Into<Segment>, sums: Vec<ChunkSum>) -> Self {
        let sum_chunk = sums.first().map(|c| c.len).unwrap_or(256 << 10).max(1);
        Snapshot { iter, registry, data: data.into(), sums: sums.into(), sum_chunk }
    }

    /// Checksums of the data in `sum_chunk`-byte pieces (computed once).
    pub fn sums(&self) -> &[ChunkSum] {
        self.sums.get_or_init(|| {
            let c = self.sum_chunk as usize;
            self.data
                .chunks(c)
                .enumerate()
                .map(|(k, d)| ChunkSum { offset: (k * c) as u64, len: d.len() as u64, xxh3: xxh3_64(d) })
                .collect()
        })
    }

    /// The bytes of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&[u8]> {
        let t = self.registry.get(name)?;
        self.data.get(t.offset as usize..(t.offset + t.len) as usize)
    }

    /// Verify `data` against `sums` (both supplied: used for replicas and files too).
    pub fn verify(data: &[u8], sums: &[ChunkSum], what: &str) -> Result<()> {
        let mut end = 0u64;
        for (i, c) in sums.iter().enumerate() {
            if c.offset != end {
                return Err(CkptError::Corrupt {
                    what: what.into(),
                    detail: format!("chunk {i} starts at {} instead of {end}", c.offset),
                });
            }
            let stop = c.offset.saturating_add(c.len);
            let Some(bytes) = usize::try_from(stop).ok().and_then(|e| data.get(c.offset as usize..e)) else {
                return Err(CkptError::Corrupt {
                    what: what.into(),
                    detail: format!("chunk {i} ({}..{stop}) beyond the {} bytes present", c.offset, data.len()),
                });
            };
            if xxh3_64(bytes) != c.xxh3 {
                return Err(CkptError::Corrupt {
                    what: what.into(),
                    detail: format!("checksum of chunk {i} (bytes {}..{}) differs", c.offset, c.offset + c.len),
                });
            }
            end = stop;
        }
        if end != data.len() as u64 {
            return Err(CkptError::Corrupt {
                what: what.into(),
                detail: format!("{} bytes present, checksums cover {end}", data.len()),
            });
        }
        Ok(())
    }
}

/// Buffers an engine keeps at most: the newest committed iteration, the one being replicated
/// and the one being taken (see [`SnapshotBuffers::take`]).
pub const SNAPSHOT_BUFFERS: usize = 3;

/// Up to [`SNAPSHOT_BUFFERS`] warm snapshot buffers and the copy engine. Snapshots are shared
/// (`Arc`) with the threads that replicate them; a buffer is refilled only when nobody holds
/// it any more (`take` waits, up to `wait`) and its iteration is older than the one the caller
/// keeps.
///
/// With a segment directory ([`SnapshotBuffers::set_segment_dir`]) the buffers are files of the
/// keep directory mapped shared (`own-K.seg`): a snapshot is then the kept copy itself, and a
/// manifest that names its segment ([`SnapshotBuffers::claim`]) is removed before the segment
/// is refilled.
#[derive(Debug)]
pub struct SnapshotBuffers {
    slots: [Option<Arc<Snapshot>>; SNAPSHOT_BUFFERS],
    /// Buffers [`SnapshotBuffers::prepare`] allocated and touched, for the slots' first use.
    spare: Vec<Segment>,
    threads: usize,
    chunk: u64,
    wait: std::time::Duration,
    /// Where segments are made (none: heap buffers).
    dir: Option<std::path::PathBuf>,
    /// Segment files not to be made anew: claimed by kept manifests this process did not adopt.
    reserved: std::collections::BTreeSet<std::path::PathBuf>,
    /// Segment file → the manifest that names it (removed before the segment is refilled).
    claims: std::collections::BTreeMap<std::path::PathBuf, std::path::PathBuf>,
}

impl SnapshotBuffers {
    /// `threads` copy threads (0: all cores), checksums over `chunk`-byte pieces.
    pub fn new(threads: usize, chunk: u64) -> Self {
        let threads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        SnapshotBuffers {
            slots: Default::default(),
            spare: Vec::new(),
            threads,
            chunk: chunk.max(4096),
            wait: std::time::Duration::from_secs(300),
            dir: None,
            reserved: Default::default(),
            claims: Default::default(),
        }
    }

    /// Makes every buffer from now on a segment file in `dir` (`own-K.seg`, 0600), skipping the
    /// files in `reserved` (named by kept manifests not adopted: another layout's copies, kept
    /// for the user to see).
    pub fn set_segment_dir(&mut self, dir: std::path::PathBuf, reserved: std::collections::BTreeSet<std::path::PathBuf>) {
        self.dir = Some(dir);
        self.reserved = reserved;
    }

    /// The manifest `manifest` names the segment of the held snapshot of `iter`: it is removed
    /// before that segment is refilled (a restarted process never finds a manifest over bytes
    /// of another iteration). Returns whether `iter` is held in a segment.
    pub fn claim(&mut self, iter: u64, manifest: std::path::PathBuf) -> bool {
        let Some(p) = self.get(iter).and_then(|s| s.data.path()).map(|p| p.to_path_buf()) else { return false };
        self.claims.insert(p, manifest);
        true
    }

    /// Moves the held snapshot of `iter` into a segment if it is in heap memory (a state
    /// restored from a peer or a file) and segments are made: it can then be kept. Returns
    /// the snapshot as held (none: `iter` is not held).
    pub fn settle(&mut self, iter: u64) -> Result<Option<Arc<Snapshot>>> {
        let Some(k) = self.slots.iter().position(|s| s.as_ref().is_some_and(|s| s.iter == iter)) else { return Ok(None) };
        let held = self.slots[k].clone().expect("found");
        if self.dir.is_none() || held.data.path().is_some() {
            return Ok(Some(held));
        }
        // a spare no kept manifest names, else a new segment (a kept copy of an older
        // iteration stays: it is the fallback while this one is written)
        let free = |v: &Segment| v.len() == held.data.len() && v.path().is_none_or(|p| !self.claims.contains_key(p));
        let mut seg = match self.spare.iter().position(free) {
            Some(i) => self.spare.swap_remove(i),
            None => self.fresh(held.data.len() as u64)?,
        };
        self.unclaim(&seg)?;
        seg.copy_from_slice(&held.data);
        let moved = Arc::new(Snapshot::with_sums(iter, held.registry.clone(), seg, held.sums().to_vec()));
        self.slots[k] = Some(moved.clone());
        Ok(Some(moved))
    }

    /// Removes the manifest claiming `seg`, if any (before it is written).
    fn unclaim(&mut self, seg: &Segment) -> Result<()> {
        if let Some(m) = seg.path().and_then(|p| self.claims.remove(p)) {
            match std::fs::remove_file(&m) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(CkptError::io(&m, e)),
                _ => {}
            }
        }
        Ok(())
    }

    /// A buffer of `bytes`: a new segment file (a name no held, spare or reserved segment
    /// has), else heap memory; every page touched.
    fn fresh(&self, bytes: u64) -> Result<Segment> {
        let Some(dir) = &self.dir else { return Ok(Segment::heap(bytes as usize)) };
        let used: std::collections::BTreeSet<&std::path::Path> =
            self.slots.iter().flatten().filter_map(|s| s.data.path()).chain(self.spare.iter().filter_map(|s| s.path())).collect();
        Segment::create_free(dir, "own", bytes as usize, |p| used.contains(p) || self.reserved.contains(p))
    }

    /// Allocates `buffers` (at most [`SNAPSHOT_BUFFERS`]) buffers of `bytes` and touches every
    /// page now, for the snapshots to come. Without it a slot's first snapshot pays the page
    /// faults of a fresh buffer inside the training step: measured on the emulated beds, 8
    /// ranks' first use of a 147 MB buffer stalled the step 1.7–2.4 s, at the second and
    /// third snapshot of a run (and at every fourth iteration's under capricorn-sparse).
    pub fn prepare(&mut self, buffers: usize, bytes: u64) -> Result<()> {
        let want = buffers.min(SNAPSHOT_BUFFERS).saturating_sub(self.slots.iter().flatten().count());
        let (keep, other): (Vec<Segment>, Vec<Segment>) =
            std::mem::take(&mut self.spare).into_iter().partition(|v| v.len() as u64 == bytes);
        self.spare = keep;
        for s in other {
            self.discard(s);
        }
        while self.spare.len() < want {
            let s = self.fresh(bytes)?;
            self.spare.push(s);
        }
        Ok(())
    }

    /// Buffers prepared and not yet used by a slot.
    pub fn spare_buffers(&self) -> usize {
        self.spare.len()
    }

    /// How long `take` waits for a buffer still being replicated.
    pub fn set_wait(&mut self, wait: std::time::Duration) {
        self.wait = wait;
    }

    /// The slot `take` would fill when iterations from `keep_from` on must be kept: a held
    /// buffer nobody else uses (the oldest), else an empty slot, else a held buffer still in
    /// use (the oldest: `take` waits for it); `None` when every slot holds an iteration to keep.
    fn slot_for(&self, keep_from: u64) -> Option<usize> {
        let reusable = |k: &usize| self.slots[*k].as_ref().is_some_and(|s| s.iter < keep_from);
        let oldest = |ks: Vec<usize>| ks.into_iter().min_by_key(|&k| self.slots[k].as_ref().map_or(0, |s| s.iter));
        let all: Vec<usize> = (0..SNAPSHOT_BUFFERS).collect();
        oldest(
            all.iter()
                .copied()
                .filter(reusable)
                .filter(|&k| self.slots[k].as_ref().is_some_and(|s| Arc::strong_count(s) == 1))
                .collect(),
        )
        .or_else(|| all.iter().copied().find(|&k| self.slots[k].is_none()))
        .or_else(|| oldest(all.iter().copied().filter(reusable).collect()))
    }

    /// Whether [`SnapshotBuffers::take`] has a buffer when iterations from `keep_from` on must
    /// be kept.
    pub fn can_take(&self, keep_from: u64) -> bool {
        self.slot_for(keep_from).is_some()
    }

    /// Copy the state after iteration `iter`'s optimizer step into a buffer whose iteration is
    /// older than `keep_from` (0: keep every held iteration; `u64::MAX`: keep none), computing
    /// each chunk's checksum as it is copied (the chunk is still in cache: one pass over the
    /// state). Fails when there is none ([`SnapshotBuffers::can_take`] says so first) or when
    /// the one to refill is still being replicated after the wait.
    pub fn take(&mut self, iter: u64, keep_from: u64, registry: &Arc<Registry>, bufs: &[&[u8]]) -> Result<Arc<Snapshot>> {
        registry.check(bufs)?;
        let Some(slot) = self.slot_for(keep_from) else {
            let held: Vec<u64> = self.held().map(|s| s.iter).collect();
            return Err(CkptError::Invalid(format!(
                "no snapshot buffer for iteration {iter}: every buffer holds an iteration to keep ({held:?}, from {keep_from} on)"
            )));
        };
        let deadline = std::time::Instant::now() + self.wait;
        let mut arc = self.slots[slot].take().unwrap_or_else(|| {
            Arc::new(Snapshot {
                iter,
                registry: registry.clone(),
                data: Segment::default(),
                sums: Default::default(),
                sum_chunk: 0,
            })
        });
        loop {
            match Arc::get_mut(&mut arc) {
                Some(_) => break,
                None if std::time::Instant::now() < deadline => std::thread::sleep(std::time::Duration::from_micros(200)),
                None => {
                    let held = arc.iter;
                    self.slots[slot] = Some(arc);
                    return Err(CkptError::Invalid(format!(
                        "snapshot buffer of iteration {held} is still being replicated after {:?}; the network cannot keep up with one checkpoint per iteration",
                        self.wait
                    )));
                }
            }
        }
        let total = registry.total as usize;
        {
            let snap = Arc::get_mut(&mut arc).expect("unique");
            if snap.data.len() != total {
                // first use (or new layout): a prepared buffer, else a fresh one; later
                // snapshots reuse it warm
                snap.data = match self.spare.iter().position(|v| v.len() == total) {
                    Some(k) => self.spare.swap_remove(k),
                    None => match self.fresh(total as u64) {
                        Ok(s) => s,
                        Err(e) => {
                            self.slots[slot] = None;
                            return Err(e);
                        }
                    },
                };
            }
        }
        // a kept manifest over these bytes goes before they change
        if let Err(e) = self.unclaim(&arc.data) {
            self.slots[slot] = Some(arc);
            return Err(e);
        }
        let snap = Arc::get_mut(&mut arc).expect("unique");
        snap.iter = iter;
        snap.registry = registry.clone();
        let chunk = self.chunk as usize;
        let n_chunks = total.div_ceil(chunk);
        snap.sum_chunk = self.chunk;
        // Source pieces: (dst offset, src slice), in order.
        let pieces: Vec<(usize, &[u8])> = registry.tensors.iter().zip(bufs).map(|(t, b)| (t.offset as usize, *b)).collect();
        let copy_range = |dst: &mut [u8], base: usize| {
            // copy every source byte that falls in [base, base + dst.len())
            let end = base + dst.len();
            let first = pieces.partition_point(|(off, b)| off + b.len() <= base);
            for (off, src) in &pieces[first..] {
                if *off >= end {
                    break;
                }
                let a = base.max(*off);
                let b = end.min(off + src.len());
                dst[a - base..b - base].copy_from_slice(&src[a - off..b - off]);
            }
        };
        let threads = self.threads.min(n_chunks.max(1));
        let per = n_chunks.div_ceil(threads.max(1)).max(1);
        let sums: Vec<ChunkSum> = std::thread::scope(|s| {
            let mut data_rest: &mut [u8] = &mut snap.data;
            let mut base = 0usize;
            let mut handles = Vec::new();
            for _ in 0..threads {
                let bytes = (per * chunk).min(data_rest.len());
                if bytes == 0 {
                    break;
                }
                let (d, dr) = std::mem::take(&mut data_rest).split_at_mut(bytes);
                data_rest = dr;
                let my_base = base;
                base += bytes;
                let copy_range = &copy_range;
                handles.push(s.spawn(move || {
                    d.chunks_mut(chunk)
                        .enumerate()
                        .map(|(k, dchunk)| {
                            let at = my_base + k * chunk;
                            copy_range(dchunk, at);
                            // the piece was just written: hashing it reads the cache, not memory
                            ChunkSum { offset: at as u64, len: dchunk.len() as u64, xxh3: xxh3_64(dchunk) }
                        })
                        .collect::<Vec<ChunkSum>>()
                }));
            }
            handles.into_iter().flat_map(|h| h.join().expect("a copy thread panicked")).collect()
        });
        snap.sums = sums.into();
        self.slots[slot] = Some(arc.clone());
        self.trim_spare();
        Ok(arc)
    }

    /// Never more prepared buffers than empty slots to fill.
    fn trim_spare(&mut self) {
        let empty = self.slots.iter().filter(|s| s.is_none()).count();
        // segments holding a kept copy go last
        self.spare.sort_by_key(|s| s.path().is_some_and(|p| self.claims.contains_key(p)));
        while self.spare.len() > empty {
            let s = self.spare.remove(0);
            self.discard(s);
        }
    }

    /// Lets go of `seg` for good: its file is removed, unless a kept manifest names it (a
    /// committed iteration's copy a restart may need): that one stays on disk, reserved.
    fn discard(&mut self, seg: Segment) {
        match seg.path().filter(|p| self.claims.contains_key(*p)) {
            Some(p) => {
                let p = p.to_path_buf();
                self.claims.remove(&p);
                self.reserved.insert(p);
            }
            None => seg.discard(),
        }
    }

    /// The newest snapshot.
    pub fn latest(&self) -> Option<&Arc<Snapshot>> {
        self.slots.iter().flatten().max_by_key(|s| s.iter)
    }

    /// The snapshot of iteration `iter`, if still held.
    pub fn get(&self, iter: u64) -> Option<&Arc<Snapshot>> {
        self.slots.iter().flatten().find(|s| s.iter == iter)
    }

    /// All held snapshots.
    pub fn held(&self) -> impl Iterator<Item = &Arc<Snapshot>> {
        self.slots.iter().flatten()
    }

    /// Drop every held snapshot (e.g. after restoring an older iteration); the buffers nobody
    /// else holds are kept, warm, for the next snapshots.
    pub fn clear(&mut self) {
        // a buffer nobody else holds stays warm for the next snapshots
        for slot in &mut self.slots {
            if let Some(snap) = slot.take() {
                if let Ok(s) = Arc::try_unwrap(snap) {
                    if !s.data.is_empty() {
                        self.spare.push(s.data);
                    }
                }
            }
        }
    }

    /// Hold `snap` (a restored state: the copy of the committed iteration this rank keeps
    /// until a newer one commits) in place of every held snapshot.
    pub fn adopt(&mut self, snap: Arc<Snapshot>) {
        self.clear();
        self.slots[0] = Some(snap);
        self.trim_spare();
    }

    /// Hold `snaps` (copies adopted from the keep directory) in place of every held snapshot,
    /// the newest first as far as the buffers go.
    pub fn adopt_all(&mut self, mut snaps: Vec<Arc<Snapshot>>) {
        self.clear();
        snaps.sort_by_key(|s| std::cmp::Reverse(s.iter));
        for (slot, s) in self.slots.iter_mut().zip(snaps) {
            *slot = Some(s);
        }
        self.trim_spare();
    }

    /// Test hook: flip one byte of a held snapshot (simulates memory corruption).
    #[doc(hidden)]
    pub fn corrupt_for_test(&mut self, iter: u64, offset: usize) -> bool {
        for s in self.slots.iter_mut().flatten() {
            if s.iter == iter {
                if let Some(s) = Arc::get_mut(s) {
                    if let Some(b) = s.data.get_mut(offset) {
                        *b ^= 0x01;
                        return true;
                    }
                }
            }
        }
        false
    }
}

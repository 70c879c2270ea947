//! The communicator: one rank's view of a group, point-to-point and collectives.
//!
//! Collectives are written once over a link's point-to-point operations. Large messages use
//! ring algorithms (bandwidth-optimal, chunks pipelined in segments so reduction overlaps the
//! network); small ones use recursive doubling or a binomial tree (latency-optimal). Any error
//! inside a collective aborts the link, at every peer, so nobody waits for a partner that will
//! never send: a failed collective leaves the communicator unusable, as in NCCL.

mod balance;
mod nonblocking;
mod stripe;

pub use nonblocking::CollHandle;

use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::dtype::{finish_avg, reduce_into, DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::link::{Buf, BufMut, Link, LinkInfo, MemKind, NativeCollectives, RecvBuf, RecvHandle, SendHandle, Tag};

/// Default deadline of every blocking call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Tunables of a communicator.
#[derive(Debug, Clone, PartialEq)]
pub struct CommOptions {
    /// Deadline of each blocking call (send, receive, collective).
    pub timeout: Duration,
    /// Messages up to this many bytes use the latency-optimal algorithms.
    pub small_bytes: usize,
    /// Ring chunks travel in segments of this many bytes, so reduction overlaps transfer.
    pub segment_bytes: usize,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions { timeout: DEFAULT_TIMEOUT, small_bytes: 64 * 1024, segment_bytes: 1 << 20 }
    }
}

impl CommOptions {
    /// Options from the environment: `IRONWEAVE_TIMEOUT_S` (seconds, fractional allowed),
    /// `IRONWEAVE_SMALL_BYTES`, `IRONWEAVE_SEGMENT_BYTES`.
    pub fn from_env() -> Result<Self> {
        let mut o = CommOptions::default();
        if let Ok(v) = std::env::var("IRONWEAVE_TIMEOUT_S") {
            let secs: f64 = v
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s > 0.0)
                .ok_or_else(|| Error::Config(format!("IRONWEAVE_TIMEOUT_S={v:?} is not a positive number of seconds")))?;
            o.timeout = Duration::from_secs_f64(secs);
        }
        for (key, slot) in [("IRONWEAVE_SMALL_BYTES", &mut o.small_bytes), ("IRONWEAVE_SEGMENT_BYTES", &mut o.segment_bytes)] {
            if let Ok(v) = std::env::var(key) {
                *slot = v
                    .trim()
                    .parse()
                    .ok()
                    .filter(|&b: &usize| b > 0)
                    .ok_or_else(|| Error::Config(format!("{key}={v:?} is not a positive number of bytes")))?;
            }
        }
        Ok(o)
    }
}

const COLL_BIT: u64 = 1 << 31;
/// The largest user tag for point-to-point messages.
pub const MAX_USER_TAG: u32 = (1 << 31) - 1;

fn mix(a: u32, b: u64) -> u32 {
    // FNV-1a over the 12 bytes; context ids only need to differ, not to be secret.
    let mut h: u32 = 0x811c_9dc5;
    for byte in a.to_le_bytes().into_iter().chain(b.to_le_bytes()) {
        h ^= u32::from(byte);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// One rank's view of a group of ranks over one or more links.
///
/// `Communicator` is `Send + Sync`; collectives on one communicator must be called in the same
/// order by every member, from one thread at a time. Views on different links
/// ([`Communicator::on_link`]) may run collectives concurrently.
#[derive(Debug)]
pub struct Communicator {
    pub(crate) links: Arc<[Arc<dyn Link>]>,
    link: usize,
    pub(crate) members: Arc<[usize]>,
    pub(crate) me: usize,
    ctx: u32,
    splits: AtomicU32,
    pub(crate) opts: CommOptions,
    /// How collectives are split over all links, when they are (see `stripe.rs`).
    pub(crate) stripe: Option<Arc<stripe::Stripe>>,
    /// The thread that runs non-blocking collectives, started on first use (`nonblocking.rs`).
    pub(crate) nb: std::sync::OnceLock<Result<nonblocking::CollExecutor>>,
    /// The intra-host channel this communicator claimed (decided on first use).
    shm_chan: std::sync::OnceLock<Option<usize>>,
    /// The intra-host shared-memory group of the first link's whole world, where the backend
    /// set one up ([`Communicator::with_intra_host`]): given when the world communicator is
    /// built, carried by its views, dups and splits.
    intra: Option<Arc<crate::shm::ShmGroup>>,
}

impl Communicator {
    /// The world communicator over `links` (all over the same world; the first is active).
    pub fn new(links: Vec<Arc<dyn Link>>, opts: CommOptions) -> Result<Self> {
        let first = links.first().ok_or_else(|| Error::InvalidArgument("a communicator needs at least one link".into()))?;
        let (rank, size) = (first.rank(), first.size());
        if let Some(l) = links.iter().find(|l| l.rank() != rank || l.size() != size) {
            return Err(Error::InvalidArgument(format!(
                "link {:?} is rank {} of {} but the first link is rank {rank} of {size}",
                l.info().name,
                l.rank(),
                l.size()
            )));
        }
        Ok(Communicator {
            links: links.into(),
            link: 0,
            members: (0..size).collect::<Vec<_>>().into(),
            me: rank,
            ctx: 1,
            splits: AtomicU32::new(0),
            opts,
            stripe: None,
            nb: std::sync::OnceLock::new(),
            shm_chan: std::sync::OnceLock::new(),
            intra: None,
        })
    }

    /// The world communicator with the intra-host shared-memory path of its first link's
    /// whole world (every rank on one host): its host collectives, and those of its views and
    /// dups on that link, take it.
    pub fn with_intra_host(mut self, g: Option<Arc<crate::shm::ShmGroup>>) -> Self {
        self.intra = g;
        self
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.me
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// World rank of group rank `r`.
    pub fn world_rank(&self, r: usize) -> usize {
        self.members[r]
    }

    /// The options in force.
    pub fn options(&self) -> &CommOptions {
        &self.opts
    }

    /// Changes the deadline of every later blocking call.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.opts.timeout = timeout;
    }

    /// Information on every link, in order; [`Communicator::active_link`] is the one in use.
    pub fn links(&self) -> Vec<LinkInfo> {
        self.links.iter().map(|l| l.info().clone()).collect()
    }

    /// Index of the link this view uses.
    pub fn active_link(&self) -> usize {
        self.link
    }

    /// The same group on link `i`, with its own tag space: collectives on two views over
    /// two links may run at the same time from two threads.
    pub fn on_link(&self, i: usize) -> Result<Communicator> {
        self.view(i, 0xffff_0000)
    }

    /// The same group bound to link `i`, unstriped, in a tag space derived from `salt`.
    pub(crate) fn view(&self, i: usize, salt: u64) -> Result<Communicator> {
        if i >= self.links.len() {
            return Err(Error::InvalidArgument(format!("link index {i} but the communicator has {} links", self.links.len())));
        }
        let mut c = self.derived(i, self.members.clone(), self.me, mix(self.ctx, salt + i as u64));
        c.stripe = None;
        Ok(c)
    }

    /// A communicator over this one's links and options with its own tag space `ctx`: no
    /// collective thread or shared-memory channel yet (each view starts its own), the
    /// striping and the intra-host group kept.
    fn derived(&self, link: usize, members: Arc<[usize]>, me: usize, ctx: u32) -> Communicator {
        Communicator {
            links: self.links.clone(),
            link,
            members,
            me,
            ctx,
            splits: AtomicU32::new(0),
            opts: self.opts.clone(),
            stripe: self.stripe.clone(),
            nb: std::sync::OnceLock::new(),
            shm_chan: std::sync::OnceLock::new(),
            intra: self.intra.clone(),
        }
    }

    pub(crate) fn l(&self) -> &dyn Link {
        &*self.links[self.link]
    }

    /// The intra-host shared-memory path, for a communicator over the whole world (in world
    /// order) on the first link when the backend set one up: each such communicator (the world,
    /// its views and dups) gets a channel of its own, since they may run collectives from
    /// different threads at once. Sub-groups, striped views, and communicators beyond the
    /// segment's channels keep to the link.
    fn shm(&self) -> Option<crate::shm::Chan<'_>> {
        if self.link != 0 || self.stripe.is_some() {
            return None;
        }
        let g = self.intra.as_deref()?;
        let ch = *self.shm_chan.get_or_init(|| {
            let whole = g.size() == self.size() && g.rank() == self.me && self.members.iter().enumerate().all(|(i, &m)| i == m);
            whole.then(|| g.channel(self.ctx).map(|c| c.index())).flatten()
        });
        ch.map(|i| g.chan_at(i))
    }

    /// Whether this communicator's host collectives take the intra-host shared-memory path.
    pub fn uses_shared_memory(&self) -> bool {
        self.shm().is_some()
    }

    /// Collectives this rank has run through the intra-host path (of every communicator on
    /// the link), or `None` where the link has none.
    pub fn shared_memory_collectives(&self) -> Option<u64> {
        self.intra.as_ref().map(|g| g.collectives_run())
    }

    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.opts.timeout
    }

    fn user_tag(&self, tag: u32) -> Result<Tag> {
        if tag > MAX_USER_TAG {
            return Err(Error::InvalidArgument(format!("tag {tag} exceeds the largest user tag {MAX_USER_TAG}")));
        }
        Ok(Tag((u64::from(self.ctx) << 32) | u64::from(tag)))
    }

    pub(crate) fn coll_tag(&self) -> Tag {
        Tag((u64::from(self.ctx) << 32) | COLL_BIT)
    }

    fn peer(&self, r: usize) -> Result<usize> {
        self.members.get(r).copied().ok_or(Error::RankOutOfRange { rank: r, size: self.members.len() })
    }

    // ---------------------------------------------------------------- point to point

    /// Sends bytes to group rank `peer` with a user tag; returns when `data` may be reused.
    pub fn send_bytes(&self, peer: usize, tag: u32, data: &[u8]) -> Result<()> {
        self.l().send(self.peer(peer)?, self.user_tag(tag)?, data, self.deadline())
    }

    /// Sends the concatenation of `parts` to group rank `peer` as one message with a user tag
    /// (the receiver sees one message); returns whether the link copied them into one buffer
    /// first ([`Link::send_parts`]).
    pub fn send_bytes_parts(&self, peer: usize, tag: u32, parts: &[&[u8]]) -> Result<bool> {
        self.l().send_parts(self.peer(peer)?, self.user_tag(tag)?, parts, self.deadline())
    }

    /// Receives the next message from `peer` on `tag`.
    pub fn recv_bytes(&self, peer: usize, tag: u32) -> Result<Vec<u8>> {
        Ok(self.irecv_bytes(peer, tag)?.wait(self.deadline())?.into_vec())
    }

    /// Starts sending an owned buffer; the handle returns it.
    pub fn isend_bytes(&self, peer: usize, tag: u32, data: Vec<u8>) -> Result<SendHandle> {
        self.l().isend(self.peer(peer)?, self.user_tag(tag)?, data)
    }

    /// Posts a receive; wait on the handle with [`Communicator::deadline_from_now`].
    pub fn irecv_bytes(&self, peer: usize, tag: u32) -> Result<RecvHandle> {
        self.l().irecv(self.peer(peer)?, self.user_tag(tag)?)
    }

    /// The deadline a blocking call started now would have.
    pub fn deadline_from_now(&self) -> Instant {
        self.deadline()
    }

    /// Sends typed elements (split over all links on a striped communicator).
    pub fn send<T: Element>(&self, peer: usize, tag: u32, data: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        match self.stripe_plan(bytes.len()) {
            Some(Ok(())) => self.striped_send(peer, tag, bytes),
            _ => self.send_bytes(peer, tag, bytes),
        }
    }

    /// Receives exactly `out.len()` elements; a message of another length is an error.
    pub fn recv<T: Element>(&self, peer: usize, tag: u32, out: &mut [T]) -> Result<()> {
        let dst: &mut [u8] = bytemuck::cast_slice_mut(out);
        if let Some(Ok(())) = self.stripe_plan(dst.len()) {
            return self.striped_recv(peer, tag, dst);
        }
        let (src, tag) = (self.peer(peer)?, self.user_tag(tag)?);
        // SAFETY: `dst` is borrowed mutably for this whole call and only written through the
        // zone; the handle is consumed by `wait_exact` (whose drop on failure withdraws the
        // zone and waits for a writer in progress) before we return.
        let h = unsafe { self.l().irecv_into(src, tag, dst.as_mut_ptr(), dst.len()) }?;
        let m = wait_exact(h, "recv", peer, dst.len(), self.deadline())?;
        if !m.is_landed() {
            m.copy_to(dst);
        }
        Ok(())
    }

    // ---------------------------------------------------------------- helpers

    /// Runs a collective; on failure, aborts the link so that peers fail fast too.
    pub(crate) fn guarded<R>(&self, op: &str, f: impl FnOnce(Instant) -> Result<R>) -> Result<R> {
        let r = f(self.deadline());
        if let Err(e) = &r {
            if !from_peer(e) {
                self.l().abort(&format!("{op} failed on rank {}: {e}", self.world_rank(self.me)));
            }
        }
        r
    }

    pub(crate) fn csend(&self, peer: usize, data: &[u8], dl: Instant) -> Result<()> {
        self.l().send(self.members[peer], self.coll_tag(), data, dl)
    }

    pub(crate) fn cpost(&self, peer: usize) -> Result<RecvHandle> {
        self.l().irecv(self.members[peer], self.coll_tag())
    }

    fn crecv_exact(&self, op: &'static str, peer: usize, expected: usize, dl: Instant) -> Result<RecvBuf> {
        wait_exact(self.cpost(peer)?, op, peer, expected, dl)
    }

    /// Segment lengths of a chunk: full segments then the remainder, always including the
    /// (possibly empty) remainder so that two different lengths never yield sequences where
    /// one is a prefix of the other — a size mismatch is always detected.
    fn segments(&self, len: usize) -> impl Iterator<Item = Range<usize>> {
        let seg = self.opts.segment_bytes.max(1);
        let full = len / seg;
        (0..=full).map(move |i| i * seg..((i + 1) * seg).min(len))
    }

    fn send_segmented(&self, peer: usize, data: &[u8], dl: Instant) -> Result<()> {
        for r in self.segments(data.len()) {
            self.csend(peer, &data[r], dl)?;
        }
        Ok(())
    }

    /// One ring step: sends `send` in segments to the right neighbour while receiving
    /// `recv_len` bytes in segments from the left one. With `Sink::Reduce`, each received
    /// segment is handed to the closure; with `Sink::Land`, segments are received straight into
    /// the given buffer where the backend can (copied there otherwise). One thread drives both
    /// directions: between two segment sends it processes whatever already arrived (the link's
    /// progress threads keep draining the sockets, so a blocking send never waits on this
    /// thread), which overlaps reduction with the network without a helper thread per step.
    fn ring_step<F: FnMut(Range<usize>, &RecvBuf)>(
        &self,
        op: &'static str,
        send: &[u8],
        sink: Sink<'_, F>,
        dl: Instant,
    ) -> Result<()> {
        let n = self.size();
        let (to, from) = ((self.me + 1) % n, (self.me + n - 1) % n);
        let (recv_len, land, mut reduce) = match sink {
            Sink::Land(buf) => (buf.len(), Some(buf.as_mut_ptr()), None),
            Sink::Reduce(len, f) => (len, None, Some(f)),
        };
        // Post all receives first so the matching order is fixed before any byte arrives.
        let mut posted = std::collections::VecDeque::new();
        for r in self.segments(recv_len) {
            let h = match land {
                // SAFETY: `base` comes from the `&mut [u8]` this function borrows for its whole
                // run and which is only accessed through `base` below; every handle is waited
                // on or dropped (never leaked) before we return, also on the error path, where
                // the link is aborted first so that no write into the zone is in progress.
                Some(base) => unsafe { self.l().irecv_into(self.members[from], self.coll_tag(), base.add(r.start), r.len()) },
                None => self.cpost(from),
            };
            posted.push_back((r, h?));
        }
        let mut take = |h: RecvHandle, r: Range<usize>| -> Result<()> {
            let m = wait_exact(h, op, from, r.len(), dl)?;
            match (land, &mut reduce) {
                (Some(base), _) if !m.is_landed() => {
                    // SAFETY: `r` lies within the borrowed buffer (segments cover 0..recv_len)
                    // and no landing zone overlapping it is live: its handle just completed.
                    let dst = unsafe { std::slice::from_raw_parts_mut(base.add(r.start), r.len()) };
                    m.copy_to(dst);
                }
                (_, Some(f)) => f(r, &m),
                _ => {}
            }
            Ok(())
        };
        let mut run = || -> Result<()> {
            for seg in self.segments(send.len()) {
                self.csend(to, &send[seg], dl)?;
                while posted.front().is_some_and(|(_, h)| h.is_ready()) {
                    if let Some((r, h)) = posted.pop_front() {
                        take(h, r)?;
                    }
                }
            }
            while let Some((r, h)) = posted.pop_front() {
                take(h, r)?;
            }
            Ok(())
        };
        let res = run();
        if let Err(e) = &res {
            // Make sure no transfer into a landing zone is still running before the pending
            // handles are dropped (dropping waits for writers; an aborted link ends them).
            self.l().abort(&format!("{op} failed on rank {}: {e}", self.world_rank(self.me)));
        }
        drop(posted);
        res
    }

    fn chunk_ranges(count: usize, n: usize, es: usize) -> Vec<Range<usize>> {
        let (base, extra) = (count / n, count % n);
        let mut out = Vec::with_capacity(n);
        let mut at = 0;
        for i in 0..n {
            let c = base + usize::from(i < extra);
            out.push(at * es..(at + c) * es);
            at += c;
        }
        out
    }

    /// Chunks sent and received at step `s` of a ring reduce-scatter that ends with chunk `me`
    /// fully reduced on this rank.
    fn reduce_scatter_step(&self, s: usize) -> (usize, usize) {
        let (n, r) = (self.size(), self.me);
        ((r + 2 * n - s - 1) % n, (r + 2 * n - s - 2) % n)
    }

    /// In-place ring reduce-scatter: afterwards chunk `me` holds the full reduction.
    fn ring_reduce_scatter(
        &self,
        buf: &mut [u8],
        chunks: &[Range<usize>],
        dtype: DType,
        op: ReduceOp,
        dl: Instant,
    ) -> Result<()> {
        let n = self.size();
        for s in 0..n - 1 {
            let (si, ri) = self.reduce_scatter_step(s);
            let (send, recv) = split_two(buf, chunks[si].clone(), chunks[ri].clone());
            self.ring_step(
                "reduce_scatter",
                send,
                Sink::Reduce(recv.len(), |seg: Range<usize>, m: &RecvBuf| reduce_parts(dtype, &mut recv[seg], m, op)),
                dl,
            )?;
        }
        Ok(())
    }

    /// Ring reduce-scatter that leaves `input` untouched: partial sums travel in two
    /// chunk-sized accumulators; the last step reduces straight into `output` (block `me`).
    fn ring_reduce_scatter_out_of_place(
        &self,
        blocks: &[&[u8]],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        dl: Instant,
    ) -> Result<()> {
        let n = self.size();
        let m = output.len();
        let block = |i: usize| blocks[i];
        let mut sending = Vec::new();
        let mut next = vec![0u8; if n > 2 { m } else { 0 }];
        for s in 0..n - 1 {
            let (si, ri) = self.reduce_scatter_step(s);
            let send: &[u8] = if s == 0 { block(si) } else { &sending };
            let dst: &mut [u8] = if s == n - 2 { &mut *output } else { &mut next };
            let local = block(ri);
            let sink = Sink::Reduce(m, |seg: Range<usize>, msg: &RecvBuf| {
                dst[seg.clone()].copy_from_slice(&local[seg.clone()]);
                reduce_parts(dtype, &mut dst[seg], msg, op);
            });
            self.ring_step("reduce_scatter", send, sink, dl)?;
            if s < n - 2 {
                std::mem::swap(&mut sending, &mut next);
                if next.len() != m {
                    next = vec![0u8; m];
                }
            }
        }
        Ok(())
    }

    /// In-place ring all-gather over consecutive `chunks` covering `buf`: rank i starts with
    /// chunk i, ends with all.
    fn ring_all_gather(&self, buf: &mut [u8], chunks: &[Range<usize>], dl: Instant) -> Result<()> {
        let mut pieces = Vec::with_capacity(chunks.len());
        let mut rest = buf;
        for c in chunks {
            debug_assert_eq!(c.start + rest.len(), chunks.last().map_or(0, |l| l.end), "chunks must be consecutive");
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(c.len());
            pieces.push(head);
            rest = tail;
        }
        self.ring_all_gather_pieces(&mut pieces, dl)
    }

    /// Ring all-gather over separate pieces (piece i is rank i's block); the pieces may live
    /// anywhere, e.g. strided through a larger buffer.
    fn ring_all_gather_pieces(&self, pieces: &mut [&mut [u8]], dl: Instant) -> Result<()> {
        let n = self.size();
        let r = self.me;
        for s in 0..n - 1 {
            let si = (r + n - s) % n;
            let ri = (r + 2 * n - s - 1) % n;
            let (send, recv): (&[u8], &mut [u8]) = if si < ri {
                let (lo, hi) = pieces.split_at_mut(ri);
                (&*lo[si], &mut *hi[0])
            } else {
                let (lo, hi) = pieces.split_at_mut(si);
                (&*hi[0], &mut *lo[ri])
            };
            self.ring_step("all_gather", send, Sink::<fn(Range<usize>, &RecvBuf)>::Land(recv), dl)?;
        }
        Ok(())
    }

    /// All-gather where rank i's block is `pieces[i]` (every piece as long as `input`),
    /// always by the ring. Used by striped communicators, whose per-link pieces are strided.
    pub(crate) fn all_gather_pieces(&self, input: &[u8], pieces: &mut [&mut [u8]]) -> Result<()> {
        self.guarded("all_gather", |dl| {
            if pieces.len() != self.size() || pieces.iter().any(|p| p.len() != input.len()) {
                return Err(Error::InvalidArgument("all_gather pieces do not match the group or the input".into()));
            }
            pieces[self.me].copy_from_slice(input);
            if self.size() == 1 {
                return Ok(());
            }
            self.ring_all_gather_pieces(pieces, dl)
        })
    }

    /// Reduce-scatter where block j (for rank j) is `blocks[j]`, always by the ring. Used by
    /// striped communicators, whose per-link blocks are strided.
    pub(crate) fn reduce_scatter_blocks(&self, blocks: &[&[u8]], output: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        self.guarded("reduce_scatter", |dl| {
            let n = self.size();
            if blocks.len() != n || blocks.iter().any(|b| b.len() != output.len()) || output.len() % dtype.size() != 0 {
                return Err(Error::InvalidArgument("reduce_scatter blocks do not match the group or the output".into()));
            }
            if n == 1 {
                output.copy_from_slice(blocks[0]);
            } else {
                self.ring_reduce_scatter_out_of_place(blocks, output, dtype, op, dl)?;
            }
            if op == ReduceOp::Avg {
                finish_avg(dtype, output, n);
            }
            Ok(())
        })
    }

    /// Recursive doubling all-reduce; non-power-of-two sizes fold the extra ranks in first.
    fn rd_all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp, dl: Instant) -> Result<()> {
        let n = self.size();
        let r = self.me;
        let p2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let rem = n - p2;
        let len = buf.len();
        if r >= p2 {
            self.csend(r - p2, buf, dl)?;
            let m = self.crecv_exact("all_reduce", r - p2, len, dl)?;
            m.copy_to(buf);
            return Ok(());
        }
        if r < rem {
            let m = self.crecv_exact("all_reduce", r + p2, len, dl)?;
            reduce_parts(dtype, buf, &m, op);
        }
        let mut mask = 1;
        while mask < p2 {
            let partner = r ^ mask;
            let h = self.cpost(partner)?;
            self.csend(partner, buf, dl)?;
            let m = wait_exact(h, "all_reduce", partner, len, dl)?;
            reduce_parts(dtype, buf, &m, op);
            mask <<= 1;
        }
        if r < rem {
            self.csend(r + p2, buf, dl)?;
        }
        Ok(())
    }

    /// The backend's native collectives, for buffers that are not in host memory (the
    /// point-to-point algorithms only touch host memory). `None` means: use the host path.
    fn native_for(&self, mems: &[MemKind]) -> Result<Option<&dyn NativeCollectives>> {
        let Some(&mem) = mems.iter().find(|&&m| m != MemKind::Host) else { return Ok(None) };
        match self.l().native_collectives() {
            // Native collectives run on the backend's own world communicator.
            Some(n) if self.size() == self.l().size() => Ok(Some(n)),
            _ => Err(Error::UnsupportedMemory { link: self.l().info().name.clone(), memory: mem.to_string() }),
        }
    }

    fn check_blocks(op: &str, whole: usize, block: usize, n: usize, whole_name: &str) -> Result<()> {
        if whole == block * n {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!("{op} {whole_name} holds {whole} bytes but {n} ranks × {block} bytes were expected")))
    }

    // ---------------------------------------------------------------- collectives

    /// All-reduce on a buffer in host or device memory (device memory needs a backend with
    /// native collectives, such as NCCL).
    pub fn all_reduce_buf(&self, buf: BufMut<'_>, dtype: DType, op: ReduceOp) -> Result<()> {
        let buf = match (self.native_for(&[buf.memory()])?, buf) {
            (Some(native), buf) => return native.all_reduce(buf, dtype, op),
            (None, BufMut::Host(b)) => b,
            (None, BufMut::Device(_)) => unreachable!("native_for refuses device memory without native collectives"),
        };
        match self.stripe_plan(buf.len()) {
            Some(Ok(())) if buf.len() % dtype.size() == 0 => return self.striped_all_reduce(buf, dtype, op),
            Some(Err(lane)) => return self.view(lane, 0xfffd_0000)?.all_reduce_buf(BufMut::Host(buf), dtype, op),
            _ => {}
        }
        self.guarded("all_reduce", |dl| {
            if buf.len() % dtype.size() != 0 {
                return Err(Error::InvalidArgument(format!("buffer of {} bytes is not a whole number of {dtype}", buf.len())));
            }
            let n = self.size();
            let count = buf.len() / dtype.size();
            if let Some(g) = self.shm() {
                g.all_reduce(buf, dtype, op, dl)?;
            } else if n > 1 {
                if buf.len() <= self.opts.small_bytes || count < n {
                    self.rd_all_reduce(buf, dtype, op, dl)?;
                } else {
                    let chunks = Self::chunk_ranges(count, n, dtype.size());
                    self.ring_reduce_scatter(buf, &chunks, dtype, op, dl)?;
                    self.ring_all_gather(buf, &chunks, dl)?;
                }
            }
            if op == ReduceOp::Avg {
                finish_avg(dtype, buf, n);
            }
            Ok(())
        })
    }

    /// In-place all-reduce of host elements.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_buf(BufMut::Host(bytemuck::cast_slice_mut(buf)), T::DTYPE, op)
    }

    /// Broadcast of `buf` from group rank `root` to every rank.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_buf(BufMut::Host(bytemuck::cast_slice_mut(buf)), root)
    }

    /// Broadcast of a host or device buffer (device memory needs native collectives).
    pub fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let buf = match (self.native_for(&[buf.memory()])?, buf) {
            (Some(native), buf) => return native.broadcast(buf, root),
            (None, BufMut::Host(b)) => b,
            (None, BufMut::Device(_)) => unreachable!("native_for refuses device memory without native collectives"),
        };
        match self.stripe_plan(buf.len()) {
            Some(Ok(())) => return self.striped_broadcast(buf, root),
            Some(Err(lane)) => return self.view(lane, 0xfffd_0000)?.broadcast_buf(BufMut::Host(buf), root),
            None => {}
        }
        // Broadcast moves bytes, never splits elements apart in a way that matters.
        let es = 1;
        self.guarded("broadcast", |dl| {
            let n = self.size();
            if root >= n {
                return Err(Error::RankOutOfRange { rank: root, size: n });
            }
            if n == 1 {
                return Ok(());
            }
            if let Some(g) = self.shm() {
                return g.broadcast(buf, root, dl);
            }
            let count = buf.len() / es;
            if buf.len() <= self.opts.small_bytes || count < n {
                // Binomial tree on ranks relative to the root.
                let vr = (self.me + n - root) % n;
                let mut mask = 1;
                while mask < n {
                    if vr & mask != 0 {
                        let src = (vr - mask + root) % n;
                        self.crecv_exact("broadcast", src, buf.len(), dl)?.copy_to(buf);
                        break;
                    }
                    mask <<= 1;
                }
                mask >>= 1;
                while mask > 0 {
                    if vr + mask < n {
                        self.csend((vr + mask + root) % n, buf, dl)?;
                    }
                    mask >>= 1;
                }
                return Ok(());
            }
            // Scatter from the root, then ring all-gather (van de Geijn).
            let chunks = Self::chunk_ranges(count, n, es);
            if self.me == root {
                for (i, c) in chunks.iter().enumerate() {
                    if i != root {
                        self.send_segmented(i, &buf[c.clone()], dl)?;
                    }
                }
            } else {
                let mine = chunks[self.me].clone();
                let posted: Vec<_> = self.segments(mine.len()).map(|r| Ok((r, self.cpost(root)?))).collect::<Result<_>>()?;
                for (r, h) in posted {
                    let m = wait_exact(h, "broadcast", root, r.len(), dl)?;
                    m.copy_to(&mut buf[mine.start + r.start..mine.start + r.end]);
                }
            }
            self.ring_all_gather(buf, &chunks, dl)
        })
    }

    /// All-gather: every rank contributes `input`; `output` (size × input) receives all
    /// contributions in rank order.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.all_gather_buf(Buf::Host(bytemuck::cast_slice(input)), BufMut::Host(bytemuck::cast_slice_mut(output)))
    }

    /// All-gather on host or device buffers (device memory needs native collectives).
    pub fn all_gather_buf(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()> {
        let (inb, outb) = match (self.native_for(&[input.memory(), output.memory()])?, input, output) {
            (Some(native), i, o) => return native.all_gather(i, o),
            (None, Buf::Host(i), BufMut::Host(o)) => (i, o),
            _ => unreachable!("native_for refuses device memory without native collectives"),
        };
        match self.stripe_plan(outb.len()) {
            Some(Ok(())) if outb.len() == inb.len() * self.size() => return self.striped_all_gather(inb, outb),
            Some(Err(lane)) => return self.view(lane, 0xfffd_0000)?.all_gather_buf(Buf::Host(inb), BufMut::Host(outb)),
            _ => {}
        }
        self.guarded("all_gather", |dl| {
            let n = self.size();
            Self::check_blocks("all_gather", outb.len(), inb.len(), n, "output")?;
            if let Some(g) = self.shm() {
                return g.all_gather(inb, outb, dl);
            }
            let m = inb.len();
            let r = self.me;
            outb[r * m..(r + 1) * m].copy_from_slice(inb);
            if n == 1 {
                return Ok(());
            }
            let chunks: Vec<Range<usize>> = (0..n).map(|i| i * m..(i + 1) * m).collect();
            if outb.len() > self.opts.small_bytes {
                return self.ring_all_gather(outb, &chunks, dl);
            }
            if n.is_power_of_two() {
                // Recursive doubling: after step k each rank holds 2^(k+1) consecutive blocks.
                let mut d = 1;
                while d < n {
                    let partner = r ^ d;
                    let mine = (r & !(d - 1)) * m..((r & !(d - 1)) + d) * m;
                    let theirs = (partner & !(d - 1)) * m..((partner & !(d - 1)) + d) * m;
                    let h = self.cpost(partner)?;
                    self.csend(partner, &outb[mine], dl)?;
                    let got = wait_exact(h, "all_gather", partner, theirs.len(), dl)?;
                    got.copy_to(&mut outb[theirs]);
                    d <<= 1;
                }
                return Ok(());
            }
            // Small, not a power of two: one round of direct exchange.
            let posted: Vec<_> = (0..n).filter(|&p| p != r).map(|p| Ok((p, self.cpost(p)?))).collect::<Result<_>>()?;
            for p in (0..n).filter(|&p| p != r) {
                self.csend(p, inb, dl)?;
            }
            for (p, h) in posted {
                let got = wait_exact(h, "all_gather", p, m, dl)?;
                got.copy_to(&mut outb[p * m..(p + 1) * m]);
            }
            Ok(())
        })
    }

    /// Reduce-scatter: `input` holds size × `output.len()` elements; rank i receives the
    /// reduction of every rank's block i.
    pub fn reduce_scatter<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
        let (i, o) = (Buf::Host(bytemuck::cast_slice(input)), BufMut::Host(bytemuck::cast_slice_mut(output)));
        self.reduce_scatter_buf(i, o, T::DTYPE, op)
    }

    /// Reduce-scatter on host or device buffers (device memory needs native collectives).
    pub fn reduce_scatter_buf(&self, input: Buf<'_>, output: BufMut<'_>, dtype: DType, op: ReduceOp) -> Result<()> {
        let (inb, outb) = match (self.native_for(&[input.memory(), output.memory()])?, input, output) {
            (Some(native), i, o) => return native.reduce_scatter(i, o, dtype, op),
            (None, Buf::Host(i), BufMut::Host(o)) => (i, o),
            _ => unreachable!("native_for refuses device memory without native collectives"),
        };
        match self.stripe_plan(inb.len()) {
            Some(Ok(())) if inb.len() == outb.len() * self.size() && outb.len() % dtype.size() == 0 => {
                return self.striped_reduce_scatter(inb, outb, dtype, op)
            }
            Some(Err(lane)) => {
                return self.view(lane, 0xfffd_0000)?.reduce_scatter_buf(Buf::Host(inb), BufMut::Host(outb), dtype, op)
            }
            _ => {}
        }
        self.guarded("reduce_scatter", |dl| {
            let n = self.size();
            Self::check_blocks("reduce_scatter", inb.len(), outb.len(), n, "input")?;
            if outb.len() % dtype.size() != 0 {
                return Err(Error::InvalidArgument(format!("output of {} bytes is not a whole number of {dtype}", outb.len())));
            }
            let m = outb.len();
            let r = self.me;
            if let Some(g) = self.shm() {
                g.reduce_scatter(inb, outb, dtype, op, dl)?;
            } else if n == 1 {
                outb.copy_from_slice(inb);
            } else if inb.len() <= self.opts.small_bytes {
                let mut work = inb.to_vec();
                self.rd_all_reduce(&mut work, dtype, op, dl)?;
                outb.copy_from_slice(&work[r * m..(r + 1) * m]);
            } else {
                let blocks: Vec<&[u8]> = (0..n).map(|j| &inb[j * m..(j + 1) * m]).collect();
                self.ring_reduce_scatter_out_of_place(&blocks, outb, dtype, op, dl)?;
            }
            if op == ReduceOp::Avg {
                finish_avg(dtype, outb, n);
            }
            Ok(())
        })
    }

    /// All-to-all with equal blocks: block j of `send` goes to rank j; block i of `recv`
    /// comes from rank i.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let n = self.size();
        if send.len() % n != 0 || recv.len() != send.len() {
            let msg = format!(
                "all_to_all needs equal send and receive lengths divisible by {n}, got {} and {}",
                send.len(),
                recv.len()
            );
            return self.guarded("all_to_all", |_| Err(Error::InvalidArgument(msg)));
        }
        let counts = vec![send.len() / n; n];
        self.all_to_all_v(send, &counts, recv, &counts)
    }

    /// All-to-all with variable counts (the MoE token dispatch): `send_counts[j]` elements go
    /// to rank j, `recv_counts[i]` elements are expected from rank i; a peer that sends another
    /// count is an error.
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let n = self.size();
        let counts_ok = send_counts.len() == n
            && recv_counts.len() == n
            && send_counts.iter().sum::<usize>() == send.len()
            && recv_counts.iter().sum::<usize>() == recv.len();
        if self.stripe.is_some() && counts_ok {
            // Always striped: a lane with nothing to send here may have data coming.
            return self.striped_all_to_all_v(send, send_counts, recv, recv_counts);
        }
        let (sb, rb): (&[u8], &mut [u8]) = (bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv));
        let es = std::mem::size_of::<T>();
        self.guarded("all_to_all_v", |dl| {
            let n = self.size();
            if send_counts.len() != n || recv_counts.len() != n {
                return Err(Error::InvalidArgument(format!("all_to_all_v needs {n} send and receive counts")));
            }
            if send_counts.iter().sum::<usize>() * es != sb.len() || recv_counts.iter().sum::<usize>() * es != rb.len() {
                return Err(Error::InvalidArgument("all_to_all_v counts do not add up to the buffer lengths".into()));
            }
            let offsets = |c: &[usize]| -> Vec<Range<usize>> {
                let mut at = 0;
                c.iter()
                    .map(|&k| {
                        let r = at * es..(at + k) * es;
                        at += k;
                        r
                    })
                    .collect()
            };
            let (so, ro) = (offsets(send_counts), offsets(recv_counts));
            if let Some(g) = self.shm() {
                // The counts ride on the first window: a count this rank did not expect is a
                // typed error here (and the abort that follows stops the others).
                return g.all_to_all_v(sb, &so, rb, &ro, dl);
            }
            let r = self.me;
            if send_counts[r] != recv_counts[r] {
                return Err(Error::LengthMismatch {
                    op: "all_to_all_v",
                    peer: r,
                    expected: recv_counts[r] * es,
                    got: send_counts[r] * es,
                });
            }
            let (own_from, own_to) = (so[r].clone(), ro[r].clone());
            let mut landing = Landing::new(self, rb);
            // Blocks travel in segments, like ring chunks: large blocks pipeline through the
            // sockets instead of going as one message (which a backend may stripe over its
            // connections with helper threads); a block's segment count follows from its
            // length, so the receiver posts exactly what the sender sends.
            for p in (1..n).map(|k| (r + n - k) % n) {
                for seg in self.segments(ro[p].len()) {
                    landing.post(p, ro[p].start + seg.start..ro[p].start + seg.end)?;
                }
            }
            // Pairwise order spreads the load: at step k everybody sends to rank + k.
            for k in 1..n {
                let p = (r + k) % n;
                self.send_segmented(p, &sb[so[p].clone()], dl)?;
            }
            // The own block is copied while the peers' blocks are on their way (it is off the
            // critical path there), through the landing guard that owns the buffer meanwhile.
            landing.copy_in(own_to, &sb[own_from]);
            landing.finish("all_to_all_v", dl)
        })
    }

    /// All-to-all with variable counts where the receiver does not know the counts yet:
    /// exchanges counts first, returns the received elements and the count from each rank.
    pub fn all_to_all_v_exchange<T: Element>(&self, send: &[T], send_counts: &[usize]) -> Result<(Vec<T>, Vec<usize>)> {
        let n = self.size();
        if send_counts.len() != n {
            let msg = format!("all_to_all_v_exchange needs {n} send counts, got {}", send_counts.len());
            return self.guarded("all_to_all_v", |_| Err(Error::InvalidArgument(msg)));
        }
        let sc: Vec<i64> = send_counts.iter().map(|&c| c as i64).collect();
        let mut rc = vec![0i64; n];
        self.all_to_all(&sc, &mut rc)?;
        let recv_counts: Vec<usize> = rc.iter().map(|&c| c.max(0) as usize).collect();
        let mut out = vec![T::zeroed(); recv_counts.iter().sum()];
        self.all_to_all_v(send, send_counts, &mut out, &recv_counts)?;
        Ok((out, recv_counts))
    }

    /// Blocks until every rank of the group has entered the barrier (dissemination).
    pub fn barrier(&self) -> Result<()> {
        self.guarded("barrier", |dl| {
            if let Some(g) = self.shm() {
                return g.barrier(dl);
            }
            let n = self.size();
            let mut k = 1;
            while k < n {
                let from = (self.me + n - k) % n;
                let h = self.cpost(from)?;
                self.csend((self.me + k) % n, &[], dl)?;
                wait_exact(h, "barrier", from, 0, dl)?;
                k <<= 1;
            }
            Ok(())
        })
    }

    /// Splits the group: ranks passing the same `color` form a new group, ordered by `key`
    /// then by their rank here. Every member must call it.
    pub fn split(&self, color: u32, key: u32) -> Result<Communicator> {
        let n = self.size();
        let mine = [i64::from(color), i64::from(key)];
        let mut all = vec![0i64; 2 * n];
        self.all_gather(&mine, &mut all)?;
        let mut group: Vec<(i64, usize)> =
            (0..n).filter(|&i| all[2 * i] == i64::from(color)).map(|i| (all[2 * i + 1], i)).collect();
        group.sort_unstable();
        let members: Vec<usize> = group.iter().map(|&(_, i)| self.members[i]).collect();
        let me =
            group.iter().position(|&(_, i)| i == self.me).ok_or_else(|| Error::InvalidArgument("split lost this rank".into()))?;
        let nth = self.splits.fetch_add(1, Ordering::Relaxed);
        Ok(self.derived(self.link, members.into(), me, mix(mix(self.ctx, u64::from(nth)), u64::from(color))))
    }

    /// The same group on the same link in a fresh tag space (MPI's `MPI_Comm_dup`): its
    /// collectives may run from another thread at the same time as this communicator's, e.g.
    /// gradient all-reduces on a communication thread during the backward pass. Involves no
    /// communication; every member must call it in the same order relative to `split`.
    pub fn dup(&self) -> Communicator {
        let nth = self.splits.fetch_add(1, Ordering::Relaxed);
        self.derived(self.link, self.members.clone(), self.me, mix(mix(self.ctx, u64::from(nth)), 0xd0d0_0000_0000))
    }

    /// Aborts the active link: every pending and future operation fails, here and at peers.
    pub fn abort(&self, reason: &str) {
        self.l().abort(reason);
    }
}

/// Waits for a message that must be exactly `expected` bytes long (group rank `peer`, for
/// the error): every receive of a known size goes through here, so a size disagreement
/// between ranks is always a `LengthMismatch`.
fn wait_exact(h: RecvHandle, op: &'static str, peer: usize, expected: usize, dl: Instant) -> Result<RecvBuf> {
    let m = h.wait(dl)?;
    if m.len() != expected {
        return Err(Error::LengthMismatch { op, peer, expected, got: m.len() });
    }
    Ok(m)
}

/// Errors that a peer (or an earlier abort) caused: every rank learns of those by itself, so
/// they are not broadcast again (which would race with and mask the original cause).
fn from_peer(e: &Error) -> bool {
    matches!(e, Error::PeerLost { .. } | Error::PeerAborted { .. } | Error::PeerClosed { .. } | Error::Aborted { .. })
}

/// Receives into disjoint ranges of one buffer, straight into it where the backend can.
///
/// Holds the buffer's unique borrow for its whole life and touches it only through `base`. If it
/// is dropped with receives still pending (an error on the way), it aborts the link first so no
/// backend writer stays inside a zone, then drops the handles (which wait for such writers).
struct Landing<'a> {
    comm: &'a Communicator,
    base: *mut u8,
    len: usize,
    pending: Vec<(usize, Range<usize>, RecvHandle)>,
    _buf: std::marker::PhantomData<&'a mut [u8]>,
}

impl<'a> Landing<'a> {
    fn new(comm: &'a Communicator, buf: &'a mut [u8]) -> Self {
        Landing { comm, base: buf.as_mut_ptr(), len: buf.len(), pending: Vec::new(), _buf: std::marker::PhantomData }
    }

    /// Posts the receive of the next message from group rank `peer` into `range`.
    fn post(&mut self, peer: usize, range: Range<usize>) -> Result<()> {
        assert!(range.end <= self.len && !self.pending.iter().any(|(_, r, _)| r.start < range.end && range.start < r.end));
        let c = self.comm;
        // SAFETY: `range` lies inside the buffer borrowed for 'a and overlaps no other pending
        // zone (asserted above); the handle is kept in `self.pending` and is waited on or
        // dropped (after an abort) before `self`, and with it the borrow, ends.
        let h = unsafe { c.l().irecv_into(c.members[peer], c.coll_tag(), self.base.add(range.start), range.len()) }?;
        self.pending.push((peer, range, h));
        Ok(())
    }

    /// Copies `src` into `range` of the buffer, which no posted receive covers.
    fn copy_in(&mut self, range: Range<usize>, src: &[u8]) {
        assert!(range.end <= self.len && !self.pending.iter().any(|(_, r, _)| r.start < range.end && range.start < r.end));
        // SAFETY: `range` lies inside the buffer borrowed for 'a (asserted) and overlaps no
        // landing zone, so no backend writes these bytes; `src` is another buffer.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(range.start), range.len()) }.copy_from_slice(src);
    }

    /// Waits for every receive, copying the ones the backend could not land.
    fn finish(mut self, op: &'static str, dl: Instant) -> Result<()> {
        while !self.pending.is_empty() {
            let (peer, r, h) = self.pending.remove(0);
            let m = wait_exact(h, op, peer, r.len(), dl)?;
            if !m.is_landed() {
                // SAFETY: `r` is inside the borrowed buffer and its zone's handle completed, so
                // nobody else writes these bytes.
                m.copy_to(unsafe { std::slice::from_raw_parts_mut(self.base.add(r.start), r.len()) });
            }
        }
        Ok(())
    }
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        if !self.pending.is_empty() {
            self.comm.l().abort("a collective failed with receives still pending");
            self.pending.clear();
        }
    }
}

/// What a ring step does with what it receives.
enum Sink<'a, F> {
    /// Receive into this buffer (directly where the backend can).
    Land(&'a mut [u8]),
    /// Hand `len` bytes, segment by segment, to the closure.
    Reduce(usize, F),
}

fn reduce_parts(dtype: DType, dst: &mut [u8], m: &RecvBuf, op: ReduceOp) {
    for (off, p) in m.parts() {
        reduce_into(dtype, &mut dst[off..off + p.len()], p, op);
    }
}

/// Borrows two disjoint ranges of one buffer: the first shared, the second mutable.
fn split_two(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// The id a job with the derived id `base` ([`crate::rendezvous::job_id_from_env`]) keeps its files under: `base`
/// with rank 0's [`crate::rendezvous::launcher_identity`] added (broadcast: collective), so two launches of the
/// same program on the same endpoint are two jobs. An id a launcher gave is returned as is
/// (nothing is exchanged).
pub fn unique_job_id(comm: &Communicator, base: &str) -> Result<String> {
    if !base.starts_with(crate::rendezvous::DERIVED_JOB_ID_PREFIX) {
        return Ok(base.to_string());
    }
    let mine = crate::rendezvous::launcher_identity().into_bytes();
    let mut len = [mine.len().min(256) as i64];
    comm.broadcast(&mut len, 0)?;
    let mut buf = vec![0u8; usize::try_from(len[0]).unwrap_or(0).min(256)];
    if comm.rank() == 0 {
        let n = buf.len();
        buf.copy_from_slice(&mine[..n]);
    }
    comm.broadcast(&mut buf, 0)?;
    let mut h = crate::rendezvous::Fnv::default();
    h.add(&buf);
    Ok(format!("{base}-{:08x}", h.0 as u32))
}

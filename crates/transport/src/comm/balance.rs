//! Dynamic balancing of a striped all-gather or reduce-scatter over two links.
//!
//! A fixed split (say 77% / 23% by declared rates) ends when the slower of its two parts ends,
//! and a link's pace varies from call to call (TCP against a token bucket, a neighbour's
//! traffic), so the expected end sits above either part's mean. Here the split falls out of
//! the call itself: every block is cut on one grid of segments that every rank derives from
//! the block length alone; when a rank first sends a block, link 0's thread takes segments
//! from the front and link 1's from the back (one atomic word holds both ends), each taking
//! the next as soon as its previous send returns, until they meet. Each link then sends an
//! empty message, its terminator.
//!
//! The receiver needs no header to place a segment: the k-th message on link 0 is segment k,
//! the k-th on link 1 is segment K-1-k, and the empty message ends the link's part. So every
//! segment still lands straight in its destination (`Link::irecv_into`). In a ring of more
//! than two ranks, a segment keeps the link it started on: each later hop forwards what that
//! link received in the step before, in the same order, so the two streams stay a front run
//! and a back run at every hop and every rank agrees on them without asking.
//!
//! Exactly one message carries each segment (claims are exclusive), which is what makes the
//! two links' landing zones safe even when both point at the meeting segment: the other link's
//! message there is the empty terminator, which lands nowhere.

use ironweave_units::Locked;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Communicator;
use crate::dtype::{reduce_into, DType, ReduceOp};
use crate::error::{Error, Result};
use crate::link::{RecvBuf, RecvHandle};

/// Segments per block the grid aims at: the last segment either link takes is what can make
/// one finish after the other, so it should be a small share of the block.
const SEGMENTS_PER_BLOCK: usize = 128;
/// The smallest segment: below this, per-message costs start to show.
const MIN_SEGMENT: usize = 32 << 10;
/// How much of its rate a link may hold unacknowledged when its lane claims the next
/// segment: enough to keep it busy across a late wake-up, little enough that both links'
/// backlogs drain within a few milliseconds of each other at the end.
const AHEAD: Duration = Duration::from_millis(5);

/// The grid of a block of `m` bytes: consecutive segments of whole elements (`es` bytes), about
/// `m / SEGMENTS_PER_BLOCK` long, within `[MIN_SEGMENT, max_seg]`. Every rank computes the same
/// grid from the same `m`; an empty block has no segments.
pub(crate) fn grid(m: usize, es: usize, max_seg: usize) -> Vec<Range<usize>> {
    let es = es.max(1);
    let want = (m / SEGMENTS_PER_BLOCK).clamp(MIN_SEGMENT.min(max_seg.max(1)), max_seg.max(1));
    let g = (want / es).max(1) * es;
    (0..m.div_ceil(g)).map(|i| i * g..((i + 1) * g).min(m)).collect()
}

/// The two ends of a block's segments: link 0 takes from the front, link 1 from the back.
pub(crate) struct Ends(AtomicU64);

impl Ends {
    pub(crate) fn new(k: usize) -> Self {
        Ends(AtomicU64::new((k as u64) << 32))
    }

    /// The next segment for `side` (0: front, 1: back), or `None` once the ends met.
    pub(crate) fn claim(&self, side: usize) -> Option<usize> {
        let mut cur = self.0.load(Ordering::Acquire);
        loop {
            let (front, back) = (cur & 0xffff_ffff, cur >> 32);
            if front >= back {
                return None;
            }
            let (next, k) = if side == 0 { (cur + 1, front) } else { (cur - (1 << 32), back - 1) };
            match self.0.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(k as usize),
                Err(c) => cur = c,
            }
        }
    }
}

/// The segment index of the `j`-th message on `side` of a block of `k` segments.
fn nth(side: usize, j: usize, k: usize) -> usize {
    if side == 0 {
        j
    } else {
        k - 1 - j
    }
}

/// A raw view of a buffer that two link threads fill in disjoint segments.
#[derive(Clone, Copy)]
struct Shared {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the two link threads only touch disjoint ranges through it (one message carries each
// segment, see the module doc), and the buffer outlives both (they are joined before it ends).
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    fn new(b: &mut [u8]) -> Self {
        Shared { ptr: b.as_mut_ptr(), len: b.len() }
    }

    /// # Safety
    /// No other live reference covers `r` (it is checked to lie inside the buffer).
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, r: Range<usize>) -> &mut [u8] {
        assert!(r.start <= r.end && r.end <= self.len, "segment {r:?} outside a buffer of {}", self.len);
        // SAFETY: in bounds (asserted); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }
}

/// What the ring moves.
pub(crate) enum Op<'a> {
    /// All-gather into `out` (`n` blocks of `m`); this rank's block is already in place.
    Gather { out: &'a mut [u8] },
    /// Out-of-place reduce-scatter: rank j's share of the reduction is `blocks[j]`; the result
    /// for this rank goes to `out`.
    Reduce { blocks: Vec<&'a [u8]>, out: &'a mut [u8], dtype: DType, op: ReduceOp },
}

/// One link's part of the ring: its received segments of the step before (in arrival order)
/// and, for a reduce-scatter, their partial sums, which the next step forwards.
struct Carry {
    segs: Vec<usize>,
    partials: Vec<Vec<u8>>,
}

/// Runs `op` over the two links of `c` (a striped communicator with two links), balancing
/// dynamically; afterwards checks that the two links carried every segment of every step.
pub(crate) fn run(c: &Communicator, op: Op<'_>, m: usize) -> Result<()> {
    let n = c.size();
    let (es, what) = match &op {
        Op::Gather { .. } => (1, "all_gather"),
        Op::Reduce { dtype, .. } => (dtype.size(), "reduce_scatter"),
    };
    let segs = grid(m, es, c.opts.segment_bytes);
    let first = Ends::new(segs.len());
    let (out, blocks, red) = match op {
        Op::Gather { out } => (Shared::new(out), Vec::new(), None),
        Op::Reduce { blocks, out, dtype, op } => (Shared::new(out), blocks, Some((dtype, op))),
    };
    let counts: Vec<std::sync::Mutex<Vec<usize>>> = (0..2).map(|_| std::sync::Mutex::new(Vec::new())).collect();
    c.run_lanes(&[true, true], |lane, side| {
        let got = Lane { c, lane, side, n, m, segs: &segs, what }.ring(&first, out, &blocks, red)?;
        *counts[side].locked() = got;
        Ok(())
    })?;
    let (a, b) = (counts[0].lock().map(|v| v.clone()), counts[1].lock().map(|v| v.clone()));
    let (a, b) = (a.unwrap_or_default(), b.unwrap_or_default());
    if let Some(s) = (0..n - 1).find(|&s| a.get(s).copied().unwrap_or(0) + b.get(s).copied().unwrap_or(0) != segs.len()) {
        let from = (c.rank() + n - 1) % n;
        return Err(Error::Protocol {
            from: format!("rank {}", c.world_rank(from)),
            detail: format!(
                "{what} step {s}: the two links carried {} + {} segments of a block of {} (the ranks disagree on the split)",
                a.get(s).copied().unwrap_or(0),
                b.get(s).copied().unwrap_or(0),
                segs.len()
            ),
        });
    }
    Ok(())
}

struct Lane<'a> {
    /// The striped communicator (for its counters).
    c: &'a Communicator,
    /// This link's view.
    lane: &'a Communicator,
    side: usize,
    n: usize,
    m: usize,
    segs: &'a [Range<usize>],
    what: &'static str,
}

impl Lane<'_> {
    /// The whole ring on this link; returns how many segments it received at each step.
    fn ring(&self, first: &Ends, out: Shared, blocks: &[&[u8]], red: Option<(DType, ReduceOp)>) -> Result<Vec<usize>> {
        let (n, me, m) = (self.n, self.lane.rank(), self.m);
        let dl = self.c.deadline();
        let mut carry = Carry { segs: Vec::new(), partials: Vec::new() };
        let mut got = Vec::with_capacity(n - 1);
        for s in 0..n - 1 {
            // The blocks sent and received at step s (the communicator's ring conventions).
            let (si, ri) = match red {
                None => ((me + n - s) % n, (me + 2 * n - s - 1) % n),
                Some(_) => ((me + 2 * n - s - 1) % n, (me + 2 * n - s - 2) % n),
            };
            let last = s == n - 2;
            let mut rx = Rx::new(self, ri, red, last, out, blocks);
            rx.post()?;
            let mut next = 0;
            loop {
                // Before each send, take in what arrived meanwhile (it lands by itself; this
                // only finishes it and posts the next zone, so the next one can land too).
                while rx.ready() {
                    rx.take(dl)?;
                }
                let k = if s == 0 {
                    self.drained(&mut rx, dl)?;
                    first.claim(self.side)
                } else {
                    carry.segs.get(next).copied()
                };
                let Some(k) = k else { break };
                let r = self.segs[k].clone();
                let bytes: &[u8] = match red {
                    // SAFETY: segment k of block si is this link's alone (claimed at step 0,
                    // received by this link at the step before otherwise), and no zone of this
                    // step covers block si: nothing else touches these bytes while we send.
                    None => unsafe { out.range(si * m + r.start..si * m + r.end) },
                    Some(_) if s == 0 => &blocks[si][r.clone()],
                    Some(_) => &carry.partials[next],
                };
                self.lane.csend((me + 1) % n, bytes, dl)?;
                self.c.count_lane_bytes(self.side, bytes.len());
                next += 1;
            }
            self.lane.csend((me + 1) % n, &[], dl)?;
            while !rx.done {
                rx.take(dl)?;
            }
            got.push(rx.received.len());
            carry = Carry { segs: rx.received, partials: rx.partials };
        }
        Ok(got)
    }
}

impl Lane<'_> {
    /// Waits until this link holds no more than [`AHEAD`] of its rate unacknowledged towards
    /// the next rank (where the backend can tell), taking in arrivals meanwhile. A claim made
    /// earlier would queue behind bytes the link has not delivered yet — on a link with a
    /// deep queue, long after the other link could have sent it.
    fn drained(&self, rx: &mut Rx<'_, '_>, dl: Instant) -> Result<()> {
        let link = self.lane.l();
        let to = self.lane.members[(self.lane.rank() + 1) % self.n];
        let rate = link.info().bandwidth_bytes_per_s.max(1.0);
        let limit = (rate * AHEAD.as_secs_f64()) as usize;
        let start = Instant::now();
        loop {
            let Some(q) = link.unacked_bytes(to).filter(|&q| q > limit) else { return Ok(()) };
            let now = Instant::now();
            if now >= dl {
                return Err(Error::Timeout {
                    what: format!("{}: {q} bytes still unacknowledged on link {}", self.what, link.info().name),
                    after: now.saturating_duration_since(start),
                });
            }
            let wait = Duration::from_secs_f64(((q - limit) as f64 / rate).clamp(50e-6, 1e-3));
            rx.poll((now + wait).min(dl))?;
        }
    }
}

/// The receiving half of one step on one link.
struct Rx<'a, 'b> {
    lane: &'a Lane<'b>,
    /// The block received at this step.
    ri: usize,
    red: Option<(DType, ReduceOp)>,
    /// The last step of a reduce-scatter writes the output; earlier ones keep partial sums.
    last: bool,
    out: Shared,
    blocks: &'a [&'a [u8]],
    /// The posted receive: its segment (None: only the terminator may come) and, for a partial
    /// sum, the buffer it lands in.
    posted: Option<(RecvHandle, Option<usize>, Option<Vec<u8>>)>,
    received: Vec<usize>,
    partials: Vec<Vec<u8>>,
    done: bool,
}

impl<'a, 'b> Rx<'a, 'b> {
    fn new(
        lane: &'a Lane<'b>,
        ri: usize,
        red: Option<(DType, ReduceOp)>,
        last: bool,
        out: Shared,
        blocks: &'a [&'a [u8]],
    ) -> Self {
        Rx { lane, ri, red, last, out, blocks, posted: None, received: Vec::new(), partials: Vec::new(), done: false }
    }

    fn from(&self) -> usize {
        (self.lane.lane.rank() + self.lane.n - 1) % self.lane.n
    }

    /// Where segment `k` of this step lands: the output, or a fresh partial-sum buffer.
    fn zone(&self, k: usize, fresh: &mut Option<Vec<u8>>) -> (*mut u8, usize) {
        let r = self.lane.segs[k].clone();
        match (self.red, self.last) {
            (Some(_), false) => {
                let v = fresh.insert(vec![0u8; r.len()]);
                (v.as_mut_ptr(), r.len())
            }
            _ => {
                let base = if self.red.is_some() { 0 } else { self.ri * self.lane.m };
                (self.out.ptr.wrapping_add(base + r.start), r.len())
            }
        }
    }

    /// Posts the receive of this link's next message: the next segment on its side if the
    /// grid has one left, else only the terminator may come.
    fn post(&mut self) -> Result<()> {
        let k_total = self.lane.segs.len();
        let j = self.received.len();
        let lane = self.lane.lane;
        let src = lane.members[self.from()];
        let (h, k, buf) = if j < k_total {
            let k = nth(self.lane.side, j, k_total);
            let mut fresh = None;
            let (ptr, len) = self.zone(k, &mut fresh);
            // SAFETY: `ptr..ptr+len` is segment k of the output (inside it: the grid covers
            // 0..m and the output holds this block) or a fresh buffer kept beside the handle.
            // Only the message carrying segment k writes there, and exactly one message
            // carries it (module doc); the other link may point a zone at the same bytes only
            // when its message is the empty terminator, which lands nowhere. The handle is
            // waited on before this step ends, or dropped after an abort (drop waits for a
            // writer in progress), before the buffers end.
            let h = unsafe { lane.l().irecv_into(src, lane.coll_tag(), ptr, len) }?;
            (h, Some(k), fresh)
        } else {
            (lane.cpost(self.from())?, None, None)
        };
        self.posted = Some((h, k, buf));
        Ok(())
    }

    fn ready(&self) -> bool {
        !self.done && self.posted.as_ref().is_some_and(|(h, _, _)| h.is_ready())
    }

    /// Waits for the posted message and places it; posts the next unless it ended the part.
    fn take(&mut self, dl: Instant) -> Result<()> {
        let Some((h, k, buf)) = self.posted.take() else { return Ok(()) };
        let msg = h.wait(dl)?;
        self.accept(msg, k, buf)
    }

    /// Waits for the posted message until `until` at most (returning early when it comes),
    /// and takes it if it came; the link's failure is an error here too.
    fn poll(&mut self, until: Instant) -> Result<()> {
        let Some((h, _, _)) = self.posted.as_mut().filter(|_| !self.done) else {
            std::thread::sleep(until.saturating_duration_since(Instant::now()));
            return Ok(());
        };
        if let Some(msg) = h.poll_until(until)? {
            if let Some((_, k, buf)) = self.posted.take() {
                return self.accept(msg, k, buf);
            }
        }
        Ok(())
    }

    /// Places a received message (a segment, or the terminator that ends this link's part)
    /// and posts the next receive.
    fn accept(&mut self, msg: RecvBuf, k: Option<usize>, buf: Option<Vec<u8>>) -> Result<()> {
        if msg.is_empty() {
            self.done = true;
            return Ok(());
        }
        let from = self.from();
        let Some(k) = k else {
            return Err(Error::LengthMismatch { op: self.lane.what, peer: from, expected: 0, got: msg.len() });
        };
        let r = self.lane.segs[k].clone();
        if msg.len() != r.len() {
            return Err(Error::LengthMismatch { op: self.lane.what, peer: from, expected: r.len(), got: msg.len() });
        }
        self.place(k, &msg, buf);
        self.received.push(k);
        self.post()
    }

    /// Puts a received segment where it belongs (copying it if it did not land) and adds this
    /// rank's share for a reduce-scatter.
    fn place(&mut self, k: usize, msg: &RecvBuf, buf: Option<Vec<u8>>) {
        let r = self.lane.segs[k].clone();
        match (self.red, buf) {
            (Some((dtype, op)), Some(mut v)) => {
                if !msg.is_landed() {
                    msg.copy_to(&mut v);
                }
                reduce_into(dtype, &mut v, &self.blocks[self.ri][r], op);
                self.partials.push(v);
            }
            (red, _) => {
                let base = if red.is_some() { 0 } else { self.ri * self.lane.m };
                // SAFETY: segment k of this step is carried by this message only (module
                // doc), so this link is its only writer; the zone's handle has completed.
                let dst = unsafe { self.out.range(base + r.start..base + r.end) };
                if !msg.is_landed() {
                    msg.copy_to(dst);
                }
                if let Some((dtype, op)) = red {
                    reduce_into(dtype, dst, &self.blocks[self.ri][r], op);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_covers_the_block_in_whole_elements() {
        for (m, es) in [(0usize, 4usize), (1, 1), (4, 4), (1000, 4), ((1 << 20) + 12, 4), (64 << 20, 8), (3 << 20, 2)] {
            let g = grid(m, es, 1 << 20);
            assert_eq!(g.first().map_or(0, |r| r.start), 0);
            assert_eq!(g.last().map_or(0, |r| r.end), m);
            for w in g.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            assert!(g.iter().all(|r| !r.is_empty() && r.start % es == 0 && r.len() <= 1 << 20));
            assert!(g.len() <= SEGMENTS_PER_BLOCK.max(m.div_ceil(MIN_SEGMENT)) + 1, "m={m}: {} segments", g.len());
        }
        assert_eq!(grid(16 << 20, 4, 1 << 20).len(), SEGMENTS_PER_BLOCK);
    }

    #[test]
    fn the_two_ends_hand_out_every_segment_once() {
        for k in [0usize, 1, 2, 7, 100] {
            let e = Ends::new(k);
            let mut got = vec![0u32; k];
            let mut side = 0;
            while let Some(i) = e.claim(side) {
                got[i] += 1;
                side = (side + 1 + i % 3) % 2;
            }
            assert!(got.iter().all(|&c| c == 1), "k={k}: {got:?}");
            assert_eq!(e.claim(0), None);
            assert_eq!(e.claim(1), None);
        }
        // Two threads racing for the same ends.
        let e = Ends::new(10_000);
        let taken: Vec<Vec<usize>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|side| {
                    let e = &e;
                    s.spawn(move || std::iter::from_fn(|| e.claim(side)).collect::<Vec<_>>())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(taken[0].len() + taken[1].len(), 10_000);
        assert!(taken[0].windows(2).all(|w| w[1] == w[0] + 1) && taken[0].first().is_none_or(|&f| f == 0));
        assert!(taken[1].windows(2).all(|w| w[1] + 1 == w[0]) && taken[1].first().is_none_or(|&f| f == 9_999));
    }
}

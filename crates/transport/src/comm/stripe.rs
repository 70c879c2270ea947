//! Several links at once. A *striped* communicator splits every collective — and typed
//! point-to-point transfers — over all its links, drives the parts concurrently (one thread per
//! link, each on its own link view with its own tag space) and joins them. This is HSDP's
//! mechanism: links are independent, so their bandwidths add up.
//!
//! How the bytes are split: with two links, all-gather and reduce-scatter balance *dynamically*
//! (`balance.rs`): each link takes the next segment as it frees up, so a link that runs slow in
//! this very call carries less of it. Everything else — and every collective of a communicator
//! made with [`Communicator::with_static_split`] or over more than two links — splits by fixed
//! fractions, from the caller (a planner) or the links' declared or probed bandwidths.

use ironweave_units::Locked;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Communicator;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::link::BufMut;

/// How a striped communicator splits its collectives.
#[derive(Debug)]
pub(crate) struct Stripe {
    /// Fixed fractions per link (normalised): the static split, and the largest one picks the
    /// link of small collectives.
    pub(crate) fractions: Vec<f64>,
    /// All-gather and reduce-scatter over two links balance segment by segment.
    pub(crate) dynamic: bool,
    /// Bytes this rank sent on each link through striped collectives: the counter that shows
    /// how a dynamic split actually fell.
    pub(crate) sent: Vec<AtomicU64>,
}

impl Communicator {
    /// A view of this group that splits collectives over all its links. `fractions[i]` of the
    /// bytes travel on link i (normalised; `None` means proportional to each link's
    /// bandwidth) for collectives split statically; over two links, all-gather and
    /// reduce-scatter balance dynamically instead (see [`Communicator::with_static_split`]).
    /// Collectives of at most `small_bytes` use only the link with the largest fraction.
    /// `split` and `dup` keep the striping.
    pub fn striped(&self, fractions: Option<Vec<f64>>) -> Result<Communicator> {
        let k = self.links.len();
        let f = fractions.unwrap_or_else(|| self.links.iter().map(|l| l.info().bandwidth_bytes_per_s).collect());
        if f.len() != k || f.iter().any(|x| !x.is_finite() || *x < 0.0) || f.iter().sum::<f64>() <= 0.0 {
            return Err(Error::InvalidArgument(format!(
                "striping needs {k} non-negative fractions (one per link) with a positive sum, got {f:?}"
            )));
        }
        let sum: f64 = f.iter().sum();
        let mut c = self.view(0, 0xfffe_0000)?;
        c.stripe = Some(
            Stripe {
                fractions: f.iter().map(|x| x / sum).collect(),
                dynamic: k == 2,
                sent: (0..k).map(|_| AtomicU64::new(0)).collect(),
            }
            .into(),
        );
        Ok(c)
    }

    /// The same striped communicator with every collective split by its fixed fractions (no
    /// dynamic balancing): for a planner that wants exactly its split, and for comparisons.
    /// Every member must make the same choice. A no-op on an unstriped communicator.
    pub fn with_static_split(mut self) -> Communicator {
        if let Some(s) = &self.stripe {
            let sent = (0..s.sent.len()).map(|_| AtomicU64::new(0)).collect();
            self.stripe = Some(Stripe { fractions: s.fractions.clone(), dynamic: false, sent }.into());
        }
        self
    }

    /// The fixed fractions of a striped communicator.
    pub fn stripe_fractions(&self) -> Option<&[f64]> {
        self.stripe.as_ref().map(|s| &s.fractions[..])
    }

    /// Whether all-gather and reduce-scatter balance dynamically over the links.
    pub fn stripe_is_dynamic(&self) -> bool {
        self.stripe.as_ref().is_some_and(|s| s.dynamic)
    }

    /// Bytes this rank has sent on each link through this striped communicator's collectives
    /// (shared with its splits and dups); `None` when it is not striped. Differences between
    /// two readings show how a dynamic split fell.
    pub fn stripe_bytes_sent(&self) -> Option<Vec<u64>> {
        self.stripe.as_ref().map(|s| s.sent.iter().map(|a| a.load(Ordering::Relaxed)).collect())
    }

    /// Counts `bytes` sent on link `i` by a striped collective.
    pub(crate) fn count_lane_bytes(&self, i: usize, bytes: usize) {
        if let Some(a) = self.stripe.as_ref().and_then(|s| s.sent.get(i)) {
            a.fetch_add(bytes as u64, Ordering::Relaxed);
        }
    }

    /// Splits `count` units by the fractions: floors, then the remainder to the largest
    /// fractional parts (ties to the lower link). Every rank computes the same split.
    pub fn stripe_counts(&self, count: usize) -> Vec<usize> {
        let Some(f) = self.stripe_fractions() else { return vec![count] };
        let exact: Vec<f64> = f.iter().map(|x| x * count as f64).collect();
        let mut out: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
        let mut order: Vec<usize> = (0..f.len()).collect();
        order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
        let mut left = count - out.iter().sum::<usize>().min(count);
        for i in order.into_iter().cycle().take(left.max(1) * f.len()) {
            if left == 0 {
                break;
            }
            out[i] += 1;
            left -= 1;
        }
        out
    }

    /// The link a small striped collective uses alone.
    fn main_lane(&self) -> usize {
        let f = self.stripe_fractions().unwrap_or(&[1.0]);
        (0..f.len()).fold(0, |best, i| if f[i] > f[best] { i } else { best })
    }

    /// The striped communicator's per-link view (its own tag space, no striping).
    pub(crate) fn lane(&self, i: usize) -> Result<Communicator> {
        self.view(i, 0xfffd_0000)
    }

    /// Whether a collective of `bytes` (the same on every rank) is striped, and if not, on
    /// which link it runs.
    pub(crate) fn stripe_plan(&self, bytes: usize) -> Option<std::result::Result<(), usize>> {
        self.stripe.as_ref()?;
        Some(if bytes <= self.opts.small_bytes { Err(self.main_lane()) } else { Ok(()) })
    }

    /// Runs `f(lane, i)` for every link `i` in `active` on its own thread. The first failure
    /// aborts every link, so no lane waits for a part that will never come.
    pub(crate) fn run_lanes<'s>(
        &'s self,
        active: &[bool],
        f: impl Fn(&Communicator, usize) -> Result<()> + Sync + 's,
    ) -> Result<()> {
        let lanes: Vec<Communicator> = (0..self.links.len()).map(|i| self.lane(i)).collect::<Result<_>>()?;
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = lanes
                .iter()
                .enumerate()
                .filter(|(i, _)| active[*i])
                .map(|(i, lane)| {
                    let f = &f;
                    s.spawn(move || {
                        let r = f(lane, i);
                        crate::threads::count_this_thread();
                        if let Err(e) = &r {
                            // A peer's failure travels on as itself (every link names the lost
                            // rank); our own is said with the link it happened on.
                            let peer_caused =
                                matches!(e, Error::PeerLost { .. } | Error::PeerAborted { .. } | Error::PeerClosed { .. });
                            for l in self.links.iter() {
                                if peer_caused {
                                    l.abort_with(e);
                                } else {
                                    l.abort(&format!("striped collective failed on link {i}: {e}"));
                                }
                            }
                        }
                        r
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::InvalidArgument("a lane panicked".into())))).collect()
        });
        // Report the root cause rather than the aborts it caused on other lanes.
        let mut errs: Vec<Error> = results.into_iter().filter_map(Result::err).collect();
        errs.sort_by_key(|e| matches!(e, Error::Aborted { .. } | Error::PeerAborted { .. }));
        errs.into_iter().next().map_or(Ok(()), Err)
    }

    /// Byte ranges of `units` units of `unit` bytes, split by the fractions.
    fn stripe_ranges(&self, units: usize, unit: usize) -> Vec<Range<usize>> {
        let mut at = 0;
        self.stripe_counts(units)
            .into_iter()
            .map(|c| {
                let r = at * unit..(at + c) * unit;
                at += c;
                r
            })
            .collect()
    }

    pub(crate) fn striped_all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let ranges = self.stripe_ranges(buf.len() / dtype.size(), dtype.size());
        let pieces = Mut(split_by(buf, &ranges));
        let active: Vec<bool> = ranges.iter().map(|r| !r.is_empty()).collect();
        self.run_lanes(&active, |lane, i| lane.all_reduce_buf(BufMut::Host(pieces.take(i)), dtype, op))
    }

    pub(crate) fn striped_broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let ranges = self.stripe_ranges(buf.len(), 1);
        let pieces = Mut(split_by(buf, &ranges));
        let active: Vec<bool> = ranges.iter().map(|r| !r.is_empty()).collect();
        self.run_lanes(&active, |lane, i| lane.broadcast_buf(BufMut::Host(pieces.take(i)), root))
    }

    pub(crate) fn striped_all_gather(&self, inb: &[u8], outb: &mut [u8]) -> Result<()> {
        let (n, m, k) = (self.size(), inb.len(), self.links.len());
        if self.stripe_is_dynamic() {
            outb[self.rank() * m..(self.rank() + 1) * m].copy_from_slice(inb);
            if n == 1 {
                return Ok(());
            }
            return super::balance::run(self, super::balance::Op::Gather { out: outb }, m);
        }
        let ranges = self.stripe_ranges(m, 1);
        let active: Vec<bool> = ranges.iter().map(|r| !r.is_empty()).collect();
        // Lane i owns piece i of every rank's block: strided, disjoint, no staging copy.
        let mut lanes: Vec<Vec<&mut [u8]>> = (0..k).map(|_| Vec::with_capacity(n)).collect();
        for block in outb.chunks_mut(m.max(1)).take(n) {
            let mut rest = block;
            for (i, r) in ranges.iter().enumerate() {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
                lanes[i].push(head);
                rest = tail;
            }
        }
        let lanes: Vec<std::sync::Mutex<Vec<&mut [u8]>>> = lanes.into_iter().map(std::sync::Mutex::new).collect();
        self.run_lanes(&active, |lane, i| {
            let mut pieces = lanes[i].locked();
            lane.all_gather_pieces(&inb[ranges[i].clone()], &mut pieces)?;
            self.count_lane_bytes(i, (n - 1) * ranges[i].len());
            Ok(())
        })
    }

    pub(crate) fn striped_reduce_scatter(&self, inb: &[u8], outb: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let (n, m) = (self.size(), outb.len());
        if self.stripe_is_dynamic() {
            if n == 1 {
                outb.copy_from_slice(inb);
            } else {
                let blocks: Vec<&[u8]> = (0..n).map(|j| &inb[j * m..(j + 1) * m]).collect();
                super::balance::run(self, super::balance::Op::Reduce { blocks, out: &mut *outb, dtype, op }, m)?;
            }
            if op == ReduceOp::Avg {
                crate::dtype::finish_avg(dtype, outb, n);
            }
            return Ok(());
        }
        let ranges = self.stripe_ranges(m / dtype.size(), dtype.size());
        let active: Vec<bool> = ranges.iter().map(|r| !r.is_empty()).collect();
        let pieces = Mut(split_by(outb, &ranges));
        self.run_lanes(&active, |lane, i| {
            let r = &ranges[i];
            let blocks: Vec<&[u8]> = (0..n).map(|j| &inb[j * m + r.start..j * m + r.end]).collect();
            lane.reduce_scatter_blocks(&blocks, pieces.take(i), dtype, op)?;
            self.count_lane_bytes(i, (n - 1) * r.len());
            Ok(())
        })
    }

    pub(crate) fn striped_all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let n = self.size();
        let k = self.links.len();
        // Block j is split by the same fractions on both sides (sender's send_counts[j] is the
        // receiver's recv_counts[me]).
        let parts = |c: &[usize]| -> Vec<Vec<usize>> { c.iter().map(|&x| self.stripe_counts(x)).collect() };
        let (sp, rp) = (parts(send_counts), parts(recv_counts));
        let offsets = |c: &[usize]| -> Vec<usize> { c.iter().scan(0, |a, &x| Some(std::mem::replace(a, *a + x))).collect() };
        let (so, ro) = (offsets(send_counts), offsets(recv_counts));
        let received: Vec<std::sync::Mutex<Vec<T>>> = (0..k).map(|_| std::sync::Mutex::new(Vec::new())).collect();
        // Every lane runs: a lane with nothing to send here may still have data coming.
        self.run_lanes(&vec![true; k], |lane, i| {
            let before = |p: &[usize]| p[..i].iter().sum::<usize>();
            let sc: Vec<usize> = (0..n).map(|j| sp[j][i]).collect();
            let rc: Vec<usize> = (0..n).map(|j| rp[j][i]).collect();
            let mut s: Vec<T> = Vec::with_capacity(sc.iter().sum());
            for j in 0..n {
                s.extend_from_slice(&send[so[j] + before(&sp[j])..][..sc[j]]);
            }
            let mut r = vec![T::zeroed(); rc.iter().sum()];
            lane.all_to_all_v(&s, &sc, &mut r, &rc)?;
            *received[i].locked() = r;
            Ok(())
        })?;
        for (i, r) in received.into_iter().enumerate() {
            let r = r.into_inner().unwrap_or_else(|e| e.into_inner());
            let mut at = 0;
            for j in 0..n {
                let c = rp[j][i];
                let dst = ro[j] + rp[j][..i].iter().sum::<usize>();
                recv[dst..dst + c].copy_from_slice(&r[at..at + c]);
                at += c;
            }
        }
        Ok(())
    }

    pub(crate) fn striped_send(&self, peer: usize, tag: u32, data: &[u8]) -> Result<()> {
        let ranges = self.stripe_ranges(data.len(), 1);
        let active: Vec<bool> = ranges.iter().map(|r| !r.is_empty()).collect();
        self.run_lanes(&active, |lane, i| lane.send_bytes(peer, tag, &data[ranges[i].clone()]))
    }

    pub(crate) fn striped_recv(&self, peer: usize, tag: u32, out: &mut [u8]) -> Result<()> {
        let ranges = self.stripe_ranges(out.len(), 1);
        let active: Vec<bool> = ranges.iter().map(|r| !r.is_empty()).collect();
        let pieces = Mut(split_by(out, &ranges));
        self.run_lanes(&active, |lane, i| lane.recv::<u8>(peer, tag, pieces.take(i)))
    }
}

/// Disjoint mutable pieces handed out once each to the lane threads.
struct Mut<'a>(Vec<std::sync::Mutex<Option<&'a mut [u8]>>>);

impl<'a> Mut<'a> {
    fn take(&self, i: usize) -> &'a mut [u8] {
        self.0[i].locked().take().unwrap_or_default()
    }
}

/// Splits `buf` into the consecutive `ranges` (which cover it in order).
fn split_by<'a>(mut buf: &'a mut [u8], ranges: &[Range<usize>]) -> Vec<std::sync::Mutex<Option<&'a mut [u8]>>> {
    let mut out = Vec::with_capacity(ranges.len());
    for r in ranges {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(r.len());
        out.push(std::sync::Mutex::new(Some(head)));
        buf = tail;
    }
    out
}

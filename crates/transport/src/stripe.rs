//! Several links at once. A *striped* communicator splits every collective — and typed
//! point-to-point transfers — over all its links by fractions, drives the parts concurrently
//! (one thread per link, each on its own link view with its own tag space) and joins them.
//! This is HSDP's mechanism: links are independent, so their bandwidths add up. The fractions
//! come from the caller (a planner) or default to the links' declared or probed bandwidths.

use std::ops::Range;

use crate::comm::Communicator;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::link::BufMut;

impl Communicator {
    /// A view of this group that splits collectives over all its links: `fractions[i]` of the
    /// bytes travel on link i (normalised; `None` means proportional to each link's
    /// bandwidth). Collectives of at most `small_bytes` use only the link with the largest
    /// fraction. `split` keeps the striping.
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
        c.stripe = Some(f.iter().map(|x| x / sum).collect::<Vec<_>>().into());
        Ok(c)
    }

    /// The fractions of a striped communicator.
    pub fn stripe_fractions(&self) -> Option<&[f64]> {
        self.stripe.as_deref()
    }

    /// Splits `count` units by the fractions: floors, then the remainder to the largest
    /// fractional parts (ties to the lower link). Every rank computes the same split.
    pub fn stripe_counts(&self, count: usize) -> Vec<usize> {
        let Some(f) = self.stripe.as_deref() else { return vec![count] };
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
        let f = self.stripe.as_deref().unwrap_or(&[1.0]);
        (0..f.len()).fold(0, |best, i| if f[i] > f[best] { i } else { best })
    }

    /// The striped communicator's per-link view (its own tag space, no striping).
    fn lane(&self, i: usize) -> Result<Communicator> {
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
    fn run_lanes<'s>(&'s self, active: &[bool], f: impl Fn(&Communicator, usize) -> Result<()> + Sync + 's) -> Result<()> {
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
                        if let Err(e) = &r {
                            for l in self.links.iter() {
                                l.abort(&format!("striped collective failed on link {i}: {e}"));
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
            let mut pieces = lanes[i].lock().unwrap_or_else(|e| e.into_inner());
            lane.all_gather_pieces(&inb[ranges[i].clone()], &mut pieces)
        })
    }

    pub(crate) fn striped_reduce_scatter(&self, inb: &[u8], outb: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let (n, m) = (self.size(), outb.len());
        let ranges = self.stripe_ranges(m / dtype.size(), dtype.size());
        let active: Vec<bool> = ranges.iter().map(|r| !r.is_empty()).collect();
        let pieces = Mut(split_by(outb, &ranges));
        self.run_lanes(&active, |lane, i| {
            let r = &ranges[i];
            let blocks: Vec<&[u8]> = (0..n).map(|j| &inb[j * m + r.start..j * m + r.end]).collect();
            lane.reduce_scatter_blocks(&blocks, pieces.take(i), dtype, op)
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
            *received[i].lock().unwrap_or_else(|e| e.into_inner()) = r;
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
        self.0[i].lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default()
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

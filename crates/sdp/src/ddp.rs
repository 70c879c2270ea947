//! Data-parallel gradients averaged in buckets during the backward pass (PyTorch DDP's design),
//! for any model: the caller numbers its backward stages (0 finishes first) and says after
//! which stage each parameter's gradient is final; parameters are grouped into buckets in that
//! order; a bucket's average starts on a communication thread as soon as its last gradient is
//! final and travels while the remaining stages compute ([`backward_with_buckets`]).
//!
//! Every element is averaged in rank order, `((g0 + g1) + g2 + ...) / n`, whatever bucket it
//! falls in ([`ordered_avg`]): bucketed and single-bucket runs are bit-identical, for any world
//! size (a ring all-reduce sums an element in an order that depends on where its chunk falls,
//! so two bucketings would differ in the last bits).

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use ironweave_profile::{CommKind, MonotonicClock, Profiler};
use ironweave_transport::Communicator;

use crate::{Result, SdpError};

/// Default bucket size. DDP's 25 MB is a few percent of a BERT-scale gradient; ours are a few
/// MB, so 512 KiB gives the backward several buckets.
pub const DEFAULT_BUCKET_BYTES: usize = 512 << 10;

/// One bucket: parameter indices in the order their gradients are packed, and the backward
/// stage after which all of them are final.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Parameter indices, packed in this order.
    pub params: Vec<usize>,
    /// The backward stage after which every gradient of the bucket is final.
    pub ready_after: usize,
    /// Floats in the bucket.
    pub len: usize,
}

/// Groups parameters `(index, stage, floats)` — `stage`: the backward stage after which the
/// parameter's gradient is final — into buckets of at most `bucket_bytes` (a larger parameter
/// gets a bucket of its own), in backward order (ties by index); `None`: one bucket, ready
/// after `last_stage` (the unbucketed baseline).
pub fn plan_buckets(params: &[(usize, usize, usize)], bucket_bytes: Option<usize>, last_stage: usize) -> Vec<Bucket> {
    let mut order: Vec<(usize, usize, usize)> = params.iter().map(|&(i, stage, n)| (stage, i, n)).collect();
    order.sort_unstable();
    let cap = bucket_bytes.map(|b| (b / 4).max(1));
    let mut out: Vec<Bucket> = Vec::new();
    for (stage, i, n) in order {
        match out.last_mut() {
            Some(b) if cap.is_none_or(|c| b.len + n <= c) => {
                b.params.push(i);
                b.len += n;
                b.ready_after = stage;
            }
            _ => out.push(Bucket { params: vec![i], ready_after: stage, len: n }),
        }
    }
    if bucket_bytes.is_none() {
        if let Some(b) = out.last_mut() {
            b.ready_after = last_stage;
        }
    }
    out
}

/// Averages `buf` over the group so that every element is summed in rank order: a direct
/// reduce-scatter (element chunk `j` goes to rank `j`, which adds the n parts in rank order),
/// then an all-gather. Moves the same bytes as a ring all-reduce.
pub fn ordered_avg(comm: &Communicator, buf: &mut [f32]) -> ironweave_transport::Result<()> {
    let n = comm.size();
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    let c = buf.len().div_ceil(n);
    let mut send = vec![0f32; n * c];
    send[..buf.len()].copy_from_slice(buf);
    let mut parts = vec![0f32; n * c];
    comm.all_to_all(&send, &mut parts)?;
    let mut acc = parts[..c].to_vec();
    for k in 1..n {
        for (a, p) in acc.iter_mut().zip(&parts[k * c..(k + 1) * c]) {
            *a += *p;
        }
    }
    let inv = n as f32;
    acc.iter_mut().for_each(|a| *a /= inv);
    comm.all_gather(&acc, &mut send)?;
    buf.copy_from_slice(&send[..buf.len()]);
    Ok(())
}

/// What the data-parallel gradient averaging of one iteration did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GradSyncStats {
    /// Buckets averaged.
    pub buckets: usize,
    /// Seconds the communication thread spent averaging.
    pub comm_s: f64,
    /// Of those, seconds during which this rank's backward pass computed.
    pub hidden_s: f64,
}

/// A finished bucket: its index, averaged floats and time on the wire.
type Done = (usize, Vec<f32>, Instant, Instant);

/// Hands buckets to the communication thread as the backward pass finishes their stages.
#[derive(Debug)]
pub struct Handoff<'a> {
    buckets: &'a [Bucket],
    next: usize,
    to_comm: Option<mpsc::Sender<(usize, Vec<f32>)>>,
    from_comm: &'a mpsc::Receiver<ironweave_transport::Result<Done>>,
    compute: Vec<(Instant, Instant)>,
}

impl Handoff<'_> {
    /// Backward stage `stage` has finished: every bucket ready after it (and not handed over
    /// yet) starts averaging, packed from `grads` (indexed by parameter).
    pub fn stage_done(&mut self, stage: usize, grads: &[Vec<f32>]) -> Result<()> {
        let Some(tx) = &self.to_comm else { return Ok(()) };
        while self.next < self.buckets.len() && self.buckets[self.next].ready_after <= stage {
            let bk = &self.buckets[self.next];
            let mut flat = Vec::with_capacity(bk.len);
            for &i in &bk.params {
                let g = grads
                    .get(i)
                    .ok_or_else(|| SdpError::Invalid(format!("bucket parameter {i} is not among {} gradients", grads.len())))?;
                flat.extend_from_slice(g);
            }
            if tx.send((self.next, flat)).is_err() {
                // the thread stops only after a failed average: report that failure
                return Err(match self.from_comm.try_iter().find_map(|r| r.err()) {
                    Some(e) => e.into(),
                    None => SdpError::Invalid("the gradient communication thread stopped early".into()),
                });
            }
            self.next += 1;
        }
        Ok(())
    }

    /// Records a span of backward compute (what the averaging is measured against).
    pub fn computed(&mut self, start: Instant, end: Instant) {
        self.compute.push((start, end));
    }
}

/// Runs `backward(grads, handoff)` — which fills `grads` (one vector per parameter) stage by
/// stage and calls [`Handoff::stage_done`] after each — while each bucket is averaged over
/// `comm` on a communication thread as soon as its stage is done. Afterwards every bucketed
/// parameter's gradient in `grads` is the group's average. `comm: None` (alone) averages
/// nothing. `prof` records each average as training communication on link 0.
pub fn backward_with_buckets<R, E: From<SdpError>>(
    comm: Option<&Communicator>,
    buckets: &[Bucket],
    prof: Option<&Arc<Profiler<MonotonicClock>>>,
    grads: &mut [Vec<f32>],
    backward: impl FnOnce(&mut [Vec<f32>], &mut Handoff<'_>) -> std::result::Result<R, E>,
) -> std::result::Result<(R, GradSyncStats), E> {
    std::thread::scope(|s| {
        let (to_comm, from_main) = mpsc::channel::<(usize, Vec<f32>)>();
        let (to_main, from_comm) = mpsc::channel::<ironweave_transport::Result<Done>>();
        let worker = comm.filter(|c| c.size() > 1).map(|comm| {
            let prof = prof.cloned();
            std::thread::Builder::new().name("ddp-comm".into()).spawn_scoped(s, move || {
                // buckets are averaged in the order they are handed over (the same on every rank)
                for (k, mut flat) in from_main {
                    let t0 = Instant::now();
                    let r = {
                        let _c = prof.as_ref().map(|p| p.comm(0, CommKind::Training, (flat.len() * 4) as u64));
                        ordered_avg(comm, &mut flat)
                    };
                    let failed = r.is_err();
                    let _ = to_main.send(r.map(|()| (k, flat, t0, Instant::now())));
                    if failed {
                        break;
                    }
                }
                // communication's CPU (`ironweave_transport::threads::comm_cpu_ns`)
                ironweave_transport::threads::count_this_thread();
            })
        });
        let worker =
            worker.transpose().map_err(|e| SdpError::Invalid(format!("cannot start the gradient communication thread: {e}")))?;
        let mut h = Handoff {
            buckets,
            next: 0,
            to_comm: worker.is_some().then_some(to_comm),
            from_comm: &from_comm,
            compute: Vec::new(),
        };
        let r = backward(grads, &mut h);
        // the thread ends once its channel closes, whatever the backward did
        let (handed, compute) = (h.next, std::mem::take(&mut h.compute));
        drop(h);
        let r = r?;
        let mut stats = GradSyncStats::default();
        if worker.is_some() {
            let mut spans = Vec::with_capacity(handed);
            for _ in 0..handed {
                let (k, flat, c0, c1) = from_comm
                    .recv()
                    .map_err(|_| SdpError::Invalid("the gradient communication thread ended without answering".into()))?
                    .map_err(SdpError::from)?;
                let mut off = 0;
                for &i in &buckets[k].params {
                    let n = grads[i].len();
                    grads[i].copy_from_slice(&flat[off..off + n]);
                    off += n;
                }
                spans.push((c0, c1));
            }
            stats = GradSyncStats {
                buckets: spans.len(),
                comm_s: spans.iter().map(|(a, b)| (*b - *a).as_secs_f64()).sum(),
                hidden_s: ironweave_overlap::covered_s(&spans, &compute),
            };
        }
        Ok((r, stats))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_parameter_once_in_backward_order() {
        // (index, stage, floats): stage 0 finishes first
        let p: Vec<(usize, usize, usize)> =
            vec![(0, 3, 100), (1, 3, 50), (2, 2, 64), (3, 2, 128), (4, 1, 64), (5, 0, 8), (6, 0, 80)];
        for cap in [None, Some(4), Some(400), Some(800), Some(10_000)] {
            let b = plan_buckets(&p, cap, 3);
            let mut seen: Vec<usize> = b.iter().flat_map(|b| b.params.clone()).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..p.len()).collect::<Vec<_>>(), "cap {cap:?}");
            assert!(b.windows(2).all(|w| w[0].ready_after <= w[1].ready_after));
            for bk in &b {
                assert_eq!(bk.len, bk.params.iter().map(|&i| p[i].2).sum::<usize>());
                if let Some(c) = cap {
                    assert!(bk.len * 4 <= c || bk.params.len() == 1, "{bk:?} over {c}");
                }
            }
        }
        let one = plan_buckets(&p, None, 3);
        assert_eq!((one.len(), one[0].ready_after), (1, 3));
        let b = plan_buckets(&p, Some(400), 3);
        assert_eq!((b[0].params.clone(), b[0].ready_after), (vec![5, 6], 0));
    }

    #[test]
    fn alone_the_backward_runs_and_nothing_is_averaged() {
        let buckets = plan_buckets(&[(0, 0, 2), (1, 1, 3)], Some(8), 1);
        let mut grads = vec![vec![0.0; 2], vec![0.0; 3]];
        let (r, stats) = backward_with_buckets::<u32, SdpError>(None, &buckets, None, &mut grads, |g, h| {
            g[0] = vec![1.0, 2.0];
            h.stage_done(0, g)?;
            g[1] = vec![3.0, 4.0, 5.0];
            h.stage_done(1, g)?;
            Ok(7)
        })
        .unwrap();
        assert_eq!((r, stats.buckets), (7, 0));
        assert_eq!(grads, vec![vec![1.0, 2.0], vec![3.0, 4.0, 5.0]]);
    }
}

//! The discrete-event engine: compute streams run one op at a time in readiness order; links
//! share their bandwidth among the flows on them (equally within a traffic class; training
//! traffic first when the link gives it priority). Time is virtual: the engine reads no clock
//! and does no IO, and the same DAG gives the same trace, bit for bit.

use serde::{Deserialize, Serialize};

use crate::error::{Result, SimError};

/// Index of a resource.
pub type ResId = usize;
/// Index of an op.
pub type OpId = usize;

/// Traffic class of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    /// Training communication (collectives of the model).
    Training,
    /// Checkpoint traffic.
    Checkpoint,
}

/// A compute stream or a link.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Resource {
    /// Name in timelines.
    pub name: String,
    /// `None` for a compute stream; bytes/s for a link.
    pub bytes_per_s: Option<f64>,
    /// Links: whether training flows take the whole bandwidth while any is active.
    pub priority: bool,
    /// Links: first come, first served — the flow that started first takes the whole bandwidth
    /// until it ends (a host's egress queue with deep buffers), instead of equal shares.
    #[serde(default)]
    pub fifo: bool,
    /// FIFO links: how the two classes meet on the link (see [`Sharing`]). `None`: one queue
    /// for both classes.
    #[serde(default)]
    pub sharing: Option<Sharing>,
}

/// Two classes on one FIFO link that interleave instead of queueing whole transfers behind
/// each other — TCP flows through one shaper queue, packet by packet: each class serves its own
/// transfers first come, first served; while both have bytes on the link the training class
/// gets `training_share` of the rate; and a training transfer that arrives while checkpoint
/// bytes are on the link first waits `queue_wait_s` (the shaper's queue ahead of its first
/// packet). Both are measured on the link, not fitted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sharing {
    /// Fraction of the rate training gets while both classes have bytes on the link, in (0, 1].
    pub training_share: f64,
    /// Seconds a training transfer waits before its bytes move when it finds checkpoint bytes
    /// on the link.
    pub queue_wait_s: f64,
}

/// What an op does.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Work {
    /// Occupy a compute stream for a duration.
    Compute {
        /// The stream.
        res: ResId,
        /// Seconds.
        seconds: f64,
    },
    /// Move bytes over a link after a fixed latency.
    Transfer {
        /// The link.
        res: ResId,
        /// Bytes.
        bytes: f64,
        /// Latency before the bytes flow, seconds.
        latency_s: f64,
        /// Class.
        class: Class,
    },
    /// A marker that completes as soon as its dependencies do.
    Mark,
    /// Completes `seconds` after its dependencies, occupying nothing (a timer).
    Delay {
        /// Seconds.
        seconds: f64,
    },
}

/// One op of the DAG.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Op {
    /// Label in timelines (`L3.fwd`, `ckpt chunk 5`).
    pub name: String,
    /// Category for colouring and accounting (`compute`, `tp-comm`, `ckpt`, ...).
    pub tag: String,
    /// What it does.
    pub work: Work,
    /// Ops that must finish first.
    pub deps: Vec<OpId>,
    /// Earliest start (virtual seconds).
    pub not_before: f64,
}

/// A DAG of ops on resources.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Dag {
    /// Resources.
    pub resources: Vec<Resource>,
    /// Ops, in creation order (which is also the tie-break order).
    pub ops: Vec<Op>,
}

impl Dag {
    /// Add a compute stream.
    pub fn stream(&mut self, name: &str) -> ResId {
        self.resources.push(Resource { name: name.into(), bytes_per_s: None, priority: false, fifo: false, sharing: None });
        self.resources.len() - 1
    }
    /// A first-come-first-served link (see [`Resource::fifo`]).
    pub fn fifo_link(&mut self, name: &str, bytes_per_s: f64) -> ResId {
        let r = self.link(name, bytes_per_s, false);
        self.resources[r].fifo = true;
        r
    }

    /// A FIFO link whose two classes interleave (see [`Sharing`]).
    pub fn shared_link(&mut self, name: &str, bytes_per_s: f64, sharing: Sharing) -> ResId {
        let r = self.fifo_link(name, bytes_per_s);
        self.resources[r].sharing = Some(sharing);
        r
    }

    /// Add a link.
    pub fn link(&mut self, name: &str, bytes_per_s: f64, priority: bool) -> ResId {
        self.resources.push(Resource { name: name.into(), bytes_per_s: Some(bytes_per_s), priority, fifo: false, sharing: None });
        self.resources.len() - 1
    }
    /// Add an op.
    pub fn add(&mut self, name: impl Into<String>, tag: &str, work: Work, deps: Vec<OpId>) -> OpId {
        self.ops.push(Op { name: name.into(), tag: tag.into(), work, deps, not_before: 0.0 });
        self.ops.len() - 1
    }
    /// Compute op.
    pub fn compute(&mut self, name: impl Into<String>, tag: &str, res: ResId, seconds: f64, deps: Vec<OpId>) -> OpId {
        self.add(name, tag, Work::Compute { res, seconds }, deps)
    }
    /// Transfer op.
    #[allow(clippy::too_many_arguments)] // mirrors the fields of Work::Transfer plus the op's own
    pub fn transfer(
        &mut self,
        name: impl Into<String>,
        tag: &str,
        res: ResId,
        bytes: f64,
        latency_s: f64,
        class: Class,
        deps: Vec<OpId>,
    ) -> OpId {
        self.add(name, tag, Work::Transfer { res, bytes, latency_s, class }, deps)
    }
    /// Timer op.
    pub fn delay(&mut self, name: impl Into<String>, seconds: f64, deps: Vec<OpId>) -> OpId {
        self.add(name, "mark", Work::Delay { seconds }, deps)
    }
    /// Marker op.
    pub fn mark(&mut self, name: impl Into<String>, deps: Vec<OpId>) -> OpId {
        self.add(name, "mark", Work::Mark, deps)
    }
}

/// What happened to one op.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OpRecord {
    /// When its dependencies were all done (and `not_before` passed).
    pub ready: f64,
    /// Start.
    pub start: f64,
    /// End.
    pub end: f64,
    /// Bytes delivered (transfers).
    pub delivered: f64,
}

/// A span during which a link's flows had constant rates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkSpan {
    /// The link.
    pub res: ResId,
    /// Start.
    pub t0: f64,
    /// End.
    pub t1: f64,
    /// Sum of the flows' rates, bytes/s.
    pub rate: f64,
    /// Training flows active.
    pub training_flows: u32,
    /// Checkpoint flows active.
    pub checkpoint_flows: u32,
}

/// The trace of a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Trace {
    /// Per op.
    pub ops: Vec<OpRecord>,
    /// Per link, spans of constant rate.
    pub spans: Vec<LinkSpan>,
    /// End of the last op.
    pub makespan: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Waiting,
    Ready,
    Latency,
    Running,
    Done,
}

/// Run the DAG to completion.
pub fn run(dag: &Dag) -> Result<Trace> {
    let n = dag.ops.len();
    for (i, op) in dag.ops.iter().enumerate() {
        for &d in &op.deps {
            if d >= i {
                return Err(SimError::BadDag(format!("op {i} ({}) depends on op {d}, which is not created before it", op.name)));
            }
        }
        let (res, ok) = match op.work {
            Work::Compute { res, seconds } => (Some(res), seconds.is_finite() && seconds >= 0.0),
            Work::Transfer { res, bytes, latency_s, .. } => {
                (Some(res), bytes.is_finite() && bytes >= 0.0 && latency_s.is_finite() && latency_s >= 0.0)
            }
            Work::Mark => (None, true),
            Work::Delay { seconds } => (None, seconds.is_finite() && seconds >= 0.0),
        };
        if !ok || !op.not_before.is_finite() {
            return Err(SimError::BadDag(format!("op {i} ({}) has a negative or non-finite amount", op.name)));
        }
        if let Some(r) = res {
            let Some(resource) = dag.resources.get(r) else {
                return Err(SimError::BadDag(format!("op {i} ({}) uses resource {r}, which does not exist", op.name)));
            };
            let is_link = resource.bytes_per_s.is_some();
            let wants_link = matches!(op.work, Work::Transfer { .. });
            if is_link != wants_link {
                return Err(SimError::BadDag(format!("op {i} ({}) uses `{}` of the wrong kind", op.name, resource.name)));
            }
            if let Some(bw) = resource.bytes_per_s {
                if !(bw > 0.0 && bw.is_finite()) {
                    return Err(SimError::BadDag(format!("link `{}` has no bandwidth", resource.name)));
                }
            }
            if let Some(sh) = resource.sharing {
                let ok =
                    sh.training_share > 0.0 && sh.training_share <= 1.0 && sh.queue_wait_s.is_finite() && sh.queue_wait_s >= 0.0;
                if !ok {
                    return Err(SimError::BadDag(format!(
                        "link `{}`: a training share in (0, 1] and a queue wait of 0 s or more, got {} and {} s",
                        resource.name, sh.training_share, sh.queue_wait_s
                    )));
                }
            }
        }
    }
    let mut dependents: Vec<Vec<OpId>> = vec![Vec::new(); n];
    let mut missing: Vec<usize> = vec![0; n];
    for (i, op) in dag.ops.iter().enumerate() {
        missing[i] = op.deps.len();
        for &d in &op.deps {
            dependents[d].push(i);
        }
    }
    let mut state = vec![State::Waiting; n];
    let mut rec = vec![OpRecord { ready: f64::NAN, start: f64::NAN, end: f64::NAN, delivered: 0.0 }; n];
    let mut remaining = vec![0.0f64; n];
    let mut phase_end = vec![0.0f64; n]; // end of compute or of latency
    let mut dep_done_at = vec![0.0f64; n];
    let mut busy: Vec<Option<OpId>> = vec![None; dag.resources.len()];
    let mut ready_compute: Vec<Vec<OpId>> = vec![Vec::new(); dag.resources.len()];
    let mut pending: Vec<OpId> = Vec::new(); // deps done, waiting for not_before
    let mut flows: Vec<Vec<OpId>> = vec![Vec::new(); dag.resources.len()];
    let mut spans = Vec::new();
    let mut done = 0usize;
    let mut t = 0.0f64;
    let mut active: Vec<OpId> = Vec::new(); // ready, in latency or running
    let mut rate = vec![0.0f64; n]; // valid for ops that are flows now
    let mut held = vec![false; n]; // training transfers that waited for a shared link's queue
    pending.extend((0..n).filter(|&i| missing[i] == 0));
    let eps = 1e-12;
    let mut guard = 0u64;
    while done < n {
        guard += 1;
        if guard > 50 * n as u64 + 1000 {
            return Err(SimError::BadDag("the simulation made no progress (internal error); report the DAG".into()));
        }
        // 1. release pending ops whose time has come
        let mut k = 0;
        while k < pending.len() {
            let i = pending[k];
            let at = dag.ops[i].not_before.max(dep_done_at[i]);
            if at <= t + eps {
                pending.swap_remove(k);
                rec[i].ready = t;
                match dag.ops[i].work {
                    Work::Mark => {
                        state[i] = State::Done;
                        rec[i].start = t;
                        rec[i].end = t;
                        done += 1;
                        for &j in &dependents[i] {
                            missing[j] -= 1;
                            dep_done_at[j] = dep_done_at[j].max(t);
                            if missing[j] == 0 {
                                pending.push(j);
                            }
                        }
                        k = 0; // new pending ops may be releasable now
                        continue;
                    }
                    Work::Compute { res, .. } => {
                        state[i] = State::Ready;
                        ready_compute[res].push(i);
                        active.push(i);
                    }
                    Work::Delay { seconds } => {
                        state[i] = State::Running;
                        active.push(i);
                        rec[i].start = t;
                        phase_end[i] = t + seconds;
                    }
                    Work::Transfer { latency_s, bytes, .. } => {
                        state[i] = State::Latency;
                        active.push(i);
                        rec[i].start = t;
                        phase_end[i] = t + latency_s;
                        remaining[i] = bytes;
                    }
                }
            } else {
                k += 1;
            }
        }
        if done == n {
            break;
        }
        // 2. start compute on idle streams (lowest op id first: program order)
        for (r, q) in ready_compute.iter_mut().enumerate() {
            if busy[r].is_none() && !q.is_empty() {
                let (pos, &i) = q.iter().enumerate().min_by_key(|(_, &i)| i).expect("non-empty");
                q.swap_remove(pos);
                busy[r] = Some(i);
                state[i] = State::Running;
                rec[i].start = t;
                if let Work::Compute { seconds, .. } = dag.ops[i].work {
                    phase_end[i] = t + seconds;
                }
            }
        }
        // 3. transfers whose latency has passed become flows; those that arrive together
        // queue in creation order (program order), whatever order they were released in
        let mut arriving: Vec<OpId> =
            active.iter().copied().filter(|&i| state[i] == State::Latency && phase_end[i] <= t + eps).collect();
        arriving.sort_unstable();
        let class_of = |i: OpId| match dag.ops[i].work {
            Work::Transfer { class, .. } => class,
            _ => Class::Training,
        };
        for i in arriving {
            // on a shared link, a training transfer that finds checkpoint bytes there waits
            // for the queue ahead of it first (once)
            if let Work::Transfer { res, .. } = dag.ops[i].work {
                if let Some(sh) = dag.resources[res].sharing {
                    let checkpoint_on = flows[res].iter().any(|&f| class_of(f) == Class::Checkpoint);
                    if class_of(i) == Class::Training && !held[i] && checkpoint_on && sh.queue_wait_s > 0.0 {
                        held[i] = true;
                        phase_end[i] = t + sh.queue_wait_s;
                        continue;
                    }
                }
            }
            state[i] = State::Running;
            if let Work::Transfer { res, .. } = dag.ops[i].work {
                flows[res].push(i);
            }
        }
        // 4. rates
        for (r, fl) in flows.iter().enumerate() {
            if fl.is_empty() {
                continue;
            }
            let res = &dag.resources[r];
            let bw = res.bytes_per_s.unwrap_or(0.0);
            let tr = fl.iter().filter(|&&i| class_of(i) == Class::Training).count();
            // a shared link serves the first flow of each class; they split the rate
            let heads = res.sharing.map(|sh| {
                let first = |c: Class| fl.iter().position(|&i| class_of(i) == c);
                (first(Class::Training), first(Class::Checkpoint), sh.training_share)
            });
            for (k, &i) in fl.iter().enumerate() {
                rate[i] = if let Some((first_t, first_c, w)) = heads {
                    match (first_t, first_c) {
                        (Some(ft), Some(_)) if k == ft => bw * w,
                        (Some(_), Some(fc)) if k == fc => bw * (1.0 - w),
                        (Some(ft), None) if k == ft => bw,
                        (None, Some(fc)) if k == fc => bw,
                        _ => 0.0,
                    }
                } else if res.fifo {
                    // flows are listed in the order they started
                    if k == 0 {
                        bw
                    } else {
                        0.0
                    }
                } else if res.priority && tr > 0 {
                    if class_of(i) == Class::Training {
                        bw / tr as f64
                    } else {
                        0.0
                    }
                } else {
                    bw / fl.len() as f64
                };
            }
        }
        // 5. next event
        let mut next = f64::INFINITY;
        for &i in &active {
            match state[i] {
                State::Latency => next = next.min(phase_end[i]),
                State::Running => match dag.ops[i].work {
                    Work::Compute { .. } | Work::Delay { .. } => next = next.min(phase_end[i]),
                    Work::Transfer { .. } if rate[i] > 0.0 => next = next.min(t + remaining[i] / rate[i]),
                    Work::Transfer { bytes: 0.0, .. } => next = next.min(t),
                    _ => {}
                },
                _ => {}
            }
        }
        for &i in &pending {
            next = next.min(dag.ops[i].not_before.max(dep_done_at[i]));
        }
        if !next.is_finite() {
            return Err(SimError::BadDag("deadlock: ops wait for each other (a dependency cycle through a resource?)".into()));
        }
        let next = next.max(t);
        // 6. advance, recording link spans
        let dt = next - t;
        for (r, fl) in flows.iter().enumerate() {
            if fl.is_empty() || dt <= 0.0 {
                continue;
            }
            let total: f64 = fl.iter().map(|&i| rate[i]).sum();
            let tr =
                fl.iter().filter(|&&i| matches!(dag.ops[i].work, Work::Transfer { class: Class::Training, .. })).count() as u32;
            spans.push(LinkSpan {
                res: r,
                t0: t,
                t1: next,
                rate: total,
                training_flows: tr,
                checkpoint_flows: fl.len() as u32 - tr,
            });
            for &i in fl {
                let moved = (rate[i] * dt).min(remaining[i]);
                remaining[i] -= moved;
                rec[i].delivered += moved;
            }
        }
        t = next;
        // 7. completions
        let mut finished = Vec::new();
        for &i in &active {
            if state[i] != State::Running {
                continue;
            }
            let fin = match dag.ops[i].work {
                Work::Compute { .. } | Work::Delay { .. } => phase_end[i] <= t + eps,
                // done, or so nearly done that the time left is below f64 resolution at `t`
                Work::Transfer { bytes, .. } => {
                    remaining[i] <= bytes * 1e-12 + 1e-9 || (rate[i] > 0.0 && t + remaining[i] / rate[i] <= t)
                }
                Work::Mark => false,
            };
            if fin {
                finished.push(i);
            }
        }
        active.retain(|&i| !finished.contains(&i));
        for i in finished {
            state[i] = State::Done;
            rec[i].end = t;
            done += 1;
            match dag.ops[i].work {
                Work::Compute { res, .. } => busy[res] = None,
                Work::Transfer { res, bytes, .. } => {
                    rec[i].delivered = bytes; // absorb rounding below the completion tolerance
                    flows[res].retain(|&j| j != i);
                }
                Work::Mark | Work::Delay { .. } => {}
            }
            for &j in &dependents[i] {
                missing[j] -= 1;
                dep_done_at[j] = dep_done_at[j].max(t);
                if missing[j] == 0 {
                    pending.push(j);
                }
            }
        }
    }
    let makespan = rec.iter().map(|r| r.end).fold(0.0, f64::max);
    Ok(Trace { ops: rec, spans, makespan })
}

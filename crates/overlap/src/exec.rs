//! Runs a schedule's steps: compute on the caller's thread, collectives on each group's
//! collective thread (the transport's non-blocking all-reduce), results handed from a
//! sub-batch's collective to its next stage.

use std::collections::HashMap;
use std::time::Instant;

use ironweave_transport::{CollHandle, Communicator};

use crate::error::{OverlapError, Result};
use crate::schedule::{CollOp, CommRef, CommSpec, Program, Step};
use crate::trace::{covered_s, Lane, Span};

/// The model's side of a program: what each compute task does, and what tails carry.
pub trait Work {
    /// Runs stage `stage` for sub-batch `sub`. `input` is the result of the previous stage's
    /// collective for this sub-batch (or the previous stage's output when it had none;
    /// `None` for the first stage). Returns the buffer this stage's collective reduces
    /// (anything, e.g. empty, when the stage has none).
    fn compute(
        &mut self,
        stage: usize,
        sub: usize,
        input: Option<Vec<f32>>,
    ) -> std::result::Result<Vec<f32>, Box<dyn std::error::Error + Send + Sync>>;
    /// The buffer of tail `tail`, asked for when it is issued.
    fn tail_input(&mut self, tail: usize) -> Vec<f32>;
    /// The reduced buffer of tail `tail`.
    fn tail_output(&mut self, tail: usize, data: Vec<f32>);
}

/// What one execution did.
#[derive(Debug, Clone, Default)]
pub struct ExecStats {
    /// Every compute task and collective with its time.
    pub spans: Vec<Span>,
    /// Seconds of compute.
    pub compute_s: f64,
    /// Seconds the collective threads spent in this program's collectives, per group.
    pub comm_s: Vec<f64>,
    /// Of those, seconds during which this rank's compute lane was busy, per group.
    pub hidden_s: Vec<f64>,
    /// Seconds the compute lane waited for collectives.
    pub wait_s: f64,
}

impl ExecStats {
    /// Share of group `g`'s communication time hidden behind compute (None: nothing sent).
    pub fn hidden_fraction(&self, g: usize) -> Option<f64> {
        let c = self.comm_s.get(g).copied().unwrap_or(0.0);
        (c > 0.0).then(|| self.hidden_s[g] / c)
    }
}

enum InFlight {
    Pending(CollHandle<Vec<f32>>),
    Done(Vec<f32>),
}

/// Runs `steps` (from [`crate::steps`] on `p`). `groups[g]` is the communicator of group `g`;
/// `None` or a group of one rank makes its collectives the identity (no thread, no span). An
/// all-gather hands the next stage every member's buffer, in group-rank order (buffers must be
/// the same length on every member).
pub fn execute(p: &Program, steps: &[Step], groups: &[Option<&Communicator>], work: &mut dyn Work) -> Result<ExecStats> {
    p.validate()?;
    if p.groups_used() > groups.len() {
        return Err(OverlapError::Program(format!(
            "the program uses {} groups, the executor was given {}",
            p.groups_used(),
            groups.len()
        )));
    }
    // steps may come from anywhere: every index they name must exist, and only a stage with a
    // collective can issue one
    for step in steps {
        let bad = match *step {
            Step::Run { stage, sub } => stage >= p.stages.len() || sub >= p.sub_batches,
            Step::Issue(CommRef::Stage { stage, sub }) | Step::Wait(CommRef::Stage { stage, sub }) => {
                stage >= p.stages.len() || sub >= p.sub_batches || p.stages[stage].comm.is_none()
            }
            Step::Issue(CommRef::Tail(t)) | Step::Wait(CommRef::Tail(t)) => t >= p.tails.len(),
        };
        if bad {
            return Err(OverlapError::Program(format!("step {step:?} names no task or collective of the program")));
        }
    }
    let mut st = ExecStats { comm_s: vec![0.0; groups.len()], hidden_s: vec![0.0; groups.len()], ..Default::default() };
    let mut flight: HashMap<CommRef, InFlight> = HashMap::new();
    // the output of a stage without a collective, for the next stage of the same sub-batch
    let mut passed: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
    let mut outputs: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
    let spec = |c: CommRef| match c {
        // checked above: a stage that issues has a collective
        CommRef::Stage { stage, .. } => {
            p.stages[stage].comm.unwrap_or(CommSpec::all_reduce(0, ironweave_transport::ReduceOp::Sum))
        }
        CommRef::Tail(t) => p.tails[t].comm,
    };
    let label = |c: CommRef| match c {
        CommRef::Stage { stage, sub } => format!("{}/{sub}", p.stages[stage].name),
        CommRef::Tail(t) => p.tails[t].name.clone(),
    };
    // waits for `c` if it is still in flight, recording its span and the compute lane's wait
    let settle = |c: CommRef, flight: &mut HashMap<CommRef, InFlight>, st: &mut ExecStats| -> Result<()> {
        match flight.remove(&c) {
            Some(InFlight::Pending(h)) => {
                let t0 = Instant::now();
                let deadline = h.deadline();
                let (v, a, b) = h.wait_timed(deadline)?;
                st.wait_s += t0.elapsed().as_secs_f64();
                let g = spec(c).group;
                st.comm_s[g] += (b - a).as_secs_f64();
                st.spans.push(Span { lane: Lane::Comm(g), name: label(c), start: a, end: b });
                flight.insert(c, InFlight::Done(v));
            }
            Some(done) => {
                flight.insert(c, done);
            }
            None => {}
        }
        Ok(())
    };
    for step in steps {
        match *step {
            Step::Run { stage, sub } => {
                let input = if stage == 0 {
                    None
                } else if p.stages[stage - 1].comm.is_some() {
                    let c = CommRef::Stage { stage: stage - 1, sub };
                    settle(c, &mut flight, &mut st)?;
                    match flight.remove(&c) {
                        Some(InFlight::Done(v)) => Some(v),
                        _ => {
                            return Err(OverlapError::Program(format!(
                                "{} of sub-batch {sub} runs before its input's collective was issued",
                                p.stages[stage].name
                            )))
                        }
                    }
                } else {
                    passed.remove(&(stage - 1, sub))
                };
                let t0 = Instant::now();
                let out = work.compute(stage, sub, input).map_err(|source| OverlapError::Compute {
                    stage: p.stages[stage].name.clone(),
                    sub,
                    source,
                })?;
                let t1 = Instant::now();
                st.compute_s += (t1 - t0).as_secs_f64();
                st.spans.push(Span { lane: Lane::Compute, name: format!("{}/{sub}", p.stages[stage].name), start: t0, end: t1 });
                if p.stages[stage].comm.is_some() {
                    outputs.insert((stage, sub), out);
                } else {
                    passed.insert((stage, sub), out);
                }
            }
            Step::Issue(c) => {
                let buf = match c {
                    CommRef::Stage { stage, sub } => outputs
                        .remove(&(stage, sub))
                        .ok_or_else(|| OverlapError::Program(format!("{} is issued before its compute ran", label(c))))?,
                    CommRef::Tail(t) => work.tail_input(t),
                };
                let s = spec(c);
                let entry = match (groups[s.group], s.op) {
                    (Some(comm), CollOp::AllReduce(op)) if comm.size() > 1 => InFlight::Pending(comm.iall_reduce(buf, op)?),
                    (Some(comm), CollOp::AllGather) if comm.size() > 1 => InFlight::Pending(comm.iall_gather(buf)?),
                    _ => InFlight::Done(buf),
                };
                flight.insert(c, entry);
            }
            Step::Wait(c) => {
                settle(c, &mut flight, &mut st)?;
                if let CommRef::Tail(t) = c {
                    if let Some(InFlight::Done(v)) = flight.remove(&c) {
                        work.tail_output(t, v);
                    }
                }
            }
        }
    }
    // anything never waited for (a schedule that leaves tails open) is settled here
    let left: Vec<CommRef> = flight.keys().copied().collect();
    for c in left {
        settle(c, &mut flight, &mut st)?;
        if let (CommRef::Tail(t), Some(InFlight::Done(v))) = (c, flight.remove(&c)) {
            work.tail_output(t, v);
        }
    }
    let compute: Vec<(Instant, Instant)> =
        st.spans.iter().filter(|s| s.lane == Lane::Compute).map(|s| (s.start, s.end)).collect();
    for g in 0..groups.len() {
        let comm: Vec<(Instant, Instant)> =
            st.spans.iter().filter(|s| s.lane == Lane::Comm(g)).map(|s| (s.start, s.end)).collect();
        st.hidden_s[g] = covered_s(&comm, &compute);
    }
    Ok(st)
}

//! The schedule: which compute task runs when, and where each collective is issued and
//! waited for. Pure: a program and a schedule in, a list of steps out.

use std::collections::HashMap;

use ironweave_transport::ReduceOp;

use crate::error::{OverlapError, Result};

/// How collectives are placed against compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// Megatron-LM: every collective is waited for where its result is needed — a sub-layer's
    /// all-reduce right after it is issued (the next sub-layer needs it: no overlap), tails
    /// (data-parallel gradients, needed by the optimizer) at the end, as Megatron-LM overlaps
    /// its gradient reduction with the rest of backward.
    Megatron,
    /// Oases: each stage runs for every sub-batch before the next stage starts, so the
    /// collective of sub-batch j runs while sub-batch j+1 (or the next stage of sub-batch
    /// j-1) computes; a collective is waited for only when its result is needed, and tails
    /// (data-parallel gradients) only at the end.
    Oases,
}

impl Schedule {
    /// Name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Megatron => "megatron",
            Schedule::Oases => "oases",
        }
    }
}

impl std::str::FromStr for Schedule {
    type Err = OverlapError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "megatron" => Ok(Schedule::Megatron),
            "oases" => Ok(Schedule::Oases),
            _ => Err(OverlapError::Program(format!("unknown schedule {s:?}: use megatron or oases"))),
        }
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a collective does with the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollOp {
    /// All-reduce with this reduction (tensor-parallel partial sums, data-parallel gradients).
    AllReduce(ReduceOp),
    /// All-gather in group-rank order (resharding activations to a larger tensor group).
    AllGather,
}

/// A collective: on which of the rank's groups, doing what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommSpec {
    /// Index into the groups handed to the executor.
    pub group: usize,
    /// The operation.
    pub op: CollOp,
}

impl CommSpec {
    /// An all-reduce on group `group`.
    pub fn all_reduce(group: usize, op: ReduceOp) -> CommSpec {
        CommSpec { group, op: CollOp::AllReduce(op) }
    }
    /// An all-gather on group `group`.
    pub fn all_gather(group: usize) -> CommSpec {
        CommSpec { group, op: CollOp::AllGather }
    }
}

/// One step of the chain every sub-batch passes through.
#[derive(Debug, Clone, PartialEq)]
pub struct Stage {
    /// Name (trace label): `L3.attn`, `L3.mlp.bwd`.
    pub name: String,
    /// The all-reduce of the compute task's output, whose result is the next stage's input.
    pub comm: Option<CommSpec>,
}

/// A collective over what every sub-batch of a stage produced together (a layer's gradients
/// for data parallelism): issued after the stage's last sub-batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Tail {
    /// Name (trace label).
    pub name: String,
    /// Issued after this stage has run for every sub-batch.
    pub after_stage: usize,
    /// The collective.
    pub comm: CommSpec,
}

/// The work of one iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// Stages in order.
    pub stages: Vec<Stage>,
    /// Tails.
    pub tails: Vec<Tail>,
    /// Sub-batches each micro-batch is split into.
    pub sub_batches: usize,
}

/// A collective of the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommRef {
    /// Stage `stage`'s collective for sub-batch `sub`.
    Stage {
        /// Stage.
        stage: usize,
        /// Sub-batch.
        sub: usize,
    },
    /// Tail `0`.
    Tail(usize),
}

/// What a rank does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Run the compute task of `stage` for sub-batch `sub`.
    Run {
        /// Stage.
        stage: usize,
        /// Sub-batch.
        sub: usize,
    },
    /// Hand a collective to its group's collective thread.
    Issue(CommRef),
    /// Block until a collective has finished.
    Wait(CommRef),
}

impl Program {
    /// Checks what the executor relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |w: String| Err(OverlapError::Program(w));
        if self.sub_batches == 0 {
            return bad("sub_batches must be at least 1".into());
        }
        let Some(last) = self.stages.last() else {
            return bad("a program needs at least one stage".into());
        };
        if last.comm.is_some() {
            return bad(format!("the last stage ({}) cannot end with a collective: nothing would take its result", last.name));
        }
        if let Some(t) = self.tails.iter().find(|t| t.after_stage >= self.stages.len()) {
            return bad(format!("tail {} follows stage {} of {}", t.name, t.after_stage, self.stages.len()));
        }
        Ok(())
    }

    /// The collectives every rank issues, in order (the same on every rank).
    pub fn groups_used(&self) -> usize {
        let s = self.stages.iter().filter_map(|s| s.comm.map(|c| c.group + 1));
        s.chain(self.tails.iter().map(|t| t.comm.group + 1)).max().unwrap_or(0)
    }
}

/// The steps of one iteration of `p` under `schedule`.
pub fn steps(p: &Program, schedule: Schedule) -> Result<Vec<Step>> {
    p.validate()?;
    let k = p.sub_batches;
    let mut out = Vec::new();
    for (s, stage) in p.stages.iter().enumerate() {
        for j in 0..k {
            if schedule == Schedule::Oases && s > 0 && p.stages[s - 1].comm.is_some() {
                out.push(Step::Wait(CommRef::Stage { stage: s - 1, sub: j }));
            }
            out.push(Step::Run { stage: s, sub: j });
            if stage.comm.is_some() {
                let c = CommRef::Stage { stage: s, sub: j };
                out.push(Step::Issue(c));
                if schedule == Schedule::Megatron {
                    out.push(Step::Wait(c));
                }
            }
        }
        for t in (0..p.tails.len()).filter(|&t| p.tails[t].after_stage == s) {
            out.push(Step::Issue(CommRef::Tail(t)));
        }
    }
    // both schedules need the tails' results only at the optimizer
    out.extend((0..p.tails.len()).map(|t| Step::Wait(CommRef::Tail(t))));
    Ok(out)
}

/// Replays `steps` on durations: compute tasks run one after another on the compute lane;
/// each group's collectives run one after another on that group's lane, each starting when
/// issued and its lane is free; a wait blocks the compute lane until the collective ends.
/// Returns the iteration time. `compute(stage, sub)` and `comm(c)` give the durations.
pub fn predict(p: &Program, steps: &[Step], compute: impl Fn(usize, usize) -> f64, comm: impl Fn(CommRef) -> f64) -> f64 {
    let mut now = 0.0f64;
    let mut lane_free: HashMap<usize, f64> = HashMap::new();
    let mut ends: HashMap<CommRef, f64> = HashMap::new();
    let group = |c: CommRef| match c {
        CommRef::Stage { stage, .. } => p.stages[stage].comm.map_or(0, |c| c.group),
        CommRef::Tail(t) => p.tails[t].comm.group,
    };
    for st in steps {
        match *st {
            Step::Run { stage, sub } => now += compute(stage, sub),
            Step::Issue(c) => {
                let free = lane_free.entry(group(c)).or_insert(0.0);
                let end = free.max(now) + comm(c);
                *free = end;
                ends.insert(c, end);
            }
            Step::Wait(c) => now = now.max(ends.get(&c).copied().unwrap_or(now)),
        }
    }
    ends.values().fold(now, |a, &b| a.max(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prog(stages: usize, k: usize, tails: &[usize]) -> Program {
        let mut v: Vec<Stage> =
            (0..stages).map(|s| Stage { name: format!("s{s}"), comm: Some(CommSpec::all_reduce(0, ReduceOp::Sum)) }).collect();
        v.last_mut().expect("one").comm = None;
        let tails = tails
            .iter()
            .enumerate()
            .map(|(i, &a)| Tail { name: format!("t{i}"), after_stage: a, comm: CommSpec::all_reduce(1, ReduceOp::Avg) })
            .collect();
        Program { stages: v, tails, sub_batches: k }
    }

    use CommRef::Stage as S;
    use Step::{Issue, Run, Wait};

    #[test]
    fn megatron_waits_right_after_each_issue_and_for_tails_at_the_optimizer() {
        let p = prog(3, 1, &[1]);
        let got = steps(&p, Schedule::Megatron).unwrap();
        let want = vec![
            Run { stage: 0, sub: 0 },
            Issue(S { stage: 0, sub: 0 }),
            Wait(S { stage: 0, sub: 0 }),
            Run { stage: 1, sub: 0 },
            Issue(S { stage: 1, sub: 0 }),
            Wait(S { stage: 1, sub: 0 }),
            Issue(CommRef::Tail(0)),
            Run { stage: 2, sub: 0 },
            Wait(CommRef::Tail(0)),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn oases_runs_the_next_sub_batch_while_the_previous_communicates() {
        let p = prog(3, 2, &[1]);
        let got = steps(&p, Schedule::Oases).unwrap();
        let want = vec![
            Run { stage: 0, sub: 0 },
            Issue(S { stage: 0, sub: 0 }),
            Run { stage: 0, sub: 1 },
            Issue(S { stage: 0, sub: 1 }),
            Wait(S { stage: 0, sub: 0 }),
            Run { stage: 1, sub: 0 },
            Issue(S { stage: 1, sub: 0 }),
            Wait(S { stage: 0, sub: 1 }),
            Run { stage: 1, sub: 1 },
            Issue(S { stage: 1, sub: 1 }),
            Issue(CommRef::Tail(0)),
            Wait(S { stage: 1, sub: 0 }),
            Run { stage: 2, sub: 0 },
            Wait(S { stage: 1, sub: 1 }),
            Run { stage: 2, sub: 1 },
            Wait(CommRef::Tail(0)),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn every_collective_is_issued_once_and_waited_after_its_issue_and_before_its_use() {
        for sched in [Schedule::Megatron, Schedule::Oases] {
            for k in 1..4 {
                let p = prog(5, k, &[0, 2, 4]);
                let st = steps(&p, sched).unwrap();
                let pos = |x: Step| st.iter().position(|&y| y == x);
                for s in 0..4 {
                    for j in 0..k {
                        let c = S { stage: s, sub: j };
                        let (i, w) = (pos(Issue(c)).unwrap(), pos(Wait(c)).unwrap());
                        assert!(pos(Run { stage: s, sub: j }).unwrap() < i && i < w);
                        assert!(w < pos(Run { stage: s + 1, sub: j }).unwrap(), "{sched} k={k} s={s} j={j}");
                    }
                }
                for t in 0..3 {
                    assert!(pos(Issue(CommRef::Tail(t))).unwrap() < pos(Wait(CommRef::Tail(t))).unwrap());
                }
                assert_eq!(st.iter().filter(|x| matches!(x, Run { .. })).count(), 5 * k);
            }
        }
    }

    #[test]
    fn malformed_programs_are_refused_with_the_reason() {
        let mut p = prog(2, 1, &[]);
        p.stages[1].comm = Some(CommSpec::all_reduce(0, ReduceOp::Sum));
        assert!(steps(&p, Schedule::Oases).unwrap_err().to_string().contains("last stage"));
        let p = prog(2, 0, &[]);
        assert!(steps(&p, Schedule::Oases).unwrap_err().to_string().contains("sub_batches"));
        let p = prog(2, 1, &[5]);
        assert!(steps(&p, Schedule::Oases).unwrap_err().to_string().contains("follows stage 5"));
        assert!("gpipe".parse::<Schedule>().unwrap_err().to_string().contains("megatron or oases"));
    }

    #[test]
    fn predicted_time_is_compute_plus_comm_for_megatron_and_the_max_for_oases() {
        // 2 stages with a collective and a last one, compute 1 per stage per whole batch and
        // communication 1 per stage per whole batch: megatron pays both, oases hides all
        // but the edges of the pipeline
        for k in [1usize, 2, 4] {
            let p = prog(3, k, &[]);
            let kf = k as f64;
            let comp = |s: usize, _| if s < 2 { 1.0 / kf } else { 0.0 };
            let comm = |_| 1.0 / kf;
            let m = predict(&p, &steps(&p, Schedule::Megatron).unwrap(), comp, comm);
            assert!((m - 4.0).abs() < 1e-12, "megatron k={k}: {m}");
            let o = predict(&p, &steps(&p, Schedule::Oases).unwrap(), comp, comm);
            // k >= 2: the compute lane never waits (2k pieces of compute back to back), then
            // the last piece's collective; k = 1: nothing to overlap with
            let want = if k == 1 { 4.0 } else { (2.0 * kf + 1.0) / kf };
            assert!((o - want).abs() < 1e-12, "oases k={k}: {o} vs {want}");
        }
    }
}

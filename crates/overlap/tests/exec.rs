//! The executor over real collectives (in-process ranks): every schedule delivers the same
//! reduced values to the right sub-batch, and tails come back averaged.

use std::sync::{Arc, Mutex};

use ironweave_overlap::{execute, steps, CommSpec, Program, Schedule, Stage, Tail, Work};
use ironweave_transport::{inproc, CommOptions, Communicator, ReduceOp};

#[derive(Debug)]
struct Chain {
    rank: usize,
    /// (stage, sub, input) as seen by each compute task.
    seen: Vec<(usize, usize, Option<Vec<f32>>)>,
    tail: Option<Vec<f32>>,
}

impl Work for Chain {
    fn compute(
        &mut self,
        stage: usize,
        sub: usize,
        input: Option<Vec<f32>>,
    ) -> Result<Vec<f32>, Box<dyn std::error::Error + Send + Sync>> {
        self.seen.push((stage, sub, input.clone()));
        if stage == 2 && sub == 1 && self.rank == 7 {
            return Err("boom".into());
        }
        let base = input.map_or(0.0, |v| v[0]);
        Ok(vec![base + (self.rank + 1) as f32 * 10f32.powi(stage as i32) + sub as f32; 3])
    }
    fn tail_input(&mut self, t: usize) -> Vec<f32> {
        vec![(self.rank * 2 + t) as f32; 4]
    }
    fn tail_output(&mut self, _t: usize, data: Vec<f32>) {
        self.tail = Some(data);
    }
}

fn program(k: usize) -> Program {
    let sum = Some(CommSpec::all_reduce(0, ReduceOp::Sum));
    Program {
        stages: vec![
            Stage { name: "a".into(), comm: sum },
            Stage { name: "b".into(), comm: sum },
            Stage { name: "c".into(), comm: None },
        ],
        tails: vec![Tail { name: "grads".into(), after_stage: 1, comm: CommSpec::all_reduce(1, ReduceOp::Avg) }],
        sub_batches: k,
    }
}

fn run(n: usize, k: usize, sched: Schedule) -> Vec<Chain> {
    let comms: Vec<Communicator> =
        inproc::world(n).into_iter().map(|l| Communicator::new(vec![l], CommOptions::default()).unwrap()).collect();
    let out = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|s| {
        for c in &comms {
            let out = out.clone();
            s.spawn(move || {
                let p = program(k);
                let st = steps(&p, sched).unwrap();
                let mut w = Chain { rank: c.rank(), seen: Vec::new(), tail: None };
                let stats = execute(&p, &st, &[Some(c), Some(c)], &mut w).unwrap();
                // every collective left a span on its group's lane
                let comm_spans = stats.spans.iter().filter(|s| s.lane != ironweave_overlap::Lane::Compute).count();
                assert_eq!(comm_spans, 2 * k + 1);
                assert_eq!(stats.comm_s.len(), 2);
                out.lock().unwrap().push(w);
            });
        }
    });
    let mut v = Arc::try_unwrap(out).unwrap().into_inner().unwrap();
    v.sort_by_key(|w| w.rank);
    v
}

#[test]
fn both_schedules_hand_every_sub_batch_its_own_reduced_input() {
    for sched in [Schedule::Megatron, Schedule::Oases] {
        for k in [1, 2, 3] {
            let ws = run(3, k, sched);
            for w in &ws {
                for (stage, sub, input) in &w.seen {
                    let j = *sub as f32;
                    // stage a on rank r gives (r+1) + j; summed over 3 ranks: 6 + 3j
                    let a = 6.0 + 3.0 * j;
                    let want = match stage {
                        0 => None,
                        1 => Some(a),
                        // stage b adds (r+1)*10 + j to its input: sum 3a + 60 + 3j
                        _ => Some(3.0 * a + 60.0 + 3.0 * j),
                    };
                    assert_eq!(input.as_ref().map(|v| v[0]), want, "{sched} k={k} rank {} stage {stage} sub {sub}", w.rank);
                }
                assert_eq!(w.seen.len(), 3 * k);
                // tail 0: ranks give 0, 2, 4 → average 2
                assert_eq!(w.tail.as_deref(), Some(&[2.0f32; 4][..]));
            }
        }
    }
}

#[test]
fn a_failing_compute_task_is_an_error_naming_the_stage_not_a_hang() {
    let comms: Vec<Communicator> =
        inproc::world(1).into_iter().map(|l| Communicator::new(vec![l], CommOptions::default()).unwrap()).collect();
    let p = program(2);
    let st = steps(&p, Schedule::Oases).unwrap();
    let mut w = Chain { rank: 7, seen: Vec::new(), tail: None };
    let e = execute(&p, &st, &[Some(&comms[0]), None], &mut w).unwrap_err().to_string();
    assert!(e.contains("compute task c (sub-batch 1) failed: boom"), "{e}");
    // a program using a group the executor was not given is refused up front
    let e = execute(&p, &st, &[None], &mut w).unwrap_err().to_string();
    assert!(e.contains("uses 2 groups"), "{e}");
    // so are steps naming what the program lacks (a hand-written list, not `steps`)
    use ironweave_overlap::schedule::CommRef;
    use ironweave_overlap::Step;
    for bad in [
        vec![Step::Run { stage: 9, sub: 0 }],
        vec![Step::Run { stage: 0, sub: 5 }],
        vec![Step::Issue(CommRef::Stage { stage: 2, sub: 0 })],
        vec![Step::Wait(CommRef::Tail(3))],
    ] {
        let e = execute(&p, &bad, &[None, None], &mut w).unwrap_err().to_string();
        assert!(e.contains("names no task"), "{bad:?}: {e}");
    }
}

#[derive(Debug)]
struct Gather(Vec<f32>);

impl Work for Gather {
    fn compute(
        &mut self,
        stage: usize,
        _sub: usize,
        input: Option<Vec<f32>>,
    ) -> Result<Vec<f32>, Box<dyn std::error::Error + Send + Sync>> {
        if stage == 1 {
            self.0 = input.unwrap_or_default();
        }
        Ok(self.0.clone())
    }
    fn tail_input(&mut self, _t: usize) -> Vec<f32> {
        Vec::new()
    }
    fn tail_output(&mut self, _t: usize, _d: Vec<f32>) {}
}

#[test]
fn an_all_gather_hands_the_next_stage_every_member_s_buffer_in_rank_order() {
    let comms: Vec<Communicator> =
        inproc::world(3).into_iter().map(|l| Communicator::new(vec![l], CommOptions::default()).unwrap()).collect();
    let p = Program {
        stages: vec![
            Stage { name: "rows".into(), comm: Some(CommSpec::all_gather(0)) },
            Stage { name: "use".into(), comm: None },
        ],
        tails: vec![],
        sub_batches: 1,
    };
    std::thread::scope(|s| {
        for c in &comms {
            let p = p.clone();
            s.spawn(move || {
                let r = c.rank() as f32;
                let mut w = Gather(vec![r, r + 0.5]);
                execute(&p, &steps(&p, Schedule::Oases).unwrap(), &[Some(c)], &mut w).unwrap();
                assert_eq!(w.0, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
            });
        }
    });
}

//! Routing traces: which experts a real router sent each rank's tokens to, per iteration and MoE
//! layer — recorded by `ironweave train --record-routing FILE`, replayed by emulated compute
//! (issue 38) so that the expert load an emulated bed sees, and that Capricorn's profiler and
//! speculative activation react to, is a router's and not an invented pattern.
//!
//! A trace holds the router's choices *before* capacity (`Routing::wanted`): every rank's row of
//! one layer sums to its tokens × `top_k`. The emulator applies the capacity of the model it
//! runs. Pure: reading and writing files is the caller's.

use ironweave_profile::ExpertLoad;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};

/// What a trace was recorded on: a replay must run the same shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingShape {
    /// The configuration's name.
    pub model: String,
    /// MoE layers (the model's layers that route).
    pub moe_layers: usize,
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts each token goes to.
    pub top_k: usize,
    /// Ranks of the recording job.
    pub ranks: usize,
    /// Tokens each rank routes per layer and iteration.
    pub tokens_per_rank: u64,
}

impl RoutingShape {
    /// The shape of a job training `cfg` on `ranks` ranks.
    pub fn of(cfg: &TrainConfig, ranks: usize) -> RoutingShape {
        let m = &cfg.model;
        RoutingShape {
            model: cfg.name.clone(),
            moe_layers: (0..m.layers).filter(|&l| cfg.is_moe(l)).count(),
            experts: m.experts,
            top_k: m.top_k,
            ranks,
            tokens_per_rank: (cfg.train.batch * m.seq) as u64,
        }
    }
}

/// A recorded routing trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingTrace {
    /// What it was recorded on.
    pub shape: RoutingShape,
    /// The first iteration recorded.
    pub first_iter: u64,
    /// `iterations[i][m][r][e]`: iteration `first_iter + i`, MoE layer `m`, rank `r`, expert `e`:
    /// tokens rank `r` routed to expert `e`.
    pub iterations: Vec<Vec<Vec<Vec<u64>>>>,
}

fn bad(what: &str, why: impl std::fmt::Display) -> TrainError {
    TrainError::Config(format!("routing trace {what}: {why}"))
}

impl RoutingTrace {
    /// Assembles a trace from rows `(iteration, rank, tokens[m][e])` in any order (a row
    /// recorded again, by a rank that repeated an iteration after a recovery, replaces the
    /// earlier one: the job's state went back, so did its routing). Every iteration from the
    /// first to the last must have every rank's row.
    pub fn assemble(shape: RoutingShape, rows: impl IntoIterator<Item = (u64, usize, Vec<Vec<u64>>)>) -> Result<RoutingTrace> {
        let mut by_iter: std::collections::BTreeMap<u64, Vec<Option<Vec<Vec<u64>>>>> = Default::default();
        for (iter, rank, tokens) in rows {
            if rank >= shape.ranks {
                return Err(bad("row", format!("rank {rank} in a job of {} ranks", shape.ranks)));
            }
            by_iter.entry(iter).or_insert_with(|| vec![None; shape.ranks])[rank] = Some(tokens);
        }
        let first_iter = by_iter.keys().next().copied().ok_or_else(|| bad("rows", "none recorded"))?;
        let mut iterations = Vec::with_capacity(by_iter.len());
        for (i, (iter, ranks)) in by_iter.into_iter().enumerate() {
            if iter != first_iter + i as u64 {
                return Err(bad("rows", format!("iteration {} is missing", first_iter + i as u64)));
            }
            let mut layers = vec![Vec::with_capacity(shape.ranks); shape.moe_layers];
            for (r, row) in ranks.into_iter().enumerate() {
                let row = row.ok_or_else(|| bad("rows", format!("iteration {iter} has no row of rank {r}")))?;
                if row.len() != shape.moe_layers {
                    return Err(bad(
                        "rows",
                        format!("iteration {iter}, rank {r}: {} layers, not {}", row.len(), shape.moe_layers),
                    ));
                }
                for (m, tokens) in row.into_iter().enumerate() {
                    layers[m].push(tokens);
                }
            }
            iterations.push(layers);
        }
        let t = RoutingTrace { shape, first_iter, iterations };
        t.validate()?;
        Ok(t)
    }

    /// Parses and validates a trace (`what` names the file in errors).
    pub fn from_json_str(text: &str, what: &str) -> Result<RoutingTrace> {
        let t: RoutingTrace = serde_json::from_str(text).map_err(|e| bad(what, e))?;
        t.validate().map_err(|e| TrainError::Config(format!("{what}: {e}")))?;
        Ok(t)
    }

    /// Every count in place: the shape's layers, ranks and experts, and each rank's row of a
    /// layer summing to its tokens × `top_k`.
    pub fn validate(&self) -> Result<()> {
        let s = &self.shape;
        if s.moe_layers == 0 || s.experts == 0 || s.ranks == 0 || s.top_k == 0 || s.top_k > s.experts {
            return Err(bad("shape", format!("{s:?}: layers, experts, ranks ≥ 1 and 1 ≤ top_k ≤ experts")));
        }
        let per_row = s.tokens_per_rank * s.top_k as u64;
        for (i, layers) in self.iterations.iter().enumerate() {
            let iter = self.first_iter + i as u64;
            if layers.len() != s.moe_layers {
                return Err(bad("iterations", format!("iteration {iter}: {} layers, not {}", layers.len(), s.moe_layers)));
            }
            for (m, ranks) in layers.iter().enumerate() {
                if ranks.len() != s.ranks {
                    return Err(bad(
                        "iterations",
                        format!("iteration {iter}, layer {m}: {} ranks, not {}", ranks.len(), s.ranks),
                    ));
                }
                for (r, row) in ranks.iter().enumerate() {
                    let sum: u64 = row.iter().sum();
                    if row.len() != s.experts || sum != per_row {
                        return Err(bad(
                            "iterations",
                            format!(
                                "iteration {iter}, layer {m}, rank {r}: {} experts routing {sum} tokens, not {} routing {per_row}",
                                row.len(),
                                s.experts
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks that this trace can drive a run of `shape` for `iters` iterations: the same model
    /// shape and at least as many iterations.
    pub fn check_for(&self, shape: &RoutingShape, iters: u64) -> Result<()> {
        self.check_routes_for(shape, iters)?;
        if self.shape.tokens_per_rank != shape.tokens_per_rank {
            return Err(bad(
                "shape",
                format!("recorded on {:?}, the run is {shape:?}: record one on this model and job", self.shape),
            ));
        }
        Ok(())
    }

    /// Checks that this trace's router can drive a run of `shape` for `iters` iterations: the
    /// same routing architecture (MoE layers, experts, top-k, ranks) and at least as many
    /// iterations; the tokens per rank may differ (emulated compute scales the counts).
    pub fn check_routes_for(&self, shape: &RoutingShape, iters: u64) -> Result<()> {
        let s = &self.shape;
        if (s.moe_layers, s.experts, s.top_k, s.ranks) != (shape.moe_layers, shape.experts, shape.top_k, shape.ranks) {
            return Err(bad(
                "shape",
                format!(
                    "recorded with {} MoE layers of {} experts, top-{}, on {} ranks; the run has {} MoE layers of {} experts, top-{}, on {} ranks: record one with this routing architecture (ironweave train --record-routing)",
                    s.moe_layers, s.experts, s.top_k, s.ranks, shape.moe_layers, shape.experts, shape.top_k, shape.ranks
                ),
            ));
        }
        if (self.iterations.len() as u64) < iters {
            return Err(bad("length", format!("{} iterations recorded, the run needs {iters}", self.iterations.len())));
        }
        Ok(())
    }
}

/// How one MoE layer's expert load behaves over a trace: what Capricorn's layer-level and
/// iteration-level dynamicity are about.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerStats {
    /// Busiest expert's tokens over the mean expert's, averaged over iterations (1: balanced).
    pub imbalance_mean: f64,
    /// The same, the worst iteration.
    pub imbalance_max: f64,
    /// Total-variation distance between the load distributions of consecutive iterations,
    /// averaged (0: the same load every iteration; 1: disjoint experts).
    pub drift_1: f64,
    /// The same between iterations 10 apart (temporal locality: `drift_1` below `drift_10`).
    pub drift_10: Option<f64>,
}

impl RoutingTrace {
    /// Every expert's tokens in MoE layer `m` at iteration index `i`, summed over ranks.
    pub fn expert_totals(&self, i: usize, m: usize) -> Vec<u64> {
        let mut t = vec![0u64; self.shape.experts];
        for row in &self.iterations[i][m] {
            for (x, &c) in t.iter_mut().zip(row) {
                *x += c;
            }
        }
        t
    }

    /// Per MoE layer: imbalance and drift over the trace. Drift is the profiler's own measure
    /// ([`ExpertLoad::drift`], what speculative activation compares), one layer at a time.
    pub fn stats(&self) -> Vec<LayerStats> {
        let n = self.iterations.len();
        (0..self.shape.moe_layers)
            .map(|m| {
                let loads: Vec<ExpertLoad> = (0..n).map(|i| ExpertLoad { tokens: vec![self.expert_totals(i, m)] }).collect();
                let drift = |k: usize| -> Option<f64> {
                    (n > k).then(|| {
                        let sum: f64 =
                            (k..n).map(|i| loads[i - k].drift(&loads[i]).expect("one layer of the same experts")).sum();
                        sum / (n - k) as f64
                    })
                };
                let imb: Vec<f64> = loads
                    .iter()
                    .map(|l| {
                        let t = &l.tokens[0];
                        let mean = t.iter().sum::<u64>() as f64 / t.len() as f64;
                        t.iter().copied().max().unwrap_or(0) as f64 / mean.max(f64::MIN_POSITIVE)
                    })
                    .collect();
                LayerStats {
                    imbalance_mean: imb.iter().sum::<f64>() / n.max(1) as f64,
                    imbalance_max: imb.iter().copied().fold(0.0, f64::max),
                    drift_1: drift(1).unwrap_or(0.0),
                    drift_10: drift(10),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> RoutingShape {
        RoutingShape { model: "t".into(), moe_layers: 2, experts: 4, top_k: 2, ranks: 2, tokens_per_rank: 3 }
    }

    /// rank r's row at iteration i: 6 choices over 4 experts
    fn row(i: u64, r: usize) -> Vec<Vec<u64>> {
        let e = (i as usize + r) % 4;
        (0..2)
            .map(|m| {
                (0..4)
                    .map(|x| {
                        if x == e {
                            4
                        } else if x == (e + m + 1) % 4 {
                            2
                        } else {
                            0
                        }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn rows_in_any_order_assemble_and_a_repeated_iteration_replaces_the_first() {
        let mut rows = vec![(6, 1, row(6, 1)), (5, 0, row(5, 0)), (6, 0, vec![vec![6, 0, 0, 0]; 2]), (5, 1, row(5, 1))];
        rows.push((6, 0, row(6, 0))); // rank 0 repeated iteration 6 after a recovery
        let t = RoutingTrace::assemble(shape(), rows).unwrap();
        assert_eq!(t.first_iter, 5);
        assert_eq!(t.iterations.len(), 2);
        assert_eq!(t.iterations[1][1][0], row(6, 0)[1]);
        let back = RoutingTrace::from_json_str(&serde_json::to_string(&t).unwrap(), "t.json").unwrap();
        assert_eq!(back, t);
        t.check_for(&shape(), 2).unwrap();
    }

    #[test]
    fn stats_see_imbalance_and_drift() {
        // layer 0: the same load every iteration (rank 0 all on expert 0, rank 1 spread);
        // layer 1: the busy expert moves every iteration
        let row = |i: u64, r: usize| -> Vec<Vec<u64>> {
            let l0 = if r == 0 { vec![6, 0, 0, 0] } else { vec![0, 2, 2, 2] };
            let mut l1 = vec![0; 4];
            l1[i as usize % 4] = 6;
            vec![l0, l1]
        };
        let t = RoutingTrace::assemble(shape(), (0..12).flat_map(|i| (0..2).map(move |r| (i, r, row(i, r))))).unwrap();
        assert_eq!(t.expert_totals(0, 0), [6, 2, 2, 2]);
        let s = t.stats();
        assert_eq!(s[0].imbalance_mean, 2.0); // 6 over a mean of 3
        assert_eq!((s[0].drift_1, s[0].drift_10), (0.0, Some(0.0)));
        assert_eq!(s[1].imbalance_max, 4.0); // 12 tokens on one expert of four
        assert_eq!(s[1].drift_1, 1.0); // a different expert each iteration
        assert_eq!(s[1].drift_10, Some(1.0)); // 10 apart: 10 mod 4 = 2, another expert
    }

    #[test]
    fn a_trace_that_cannot_drive_the_run_says_why() {
        let t = RoutingTrace::assemble(shape(), (0..3).flat_map(|i| (0..2).map(move |r| (i, r, row(i, r))))).unwrap();
        let e = t.check_for(&shape(), 4).unwrap_err().to_string();
        assert!(e.contains("3 iterations recorded, the run needs 4"), "{e}");
        let other = RoutingShape { experts: 8, ..shape() };
        let e = t.check_for(&other, 2).unwrap_err().to_string();
        assert!(e.contains("of 4 experts") && e.contains("of 8 experts") && e.contains("routing architecture"), "{e}");
        // another token count: the router's shares still drive emulated compute, not a CPU run
        let more = RoutingShape { tokens_per_rank: shape().tokens_per_rank * 2, ..shape() };
        t.check_routes_for(&more, 3).unwrap();
        assert!(t.check_for(&more, 3).unwrap_err().to_string().contains("record one on this model"));
        // a hole, a missing rank, a row that routes the wrong number of tokens
        let e = RoutingTrace::assemble(shape(), [(0, 0, row(0, 0)), (0, 1, row(0, 1)), (2, 0, row(2, 0)), (2, 1, row(2, 1))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("iteration 1 is missing"), "{e}");
        let e = RoutingTrace::assemble(shape(), [(0, 0, row(0, 0))]).unwrap_err().to_string();
        assert!(e.contains("no row of rank 1"), "{e}");
        let e = RoutingTrace::assemble(shape(), [(0, 0, row(0, 0)), (0, 1, vec![vec![1, 0, 0, 0]; 2])]).unwrap_err().to_string();
        assert!(e.contains("routing 1 tokens, not 4 routing 6"), "{e}");
        let e = RoutingTrace::from_json_str("{\"shape\": 3}", "x.json").unwrap_err().to_string();
        assert!(e.contains("x.json"), "{e}");
    }
}

//! A chain of decisions with pairwise costs and one memory budget — the shape of the TMP
//! planning problem (one choice per sub-layer, resharding and overlap costs between
//! neighbours, memory summed over all sub-layers).
//!
//! Solved exactly as an ILP with HiGHS. The pairwise terms use the flow formulation
//! (`Σ_b y[i][a][b] = x[i][a]`, `Σ_a y[i][a][b] = x[i+1][b]`), which without the memory row is
//! a shortest-path polytope with integral vertices, so the LP relaxation is tight and the
//! solver rarely branches. A brute-force enumerator checks the ILP on small instances.

use good_lp::{highs, variable, Expression, ProblemVariables, Solution, SolverModel, Variable, WithInitialSolution};
use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};

/// One option for one node of the chain.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// Cost (seconds) of the node with this option.
    pub cost: f64,
    /// Memory (bytes per device) the node uses with this option.
    pub mem: f64,
}

/// The problem: pick one choice per node minimising node + edge costs with memory ≤ budget.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChainProblem {
    /// `choices[i]`: the options of node `i`.
    pub choices: Vec<Vec<Choice>>,
    /// `edges[i][a][b]`: cost between node `i` with option `a` and node `i + 1` with option `b`.
    pub edges: Vec<Vec<Vec<f64>>>,
    /// Memory budget, bytes per device.
    pub mem_budget: f64,
}

/// The chosen option per node and the total cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainSolution {
    /// Index of the chosen option per node.
    pub picks: Vec<usize>,
    /// Total cost.
    pub cost: f64,
    /// Total memory.
    pub mem: f64,
}

/// How a chain problem is solved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Exact chain algorithms first (unconstrained shortest path when it fits; otherwise a
    /// Pareto-label dynamic program), HiGHS when the labels grow too many.
    #[default]
    Auto,
    /// Always the HiGHS ILP (warm-started by the Lagrangian heuristic).
    Highs,
}

/// Which algorithm produced an answer (all exact unless the time limit stopped HiGHS).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SolvedBy {
    /// The memory-unconstrained shortest path already fit.
    ShortestPath,
    /// The Pareto-label dynamic program.
    ParetoDp,
    /// HiGHS branch and bound on the ILP.
    Highs,
}

/// Label limit per (node, option) for the Pareto program before falling back to HiGHS.
pub const PARETO_LABEL_LIMIT: usize = 200_000;

/// Brute force refuses beyond this many combinations.
pub const BRUTE_FORCE_LIMIT: f64 = 5e6;

impl ChainProblem {
    fn check(&self) -> Result<()> {
        if self.choices.is_empty() {
            return Err(PlanError::invalid("chain problem", "no nodes"));
        }
        if self.edges.len() + 1 != self.choices.len() {
            return Err(PlanError::invalid("chain problem", "need one edge table between each pair of neighbours"));
        }
        for (i, c) in self.choices.iter().enumerate() {
            if c.is_empty() {
                return Err(PlanError::Infeasible {
                    why: format!("node {i} has no admissible option"),
                    hint: "allow more tensor-parallel degrees or a larger global batch".into(),
                });
            }
            if c.iter().any(|c| !c.cost.is_finite() || !c.mem.is_finite()) {
                return Err(PlanError::invalid("chain problem", format!("node {i} has a non-finite cost or memory")));
            }
        }
        for (i, e) in self.edges.iter().enumerate() {
            if e.len() != self.choices[i].len() || e.iter().any(|row| row.len() != self.choices[i + 1].len()) {
                return Err(PlanError::invalid("chain problem", format!("edge table {i} has the wrong shape")));
            }
            if e.iter().flatten().any(|v| !v.is_finite()) {
                return Err(PlanError::invalid("chain problem", format!("edge table {i} has a non-finite cost")));
            }
        }
        let min_mem: f64 = self.choices.iter().map(|c| c.iter().map(|c| c.mem).fold(f64::INFINITY, f64::min)).sum();
        if min_mem > self.mem_budget {
            return Err(PlanError::Infeasible {
                why: format!(
                    "the smallest memory footprint is {:.2} GiB per device, the budget {:.2} GiB",
                    min_mem / (1u64 << 30) as f64,
                    self.mem_budget / (1u64 << 30) as f64
                ),
                hint: "use more devices, higher tensor-parallel degrees, activation recompute, or a smaller batch".into(),
            });
        }
        Ok(())
    }

    /// Cost and memory of a given pick, or `None` when it exceeds the memory budget.
    pub fn evaluate(&self, picks: &[usize]) -> Option<(f64, f64)> {
        let mut cost = 0.0;
        let mut mem = 0.0;
        for (i, &p) in picks.iter().enumerate() {
            cost += self.choices[i][p].cost;
            mem += self.choices[i][p].mem;
            if i + 1 < picks.len() {
                cost += self.edges[i][p][picks[i + 1]];
            }
        }
        (mem <= self.mem_budget * (1.0 + 1e-9)).then_some((cost, mem))
    }

    /// Enumerate every combination (tests and tiny models only).
    pub fn brute_force(&self) -> Result<ChainSolution> {
        self.check()?;
        let combos: f64 = self.choices.iter().map(|c| c.len() as f64).product();
        if combos > BRUTE_FORCE_LIMIT {
            return Err(PlanError::TooLarge { combinations: combos, limit: BRUTE_FORCE_LIMIT });
        }
        let n = self.choices.len();
        let mut picks = vec![0usize; n];
        let mut best: Option<ChainSolution> = None;
        loop {
            if let Some((cost, mem)) = self.evaluate(&picks) {
                if best.as_ref().is_none_or(|b| cost < b.cost) {
                    best = Some(ChainSolution { picks: picks.clone(), cost, mem });
                }
            }
            // odometer
            let mut i = 0;
            loop {
                if i == n {
                    return best.ok_or_else(|| PlanError::Infeasible {
                        why: "no combination fits the memory budget".into(),
                        hint: "raise the budget or allow more options".into(),
                    });
                }
                picks[i] += 1;
                if picks[i] < self.choices[i].len() {
                    break;
                }
                picks[i] = 0;
                i += 1;
            }
        }
    }

    /// Shortest path through the chain with node weight `cost + lambda · mem` (dynamic
    /// programming, exact for the relaxed problem).
    fn shortest_path(&self, lambda: f64) -> Vec<usize> {
        let n = self.choices.len();
        let w = |i: usize, a: usize| self.choices[i][a].cost + lambda * self.choices[i][a].mem;
        let mut best: Vec<f64> = (0..self.choices[0].len()).map(|a| w(0, a)).collect();
        let mut back: Vec<Vec<usize>> = Vec::with_capacity(n);
        back.push(vec![0; best.len()]);
        for i in 1..n {
            let mut nb = vec![f64::INFINITY; self.choices[i].len()];
            let mut bk = vec![0usize; self.choices[i].len()];
            for (b, slot) in nb.iter_mut().enumerate() {
                for (a, &prev) in best.iter().enumerate() {
                    let v = prev + self.edges[i - 1][a][b];
                    if v < *slot {
                        *slot = v;
                        bk[b] = a;
                    }
                }
                *slot += w(i, b);
            }
            best = nb;
            back.push(bk);
        }
        let mut picks = vec![0usize; n];
        picks[n - 1] = (0..best.len()).min_by(|&a, &b| best[a].total_cmp(&best[b])).unwrap_or(0);
        for i in (1..n).rev() {
            picks[i - 1] = back[i][picks[i]];
        }
        picks
    }

    /// A good feasible answer fast: Lagrangian relaxation of the memory row (bisection on its
    /// multiplier, each step a shortest path), then single-node improvements. Returns the
    /// answer and whether it is proven optimal (the unconstrained optimum already fits).
    pub fn heuristic(&self) -> Option<(ChainSolution, bool)> {
        let p0 = self.shortest_path(0.0);
        if let Some((cost, mem)) = self.evaluate(&p0) {
            return Some((ChainSolution { picks: p0, cost, mem }, true));
        }
        // Find a multiplier that makes the path fit: cost per byte, scaled to the problem.
        let scale = self.choices.iter().flatten().map(|c| c.cost).fold(0.0, f64::max).max(1e-12)
            / self.choices.iter().flatten().map(|c| c.mem).fold(0.0, f64::max).max(1.0);
        let mut hi = scale;
        let mut best: Option<ChainSolution> = None;
        let consider = |picks: Vec<usize>, best: &mut Option<ChainSolution>| -> bool {
            match self.evaluate(&picks) {
                Some((cost, mem)) => {
                    if best.as_ref().is_none_or(|b| cost < b.cost) {
                        *best = Some(ChainSolution { picks, cost, mem });
                    }
                    true
                }
                None => false,
            }
        };
        let mut found = false;
        for _ in 0..60 {
            if consider(self.shortest_path(hi), &mut best) {
                found = true;
                break;
            }
            hi *= 4.0;
        }
        if !found {
            return None;
        }
        let mut lo = 0.0;
        for _ in 0..40 {
            let mid = 0.5 * (lo + hi);
            if consider(self.shortest_path(mid), &mut best) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        let mut sol = best?;
        // Greedy repair: switch one node at a time while that lowers the cost and still fits.
        loop {
            let mut improved = false;
            for i in 0..sol.picks.len() {
                for a in 0..self.choices[i].len() {
                    if a == sol.picks[i] {
                        continue;
                    }
                    let mut p = sol.picks.clone();
                    p[i] = a;
                    if let Some((cost, mem)) = self.evaluate(&p) {
                        if cost < sol.cost - 1e-15 {
                            sol = ChainSolution { picks: p, cost, mem };
                            improved = true;
                        }
                    }
                }
            }
            if !improved {
                break;
            }
        }
        Some((sol, false))
    }

    /// Exact resource-constrained shortest path by dynamic programming over Pareto labels
    /// (memory, cost) per node and option, pruned by an upper bound. Returns `None` when the
    /// label sets grow past `max_labels` per state (then the caller falls back to the ILP alone).
    pub fn pareto_dp(&self, upper_bound: f64, max_labels: usize) -> Option<ChainSolution> {
        #[derive(Clone, Copy)]
        struct Label {
            mem: f64,
            cost: f64,
            prev: (u32, u32),
        }
        let n = self.choices.len();
        // Least memory and cost the rest of the chain needs, for pruning.
        let mut rest_mem = vec![0.0; n + 1];
        let mut rest_cost = vec![0.0; n + 1];
        for i in (0..n).rev() {
            rest_mem[i] = rest_mem[i + 1] + self.choices[i].iter().map(|c| c.mem).fold(f64::INFINITY, f64::min);
            let min_edge = if i + 1 < n { self.edges[i].iter().flatten().copied().fold(f64::INFINITY, f64::min) } else { 0.0 };
            rest_cost[i] = rest_cost[i + 1] + self.choices[i].iter().map(|c| c.cost).fold(f64::INFINITY, f64::min) + min_edge;
        }
        let budget = self.mem_budget * (1.0 + 1e-9);
        let ub = upper_bound * (1.0 + 1e-12) + 1e-15;
        let mut layers: Vec<Vec<Vec<Label>>> = Vec::with_capacity(n);
        let first: Vec<Vec<Label>> = self.choices[0]
            .iter()
            .map(|c| {
                let l = Label { mem: c.mem, cost: c.cost, prev: (0, 0) };
                if l.mem + rest_mem[1] <= budget && l.cost + rest_cost[1] <= ub {
                    vec![l]
                } else {
                    vec![]
                }
            })
            .collect();
        layers.push(first);
        let mut cand: Vec<Label> = Vec::new();
        for i in 1..n {
            let prev = &layers[i - 1];
            let mut cur = Vec::with_capacity(self.choices[i].len());
            for (b, cb) in self.choices[i].iter().enumerate() {
                cand.clear();
                for (a, labels) in prev.iter().enumerate() {
                    let e = self.edges[i - 1][a][b];
                    for (k, l) in labels.iter().enumerate() {
                        let mem = l.mem + cb.mem;
                        let cost = l.cost + e + cb.cost;
                        if mem + rest_mem[i + 1] <= budget && cost + rest_cost[i + 1] <= ub {
                            cand.push(Label { mem, cost, prev: (a as u32, k as u32) });
                        }
                    }
                }
                cand.sort_by(|x, y| x.mem.total_cmp(&y.mem).then(x.cost.total_cmp(&y.cost)));
                let mut front: Vec<Label> = Vec::new();
                for l in &cand {
                    match front.last() {
                        Some(last) if l.cost >= last.cost - 1e-15 => {}
                        _ => front.push(*l),
                    }
                }
                if front.len() > max_labels {
                    return None;
                }
                cur.push(front);
            }
            layers.push(cur);
        }
        // best final label
        let mut best: Option<(usize, usize, f64)> = None;
        for (a, labels) in layers[n - 1].iter().enumerate() {
            for (k, l) in labels.iter().enumerate() {
                if best.is_none_or(|b| l.cost < b.2) {
                    best = Some((a, k, l.cost));
                }
            }
        }
        let (mut a, mut k, _) = best?;
        let mut picks = vec![0usize; n];
        for i in (0..n).rev() {
            picks[i] = a;
            let p = layers[i][a][k].prev;
            a = p.0 as usize;
            k = p.1 as usize;
        }
        let (cost, mem) = self.evaluate(&picks)?;
        Some(ChainSolution { picks, cost, mem })
    }

    /// Solve with `method`; see [`Method`].
    pub fn solve(&self, method: Method, time_limit_s: f64, rel_gap: f64) -> Result<(ChainSolution, SolvedBy)> {
        self.check()?;
        if method == Method::Highs {
            return Ok((self.solve_ilp(time_limit_s, rel_gap)?, SolvedBy::Highs));
        }
        let Some((h, proven)) = self.heuristic() else {
            return Err(PlanError::Infeasible {
                why: "no combination fits the memory budget".into(),
                hint: "raise the budget or allow more options".into(),
            });
        };
        if proven {
            return Ok((h, SolvedBy::ShortestPath));
        }
        match self.pareto_dp(h.cost, PARETO_LABEL_LIMIT) {
            Some(d) => Ok((d, SolvedBy::ParetoDp)),
            None => Ok((self.solve_ilp(time_limit_s, rel_gap)?, SolvedBy::Highs)),
        }
    }

    /// Solve with HiGHS, stopping after `time_limit_s` or when the answer is proven within
    /// `rel_gap` of the optimum (0: exact).
    pub fn solve_ilp(&self, time_limit_s: f64, rel_gap: f64) -> Result<ChainSolution> {
        self.check()?;
        let start = self.heuristic();
        // Scale costs to milliseconds and memory to fractions of the budget, so the solver's
        // absolute tolerances act on sensible magnitudes.
        const T: f64 = 1e3;
        let m_scale = 1.0 / self.mem_budget.abs().max(1e-300);
        let mut vars = ProblemVariables::new();
        let x: Vec<Vec<Variable>> =
            self.choices.iter().map(|c| c.iter().map(|_| vars.add(variable().binary())).collect()).collect();
        let y: Vec<Vec<Vec<Variable>>> = self
            .edges
            .iter()
            .map(|e| e.iter().map(|row| row.iter().map(|_| vars.add(variable().min(0.0).max(1.0))).collect()).collect())
            .collect();
        let mut objective = Expression::from(0.0);
        for (i, c) in self.choices.iter().enumerate() {
            for (a, ch) in c.iter().enumerate() {
                objective += ch.cost * T * x[i][a];
            }
        }
        for (i, e) in self.edges.iter().enumerate() {
            for (a, row) in e.iter().enumerate() {
                for (b, &cost) in row.iter().enumerate() {
                    if cost != 0.0 {
                        objective += cost * T * y[i][a][b];
                    }
                }
            }
        }
        let mut initial: Vec<(Variable, f64)> = Vec::new();
        if let Some((sol, _)) = &start {
            for (i, xi) in x.iter().enumerate() {
                for (a, v) in xi.iter().enumerate() {
                    initial.push((*v, if sol.picks[i] == a { 1.0 } else { 0.0 }));
                }
            }
            for (i, yi) in y.iter().enumerate() {
                for (a, row) in yi.iter().enumerate() {
                    for (b, v) in row.iter().enumerate() {
                        initial.push((*v, if sol.picks[i] == a && sol.picks[i + 1] == b { 1.0 } else { 0.0 }));
                    }
                }
            }
        }
        let mut model = vars.minimise(objective).using(highs);
        model.set_verbose(false);
        if !initial.is_empty() {
            model = model.with_initial_solution(initial);
        }
        let mut model = model.set_time_limit(time_limit_s).set_threads(1);
        model = model.set_mip_rel_gap(rel_gap as f32).map_err(|e| PlanError::Solver(e.to_string()))?;
        model = model.set_mip_abs_gap(1e-9).map_err(|e| PlanError::Solver(e.to_string()))?;
        for xi in &x {
            let s: Expression = xi.iter().copied().sum();
            model.add_constraint(s.eq(1.0));
        }
        for (i, e) in self.edges.iter().enumerate() {
            for (a, row) in e.iter().enumerate() {
                let s: Expression = (0..row.len()).map(|b| y[i][a][b]).sum();
                model.add_constraint(s.eq(x[i][a]));
            }
            for b in 0..self.choices[i + 1].len() {
                let s: Expression = (0..e.len()).map(|a| y[i][a][b]).sum();
                model.add_constraint(s.eq(x[i + 1][b]));
            }
        }
        let mut mem = Expression::from(0.0);
        for (i, c) in self.choices.iter().enumerate() {
            for (a, ch) in c.iter().enumerate() {
                mem += ch.mem * m_scale * x[i][a];
            }
        }
        model.add_constraint(mem.leq(1.0));
        let sol = model.solve().map_err(|e| match e {
            good_lp::ResolutionError::Infeasible => PlanError::Infeasible {
                why: "no combination fits the memory budget".into(),
                hint: "raise the budget or allow more options".into(),
            },
            other => PlanError::Solver(other.to_string()),
        })?;
        let picks: Vec<usize> = x
            .iter()
            .map(|xi| {
                xi.iter().enumerate().max_by(|a, b| sol.value(*a.1).total_cmp(&sol.value(*b.1))).map(|(i, _)| i).unwrap_or(0)
            })
            .collect();
        let (cost, mem) = self.evaluate(&picks).ok_or_else(|| {
            PlanError::Solver("the solver's answer exceeds the memory budget after rounding; report this instance".into())
        })?;
        Ok(ChainSolution { picks, cost, mem })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ilp_respects_memory_and_edges() {
        // Two nodes; cheap options are memory-hungry; the edge punishes switching.
        let p = ChainProblem {
            choices: vec![
                vec![Choice { cost: 1.0, mem: 10.0 }, Choice { cost: 2.0, mem: 1.0 }],
                vec![Choice { cost: 1.0, mem: 10.0 }, Choice { cost: 2.0, mem: 1.0 }],
            ],
            edges: vec![vec![vec![0.0, 5.0], vec![5.0, 0.0]]],
            mem_budget: 11.0,
        };
        let b = p.brute_force().unwrap();
        let i = p.solve_ilp(10.0, 0.0).unwrap();
        assert_eq!(b.picks, vec![1, 1]);
        assert_eq!(i.picks, b.picks);
        assert_eq!(i.cost, 4.0);
    }

    #[test]
    fn infeasible_is_typed() {
        let p = ChainProblem { choices: vec![vec![Choice { cost: 1.0, mem: 10.0 }]], edges: vec![], mem_budget: 1.0 };
        assert!(matches!(p.solve_ilp(1.0, 0.0), Err(PlanError::Infeasible { .. })));
        assert!(matches!(p.brute_force(), Err(PlanError::Infeasible { .. })));
    }
}

//! Tensor parallelism: one iteration of a tensor-parallel group under a TMP plan, with the
//! plan's sub-batches overlapping all-reduces with compute (Oases) or not (Megatron).
//!
//! Resources: the device's compute stream, one link per tensor-parallel degree used (its
//! group's bus bandwidth) and one per data-parallel group. Sub-layer `i`'s piece `p` waits for
//! piece `p` of sub-layer `i - 1` (same degree and piece count) or for all of it (otherwise,
//! with a resharding transfer when the degrees differ), so the overlap is whatever the
//! dependencies allow, not what the planner assumed.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use ironweave_plan::tp::{TpChoice, TpProblem};
use ironweave_plan::{Coll, CostModel, ModelDesc};

use crate::engine::{run, Class, Dag, OpId, ResId, Trace};
use crate::error::{Result, SimError};

/// Simulated vs predicted time of one configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TpRun {
    /// Label.
    pub name: String,
    /// Planner's prediction.
    pub predicted_s: f64,
    /// Simulated iteration.
    pub simulated_s: f64,
    /// The DAG and its trace (for timelines).
    #[serde(skip)]
    pub trace: Option<(Dag, Trace)>,
}

/// Simulate the sub-layer choices `picks` (indices into each sub-layer's options).
pub fn simulate(problem: &TpProblem, model: &ModelDesc, cm: &CostModel<'_>, picks: &[usize], name: &str) -> Result<TpRun> {
    if picks.len() != problem.sublayers.len() {
        return Err(SimError::Invalid(format!("{} picks for {} sub-layers", picks.len(), problem.sublayers.len())));
    }
    let ch: Vec<TpChoice> = problem
        .sublayers
        .iter()
        .zip(picks)
        .map(|(s, &p)| {
            s.options.get(p).copied().ok_or_else(|| SimError::Invalid(format!("pick {p} out of range for {}", s.name)))
        })
        .collect::<Result<_>>()?;
    let predicted = problem.chain.evaluate(picks).map(|x| x.0).unwrap_or(f64::NAN);
    let n = cm.cluster.devices();
    let mut dag = Dag::default();
    let gpu = dag.stream("gpu");
    let mut tp_links: BTreeMap<u32, ResId> = BTreeMap::new();
    let mut dp_links: BTreeMap<u32, ResId> = BTreeMap::new();
    for c in &ch {
        if c.tp > 1 && !tp_links.contains_key(&c.tp) {
            let g = cm.tp_group(c.tp);
            tp_links.insert(c.tp, dag.link(&format!("tp{} ({})", c.tp, g.links.join("+")), g.bytes_per_s, false));
        }
        if n / c.tp > 1 && !dp_links.contains_key(&c.tp) {
            let g = cm.dp_group(c.tp);
            dp_links.insert(c.tp, dag.link(&format!("dp{} ({})", n / c.tp, g.links.join("+")), g.bytes_per_s, false));
        }
    }
    // All sub-layers run the same number of micro-steps (the most any of them needs); a
    // sub-layer with a smaller tensor group has fewer sequences, so it handles
    // `group_batch / steps` of them per step.
    let steps = ch.iter().map(|c| (c.group_batch / c.micro).ceil() as usize).max().unwrap_or(1);
    let elem = model.grad_elem_bytes();
    let per_step = |c: &TpChoice| c.group_batch / steps as f64;
    let mut all: Vec<OpId> = Vec::new();
    let mut prev_step_end = dag.mark("start", vec![]);
    let allreduce = |dag: &mut Dag, c: &TpChoice, name: String, dep: OpId, tp_links: &BTreeMap<u32, ResId>| -> OpId {
        match tp_links.get(&c.tp) {
            Some(&link) => {
                let g = cm.tp_group(c.tp);
                let bytes = model.activation_bytes(per_step(c) / c.sub_batches as f64) * Coll::AllReduce.bus_factor(c.tp);
                dag.transfer(name, "tp-comm", link, bytes, Coll::AllReduce.steps(c.tp) * g.latency_s, Class::Training, vec![dep])
            }
            None => dep,
        }
    };
    let reshard =
        |dag: &mut Dag, a: &TpChoice, b: &TpChoice, name: String, deps: Vec<OpId>, tp_links: &BTreeMap<u32, ResId>| -> OpId {
            let big = if a.tp > b.tp { a } else { b };
            match tp_links.get(&big.tp) {
                Some(&link) if a.tp != b.tp => {
                    let g = cm.tp_group(big.tp);
                    let bytes = model.activation_bytes(per_step(big)) * Coll::AllToAll.bus_factor(big.tp);
                    dag.transfer(name, "reshard", link, bytes, Coll::AllToAll.steps(big.tp) * g.latency_s, Class::Training, deps)
                }
                _ => dag.mark(name, deps),
            }
        };
    let mut last_bwd: Vec<Vec<OpId>> = vec![Vec::new(); ch.len()];
    for step in 0..steps {
        // forward
        let mut prev_out: Vec<OpId> = vec![prev_step_end];
        for (i, c) in ch.iter().enumerate() {
            let k = c.sub_batches as usize;
            let per = c.fwd_s / steps as f64 / k as f64;
            let joined = i > 0 && (ch[i - 1].sub_batches != c.sub_batches || ch[i - 1].tp != c.tp);
            let entry: Vec<OpId> = if joined {
                vec![reshard(
                    &mut dag,
                    &ch[i - 1],
                    c,
                    format!("s{step} {} reshard", problem.sublayers[i].name),
                    prev_out.clone(),
                    &tp_links,
                )]
            } else {
                prev_out.clone()
            };
            let mut out = Vec::with_capacity(k);
            for p in 0..k {
                let dep = if entry.len() == k { entry[p] } else { entry[0] };
                let cp = dag.compute(format!("s{step} {} fwd {p}", problem.sublayers[i].name), "compute", gpu, per, vec![dep]);
                out.push(allreduce(&mut dag, c, format!("s{step} {} fwd ar {p}", problem.sublayers[i].name), cp, &tp_links));
            }
            all.extend(&out);
            prev_out = out;
        }
        // backward, last sub-layer first
        for i in (0..ch.len()).rev() {
            let c = &ch[i];
            let k = c.sub_batches as usize;
            let per = c.bwd_s / steps as f64 / k as f64;
            let joined = i + 1 < ch.len() && (ch[i + 1].sub_batches != c.sub_batches || ch[i + 1].tp != c.tp);
            let entry: Vec<OpId> = if joined {
                vec![reshard(
                    &mut dag,
                    &ch[i + 1],
                    c,
                    format!("s{step} {} reshard bwd", problem.sublayers[i].name),
                    prev_out.clone(),
                    &tp_links,
                )]
            } else {
                prev_out.clone()
            };
            let mut out = Vec::with_capacity(k);
            let mut computes = Vec::with_capacity(k);
            for p in 0..k {
                let dep = if entry.len() == k { entry[p] } else { entry[0] };
                let cp = dag.compute(format!("s{step} {} bwd {p}", problem.sublayers[i].name), "compute", gpu, per, vec![dep]);
                computes.push(cp);
                out.push(allreduce(&mut dag, c, format!("s{step} {} bwd ar {p}", problem.sublayers[i].name), cp, &tp_links));
            }
            all.extend(&out);
            last_bwd[i] = computes;
            prev_out = out;
        }
        prev_step_end = dag.mark(format!("s{step} end"), prev_out);
    }
    // data-parallel gradient all-reduce, each sub-layer after its last backward
    for (i, c) in ch.iter().enumerate() {
        if let Some(&link) = dp_links.get(&c.tp) {
            let g = cm.dp_group(c.tp);
            let dn = n / c.tp;
            let bytes = problem.sublayers[i].params / c.tp as f64 * elem * Coll::AllReduce.bus_factor(dn);
            let ar = dag.transfer(
                format!("{} dp ar", problem.sublayers[i].name),
                "dp-comm",
                link,
                bytes,
                Coll::AllReduce.steps(dn) * g.latency_s,
                Class::Training,
                last_bwd[i].clone(),
            );
            all.push(ar);
        }
    }
    all.push(prev_step_end);
    let end = dag.mark("end", all);
    let tr = run(&dag)?;
    Ok(TpRun { name: name.into(), predicted_s: predicted, simulated_s: tr.ops[end].end, trace: Some((dag, tr)) })
}

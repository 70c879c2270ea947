//! Sharded data parallelism: one iteration under an SDP plan (per layer, the fraction gathered
//! over all devices through the inter-node path and the rest within the node over NVLink).
//!
//! Resources: the compute stream, the intra-node link and the inter-node path (and a second
//! inter-node link when the plan's cluster has one, for the node part's all-reduce). Gathers
//! are prefetched one layer ahead (two layers' parameters in memory at most); reduce-scatters
//! follow each layer's backward; the node-sharded part's shards are then all-reduced across
//! nodes as soon as the node part's own reduce-scatter ends. Transfer sizes are the planner's busy times times the link's rate, so the simulator
//! adds only what the plan ignores: dependencies, queuing and latency.

use serde::{Deserialize, Serialize};

use ironweave_plan::sdp::SdpLayer;
use ironweave_plan::{CostModel, ModelDesc};

use crate::engine::{run, Class, Dag, OpId, Trace};
use crate::error::{Result, SimError};

/// Simulated vs predicted time of one SDP configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SdpRun {
    /// Label.
    pub name: String,
    /// Planner's prediction.
    pub predicted_s: f64,
    /// Simulated iteration.
    pub simulated_s: f64,
    /// The DAG and its trace.
    #[serde(skip)]
    pub trace: Option<(Dag, Trace)>,
}

/// Simulate one iteration with `global_fraction[l]` of layer `l` sharded over all devices.
pub fn simulate(
    layers: &[SdpLayer],
    model: &ModelDesc,
    cm: &CostModel<'_>,
    global_fraction: &[f64],
    name: &str,
) -> Result<SdpRun> {
    if layers.len() != global_fraction.len() || layers.is_empty() {
        return Err(SimError::Invalid(format!("{} fractions for {} layers", global_fraction.len(), layers.len())));
    }
    if global_fraction.iter().any(|g| !(0.0..=1.0).contains(g)) {
        return Err(SimError::Invalid("fractions must be in [0, 1]".into()));
    }
    let predicted: f64 = layers.iter().zip(global_fraction).map(|(l, &g)| l.time(g)).sum();
    let mut dag = Dag::default();
    let gpu = dag.stream("gpu");
    let intra_bw = cm.node_group().bytes_per_s;
    let inter_bw = cm.global_group().bytes_per_s;
    let intra_bw = if intra_bw.is_finite() { intra_bw } else { 1e15 };
    let inter_bw = if inter_bw.is_finite() { inter_bw } else { 1e15 };
    let intra = dag.link("intra-node", intra_bw, false);
    let inter = dag.link("inter-node", inter_bw, false);
    // the node part's cross-node all-reduce: on a second inter-node link when the cluster has one
    let rail_bw = cm.second_rail_group().bytes_per_s;
    let rail_bw = if rail_bw.is_finite() { rail_bw } else { 1e15 };
    let (rail, rail_bw) = if layers.iter().any(|l| l.separate_rail) {
        (dag.link("inter-node (second link)", rail_bw, false), rail_bw)
    } else {
        (inter, inter_bw)
    };
    let fwd_share = 1.0 / (3.0 + if model.activation_recompute { 1.0 } else { 0.0 });
    // one collective (all-gather or reduce-scatter) of the part: a third of the busy totals
    // returns the mark of the whole collective and the node part's transfer, if any
    let gather = |dag: &mut Dag, l: &SdpLayer, g: f64, name: String, deps: Vec<OpId>| -> (OpId, Option<OpId>) {
        let n = 1.0 - g;
        let mut parts = Vec::new();
        if g > 0.0 {
            parts.push(dag.transfer(
                format!("{name} global/inter"),
                "gather",
                inter,
                g * l.global_inter_s / 3.0 * inter_bw,
                l.global_latency_s / 3.0,
                Class::Training,
                deps.clone(),
            ));
            parts.push(dag.transfer(
                format!("{name} global/intra"),
                "gather",
                intra,
                g * l.global_intra_s / 3.0 * intra_bw,
                0.0,
                Class::Training,
                deps.clone(),
            ));
        }
        let mut node = None;
        if n > 0.0 {
            let t = dag.transfer(
                format!("{name} node"),
                "gather",
                intra,
                n * l.node_intra_s / 3.0 * intra_bw,
                l.node_latency_s / 3.0,
                Class::Training,
                deps.clone(),
            );
            parts.push(t);
            node = Some(t);
        }
        let mark = if parts.is_empty() { dag.mark(name, deps) } else { dag.mark(name, parts) };
        (mark, node)
    };
    let nl = layers.len();
    let mut ag: Vec<OpId> = Vec::with_capacity(nl);
    let mut fwd: Vec<OpId> = Vec::with_capacity(nl);
    for (i, (l, &g)) in layers.iter().zip(global_fraction).enumerate() {
        let mut deps = Vec::new();
        if i >= 1 {
            deps.push(ag[i - 1]);
        }
        if i >= 2 {
            deps.push(fwd[i - 2]);
        }
        let (a, _) = gather(&mut dag, l, g, format!("{} fwd gather", l.name), deps);
        ag.push(a);
        let mut deps = vec![a];
        deps.extend(fwd.last());
        fwd.push(dag.compute(format!("{} fwd", l.name), "compute", gpu, l.compute_s * fwd_share, deps));
    }
    let mut bag: Vec<Option<OpId>> = vec![None; nl];
    let mut bwd: Vec<Option<OpId>> = vec![None; nl];
    let mut tail = Vec::new();
    for i in (0..nl).rev() {
        let (l, g) = (&layers[i], global_fraction[i]);
        let mut deps = vec![*fwd.last().expect("layers")];
        if i + 1 < nl {
            deps.extend(bag[i + 1]);
        }
        if i + 2 < nl {
            deps.extend(bwd[i + 2]);
        }
        let (a, _) = gather(&mut dag, l, g, format!("{} bwd gather", l.name), deps);
        bag[i] = Some(a);
        let mut deps = vec![a];
        deps.extend(if i + 1 < nl { bwd[i + 1] } else { None });
        let b = dag.compute(format!("{} bwd", l.name), "compute", gpu, l.compute_s * (1.0 - fwd_share), deps);
        bwd[i] = Some(b);
        let (rs, node_rs) = gather(&mut dag, l, g, format!("{} reduce-scatter", l.name), vec![b]);
        let n = 1.0 - g;
        if n > 0.0 && l.node_inter_s > 0.0 {
            // the node part's all-reduce follows its own reduce-scatter, not the global part's
            tail.push(rs);
            tail.push(dag.transfer(
                format!("{} shard all-reduce", l.name),
                "grad",
                rail,
                n * l.node_inter_s * rail_bw,
                0.0,
                Class::Training,
                vec![node_rs.unwrap_or(rs)],
            ));
        } else {
            tail.push(rs);
        }
    }
    tail.extend(bwd.iter().flatten());
    let end = dag.mark("end", tail);
    let tr = run(&dag)?;
    Ok(SdpRun { name: name.into(), predicted_s: predicted, simulated_s: tr.ops[end].end, trace: Some((dag, tr)) })
}

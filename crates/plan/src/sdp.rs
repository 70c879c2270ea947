//! The HSDP sharded-data-parallel planner.
//!
//! FSDP / ZeRO-3 shard every layer over all `N` devices; its all-gathers and reduce-scatters
//! cross the inter-node link, which is the bottleneck while the intra-node link (NVLink)
//! idles. HSDP splits each layer's parameters into parts and sends each part over a
//! different link group at the same time:
//! - the **global** part is sharded over all `N` devices and gathered over the inter-node path;
//! - the **node** part is sharded over the `d` devices of a node and gathered over the
//!   intra-node link; its gradients are reduce-scattered inside the node and then all-reduced
//!   across nodes shard by shard (each device over its own rail, `1/d` of the bytes).
//!
//! Each part's all-gather (forward and backward) and reduce-scatter keep the links busy for a
//! time linear in the fractions. A layer's forward takes the longest of its forward compute and
//! each link's busy time for one gather per part; its backward the longest of its backward
//! compute and the links' busy time for a gather and a reduce-scatter per part plus the node
//! part's cross-node all-reduce (prefetching hides gathers behind compute; the node part's
//! cross-node traffic has only the backward to hide behind). With a second inter-node link the
//! all-reduce takes it, beside the global part's traffic on the first. The node part costs `N/d` times more
//! memory per parameter, so the memory budget decides how much traffic can move off the
//! inter-node link. The fractions are continuous, and a binary per (layer, part) pays the
//! collectives' latency only when the part is used: a small MILP for HiGHS.

use good_lp::{highs, variable, Expression, ProblemVariables, Solution, SolverModel};
use serde::{Deserialize, Serialize};

use crate::cost::{Coll, CostModel};
use crate::desc::{state_bytes_per_param, ClusterDesc, ModelDesc};
use crate::error::{PlanError, Result};

const GIB: f64 = (1u64 << 30) as f64;

/// Planner knobs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SdpOptions {
    /// Fraction of device memory the plan may use.
    pub mem_fraction: f64,
    /// Memory set aside for workspace, framework and fragmentation, GiB.
    pub reserve_gib: f64,
    /// Solver time limit.
    pub time_limit_s: f64,
}

impl Default for SdpOptions {
    fn default() -> Self {
        SdpOptions { mem_fraction: 0.95, reserve_gib: 1.0, time_limit_s: 600.0 }
    }
}

/// Costs of one layer, per unit fraction of its parameters on each part.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SdpLayer {
    /// `L3`, `head`.
    pub name: String,
    /// Parameters.
    pub params: f64,
    /// Forward + backward compute, seconds.
    pub compute_s: f64,
    /// The forward's share of it (1/4 with activation recompute: a backward is twice a
    /// forward, plus the recomputed forward).
    #[serde(default)]
    pub fwd_share: f64,
    /// Intra-node busy time if the whole layer were global-sharded (its ring's intra hops), seconds.
    pub global_intra_s: f64,
    /// Inter-node busy time if the whole layer were global-sharded, seconds.
    pub global_inter_s: f64,
    /// Intra-node busy time if the whole layer were node-sharded, seconds.
    pub node_intra_s: f64,
    /// Inter-node busy time if the whole layer were node-sharded (gradient sync of the shards), seconds.
    pub node_inter_s: f64,
    /// Latency of the global part's collectives, seconds.
    pub global_latency_s: f64,
    /// Latency of the node part's collectives, seconds.
    pub node_latency_s: f64,
    /// Whether the node part's cross-node all-reduce has an inter-node link of its own (a
    /// second one): then the two parts' inter-node traffic overlaps instead of adding up.
    #[serde(default)]
    pub separate_rail: bool,
    /// Memory per device if global-sharded, bytes.
    pub global_mem: f64,
    /// Memory per device if node-sharded, bytes.
    pub node_mem: f64,
}

impl SdpLayer {
    /// Time of the layer with `g` of it global-sharded and `1 - g` node-sharded: its forward
    /// (one gather of each part, behind the forward compute) plus its backward (a gather and a
    /// reduce-scatter of each part, and the node part's cross-node all-reduce, behind the
    /// backward compute). Each phase takes the longest of its compute and each link's busy
    /// time: the node part's cross-node traffic has only the backward to hide behind.
    pub fn time(&self, g: f64) -> f64 {
        let (f, b) = self.phases(g);
        f + b
    }

    /// Forward and backward time with `g` global-sharded.
    pub fn phases(&self, g: f64) -> (f64, f64) {
        let n = 1.0 - g;
        let lg = if g > 1e-12 { self.global_latency_s } else { 0.0 };
        let ln = if n > 1e-12 { self.node_latency_s } else { 0.0 };
        let intra = g * self.global_intra_s + n * self.node_intra_s + ln;
        let global_inter = g * self.global_inter_s + lg;
        let rail = n * self.node_inter_s;
        let fs = self.fwd_share();
        let fwd = (self.compute_s * fs).max(intra / 3.0).max(global_inter / 3.0);
        let bwd_inter = if self.separate_rail { (2.0 * global_inter / 3.0).max(rail) } else { 2.0 * global_inter / 3.0 + rail };
        let bwd = (self.compute_s * (1.0 - fs)).max(2.0 * intra / 3.0).max(bwd_inter);
        (fwd, bwd)
    }

    fn fwd_share(&self) -> f64 {
        if self.fwd_share > 0.0 && self.fwd_share < 1.0 {
            self.fwd_share
        } else {
            0.25
        }
    }

    /// Memory with `g` global-sharded.
    pub fn mem(&self, g: f64) -> f64 {
        g * self.global_mem + (1.0 - g) * self.node_mem
    }
}

/// The layer of a plan.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SdpLayerPlan {
    /// Name.
    pub name: String,
    /// Fraction sharded over all devices and gathered over the inter-node link.
    pub global_fraction: f64,
    /// Fraction sharded within the node and gathered over the intra-node link.
    pub node_fraction: f64,
    /// Predicted time of the layer, seconds.
    pub time_s: f64,
}

/// A baseline under the same cost model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SdpBaseline {
    /// Label.
    pub name: String,
    /// Predicted iteration time.
    pub iter_s: f64,
    /// Memory per device, GiB.
    pub memory_gib: f64,
    /// Whether it fits in the budget.
    pub fits: bool,
}

/// The planner's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SdpPlan {
    /// Model name.
    pub model: String,
    /// Cluster name.
    pub cluster: String,
    /// Devices.
    pub devices: u32,
    /// Links of the two parts: (intra-node, inter-node path of the all-device part).
    pub links: (String, String),
    /// The inter-node link of the node part's cross-node all-reduce (the all-device part's
    /// link unless the cluster has a second one).
    #[serde(default)]
    pub rail_link: String,
    /// The inter-node link the all-device part's gathers and reduce-scatters cross (its name in
    /// the cluster description; what `train --sdp-links full=...` names).
    #[serde(default)]
    pub inter_link: String,
    /// Which inter-node link each part took: the planner solves both and keeps the faster.
    #[serde(default)]
    pub assignment: LinkAssignment,
    /// The predicted iteration of the best plan under the other assignment, where there is one.
    #[serde(default)]
    pub other_assignment_iter_s: Option<f64>,
    /// Per layer.
    pub layers: Vec<SdpLayerPlan>,
    /// Predicted iteration time.
    pub predicted_iter_s: f64,
    /// Compute part of it.
    pub compute_s: f64,
    /// Memory per device, GiB.
    pub memory_gib: f64,
    /// Budget, GiB.
    pub memory_budget_gib: f64,
    /// FSDP FULL_SHARD (ZeRO-3): everything over the single inter-node path.
    pub fsdp: SdpBaseline,
    /// FSDP HYBRID_SHARD: everything node-sharded (its cross-node all-reduce on the fastest link).
    pub hybrid: SdpBaseline,
    /// Traffic share moved off the inter-node path, by bytes.
    pub node_fraction_overall: f64,
    /// Speedup over the fastest baseline that fits.
    pub speedup_vs_best_baseline: f64,
    /// Speedup over FSDP FULL_SHARD.
    pub speedup_vs_fsdp: f64,
}

/// Which inter-node link each part's cross-node traffic takes on a cluster with two or more
/// (with one, both parts share it and the two assignments are the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkAssignment {
    /// The all-device part's gathers and reduce-scatters on the fastest inter-node link, the
    /// node part's cross-node all-reduce on the second.
    #[default]
    GlobalOnFastest,
    /// The opposite: the all-reduce on the fastest, the all-device part on the second. It wins
    /// where the all-device part moves few bytes per parameter moved off the node part (the
    /// all-device part's traffic per parameter is `(N-1)/N` of three collectives, the node
    /// part's cross-node all-reduce `2 (n-1)/n / d` of one).
    RailOnFastest,
}

impl LinkAssignment {
    /// Both, the default first.
    pub const ALL: [LinkAssignment; 2] = [LinkAssignment::GlobalOnFastest, LinkAssignment::RailOnFastest];
}

/// Build the per-layer costs, the all-device part on the fastest inter-node link.
pub fn layers(model: &ModelDesc, cluster: &ClusterDesc, cm: &CostModel<'_>) -> Result<Vec<SdpLayer>> {
    layers_on(model, cluster, cm, LinkAssignment::GlobalOnFastest)
}

/// Build the per-layer costs with the parts' inter-node traffic assigned as `assign` says.
pub fn layers_on(model: &ModelDesc, cluster: &ClusterDesc, cm: &CostModel<'_>, assign: LinkAssignment) -> Result<Vec<SdpLayer>> {
    model.validate()?;
    cluster.validate()?;
    let n = cluster.devices();
    let d = cluster.devices_per_node;
    let seqs = model.global_batch as f64 / n as f64;
    let elem = model.dtype.size() as f64;
    let state = state_bytes_per_param(model.dtype);
    let bf = 3.0 + if model.activation_recompute { 1.0 } else { 0.0 };
    let node = cm.node_group();
    // the node part's cross-node all-reduce takes the other inter-node link if there is one
    let inter = cluster.inter_links();
    let separate_rail = cluster.nodes > 1 && inter.len() >= 2;
    let (global, rail) = match assign {
        LinkAssignment::RailOnFastest if separate_rail => {
            (cm.group_via(n, d, inter.get(1).copied()), cm.group_via(cluster.nodes, 1, inter.first().copied()))
        }
        _ => (cm.global_group(), cm.second_rail_group()),
    };
    let intra_bw = node.bytes_per_s;
    let mut out = Vec::new();
    for l in 0..=model.layers {
        let (name, params, flops) = if l == model.layers {
            ("head".to_string(), model.embed_params(), model.head_flops(seqs))
        } else {
            let moe = model.moe.as_ref().filter(|_| model.is_moe_layer(l));
            let ffn_flops = model.mlp_flops(seqs) * moe.map(|m| m.top_k as f64 * m.capacity_factor).unwrap_or(1.0);
            (format!("L{l}"), model.attn_params() + model.ffn_params(l), model.attn_flops(seqs) + ffn_flops)
        };
        let bytes = params * elem;
        // forward gather, backward gather, gradient reduce-scatter
        let g_moved = bytes * (2.0 * Coll::AllGather.bus_factor(n) + Coll::ReduceScatter.bus_factor(n));
        let n_moved = bytes * (2.0 * Coll::AllGather.bus_factor(d) + Coll::ReduceScatter.bus_factor(d));
        let (global_inter_s, global_intra_s) = if cluster.nodes > 1 {
            (g_moved / global.bytes_per_s, if d > 1 { g_moved / intra_bw } else { 0.0 })
        } else {
            (0.0, g_moved / global.bytes_per_s)
        };
        let node_intra_s = if d > 1 { n_moved / intra_bw } else { 0.0 };
        let node_inter_s = rail.time(Coll::AllReduce, bytes / d as f64) - Coll::AllReduce.steps(rail.size) * rail.latency_s;
        out.push(SdpLayer {
            name,
            params,
            compute_s: cm.compute_time("layer", flops * bf),
            fwd_share: 1.0 / bf,
            global_intra_s,
            global_inter_s,
            node_intra_s,
            node_inter_s,
            global_latency_s: (2.0 * Coll::AllGather.steps(n) + Coll::ReduceScatter.steps(n)) * global.latency_s,
            node_latency_s: (2.0 * Coll::AllGather.steps(d) + Coll::ReduceScatter.steps(d)) * node.latency_s
                + Coll::AllReduce.steps(rail.size) * rail.latency_s,
            separate_rail,
            global_mem: params * state / n as f64,
            node_mem: params * state / d as f64,
        });
    }
    Ok(out)
}

/// Memory every plan needs regardless of sharding: stored activations and the gathered
/// parameters of the layer being computed and the one being prefetched.
pub fn fixed_memory(model: &ModelDesc, cluster: &ClusterDesc, layers: &[SdpLayer]) -> f64 {
    let seqs = model.global_batch as f64 / cluster.devices() as f64;
    let acts = if model.activation_recompute {
        model.activation_bytes(seqs) * model.layers as f64
    } else {
        model.activation_bytes(seqs) * model.layers as f64 * 17.0
    };
    let logits = seqs * model.seq as f64 * model.vocab as f64 * 4.0;
    let biggest = layers.iter().map(|l| l.params).fold(0.0, f64::max);
    acts + logits + 2.0 * biggest * model.dtype.size() as f64
}

/// Fractions of the all-rank part per transformer layer, read from the JSON `ironweave plan sdp
/// --json` writes (`plan.layers[i].node_fraction` is the within-host share of layer `Li`; the
/// plan's `head` entry, if any, is the embeddings' and the head's, returned last). The runtime
/// runs `layers` layers; a plan for another model is an error. Pure; fuzzed (`fuzz/`, target
/// `plans`).
pub fn part_fractions_from_json(json: &[u8], layers: usize) -> Result<Vec<f64>> {
    let what = "SDP plan";
    let v: serde_json::Value = serde_json::from_slice(json).map_err(|e| PlanError::invalid(what, format!("not JSON: {e}")))?;
    let ls = v["plan"]["layers"]
        .as_array()
        .ok_or_else(|| PlanError::invalid(what, "no plan.layers: write one with `ironweave plan sdp --json`"))?;
    let node_fraction = |l: &serde_json::Value| -> Result<f64> {
        let f = l["node_fraction"].as_f64().ok_or_else(|| PlanError::invalid(what, "a layer without node_fraction"))?;
        if !(0.0..=1.0).contains(&f) {
            return Err(PlanError::invalid(what, format!("node_fraction {f}: must be between 0 and 1")));
        }
        Ok(1.0 - f)
    };
    let mut out = Vec::with_capacity(layers.min(ls.len()) + 1);
    for i in 0..layers {
        let name = format!("L{i}");
        let l = ls.iter().find(|l| l["name"] == name.as_str()).ok_or_else(|| {
            PlanError::invalid(what, format!("no layer {name}: it was made for another model (the config has {layers} layers)"))
        })?;
        out.push(node_fraction(l)?);
    }
    if let Some(l) = ls.iter().find(|l| l["name"] == "head") {
        out.push(node_fraction(l)?);
    }
    Ok(out)
}

/// Plan with HiGHS: on a cluster with two inter-node links, both [`LinkAssignment`]s are
/// solved and the faster plan kept. The baselines are each at its best: FULL_SHARD on the
/// fastest link, HYBRID_SHARD's cross-node all-reduce on the fastest link.
pub fn plan(model: &ModelDesc, cluster: &ClusterDesc, cm: &CostModel<'_>, opts: &SdpOptions) -> Result<SdpPlan> {
    if !(opts.mem_fraction > 0.0 && opts.mem_fraction <= 1.0) {
        return Err(PlanError::invalid("SDP options", "mem_fraction must be in (0, 1]"));
    }
    let assignments: &[LinkAssignment] =
        if cluster.nodes > 1 && cluster.inter_links().len() >= 2 { &LinkAssignment::ALL } else { &LinkAssignment::ALL[..1] };
    let budget = cluster.device_memory_bytes() * opts.mem_fraction - opts.reserve_gib * GIB;
    let mut best: Option<(LinkAssignment, Vec<SdpLayer>, Vec<f64>, f64)> = None;
    let mut solved: Vec<(LinkAssignment, f64)> = Vec::new();
    let mut hybrid_best: Option<SdpBaseline> = None;
    let mut fsdp: Option<SdpBaseline> = None;
    for &assign in assignments {
        let ls = layers_on(model, cluster, cm, assign)?;
        let fixed = fixed_memory(model, cluster, &ls);
        let min_mem: f64 = fixed + ls.iter().map(|l| l.global_mem.min(l.node_mem)).sum::<f64>();
        if min_mem > budget {
            return Err(PlanError::Infeasible {
                why: format!(
                    "even fully sharded over all devices the model needs {:.1} GiB per device, the budget is {:.1} GiB",
                    min_mem / GIB,
                    budget / GIB
                ),
                hint: "use more devices, activation recompute, or a smaller batch".into(),
            });
        }
        let gv = solve(&ls, budget - fixed, opts)?;
        let iter: f64 = ls.iter().zip(&gv).map(|(l, &x)| l.time(x)).sum();
        solved.push((assign, iter));
        let baseline = |name: &str, x: f64| {
            let m = fixed + ls.iter().map(|l| l.mem(x)).sum::<f64>();
            SdpBaseline {
                name: name.into(),
                iter_s: ls.iter().map(|l| l.time(x)).sum(),
                memory_gib: m / GIB,
                fits: m <= budget * (1.0 + 1e-9),
            }
        };
        if assign == LinkAssignment::GlobalOnFastest {
            fsdp = Some(baseline("FSDP FULL_SHARD (single inter-node path)", 1.0));
        }
        let h = baseline("FSDP HYBRID_SHARD (node-sharded, replicated across nodes)", 0.0);
        if hybrid_best.as_ref().is_none_or(|b| h.iter_s < b.iter_s) {
            hybrid_best = Some(h);
        }
        // the default wins ties: a second assignment must be faster by more than rounding
        if best.as_ref().is_none_or(|b| iter < b.3 * (1.0 - 1e-9)) {
            best = Some((assign, ls, gv, iter));
        }
    }
    let (assignment, ls, gv, iter) = best.expect("at least one assignment");
    let (fsdp, hybrid) = (fsdp.expect("the default assignment is always solved"), hybrid_best.expect("solved"));
    let fixed = fixed_memory(model, cluster, &ls);
    let layer_plans: Vec<SdpLayerPlan> = ls
        .iter()
        .zip(&gv)
        .map(|(l, &x)| SdpLayerPlan { name: l.name.clone(), global_fraction: x, node_fraction: 1.0 - x, time_s: l.time(x) })
        .collect();
    let mem_used = fixed + ls.iter().zip(&gv).map(|(l, &x)| l.mem(x)).sum::<f64>();
    let best_baseline = [&fsdp, &hybrid].into_iter().filter(|b| b.fits).map(|b| b.iter_s).fold(f64::INFINITY, f64::min);
    let total_bytes: f64 = ls.iter().map(|l| l.params).sum();
    let node_share = ls.iter().zip(&gv).map(|(l, &x)| l.params * (1.0 - x)).sum::<f64>() / total_bytes;
    let intra_name = cm.node_group().links.first().cloned().unwrap_or_default();
    let inter = cluster.inter_links();
    let (global_path, rail_path, inter_link) = match assignment {
        LinkAssignment::RailOnFastest => (
            cm.group_via(cluster.devices(), cluster.devices_per_node, inter.get(1).copied()),
            cm.group_via(cluster.nodes, 1, inter.first().copied()),
            inter.get(1).map(|l| l.name.clone()),
        ),
        LinkAssignment::GlobalOnFastest => (cm.global_group(), cm.second_rail_group(), inter.first().map(|l| l.name.clone())),
    };
    Ok(SdpPlan {
        model: model.name.clone(),
        cluster: cluster.name.clone(),
        devices: cluster.devices(),
        links: (intra_name, global_path.links.join("+")),
        rail_link: rail_path.links.join("+"),
        inter_link: inter_link.unwrap_or_default(),
        assignment,
        other_assignment_iter_s: solved.iter().find(|(a, _)| *a != assignment).map(|(_, t)| *t),
        layers: layer_plans,
        predicted_iter_s: iter,
        compute_s: ls.iter().map(|l| l.compute_s).sum(),
        memory_gib: mem_used / GIB,
        memory_budget_gib: budget / GIB,
        speedup_vs_best_baseline: best_baseline / iter,
        speedup_vs_fsdp: fsdp.iter_s / iter,
        fsdp,
        hybrid,
        node_fraction_overall: node_share,
    })
}

/// The MILP for one assignment's layers: each layer's all-device fraction, with `room` bytes of
/// memory for the sharded state.
fn solve(ls: &[SdpLayer], room: f64, opts: &SdpOptions) -> Result<Vec<f64>> {
    const T: f64 = 1e3;
    let mut vars = ProblemVariables::new();
    let g: Vec<_> = ls.iter().map(|_| vars.add(variable().min(0.0).max(1.0))).collect();
    let zg: Vec<_> = ls.iter().map(|_| vars.add(variable().binary())).collect();
    let zn: Vec<_> = ls.iter().map(|_| vars.add(variable().binary())).collect();
    // each layer's forward and backward time
    let tf: Vec<_> = ls.iter().map(|_| vars.add(variable().min(0.0))).collect();
    let tb: Vec<_> = ls.iter().map(|_| vars.add(variable().min(0.0))).collect();
    // Among equally fast plans prefer the one that uses less memory (a tiny tie-breaking weight).
    let tie = 1e-6 * T * ls.iter().map(|l| l.compute_s).sum::<f64>() / ls.len() as f64;
    let mut objective: Expression = tf.iter().copied().sum::<Expression>() + tb.iter().copied().sum::<Expression>();
    for (i, l) in ls.iter().enumerate() {
        objective += -tie * (l.node_mem - l.global_mem) / l.node_mem.max(1.0) * g[i];
    }
    let mut model_lp = vars.minimise(objective).using(highs);
    model_lp.set_verbose(false);
    let mut model_lp = model_lp.set_time_limit(opts.time_limit_s).set_threads(1);
    model_lp = model_lp.set_mip_rel_gap(1e-6).map_err(|e| PlanError::Solver(e.to_string()))?;
    let mut mem = Expression::from(0.0);
    for (i, l) in ls.iter().enumerate() {
        // g ≤ zg; (1 - g) ≤ zn
        model_lp.add_constraint((g[i] - zg[i]).leq(0.0));
        model_lp.add_constraint((1.0 - g[i] - zn[i]).leq(0.0));
        // the same terms as SdpLayer::phases, linear in g with the latencies on the binaries
        let fs = l.fwd_share();
        model_lp.add_constraint((T * l.compute_s * fs - tf[i]).leq(0.0));
        model_lp.add_constraint((T * l.compute_s * (1.0 - fs) - tb[i]).leq(0.0));
        let intra = || T * l.global_intra_s * g[i] + T * l.node_intra_s * (1.0 - g[i]) + T * l.node_latency_s * zn[i];
        let global_inter = || T * l.global_inter_s * g[i] + T * l.global_latency_s * zg[i];
        model_lp.add_constraint((intra() * (1.0 / 3.0) - tf[i]).leq(0.0));
        model_lp.add_constraint((intra() * (2.0 / 3.0) - tb[i]).leq(0.0));
        model_lp.add_constraint((global_inter() * (1.0 / 3.0) - tf[i]).leq(0.0));
        let rail = T * l.node_inter_s * (1.0 - g[i]);
        if l.separate_rail {
            // each part's inter-node traffic on its own link
            model_lp.add_constraint((global_inter() * (2.0 / 3.0) - tb[i]).leq(0.0));
            model_lp.add_constraint((rail - tb[i]).leq(0.0));
        } else {
            model_lp.add_constraint((global_inter() * (2.0 / 3.0) + rail - tb[i]).leq(0.0));
        }
        mem += (l.global_mem / GIB) * g[i] + (l.node_mem / GIB) * (1.0 - g[i]);
    }
    model_lp.add_constraint(mem.leq(room / GIB));
    let sol = model_lp.solve().map_err(|e| PlanError::Solver(e.to_string()))?;
    let gv: Vec<f64> = g.iter().map(|v| sol.value(*v).clamp(0.0, 1.0)).collect();
    // Snap solver noise so fractions are exact where the answer is a corner.
    let gv: Vec<f64> = gv
        .into_iter()
        .map(|x| {
            if x < 1e-9 {
                0.0
            } else if x > 1.0 - 1e-9 {
                1.0
            } else {
                x
            }
        })
        .collect();
    Ok(gv)
}

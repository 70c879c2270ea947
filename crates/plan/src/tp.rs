//! The Oases tensor-model-parallel planner.
//!
//! The model is a chain of sub-layers (attention and feed-forward of each layer, then the LM
//! head). For each sub-layer the planner picks a tensor-parallel degree `t` and a sub-batch
//! count `k`. With `t` devices per tensor group the rest of the cluster is data parallel, so a
//! group processes `global_batch · t / N` sequences; compute per device is the same for every
//! `t`, while tensor-parallel all-reduces grow and data-parallel gradient all-reduces shrink
//! with `t`, and parameters take `1/t` of the memory.
//!
//! With `k = 2` the group's batch is split in two: the all-reduce of one half overlaps the
//! other half's compute (Oases' fine-grained schedule). Costs follow Oases' overlap model:
//! forward `max(comp_i, comm_i) + max(comp_{i+1}, comm_i)` on half batches, backward
//! `max(bwd + recompute, comm)`; the part that depends on the next sub-layer sits on the edge
//! between the two, together with the resharding cost when their degrees differ. Memory
//! (parameters, gradients, fp32 Adam state, stored activations) must fit in `mem_fraction`
//! of device memory.

use serde::{Deserialize, Serialize};

use crate::chain::{ChainProblem, ChainSolution, Choice, Method, SolvedBy};
use crate::cost::{Coll, CostModel};
use crate::desc::{state_bytes_per_param, ClusterDesc, ModelDesc};
use crate::error::{PlanError, Result};

const GIB: f64 = (1u64 << 30) as f64;

/// What a sub-layer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SubLayerKind {
    /// Self-attention block.
    Attn,
    /// Dense feed-forward block.
    Mlp,
    /// MoE feed-forward block (experts sharded like a dense block).
    Moe,
    /// Embedding and LM head (tied).
    Head,
}

/// Planner knobs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TpOptions {
    /// Tensor-parallel degrees to consider (default: powers of two that divide the device
    /// count and the head count, up to the device count).
    pub tp_degrees: Option<Vec<u32>>,
    /// Sub-batch counts to consider (Oases uses 2; 1 is Megatron's schedule).
    pub sub_batches: Vec<u32>,
    /// Extra compute time of a half-size batch, as a fraction (smaller matmuls run less efficiently).
    pub sub_batch_penalty: f64,
    /// Fraction of device memory the plan may use (Oases: 0.95).
    pub mem_fraction: f64,
    /// Memory set aside for workspace, framework and fragmentation, GiB.
    pub reserve_gib: f64,
    /// Solver time limit (Oases: 600 s).
    pub time_limit_s: f64,
    /// HiGHS: stop when the plan is proven within this fraction of the optimum (0: exact).
    pub mip_rel_gap: f64,
    /// Exact chain algorithms with HiGHS as fallback, or HiGHS always.
    pub solver: Method,
}

impl Default for TpOptions {
    fn default() -> Self {
        TpOptions {
            tp_degrees: None,
            sub_batches: vec![1, 2],
            sub_batch_penalty: 0.03,
            mem_fraction: 0.95,
            reserve_gib: 1.0,
            time_limit_s: 600.0,
            mip_rel_gap: 1e-4,
            solver: Method::Auto,
        }
    }
}

/// One option of one sub-layer, with everything the costs were made of.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TpChoice {
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Sub-batches.
    pub sub_batches: u32,
    /// Sequences per tensor group per iteration.
    pub group_batch: f64,
    /// Sequences per micro-step (`min(group_batch, micro_batch)`).
    pub micro: f64,
    /// Forward compute (with the sub-batch penalty), seconds.
    pub fwd_s: f64,
    /// Backward compute including recompute, seconds.
    pub bwd_s: f64,
    /// Tensor-parallel all-reduces of the whole group batch (one per micro-step), seconds.
    pub tp_comm_s: f64,
    /// Data-parallel gradient all-reduce, seconds.
    pub dp_comm_s: f64,
    /// Memory per device, bytes.
    pub mem: f64,
}

impl TpChoice {
    /// The part of the node's time that does not depend on its neighbours.
    fn node_cost(&self) -> f64 {
        // Gradients are all-reduced once, after the last micro-step: only that micro-step's
        // backward can hide them.
        let steps = (self.group_batch / self.micro).ceil().max(1.0);
        let dp_exposed = (self.dp_comm_s - self.bwd_s / steps).max(0.0);
        if self.sub_batches <= 1 {
            self.fwd_s + self.bwd_s + 2.0 * self.tp_comm_s + dp_exposed
        } else {
            let k = self.sub_batches as f64;
            let (f, b, m) = (self.fwd_s / k, self.bwd_s / k, self.tp_comm_s / k);
            // first piece's compute, then (k-1) steps of compute overlapping the previous piece's comm
            f + (k - 1.0) * f.max(m) + b + (k - 1.0) * b.max(m) + dp_exposed
        }
    }
}

/// One sub-layer of the chain.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SubLayer {
    /// `L3.attn`, `L3.mlp`, `head`.
    pub name: String,
    /// Kind.
    pub kind: SubLayerKind,
    /// Parameters.
    pub params: f64,
    /// Admissible options.
    pub options: Vec<TpChoice>,
}

/// The planning problem in both forms: sub-layers with their options, and the chain.
#[derive(Debug, Clone)]
pub struct TpProblem {
    /// Sub-layers in execution order.
    pub sublayers: Vec<SubLayer>,
    /// The chain the solver sees.
    pub chain: ChainProblem,
}

/// The plan of one sub-layer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SubLayerPlan {
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: SubLayerKind,
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Sub-batches.
    pub sub_batches: u32,
    /// Memory per device, GiB.
    pub memory_gib: f64,
}

/// Where the predicted iteration time goes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Breakdown {
    /// Forward + backward compute.
    pub compute_s: f64,
    /// Communication (tensor parallel, resharding, data parallel) not hidden behind compute.
    pub exposed_comm_s: f64,
    /// Of which resharding between different tensor-parallel degrees.
    pub reshard_s: f64,
}

/// A uniform configuration evaluated with the same cost model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UniformResult {
    /// Label.
    pub name: String,
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Sub-batches.
    pub sub_batches: u32,
    /// Predicted iteration time.
    pub iter_s: f64,
    /// Memory per device, GiB.
    pub memory_gib: f64,
}

/// The planner's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TpPlan {
    /// Model name.
    pub model: String,
    /// Cluster name.
    pub cluster: String,
    /// Devices.
    pub devices: u32,
    /// Sequences per iteration over the whole cluster (what a runtime executing the plan
    /// splits: each tensor group of degree t takes `global_batch · t / devices`).
    #[serde(default)]
    pub global_batch: u32,
    /// Per sub-layer choices.
    pub sublayers: Vec<SubLayerPlan>,
    /// Predicted iteration time.
    pub predicted_iter_s: f64,
    /// Its breakdown.
    pub breakdown: Breakdown,
    /// Memory per device, GiB, and the budget.
    pub memory_gib: f64,
    /// Memory budget per device, GiB.
    pub memory_budget_gib: f64,
    /// Megatron-LM: the best uniform TP degree that fits, no overlap.
    pub megatron: UniformResult,
    /// Megatron-LM with TP = devices per node (its usual setting), when it fits.
    pub megatron_node: Option<UniformResult>,
    /// Oases' schedule with the best uniform degree (no per-sub-layer planning).
    pub uniform_overlap: Option<UniformResult>,
    /// `megatron.iter_s / predicted_iter_s`.
    pub speedup_vs_megatron: f64,
    /// Which algorithm found the plan.
    pub solved_by: SolvedBy,
}

impl TpPlan {
    /// Reads the JSON `ironweave plan tp --json` writes (`{"plan": ..., "solve_s": ...}`) or a
    /// bare plan. Pure; fuzzed (`fuzz/`, target `plans`).
    pub fn from_json(json: &[u8]) -> Result<TpPlan> {
        let what = "TMP plan";
        let v: serde_json::Value =
            serde_json::from_slice(json).map_err(|e| PlanError::invalid(what, format!("not JSON: {e}")))?;
        let v = v.get("plan").cloned().unwrap_or(v);
        serde_json::from_value(v)
            .map_err(|e| PlanError::invalid(what, format!("{e}: write one with `ironweave plan tp ... --json`")))
    }
}

/// Build the problem: options per sub-layer and the chain.
pub fn build(model: &ModelDesc, cluster: &ClusterDesc, cm: &CostModel<'_>, opts: &TpOptions) -> Result<TpProblem> {
    model.validate()?;
    cluster.validate()?;
    if !(opts.mem_fraction > 0.0 && opts.mem_fraction <= 1.0) {
        return Err(PlanError::invalid("TMP options", "mem_fraction must be in (0, 1]"));
    }
    if opts.sub_batches.is_empty() || opts.sub_batches.contains(&0) {
        return Err(PlanError::invalid("TMP options", "sub_batches must be a non-empty list of positive counts"));
    }
    let n = cluster.devices();
    let degrees: Vec<u32> = match &opts.tp_degrees {
        Some(d) => {
            if let Some(bad) = d.iter().find(|&&t| t == 0 || n % t != 0) {
                return Err(PlanError::invalid("TMP options", format!("TP degree {bad} does not divide the {n} devices")));
            }
            d.clone()
        }
        None => (0..=n.ilog2()).map(|e| 1u32 << e).filter(|t| n % t == 0 && model.heads % t == 0).collect(),
    };
    let mut sublayers = Vec::new();
    for l in 0..model.layers {
        sublayers.push((format!("L{l}.attn"), SubLayerKind::Attn, model.attn_params()));
        let kind = if model.is_moe_layer(l) { SubLayerKind::Moe } else { SubLayerKind::Mlp };
        sublayers.push((format!("L{l}.{}", if kind == SubLayerKind::Moe { "moe" } else { "mlp" }), kind, model.ffn_params(l)));
    }
    sublayers.push(("head".to_string(), SubLayerKind::Head, model.embed_params()));
    let state = state_bytes_per_param(model.dtype);
    let bf = 2.0 + if model.activation_recompute { 1.0 } else { 0.0 };
    let (s, h, a) = (model.seq as f64, model.hidden as f64, model.heads as f64);
    let elem = model.dtype.size() as f64;
    let subs: Vec<SubLayer> = sublayers
        .into_iter()
        .map(|(name, kind, params)| {
            let mut options = Vec::new();
            for &t in &degrees {
                // group batch must be a whole number of sequences
                let gb_num = model.global_batch as u64 * t as u64;
                if gb_num % n as u64 != 0 {
                    continue;
                }
                let gb = (gb_num / n as u64) as f64;
                let micro = gb.min(model.micro_batch as f64);
                let steps = (gb / micro).ceil();
                let flops = match kind {
                    SubLayerKind::Attn => model.attn_flops(gb),
                    SubLayerKind::Mlp => model.mlp_flops(gb),
                    SubLayerKind::Moe => {
                        let m = model.moe.as_ref().map(|m| m.top_k as f64 * m.capacity_factor).unwrap_or(1.0);
                        model.mlp_flops(gb) * m
                    }
                    SubLayerKind::Head => model.head_flops(gb),
                };
                let op = match kind {
                    SubLayerKind::Attn => "attn",
                    SubLayerKind::Mlp => "mlp",
                    SubLayerKind::Moe => "expert",
                    SubLayerKind::Head => "head",
                };
                let fwd = cm.compute_time(op, flops / t as f64);
                let tp_comm = steps * cm.tp_group(t).time(Coll::AllReduce, model.activation_bytes(micro));
                let dp_comm = cm.dp_group(t).time(Coll::AllReduce, params / t as f64 * model.grad_elem_bytes());
                let act = if model.activation_recompute {
                    model.activation_bytes(micro)
                } else {
                    // Megatron's per-layer estimate s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes in
                    // half precision, split between the two sub-layers.
                    let per = s * micro * h * elem / 2.0;
                    match kind {
                        SubLayerKind::Attn => per * (5.0 + 12.0 / t as f64 + 5.0 * a * s / (h * t as f64)),
                        _ => per * (5.0 + 12.0 / t as f64),
                    }
                };
                let act = act + if kind == SubLayerKind::Head { micro * s * model.vocab as f64 * 4.0 / t as f64 } else { 0.0 };
                let mem = params / t as f64 * state + act;
                for &k in &opts.sub_batches {
                    if micro < k as f64 || micro % k as f64 != 0.0 {
                        continue;
                    }
                    let pen = if k > 1 { 1.0 + opts.sub_batch_penalty } else { 1.0 };
                    options.push(TpChoice {
                        tp: t,
                        sub_batches: k,
                        group_batch: gb,
                        micro,
                        fwd_s: fwd * pen,
                        bwd_s: fwd * bf * pen,
                        tp_comm_s: tp_comm,
                        dp_comm_s: dp_comm,
                        mem,
                    });
                }
            }
            SubLayer { name, kind, params, options }
        })
        .collect();
    if let Some(bad) = subs.iter().find(|s| s.options.is_empty()) {
        return Err(PlanError::Infeasible {
            why: format!("sub-layer {} has no admissible (TP degree, sub-batch) option", bad.name),
            hint: format!(
                "global_batch {} must give whole sequences per tensor group (global_batch·t/{} integral) for some t in {:?}",
                model.global_batch, n, degrees
            ),
        });
    }
    let last = subs.len() - 1;
    let choices: Vec<Vec<Choice>> = subs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.options
                .iter()
                .map(|o| {
                    let mut cost = o.node_cost();
                    if o.sub_batches > 1 {
                        // the last piece's all-reduce has nothing to hide behind at the ends
                        // of the chain: forward after the last node, backward after the first
                        let tail = o.tp_comm_s / o.sub_batches as f64;
                        if i == last {
                            cost += tail;
                        }
                        if i == 0 {
                            cost += tail;
                        }
                    }
                    Choice { cost, mem: o.mem }
                })
                .collect()
        })
        .collect();
    let edges = (0..last).map(|i| edge_table(model, cm, &subs[i].options, &subs[i + 1].options)).collect();
    let budget = cluster.device_memory_bytes() * opts.mem_fraction - opts.reserve_gib * GIB;
    Ok(TpProblem { sublayers: subs, chain: ChainProblem { choices, edges, mem_budget: budget } })
}

fn reshard_s(model: &ModelDesc, cm: &CostModel<'_>, a: &TpChoice, b: &TpChoice) -> f64 {
    if a.tp == b.tp {
        return 0.0;
    }
    // Activations move between the layouts of the two degrees within the larger group,
    // forward (activations) and backward (their gradients).
    let big = if a.tp > b.tp { a } else { b };
    let steps = (big.group_batch / big.micro).ceil();
    2.0 * steps * cm.tp_group(big.tp).time(Coll::AllToAll, model.activation_bytes(big.micro))
}

fn edge_cost(model: &ModelDesc, cm: &CostModel<'_>, a: &TpChoice, b: &TpChoice) -> f64 {
    let same = a.tp == b.tp;
    let mut cost = reshard_s(model, cm, a, b);
    if a.sub_batches > 1 {
        // forward: a's last all-reduce piece overlaps b's first compute piece
        let tail = a.tp_comm_s / a.sub_batches as f64;
        cost += if b.sub_batches == a.sub_batches && same { (tail - b.fwd_s / b.sub_batches as f64).max(0.0) } else { tail };
    }
    if b.sub_batches > 1 {
        // backward runs the other way: b's last all-reduce piece overlaps a's first backward piece
        let tail = b.tp_comm_s / b.sub_batches as f64;
        cost += if a.sub_batches == b.sub_batches && same { (tail - a.bwd_s / a.sub_batches as f64).max(0.0) } else { tail };
    }
    cost
}

fn edge_table(model: &ModelDesc, cm: &CostModel<'_>, a: &[TpChoice], b: &[TpChoice]) -> Vec<Vec<f64>> {
    a.iter().map(|x| b.iter().map(|y| edge_cost(model, cm, x, y)).collect()).collect()
}

impl TpProblem {
    fn picks_for(&self, tp: u32, k: u32) -> Option<Vec<usize>> {
        self.sublayers.iter().map(|s| s.options.iter().position(|o| o.tp == tp && o.sub_batches == k)).collect()
    }

    /// Evaluate a uniform configuration; `None` if some sub-layer cannot take it or it does not fit.
    pub fn uniform(&self, tp: u32, k: u32) -> Option<UniformResult> {
        let picks = self.picks_for(tp, k)?;
        let (cost, mem) = self.chain.evaluate(&picks)?;
        let name = if k == 1 { format!("Megatron TP={tp}") } else { format!("Oases schedule, uniform TP={tp}") };
        Some(UniformResult { name, tp, sub_batches: k, iter_s: cost, memory_gib: mem / GIB })
    }

    fn degrees(&self) -> Vec<u32> {
        let mut d: Vec<u32> = self.sublayers.iter().flat_map(|s| s.options.iter().map(|o| o.tp)).collect();
        d.sort_unstable();
        d.dedup();
        d
    }

    /// The best uniform configuration with `k` sub-batches.
    pub fn best_uniform(&self, k: u32) -> Option<UniformResult> {
        self.degrees().into_iter().filter_map(|t| self.uniform(t, k)).min_by(|a, b| a.iter_s.total_cmp(&b.iter_s))
    }

    /// Turn a chain solution into a plan.
    pub fn plan(
        &self,
        model: &ModelDesc,
        cluster: &ClusterDesc,
        sol: &ChainSolution,
        solved_by: SolvedBy,
        opts: &TpOptions,
    ) -> Result<TpPlan> {
        let megatron = self.best_uniform(1).ok_or_else(|| PlanError::Infeasible {
            why: "no uniform tensor-parallel degree fits in memory, so there is no Megatron baseline".into(),
            hint: "use more devices or a smaller model".into(),
        })?;
        let mut compute = 0.0;
        let mut reshard = 0.0;
        let mut subs = Vec::new();
        for (i, (s, &p)) in self.sublayers.iter().zip(&sol.picks).enumerate() {
            let o = &s.options[p];
            compute += o.fwd_s + o.bwd_s;
            if i + 1 < sol.picks.len() {
                reshard += reshard_s(model, &CostModel::new(cluster), o, &self.sublayers[i + 1].options[sol.picks[i + 1]]);
            }
            subs.push(SubLayerPlan {
                name: s.name.clone(),
                kind: s.kind,
                tp: o.tp,
                sub_batches: o.sub_batches,
                memory_gib: o.mem / GIB,
            });
        }
        Ok(TpPlan {
            model: model.name.clone(),
            cluster: cluster.name.clone(),
            devices: cluster.devices(),
            global_batch: model.global_batch,
            sublayers: subs,
            predicted_iter_s: sol.cost,
            breakdown: Breakdown { compute_s: compute, exposed_comm_s: (sol.cost - compute).max(0.0), reshard_s: reshard },
            memory_gib: sol.mem / GIB,
            memory_budget_gib: self.chain.mem_budget / GIB,
            speedup_vs_megatron: megatron.iter_s / sol.cost,
            solved_by,
            megatron_node: self.uniform(cluster.devices_per_node, 1),
            uniform_overlap: if opts.sub_batches.iter().any(|&k| k > 1) { self.best_uniform(2) } else { None },
            megatron,
        })
    }
}

/// Plan with the ILP.
pub fn plan(model: &ModelDesc, cluster: &ClusterDesc, cm: &CostModel<'_>, opts: &TpOptions) -> Result<TpPlan> {
    let p = build(model, cluster, cm, opts)?;
    let (sol, by) = p.chain.solve(opts.solver, opts.time_limit_s, opts.mip_rel_gap)?;
    p.plan(model, cluster, &sol, by, opts)
}

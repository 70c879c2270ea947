//! MoE training with a checkpoint every iteration, under five strategies.
//!
//! One representative device is simulated (the cluster is symmetric; expert-parallel
//! all-to-alls take as long as their busiest receiver, so the device sees the worst load).
//! Resources: the device's compute stream, its share of the node's NICs (`nic`), NVLink, the
//! PCIe path to host memory and its share of storage bandwidth.
//!
//! - `none`: training only.
//! - `blocking`: after the optimizer step, copy the state to host and write it to the
//!   (remote) file system; training waits.
//! - `async` (TorchSnapshot): stage to host (training waits for the copy), then write in the
//!   background with no traffic control; the next snapshot waits for the previous write.
//! - `gemini`: copy to host, replicate to `replicas - 1` peers' host memory in fixed-size
//!   chunks released at the time offsets of the network's idle spans, profiled once in the
//!   first iteration.
//! - `capricorn`: chunks sized to each predicted window and released when the training
//!   communication before the window finishes; windows re-profiled only when expert load
//!   drifts past a threshold (speculative activation).
//!
//! The in-memory strategies keep the committed snapshot while taking the next (the engine's
//! three buffers): the copy of iteration `i` must finish before optimizer step `i + 1`, and the
//! replication of `i - 1` (its acknowledgement: the commit that frees the buffer of `i - 2`)
//! before the copy of `i + 1`.
//!
//! The decisions are the engine's own, not copies: [`Strategy`] is `ironweave_ckpt`'s;
//! speculative activation is `ironweave_profile::SpeculativeActivation` fed the *previous*
//! iteration's load (what the engine knows when an iteration begins); Capricorn's chunks come
//! from `ironweave_ckpt::schedule::capricorn` over `ironweave_profile::WindowPredictor`'s
//! windows, Gemini's from `schedule::gemini` over the spans of its last profiled iteration;
//! partition accuracy is `ironweave_ckpt::partition::partition_accuracy`.

use serde::{Deserialize, Serialize};

use ironweave_ckpt::engine::EngineConfig;
use ironweave_ckpt::partition::{partition_accuracy, ChunkSpan};
use ironweave_ckpt::schedule::{self, Scheduled, Trigger};
use ironweave_plan::{desc::state_bytes_per_param, ClusterDesc, Coll, CostModel, ModelDesc};
use ironweave_profile::{Anchor, ExpertLoad, SpeculativeActivation, Window as PWindow, WindowPredictor};

use crate::engine::{run, Class, Dag, OpId, ResId, Trace};
use crate::error::{Result, SimError};
use crate::load::{shares, LoadSource, SyntheticLoad};

pub use ironweave_ckpt::engine::Strategy;

/// Scenario knobs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CkptOptions {
    /// Iterations to simulate (the first is warm-up/profiling and is not averaged).
    pub iterations: usize,
    /// Copies of each snapshot in host memory, including the local one (Gemini's m).
    pub replicas: u32,
    /// Gemini's fixed chunk size, bytes (0: sized from the spans and the state, as the engine).
    pub gemini_chunk_bytes: f64,
    /// Gemini profiles this many iterations at the start and uses the last one's spans.
    pub gemini_profile_iters: usize,
    /// Capricorn fills this fraction of a predicted window (slack for misprediction).
    pub window_fill: f64,
    /// Drift of the smoothed load (total variation, worst layer) above which Capricorn
    /// re-profiles (`SpeculativeActivation`).
    pub drift_threshold: f64,
    /// Cost of a profiling iteration, as a fraction of its compute.
    pub profile_overhead: f64,
    /// Give training traffic priority on the links (off: fair sharing, as plain TCP/IB).
    pub priority: bool,
    /// Expert loads.
    pub load: Option<LoadSource>,
    /// Also simulate `capricorn-sparseK` for each K here: one snapshot every K iterations, a
    /// `1/K` part replicated per iteration (`EngineConfig::spread_iters`).
    pub sparse: Vec<u64>,
}

impl Default for CkptOptions {
    fn default() -> Self {
        CkptOptions {
            iterations: 20,
            replicas: 2,
            // the engine's defaults
            gemini_chunk_bytes: EngineConfig::default().gemini_chunk_bytes as f64,
            gemini_profile_iters: EngineConfig::default().gemini_profile_iters as usize,
            window_fill: EngineConfig::default().window_fill,
            drift_threshold: EngineConfig::default().drift_threshold,
            profile_overhead: 0.02,
            priority: false,
            load: None,
            sparse: Vec::new(),
        }
    }
}

/// Result of one strategy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StrategyResult {
    /// Strategy.
    pub strategy: Strategy,
    /// Its name in tables (`capricorn-sparse` for Capricorn spread over 4 iterations).
    #[serde(default)]
    pub label: String,
    /// Iteration times (after the first).
    pub iter_s: Vec<f64>,
    /// Mean of `iter_s`.
    pub mean_iter_s: f64,
    /// Checkpoint bytes sent over the NIC per iteration.
    pub ckpt_bytes_per_iter: f64,
    /// Chunks that ran only while no training flow was on the NIC / all chunks.
    pub partition_accuracy: Option<f64>,
    /// Iterations in which profiling ran.
    pub profiling_activations: usize,
    /// The trace (for timelines).
    #[serde(skip)]
    pub trace: Option<(Dag, Trace)>,
}

/// The table of all strategies.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CkptReport {
    /// Model.
    pub model: String,
    /// Cluster.
    pub cluster: String,
    /// Devices.
    pub devices: u32,
    /// Checkpoint bytes per device per iteration.
    pub state_bytes_per_device: f64,
    /// Per strategy.
    pub results: Vec<StrategyResult>,
}

struct Setup {
    compute: ResId,
    nic: ResId,
    nvl: ResId,
    pcie: ResId,
    storage: ResId,
}

/// Per-layer costs of the representative device.
struct Costs {
    attn_s: f64,
    mlp_s: f64,
    expert_base_s: f64,
    a2a_nic_bytes: f64,
    a2a_nvl_bytes: f64,
    a2a_lat: f64,
    grad_nic_bytes: Vec<f64>,
    grad_nvl_bytes: Vec<f64>,
    opt_s: f64,
    head_s: f64,
    local_experts: Vec<Vec<usize>>, // per device of the EP group: its experts
    capacity: f64,
}

fn costs(model: &ModelDesc, cluster: &ClusterDesc) -> Result<Costs> {
    let moe = model.moe.as_ref().ok_or_else(|| SimError::Invalid(format!("model `{}` has no [moe] section", model.name)))?;
    let n = cluster.devices();
    let dpn = cluster.devices_per_node;
    let ep = moe.experts.min(n);
    if moe.experts % ep != 0 || n % ep != 0 {
        return Err(SimError::Invalid(format!(
            "experts ({}) and devices ({n}) must be multiples of the expert-parallel group size {ep}",
            moe.experts
        )));
    }
    let cm = CostModel::new(cluster);
    let seqs = model.global_batch as f64 / n as f64;

    let tokens = seqs * model.seq as f64;
    let elem = model.dtype.size() as f64;
    // all-to-all within the EP group: the share that leaves the node crosses the NIC
    let m = ep.min(dpn);
    let a2a_bytes = tokens * moe.top_k as f64 * model.hidden as f64 * elem;
    let off_node = if ep > m { (ep - m) as f64 / ep as f64 } else { 0.0 };
    let on_node = (m - 1) as f64 / ep as f64;
    let ep_path = cm.group(ep, m);
    let mut grad_nic = Vec::new();
    let mut grad_nvl = Vec::new();
    let nodes = cluster.nodes as f64;
    for l in 0..model.layers {
        // dense parameters: all devices; experts: replicas across EP groups
        let dense = model.attn_params() + if model.is_moe_layer(l) { 0.0 } else { model.mlp_params() };
        let expert = if model.is_moe_layer(l) { model.ffn_params(l) / ep as f64 } else { 0.0 };
        let bytes = (dense + expert) * elem;
        // hierarchical all-reduce: reduce-scatter in the node, all-reduce of 1/dpn across nodes
        grad_nic.push(if nodes > 1.0 { bytes / dpn as f64 * 2.0 * (nodes - 1.0) / nodes } else { 0.0 });
        grad_nvl.push(bytes * 2.0 * (dpn as f64 - 1.0) / dpn as f64);
    }
    let local: Vec<Vec<usize>> =
        (0..ep as usize).map(|d| (0..moe.experts as usize).filter(|e| e % ep as usize == d).collect()).collect();
    let state_per_dev = model.total_params() * state_bytes_per_param(model.dtype) / n as f64;
    Ok(Costs {
        attn_s: cm.compute_time("attn", model.attn_flops(seqs)),
        mlp_s: cm.compute_time("mlp", model.mlp_flops(seqs)),
        expert_base_s: cm.compute_time("expert", model.mlp_flops(seqs) * moe.top_k as f64),
        a2a_nic_bytes: a2a_bytes * off_node,
        a2a_nvl_bytes: a2a_bytes * on_node,
        a2a_lat: Coll::AllToAll.steps(ep) * ep_path.latency_s,
        grad_nic_bytes: grad_nic,
        grad_nvl_bytes: grad_nvl,
        // the optimizer reads and writes the whole fp32 state once at HBM speed (~2 TB/s)
        opt_s: state_per_dev * 2.0 / 2e12,
        head_s: cm.compute_time("head", model.head_flops(seqs)),
        local_experts: local,
        capacity: moe.capacity_factor,
    })
}

/// How much more than average the busiest device of the EP group receives, capped by capacity.
fn hot_factor(c: &Costs, share: &[f64]) -> f64 {
    let devs = c.local_experts.len() as f64;
    let worst = c.local_experts.iter().map(|ex| ex.iter().map(|&e| share[e]).sum::<f64>()).fold(0.0, f64::max);
    (worst * devs).clamp(1.0 / devs, c.capacity)
}

/// Training ops of one iteration. Returns (end op, NIC training ops in order).
#[allow(clippy::too_many_arguments)] // one call site per use; a struct would only rename them
fn iteration(
    dag: &mut Dag,
    s: &Setup,
    model: &ModelDesc,
    c: &Costs,
    share: &[Vec<f64>],
    start: OpId,
    opt_deps: &[OpId],
    extra_compute: f64,
    it: usize,
) -> (OpId, Vec<OpId>) {
    let mut nic_ops = Vec::new();
    let a2a = |dag: &mut Dag, name: String, hot: f64, deps: Vec<OpId>, nic_ops: &mut Vec<OpId>| -> OpId {
        let x =
            dag.transfer(format!("{name} nic"), "a2a", s.nic, c.a2a_nic_bytes * hot, c.a2a_lat, Class::Training, deps.clone());
        nic_ops.push(x);
        let y = dag.transfer(format!("{name} nvlink"), "a2a", s.nvl, c.a2a_nvl_bytes * hot, c.a2a_lat, Class::Training, deps);
        dag.mark(name, vec![x, y])
    };
    let mut prev = start;
    let mut moe_idx = 0;
    let mut hots = Vec::new();
    for l in 0..model.layers {
        let a = dag.compute(format!("it{it} L{l} attn fwd"), "compute", s.compute, c.attn_s, vec![prev]);
        if model.is_moe_layer(l) {
            let hot = hot_factor(c, &share[moe_idx]);
            hots.push(hot);
            moe_idx += 1;
            let d = a2a(dag, format!("it{it} L{l} dispatch"), hot, vec![a], &mut nic_ops);
            let e = dag.compute(format!("it{it} L{l} experts fwd"), "compute", s.compute, c.expert_base_s * hot, vec![d]);
            prev = a2a(dag, format!("it{it} L{l} combine"), hot, vec![e], &mut nic_ops);
        } else {
            hots.push(0.0);
            prev = dag.compute(format!("it{it} L{l} mlp fwd"), "compute", s.compute, c.mlp_s, vec![a]);
        }
    }
    prev = dag.compute(format!("it{it} head"), "compute", s.compute, c.head_s * 3.0 + extra_compute, vec![prev]);
    let mut grads = Vec::new();
    for l in (0..model.layers).rev() {
        if model.is_moe_layer(l) {
            let hot = hots[l as usize];
            let d = a2a(dag, format!("it{it} L{l} combine bwd"), hot, vec![prev], &mut nic_ops);
            let e = dag.compute(format!("it{it} L{l} experts bwd"), "compute", s.compute, 2.0 * c.expert_base_s * hot, vec![d]);
            prev = a2a(dag, format!("it{it} L{l} dispatch bwd"), hot, vec![e], &mut nic_ops);
        } else {
            prev = dag.compute(format!("it{it} L{l} mlp bwd"), "compute", s.compute, 2.0 * c.mlp_s, vec![prev]);
        }
        prev = dag.compute(format!("it{it} L{l} attn bwd"), "compute", s.compute, 2.0 * c.attn_s, vec![prev]);
        let g1 = dag.transfer(
            format!("it{it} L{l} grad nic"),
            "grad",
            s.nic,
            c.grad_nic_bytes[l as usize],
            0.0,
            Class::Training,
            vec![prev],
        );
        nic_ops.push(g1);
        let g2 = dag.transfer(
            format!("it{it} L{l} grad nvlink"),
            "grad",
            s.nvl,
            c.grad_nvl_bytes[l as usize],
            0.0,
            Class::Training,
            vec![prev],
        );
        grads.push(g1);
        grads.push(g2);
    }
    let mut deps = grads;
    deps.push(prev);
    deps.extend_from_slice(opt_deps);
    let end = dag.compute(format!("it{it} optimizer"), "compute", s.compute, c.opt_s, deps);
    (end, nic_ops)
}

fn setup(dag: &mut Dag, cluster: &ClusterDesc, priority: bool) -> Setup {
    let cm = CostModel::new(cluster);
    let dpn = cluster.devices_per_node as f64;
    let nic_bw = cluster.inter_link().map(|l| l.bytes_per_s() * l.instances.unwrap_or(1) as f64 / dpn).unwrap_or(f64::INFINITY);
    let nvl_bw = cm.node_group().bytes_per_s;
    Setup {
        compute: dag.stream("gpu"),
        nic: dag.link("nic", if nic_bw.is_finite() { nic_bw } else { 1e15 }, priority),
        nvl: dag.link("nvlink", if nvl_bw.is_finite() { nvl_bw } else { 1e15 }, priority),
        pcie: dag.link("pcie", cluster.host.pcie_gbyte_s * 1e9, priority),
        storage: dag.link("storage", cluster.host.storage_gbyte_s * 1e9 / dpn, priority),
    }
}

/// An idle window of the NIC in a training-only iteration.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// Index (within the iteration's NIC training ops) of the op whose end opens the window;
    /// `None`: the iteration's start.
    after: Option<usize>,
    /// Offset from the iteration start.
    offset: f64,
    /// Length.
    len: f64,
}

/// Idle windows of the NIC in a training-only iteration with these loads.
fn windows(model: &ModelDesc, cluster: &ClusterDesc, c: &Costs, share: &[Vec<f64>]) -> Result<Vec<Window>> {
    let mut dag = Dag::default();
    let s = setup(&mut dag, cluster, false);
    let start = dag.mark("start", vec![]);
    let (end, nic) = iteration(&mut dag, &s, model, c, share, start, &[], 0.0, 0);
    let tr = run(&dag)?;
    let t_end = tr.ops[end].end;
    // merge NIC busy intervals, then gaps after each op
    let t0 = tr.ops[start].end;
    let mut iv: Vec<(f64, f64, usize)> = nic.iter().enumerate().map(|(k, &o)| (tr.ops[o].start, tr.ops[o].end, k)).collect();
    iv.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.2.cmp(&b.2)));
    let mut out = Vec::new();
    let mut cursor = t0;
    let mut opener: Option<usize> = None;
    for (a, b, k) in iv {
        if a > cursor + 1e-9 {
            out.push(Window { after: opener, offset: cursor - t0, len: a - cursor });
        }
        if b >= cursor {
            cursor = b;
            opener = Some(k);
        }
    }
    if t_end > cursor + 1e-9 {
        out.push(Window { after: opener, offset: cursor - t0, len: t_end - cursor });
    }
    Ok(out)
}

/// The smallest chunk Capricorn cuts for a window (the engine's `chunk_bytes.min(1 MiB)`).
const MIN_CHUNK: u64 = 1 << 20;

/// The simulator's windows as the profiler reports them (ns; anchored by their order in the
/// iteration, so the predictor matches them across profiles).
fn as_profile(w: &[Window]) -> Vec<PWindow> {
    w.iter()
        .enumerate()
        .map(|(k, w)| PWindow {
            link: 0,
            offset_ns: (w.offset * 1e9).round() as u64,
            len_ns: (w.len * 1e9).round() as u64,
            anchor: Anchor { at: None, ordinal: k as u32 },
            after_comm: w.after.map(|a| a as u32),
        })
        .collect()
}

/// Token shares as the counts the engine's activation reads.
fn to_load(share: &[Vec<f64>]) -> ExpertLoad {
    ExpertLoad { tokens: share.iter().map(|l| l.iter().map(|x| (x * 1e6).round().max(0.0) as u64).collect()).collect() }
}

/// The events a plan's triggers map to in one iteration.
struct Triggers<'a> {
    start: OpId,
    end: OpId,
    snap: OpId,
    nic_ops: &'a [OpId],
}

/// Adds a plan's chunks to the DAG, one after the other (the engine's sender sends in order);
/// consecutive leftovers are one transfer. Returns (op, leftover) per transfer.
fn add_chunks(dag: &mut Dag, nic: ResId, plan: &[Scheduled], t: Triggers<'_>, it: usize) -> Vec<(OpId, bool)> {
    let mut out: Vec<(OpId, bool)> = Vec::new();
    let mut k = 0;
    while k < plan.len() {
        let sc = plan[k];
        let mut bytes = sc.chunk.len as f64;
        let leftover = sc.trigger == Trigger::End;
        if leftover {
            while k + 1 < plan.len() && plan[k + 1].trigger == Trigger::End {
                k += 1;
                bytes += plan[k].chunk.len as f64;
            }
        }
        let trigger = match sc.trigger {
            Trigger::Start => t.start,
            Trigger::AfterComm(c) => t.nic_ops.get(c as usize).or(t.nic_ops.last()).copied().unwrap_or(t.start),
            Trigger::At(ns) => dag.delay(format!("it{it} gemini timer {k}"), ns as f64 * 1e-9, vec![t.start]),
            Trigger::End => t.end,
        };
        let mut deps = vec![trigger, t.snap];
        deps.extend(out.last().map(|c| c.0));
        let name = if leftover { format!("it{it} ckpt leftover") } else { format!("it{it} ckpt chunk {k}") };
        out.push((dag.transfer(name, "ckpt", nic, bytes, 0.0, Class::Checkpoint, deps), leftover));
        k += 1;
    }
    out
}

/// Run the scenario for the given strategies.
pub fn simulate(model: &ModelDesc, cluster: &ClusterDesc, strategies: &[Strategy], opts: &CkptOptions) -> Result<CkptReport> {
    model.validate()?;
    cluster.validate()?;
    if opts.iterations < 2 {
        return Err(SimError::Invalid("need at least 2 iterations (the first is warm-up)".into()));
    }
    if opts.replicas < 1
        || !(opts.window_fill > 0.0 && opts.window_fill <= 1.0)
        || opts.gemini_chunk_bytes.is_nan()
        || opts.gemini_chunk_bytes < 0.0
    {
        return Err(SimError::Invalid(
            "replicas ≥ 1, window_fill in (0, 1], gemini_chunk_bytes ≥ 0 (0: sized from the spans)".into(),
        ));
    }
    let c = costs(model, cluster)?;
    let moe = model.moe.as_ref().expect("checked in costs");
    let moe_layers = (0..model.layers).filter(|&l| model.is_moe_layer(l)).count();
    let src = opts.load.clone().unwrap_or(LoadSource::Synthetic(SyntheticLoad::default()));
    let loads = shares(&src, opts.iterations, moe_layers, moe.experts)?;
    let state = model.total_params() * state_bytes_per_param(model.dtype) / cluster.devices() as f64;
    let repl_bytes = state * (opts.replicas - 1) as f64;
    // Windows per iteration as the profiler would see them (training-only timing).
    let mut win: Vec<Vec<Window>> = Vec::with_capacity(opts.iterations);
    for l in &loads {
        win.push(windows(model, cluster, &c, l)?);
    }
    let compute_per_iter: f64 = (c.attn_s * 3.0 + c.mlp_s * 3.0) * model.layers as f64;
    let repl = repl_bytes.round() as u64;
    if opts.sparse.iter().any(|&k| k < 2) {
        return Err(SimError::Invalid("capricorn-sparseK spreads a snapshot over K ≥ 2 iterations".into()));
    }
    // (strategy, iterations one snapshot is spread over, label)
    let runs: Vec<(Strategy, usize, String)> = strategies
        .iter()
        .map(|&s| (s, 1, s.name().to_string()))
        .chain(opts.sparse.iter().map(|&k| {
            (Strategy::Capricorn, k as usize, if k == 4 { "capricorn-sparse".into() } else { format!("capricorn-sparse{k}") })
        }))
        .collect();
    let mut results = Vec::new();
    for (strat, spread, label) in runs {
        let mut dag = Dag::default();
        let s = setup(&mut dag, cluster, opts.priority);
        let nic_bw = dag.resources[s.nic].bytes_per_s.unwrap_or(1.0);
        let mut starts = Vec::new();
        let mut ends = Vec::new();
        // per iteration: its chunk transfers and whether each is a leftover
        let mut chunks: Vec<Vec<(OpId, bool)>> = Vec::new();
        let mut prev_end: Option<OpId> = None;
        let mut d2h: Vec<OpId> = Vec::new();
        let mut sends_done: Vec<OpId> = Vec::new();
        let mut writes: Vec<OpId> = Vec::new();
        let mut activations = 0usize;
        // the engine's decisions: activation from the previous iteration's load, windows
        // predicted from the profiled iterations, Gemini's spans from its last profiled one
        let mut act = SpeculativeActivation::new(opts.drift_threshold);
        let mut predictor = WindowPredictor::new(0.5);
        let mut gemini_spans: Vec<PWindow> = Vec::new();
        for it in 0..opts.iterations {
            // what the next iteration's start waits for
            let mut start_deps: Vec<OpId> = prev_end.into_iter().collect();
            match strat {
                Strategy::Blocking => start_deps.extend(writes.last()),
                Strategy::Async => start_deps.extend(d2h.last()),
                _ => {}
            }
            let start = dag.mark(format!("it{it} start"), start_deps);
            starts.push(start);
            let activated = match strat {
                Strategy::Capricorn if it == 0 => true,
                // as the engine: the first load seen (the profiled first iteration's) is the
                // reference, later ones decide
                Strategy::Capricorn if !act.primed() => {
                    act.prime(&to_load(&loads[it - 1]));
                    false
                }
                Strategy::Capricorn => act.decide(&to_load(&loads[it - 1])),
                Strategy::Gemini => it < opts.gemini_profile_iters.max(1),
                _ => false,
            };
            let extra = if activated { opts.profile_overhead * compute_per_iter } else { 0.0 };
            activations += usize::from(activated);
            let opt_deps: Vec<OpId> = match strat {
                Strategy::Gemini | Strategy::Capricorn => d2h.last().copied().into_iter().collect(),
                _ => vec![],
            };
            let (end, nic_ops) = iteration(&mut dag, &s, model, &c, &loads[it], start, &opt_deps, extra, it);
            // replicate the previous snapshot during this iteration, as the engine plans it
            let mut mine = Vec::new();
            if strat.in_memory() && it > 0 {
                // the snapshot this iteration's part belongs to (every one: the previous)
                let snap = d2h[(it - 1) / spread];
                let part = repl / spread as u64;
                let plan = if strat == Strategy::Capricorn {
                    let w = predictor.predict(0);
                    if w.is_empty() {
                        schedule::capricorn(part, &[], 1.0, 1.0, 1, u64::MAX)
                    } else {
                        schedule::capricorn(part, &w, nic_bw, opts.window_fill, MIN_CHUNK, u64::MAX)
                    }
                } else {
                    schedule::gemini(repl, &gemini_spans, nic_bw, opts.gemini_chunk_bytes.round() as u64, 1.0)
                };
                mine = add_chunks(&mut dag, s.nic, &plan, Triggers { start, end, snap, nic_ops: &nic_ops }, it);
                let done = dag.mark(format!("it{it} replicated"), mine.last().map(|c| c.0).into_iter().collect());
                sends_done.push(done);
            }
            chunks.push(mine);
            if activated {
                let w = as_profile(&win[it]);
                match strat {
                    Strategy::Capricorn => predictor.observe(&w),
                    _ => gemini_spans = w,
                }
            }
            // snapshot / write after the optimizer step
            match strat {
                Strategy::None => {}
                Strategy::Blocking => {
                    let h = dag.transfer(format!("it{it} d2h"), "ckpt", s.pcie, state, 0.0, Class::Checkpoint, vec![end]);
                    d2h.push(h);
                    let w1 = dag.transfer(format!("it{it} write nic"), "ckpt", s.nic, state, 0.0, Class::Checkpoint, vec![h]);
                    let w2 =
                        dag.transfer(format!("it{it} write storage"), "ckpt", s.storage, state, 0.0, Class::Checkpoint, vec![h]);
                    writes.push(dag.mark(format!("it{it} written"), vec![w1, w2]));
                }
                Strategy::Async => {
                    let mut deps = vec![end];
                    deps.extend(writes.last());
                    let h = dag.transfer(format!("it{it} d2h"), "ckpt", s.pcie, state, 0.0, Class::Checkpoint, deps);
                    d2h.push(h);
                    let w1 = dag.transfer(format!("it{it} write nic"), "ckpt", s.nic, state, 0.0, Class::Checkpoint, vec![h]);
                    let w2 =
                        dag.transfer(format!("it{it} write storage"), "ckpt", s.storage, state, 0.0, Class::Checkpoint, vec![h]);
                    writes.push(dag.mark(format!("it{it} written"), vec![w1, w2]));
                }
                Strategy::Gemini | Strategy::Capricorn if it % spread == 0 => {
                    // the buffer to fill is free once the snapshot before the previous one
                    // (its last part went `spread + 1` iterations ago) is replicated
                    let mut deps = vec![end];
                    if sends_done.len() > spread {
                        deps.push(sends_done[sends_done.len() - spread - 1]);
                    }
                    d2h.push(dag.transfer(format!("it{it} d2h"), "ckpt", s.pcie, state, 0.0, Class::Checkpoint, deps));
                }
                // sparse: no snapshot between
                Strategy::Gemini | Strategy::Capricorn => {}
            }
            ends.push(end);
            prev_end = Some(end);
        }
        let tr = run(&dag)?;
        // iteration time: from one start to the next (the last: to its end plus what blocks the next)
        let mut iter_s = Vec::new();
        let mut bounds = Vec::new();
        for it in 1..opts.iterations {
            let next = if it + 1 < opts.iterations {
                tr.ops[starts[it + 1]].end
            } else {
                let mut e = tr.ops[ends[it]].end;
                match strat {
                    Strategy::Blocking => e = e.max(tr.ops[*writes.last().expect("written")].end),
                    Strategy::Async => e = e.max(tr.ops[*d2h.last().expect("copied")].end),
                    _ => {}
                }
                e
            };
            iter_s.push(next - tr.ops[starts[it]].end);
            bounds.push((tr.ops[starts[it]].end, next));
        }
        let mean = iter_s.iter().sum::<f64>() / iter_s.len() as f64;
        // the engine's accuracy per iteration (training on the NIC as the collisions the
        // simulated flows saw), averaged
        let ns = |t: f64| (t * 1e9).round().max(0.0) as u64;
        let training: Vec<(u32, u64, u64)> =
            tr.spans.iter().filter(|sp| sp.res == s.nic && sp.training_flows > 0).map(|sp| (0, ns(sp.t0), ns(sp.t1))).collect();
        let per_iter: Vec<f64> = (1..opts.iterations)
            .filter_map(|it| {
                let spans: Vec<ChunkSpan> = chunks[it]
                    .iter()
                    .map(|&(op, leftover)| ChunkSpan {
                        snapshot: it as u64,
                        leftover,
                        link: 0,
                        start_ns: ns(tr.ops[op].start),
                        end_ns: ns(tr.ops[op].end),
                    })
                    .collect();
                partition_accuracy(&training, &spans, spans.len(), ns(bounds[it - 1].1))
            })
            .collect();
        let accuracy = (!per_iter.is_empty()).then(|| per_iter.iter().sum::<f64>() / per_iter.len() as f64);
        let ckpt_bytes = match strat {
            Strategy::None => 0.0,
            Strategy::Blocking | Strategy::Async => state,
            _ => repl_bytes / spread as f64,
        };
        results.push(StrategyResult {
            strategy: strat,
            label,
            iter_s,
            mean_iter_s: mean,
            ckpt_bytes_per_iter: ckpt_bytes,
            partition_accuracy: accuracy,
            profiling_activations: activations,
            trace: Some((dag, tr)),
        });
    }
    Ok(CkptReport {
        model: model.name.clone(),
        cluster: cluster.name.clone(),
        devices: cluster.devices(),
        state_bytes_per_device: state,
        results,
    })
}

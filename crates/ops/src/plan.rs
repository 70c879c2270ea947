//! `ironweave plan tp|sdp`: read the descriptions, run a planner, print the plan against its
//! baselines, optionally write it as JSON.

use std::path::Path;
use std::time::Instant;

use crate::error::{bail, Context, Result};
use ironweave_plan::chain::{Method, SolvedBy};
use ironweave_plan::{sdp, tp, ClusterDesc, CostModel, ModelDesc, ProfileTable};

/// `ironweave plan`'s subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum PlanCmd {
    /// Oases: per sub-layer tensor-parallel degree and sub-batches, against Megatron.
    #[command(alias = "tmp")]
    Tp(PlanArgs),
    /// HSDP: per layer split of parameter traffic over the links, against FSDP.
    Sdp(PlanArgs),
}

/// The inputs of a plan.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Model description (configs/models/*.toml).
    #[arg(long)]
    pub model: std::path::PathBuf,
    /// Cluster description (configs/clusters/*.toml).
    #[arg(long)]
    pub cluster: std::path::PathBuf,
    /// Measured compute throughputs overriding the analytic ones (TOML `[ops.<kind>] flops, seconds`).
    #[arg(long)]
    pub profile: Option<std::path::PathBuf>,
    /// Also write the plan as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// tp: solve with HiGHS branch and bound even where the exact chain algorithms apply.
    #[arg(long)]
    pub highs: bool,
    /// Override the model's global batch (sequences per iteration), e.g. to scale it with the cluster.
    #[arg(long)]
    pub global_batch: Option<u32>,
    /// Use link figures measured by `ironweave cluster probe --json FILE` instead of the description's.
    #[arg(long)]
    pub probe: Option<std::path::PathBuf>,
}

/// `ironweave plan tp|sdp`: the plan printed against its baselines.
pub fn command(c: &PlanCmd) -> Result<i32> {
    match c {
        PlanCmd::Tp(a) => {
            tp(&a.model, &a.cluster, a.profile.as_deref(), a.json.as_deref(), a.highs, a.global_batch, a.probe.as_deref())?
        }
        PlanCmd::Sdp(a) => {
            sdp(&a.model, &a.cluster, a.profile.as_deref(), a.json.as_deref(), a.global_batch, a.probe.as_deref())?
        }
    }
    Ok(0)
}

pub fn load_model(path: &Path, global_batch: Option<u32>) -> Result<ModelDesc> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading model file {}", path.display()))?;
    let mut m = ModelDesc::from_toml_str(&text).with_context(|| format!("in {}", path.display()))?;
    if let Some(b) = global_batch {
        m.global_batch = b;
        m.validate()?;
    }
    Ok(m)
}

pub fn load_cluster(path: &Path) -> Result<ClusterDesc> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading cluster file {}", path.display()))?;
    ClusterDesc::from_toml_str(&text).with_context(|| format!("in {}", path.display()))
}

/// Replace the alpha and beta of the cluster's links with figures measured by `ironweave
/// cluster probe --json FILE` (links matched by name; `tcp:a` matches link `a`).
pub fn apply_probe(cluster: &mut ClusterDesc, probe: Option<&Path>) -> Result<()> {
    let Some(path) = probe else { return Ok(()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading probe results {}", path.display()))?;
    let probes: Vec<ironweave_transport::probe::LinkProbe> = serde_json::from_str(&text)
        .with_context(|| format!("parsing probe results {} (expected `cluster probe --json` output)", path.display()))?;
    for p in &probes {
        let short = p.name.rsplit(':').next().unwrap_or(&p.name);
        let Some(link) = cluster.links.iter_mut().find(|l| l.name == p.name || l.name == short) else {
            let names: Vec<&str> = cluster.links.iter().map(|l| l.name.as_str()).collect();
            crate::error::bail!(
                "probe of link `{}` matches no link of cluster `{}` (its links: {})",
                p.name,
                cluster.name,
                names.join(", ")
            );
        };
        if !(p.latency_s.is_finite()
            && p.latency_s >= 0.0
            && p.bandwidth_bytes_per_s.is_finite()
            && p.bandwidth_bytes_per_s > 0.0)
        {
            crate::error::bail!("probe of link `{}` has no usable figures", p.name);
        }
        eprintln!(
            "link {}: measured {:.1} us, {:.3} GB/s (description said {:.1} us, {:.3} GB/s)",
            link.name,
            p.latency_s * 1e6,
            p.bandwidth_bytes_per_s / 1e9,
            link.latency_us,
            link.bandwidth_gbyte_s
        );
        link.latency_us = p.latency_s * 1e6;
        link.bandwidth_gbyte_s = p.bandwidth_bytes_per_s / 1e9;
    }
    cluster.validate()?;
    Ok(())
}

/// The model (with `--global-batch` applied) and the cluster (with `--probe` figures applied).
pub fn load_inputs(
    model: &Path,
    cluster: &Path,
    global_batch: Option<u32>,
    probe: Option<&Path>,
) -> Result<(ModelDesc, ClusterDesc)> {
    let (m, mut c) = (load_model(model, global_batch)?, load_cluster(cluster)?);
    apply_probe(&mut c, probe)?;
    Ok((m, c))
}

/// Measured throughputs: a TOML table (`[ops.attn] flops = ..., seconds = ...`), or a
/// tensor-parallel run (`ironweave train --tp`; its directory or report.json), whose forward
/// stages' mean compute becomes the attention and MLP throughput (the head, a matmul like the
/// MLP's, takes the MLP's).
pub fn load_profile(path: Option<&Path>, model: &ModelDesc) -> Result<Option<ProfileTable>> {
    let Some(path) = path else { return Ok(None) };
    let report = if path.is_dir() { path.join("report.json") } else { path.to_path_buf() };
    if report.extension().is_some_and(|e| e == "json") {
        let r: crate::rundir::TpReport = serde_json::from_slice(
            &std::fs::read(&report).with_context(|| format!("reading the run's report {}", report.display()))?,
        )
        .with_context(|| format!("{} is not the report of a tensor-parallel run (`ironweave train --tp`)", report.display()))?;
        return Ok(Some(profile_from_run(&r, model)?));
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading profile table {}", path.display()))?;
    Ok(Some(toml::from_str(&text).with_context(|| format!("parsing profile table {}", path.display()))?))
}

/// The throughput of attention and MLP compute measured by a tensor-parallel run: each kind's
/// forward and backward stage compute (all sub-batches, mean over layers) against the FLOPs the
/// cost model counts for them on one rank (the group's batch split `tp` ways, forward plus a
/// backward of 3x forward with recomputation), so the model's compute per sub-layer is the
/// measured one. The MLP's backward is taken from the layers below the last (whose backward
/// stage also runs the head).
pub fn profile_from_run(r: &crate::rundir::TpReport, model: &ModelDesc) -> Result<ProfileTable> {
    let layers = model.layers as usize;
    if r.stage_compute_s.len() != 4 * layers + 1 || r.degrees.iter().any(|&d| d != r.tp) {
        bail!(
            "the run has {} stages, a {}-layer model at one degree has {}: profile with a uniform run of this model's configuration",
            r.stage_compute_s.len(),
            layers,
            4 * layers + 1
        );
    }
    // a sub-layer of degree d runs B·d/N sequences split d ways on every rank: B/N sequences'
    // worth of FLOPs whatever the degree
    let per_rank = (r.tokens_per_iter as f64 / model.seq as f64) / r.ranks.max(1) as f64;
    let stage_s = |i: usize| r.stage_compute_s[i].iter().sum::<f64>();
    // stage order: forward attn/mlp per layer, then per layer from the last: mlp.bwd, attn.bwd
    let bwd_mlp = |l: usize| stage_s(2 * layers + 2 * (layers - 1 - l));
    let bwd_attn = |l: usize| stage_s(2 * layers + 2 * (layers - 1 - l) + 1);
    let attn_s = (0..layers).map(|l| stage_s(2 * l) + bwd_attn(l)).sum::<f64>() / layers as f64;
    let below: Vec<usize> = if layers > 1 { (0..layers - 1).collect() } else { vec![0] };
    let mlp_s = below.iter().map(|&l| stage_s(2 * l + 1) + bwd_mlp(l)).sum::<f64>() / below.len() as f64;
    let recompute = if model.activation_recompute { 1.0 } else { 0.0 };
    // the planner's backward is (2 + recompute) x forward: one FLOP count for both passes
    let passes = 3.0 + recompute;
    if attn_s <= 0.0 || mlp_s <= 0.0 {
        bail!("the run recorded no forward compute (fewer than 3 iterations?)");
    }
    let op = |flops: f64, seconds: f64| ironweave_plan::cost::MeasuredOp { flops, seconds };
    let mut t = ProfileTable::default();
    t.ops.insert("attn".into(), op(model.attn_flops(per_rank) * passes, attn_s));
    t.ops.insert("mlp".into(), op(model.mlp_flops(per_rank) * passes, mlp_s));
    t.ops.insert("head".into(), op(model.mlp_flops(per_rank) * passes, mlp_s));
    Ok(t)
}

fn ms(s: f64) -> String {
    format!("{:.1} ms", s * 1e3)
}

pub fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(value)?;
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// Group consecutive sub-layers with the same choice: `L0.attn..L31.mlp  TP=4 k=2`.
fn runs<T: PartialEq + Copy>(names: &[String], keys: &[T]) -> Vec<(String, String, T)> {
    let mut out: Vec<(String, String, T)> = Vec::new();
    for (n, &k) in names.iter().zip(keys) {
        match out.last_mut() {
            Some(last) if last.2 == k => last.1 = n.clone(),
            _ => out.push((n.clone(), n.clone(), k)),
        }
    }
    out
}

pub fn tp(
    model: &Path,
    cluster: &Path,
    profile: Option<&Path>,
    json: Option<&Path>,
    highs_only: bool,
    global_batch: Option<u32>,
    probe: Option<&Path>,
) -> Result<()> {
    let (m, c) = load_inputs(model, cluster, global_batch, probe)?;
    let prof = load_profile(profile, &m)?;
    let mut cm = CostModel::new(&c);
    cm.profile = prof.as_ref();
    let opts = tp::TpOptions { solver: if highs_only { Method::Highs } else { Method::Auto }, ..Default::default() };
    let t0 = Instant::now();
    let problem = tp::build(&m, &c, &cm, &opts)?;
    let (sol, by) = problem.chain.solve(opts.solver, opts.time_limit_s, opts.mip_rel_gap)?;
    let solve_s = t0.elapsed().as_secs_f64();
    let plan = problem.plan(&m, &c, &sol, by, &opts)?;
    println!(
        "TMP plan (Oases) for {} on {} ({} devices, {:.1} B parameters); {} sub-layers x {} options solved in {:.3} s by {}",
        plan.model,
        plan.cluster,
        plan.devices,
        m.total_params() / 1e9,
        problem.sublayers.len(),
        problem.chain.choices.iter().map(|c| c.len()).max().unwrap_or(0),
        solve_s,
        match by {
            SolvedBy::ShortestPath => "the chain shortest path (memory does not bind; exact)",
            SolvedBy::ParetoDp => "the Pareto-label program (exact)",
            SolvedBy::Highs => "HiGHS (ILP)",
        }
    );
    let names: Vec<String> = plan.sublayers.iter().map(|s| s.name.clone()).collect();
    let keys: Vec<(u32, u32)> = plan.sublayers.iter().map(|s| (s.tp, s.sub_batches)).collect();
    println!("  sub-layers                 TP  sub-batches");
    for (a, b, (tp, k)) in runs(&names, &keys) {
        let span = if a == b { a } else { format!("{a}..{b}") };
        println!("  {span:<26} {tp:>2}  {k}");
    }
    println!(
        "  predicted iteration {}  (compute {}, exposed communication {}, of which resharding {})",
        ms(plan.predicted_iter_s),
        ms(plan.breakdown.compute_s),
        ms(plan.breakdown.exposed_comm_s),
        ms(plan.breakdown.reshard_s)
    );
    println!("  memory {:.1} GiB per device (budget {:.1} GiB)", plan.memory_gib, plan.memory_budget_gib);
    println!();
    println!("  {:<38} {:>12} {:>10} {:>9}", "configuration", "iteration", "memory", "speedup");
    let row = |name: &str, it: f64, mem: f64| {
        println!("  {name:<38} {:>12} {:>6.1} GiB {:>8.2}x", ms(it), mem, it / plan.predicted_iter_s)
    };
    row(&format!("{} (best uniform)", plan.megatron.name), plan.megatron.iter_s, plan.megatron.memory_gib);
    match &plan.megatron_node {
        Some(u) => row(&format!("{} (TP = devices per node)", u.name), u.iter_s, u.memory_gib),
        None => println!("  Megatron TP={} (TP = devices per node)    does not fit in memory", c.devices_per_node),
    }
    if let Some(u) = &plan.uniform_overlap {
        row(&u.name, u.iter_s, u.memory_gib);
    }
    row("Oases plan (this)", plan.predicted_iter_s, plan.memory_gib);
    println!("  speedup over Megatron (best uniform TP): {:.2}x", plan.speedup_vs_megatron);
    if let Some(p) = json {
        write_json(p, &serde_json::json!({ "plan": plan, "solve_s": solve_s }))?;
    }
    Ok(())
}

pub fn sdp(
    model: &Path,
    cluster: &Path,
    profile: Option<&Path>,
    json: Option<&Path>,
    global_batch: Option<u32>,
    probe: Option<&Path>,
) -> Result<()> {
    let (m, c) = load_inputs(model, cluster, global_batch, probe)?;
    let prof = load_profile(profile, &m)?;
    let mut cm = CostModel::new(&c);
    cm.profile = prof.as_ref();
    let opts = sdp::SdpOptions::default();
    let t0 = Instant::now();
    let plan = sdp::plan(&m, &c, &cm, &opts)?;
    let solve_s = t0.elapsed().as_secs_f64();
    println!(
        "SDP plan (HSDP) for {} on {} ({} devices, {:.1} B parameters); solved by HiGHS in {:.3} s",
        plan.model,
        plan.cluster,
        plan.devices,
        m.total_params() / 1e9,
        solve_s
    );
    println!(
        "  part gathered over {} (node-sharded; its shards' gradients all-reduced across nodes over {}) and over {} (sharded over all devices)",
        plan.links.0, plan.rail_link, plan.links.1
    );
    if let Some(other) = plan.other_assignment_iter_s {
        println!(
            "  link assignment: {} (both solved; the other predicts {})",
            match plan.assignment {
                ironweave_plan::sdp::LinkAssignment::GlobalOnFastest => "all-device part on the fastest inter-node link",
                ironweave_plan::sdp::LinkAssignment::RailOnFastest => "cross-node all-reduce on the fastest inter-node link",
            },
            ms(other)
        );
    }
    let names: Vec<String> = plan.layers.iter().map(|l| l.name.clone()).collect();
    let keys: Vec<u64> = plan.layers.iter().map(|l| (l.node_fraction * 1e4).round() as u64).collect();
    println!("  layers            node-sharded  all-sharded");
    for (a, b, k) in runs(&names, &keys) {
        let span = if a == b { a } else { format!("{a}..{b}") };
        let f = k as f64 / 1e4;
        println!("  {span:<17} {:>11.1}% {:>11.1}%", f * 100.0, (1.0 - f) * 100.0);
    }
    println!(
        "  predicted iteration {} (compute {}), memory {:.1} GiB per device (budget {:.1} GiB), {:.1}% of parameter traffic moved to {}",
        ms(plan.predicted_iter_s),
        ms(plan.compute_s),
        plan.memory_gib,
        plan.memory_budget_gib,
        plan.node_fraction_overall * 100.0,
        plan.links.0
    );
    println!();
    println!("  {:<58} {:>12} {:>10} {:>9}", "configuration", "iteration", "memory", "speedup");
    for b in [&plan.fsdp, &plan.hybrid] {
        let fits = if b.fits { "" } else { "  (does not fit)" };
        println!(
            "  {:<58} {:>12} {:>6.1} GiB {:>8.2}x{fits}",
            b.name,
            ms(b.iter_s),
            b.memory_gib,
            b.iter_s / plan.predicted_iter_s
        );
    }
    println!("  {:<58} {:>12} {:>6.1} GiB {:>8.2}x", "HSDP plan (this)", ms(plan.predicted_iter_s), plan.memory_gib, 1.0);
    println!(
        "  speedup over the best baseline that fits: {:.2}x; over FSDP FULL_SHARD: {:.2}x",
        plan.speedup_vs_best_baseline, plan.speedup_vs_fsdp
    );
    if let Some(p) = json {
        write_json(p, &serde_json::json!({ "plan": plan, "solve_s": solve_s }))?;
    }
    Ok(())
}

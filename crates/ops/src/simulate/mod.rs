//! `ironweave simulate tp|sdp|ckpt`: run a scenario in the discrete-event simulator, print a
//! table, optionally write JSON and an SVG timeline.

use std::path::{Path, PathBuf};

pub mod replay;

use crate::error::{bail, Context, Result};
use ironweave_plan::chain::Method;
use ironweave_plan::{sdp as psdp, tp as ptp, CostModel};
use ironweave_sim::ckpt::{self, CkptOptions, Strategy};
use ironweave_sim::load::{LoadSource, LoadTrace, SyntheticLoad};
use ironweave_sim::{sdp, svg, tp};

use crate::plan::{load_inputs, write_json};

#[derive(Debug, clap::Args)]
pub struct SimArgs {
    /// Model description (configs/models/*.toml).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Cluster description (configs/clusters/*.toml).
    #[arg(long)]
    cluster: Option<PathBuf>,
    /// ckpt: replay a measured run instead (a `bench ckpt` output directory, or one `train`
    /// report directory): its profile, link rates and state sizes predict every strategy's
    /// iteration time on the emulated bed, beside the measured ones.
    #[arg(long)]
    from_report: Option<PathBuf>,
    /// ckpt --from-report: replay the host's egress as two interleaved classes instead of one
    /// first-come-first-served queue: SHARE,WAIT — training's share of the link while checkpoint
    /// bytes are on it, and the seconds a training transfer first waits behind them (measure both
    /// on the emulated link with benches/python/link_share.py).
    #[arg(long, value_name = "SHARE,WAIT")]
    link_sharing: Option<String>,
    /// Write the timeline here (SVG).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Write the results here (JSON).
    #[arg(long)]
    json: Option<PathBuf>,
    /// ckpt: iterations to simulate (the first is warm-up).
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// ckpt: seed of the expert-load generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// ckpt: expert loads from a recorded trace (JSON: {"experts": E, "iterations": [[[tokens per expert] per MoE layer] per iteration]}).
    #[arg(long)]
    load_trace: Option<PathBuf>,
    /// ckpt: strategies to compare.
    #[arg(long, value_delimiter = ',', default_value = "none,blocking,async,gemini,capricorn")]
    strategies: Vec<String>,
    /// Give training traffic priority over checkpoint traffic on every link.
    #[arg(long)]
    priority: bool,
    /// ckpt: fraction of a predicted window Capricorn fills (default: the engine's, 0.9).
    #[arg(long)]
    window_fill: Option<f64>,
    /// Override the model's global batch (sequences per iteration), e.g. to scale it with the cluster.
    #[arg(long)]
    global_batch: Option<u32>,
    /// Use link figures measured by `ironweave cluster probe --json FILE` instead of the description's.
    #[arg(long)]
    probe: Option<PathBuf>,
    /// tp, sdp: measured compute throughputs (a TOML table — `bench sdp` writes one — or a
    /// tensor-parallel run's directory: `ironweave train --tp` / `bench overlap` rows), as
    /// `plan tp|sdp --profile`.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// tp: also simulate these uniform degrees under both schedules (e.g. the degree a
    /// `bench overlap` ran, to compare with its measured rows).
    #[arg(long, value_delimiter = ',')]
    tp_degrees: Vec<u32>,
}

fn ms(s: f64) -> String {
    format!("{:.1} ms", s * 1e3)
}

fn write_svg(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// `--model` and `--cluster`, which every scenario but a replay needs.
fn inputs(a: &SimArgs) -> Result<(&Path, &Path)> {
    match (&a.model, &a.cluster) {
        (Some(m), Some(c)) => Ok((m, c)),
        _ => bail!("give --model and --cluster (or, for ckpt, --from-report DIR to replay a measured run)"),
    }
}

/// `ironweave simulate`'s options.
#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// tp: Megatron vs the Oases plan; sdp: FSDP vs the HSDP plan; ckpt: five checkpoint strategies.
    pub scenario: String,
    #[command(flatten)]
    pub args: SimArgs,
}

/// `ironweave simulate SCENARIO`.
pub fn command(a: &SimulateArgs) -> Result<i32> {
    run(&a.scenario, &a.args)?;
    Ok(0)
}

/// Runs `scenario` (tp, sdp, ckpt) and prints its table.
pub fn run(scenario: &str, a: &SimArgs) -> Result<()> {
    if a.from_report.is_some() && scenario != "ckpt" {
        bail!("--from-report replays a checkpoint run: use it with `simulate ckpt`");
    }
    if a.link_sharing.is_some() && a.from_report.is_none() {
        bail!("--link-sharing changes the replay's link: use it with `simulate ckpt --from-report DIR`");
    }
    match scenario {
        "tp" => run_tp(a),
        "sdp" => run_sdp(a),
        "ckpt" => match &a.from_report {
            Some(dir) => {
                let sharing = a.link_sharing.as_deref().map(crate::simulate::replay::parse_sharing).transpose()?;
                crate::simulate::replay::run(dir, a.json.as_deref(), sharing)
            }
            None => run_ckpt(a),
        },
        other => bail!("unknown scenario `{other}` (expected tp, sdp or ckpt)"),
    }
}

fn run_tp(a: &SimArgs) -> Result<()> {
    let (mp, cp) = inputs(a)?;
    let (m, c) = load_inputs(mp, cp, a.global_batch, a.probe.as_deref())?;
    let prof = crate::plan::load_profile(a.profile.as_deref(), &m)?;
    let mut cm = CostModel::new(&c);
    cm.profile = prof.as_ref();
    let opts = ptp::TpOptions { solver: Method::Auto, ..Default::default() };
    let problem = ptp::build(&m, &c, &cm, &opts)?;
    let (sol, by) = problem.chain.solve(opts.solver, opts.time_limit_s, opts.mip_rel_gap)?;
    let plan = problem.plan(&m, &c, &sol, by, &opts)?;
    let picks_for = |t: u32, k: u32| -> Option<Vec<usize>> {
        problem.sublayers.iter().map(|s| s.options.iter().position(|o| o.tp == t && o.sub_batches == k)).collect()
    };
    let mut runs = Vec::new();
    if let Some(p) = picks_for(plan.megatron.tp, 1) {
        runs.push(tp::simulate(&problem, &m, &cm, &p, &format!("Megatron TP={} (best uniform, no overlap)", plan.megatron.tp))?);
    }
    if let Some(u) = &plan.megatron_node {
        if u.tp != plan.megatron.tp {
            if let Some(p) = picks_for(u.tp, 1) {
                runs.push(tp::simulate(&problem, &m, &cm, &p, &format!("Megatron TP={} (devices per node)", u.tp))?);
            }
        }
    }
    if let Some(u) = &plan.uniform_overlap {
        if let Some(p) = picks_for(u.tp, 2) {
            runs.push(tp::simulate(&problem, &m, &cm, &p, &format!("Oases schedule, uniform TP={}", u.tp))?);
        }
    }
    for &t in &a.tp_degrees {
        for (k, what) in [(1, "Megatron"), (2, "Oases schedule")] {
            match picks_for(t, k) {
                Some(p) => runs.push(tp::simulate(&problem, &m, &cm, &p, &format!("{what}, uniform TP={t} (--tp-degrees)"))?),
                None => eprintln!("simulate tp: TP={t} with {k} sub-batch(es) is not an admissible option here; left out"),
            }
        }
    }
    runs.push(tp::simulate(&problem, &m, &cm, &sol.picks, "Oases plan")?);
    let oases = runs.last().expect("pushed").simulated_s;
    println!("Tensor parallelism: {} on {} ({} devices), one iteration", m.name, c.name, c.devices());
    println!("  {:<44} {:>12} {:>12} {:>14}", "configuration", "predicted", "simulated", "Oases speedup");
    for r in &runs {
        println!("  {:<44} {:>12} {:>12} {:>13.2}x", r.name, ms(r.predicted_s), ms(r.simulated_s), r.simulated_s / oases);
    }
    if let Some(p) = &a.svg {
        let (dag, tr) = runs.last().and_then(|r| r.trace.as_ref()).expect("trace");
        write_svg(p, &svg::timeline(dag, tr, &format!("Oases plan: {} on {}", m.name, c.name), None))?;
    }
    if let Some(p) = &a.json {
        write_json(p, &serde_json::json!({ "model": m.name, "cluster": c.name, "runs": runs, "plan": plan }))?;
    }
    Ok(())
}

fn run_sdp(a: &SimArgs) -> Result<()> {
    let (mp, cp) = inputs(a)?;
    let (m, c) = load_inputs(mp, cp, a.global_batch, a.probe.as_deref())?;
    let prof = crate::plan::load_profile(a.profile.as_deref(), &m)?;
    let mut cm = CostModel::new(&c);
    cm.profile = prof.as_ref();
    let plan = psdp::plan(&m, &c, &cm, &psdp::SdpOptions::default())?;
    // each row on its own link assignment: FULL_SHARD on the fastest inter-node link,
    // HYBRID_SHARD's all-reduce on the fastest, HSDP on the one its plan chose
    let layers = psdp::layers(&m, &c, &cm)?;
    let nl = layers.len();
    let mut runs = vec![sdp::simulate(&layers, &m, &cm, &vec![1.0; nl], "FSDP FULL_SHARD (single inter-node path)")?];
    if plan.hybrid.fits {
        let hybrid = psdp::layers_on(&m, &c, &cm, psdp::LinkAssignment::RailOnFastest)?;
        runs.push(sdp::simulate(&hybrid, &m, &cm, &vec![0.0; nl], "FSDP HYBRID_SHARD")?);
    }
    let g: Vec<f64> = plan.layers.iter().map(|l| l.global_fraction).collect();
    let planned = psdp::layers_on(&m, &c, &cm, plan.assignment)?;
    runs.push(sdp::simulate(&planned, &m, &cm, &g, "HSDP plan")?);
    let hsdp = runs.last().expect("pushed").simulated_s;
    println!("Sharded data parallelism: {} on {} ({} devices), one iteration", m.name, c.name, c.devices());
    if !plan.hybrid.fits {
        println!(
            "  (HYBRID_SHARD needs {:.1} GiB per device, over the {:.1} GiB budget: not a candidate)",
            plan.hybrid.memory_gib, plan.memory_budget_gib
        );
    }
    println!("  {:<44} {:>12} {:>12} {:>13}", "configuration", "predicted", "simulated", "HSDP speedup");
    for r in &runs {
        println!("  {:<44} {:>12} {:>12} {:>12.2}x", r.name, ms(r.predicted_s), ms(r.simulated_s), r.simulated_s / hsdp);
    }
    if let Some(p) = &a.svg {
        let (dag, tr) = runs.last().and_then(|r| r.trace.as_ref()).expect("trace");
        write_svg(p, &svg::timeline(dag, tr, &format!("HSDP plan: {} on {}", m.name, c.name), None))?;
    }
    if let Some(p) = &a.json {
        write_json(p, &serde_json::json!({ "model": m.name, "cluster": c.name, "runs": runs, "plan": plan }))?;
    }
    Ok(())
}

fn run_ckpt(a: &SimArgs) -> Result<()> {
    let (mp, cp) = inputs(a)?;
    let (m, c) = load_inputs(mp, cp, a.global_batch, a.probe.as_deref())?;
    // the engine's five by name; capricorn-sparse[K] as Capricorn spread over K iterations
    let mut strategies: Vec<Strategy> = Vec::new();
    let mut sparse: Vec<u64> = Vec::new();
    for s in &a.strategies {
        let s = s.trim();
        if s.starts_with("capricorn-sparse") {
            sparse.push(crate::train::args::parse_strategy(s)?.spread);
        } else {
            strategies.push(Strategy::parse(s)?);
        }
    }
    let load = match &a.load_trace {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading load trace {}", p.display()))?;
            LoadSource::Trace(
                serde_json::from_str::<LoadTrace>(&text).with_context(|| format!("parsing load trace {}", p.display()))?,
            )
        }
        None => LoadSource::Synthetic(SyntheticLoad { seed: a.seed, ..Default::default() }),
    };
    let mut opts = CkptOptions { iterations: a.iterations, priority: a.priority, load: Some(load), sparse, ..Default::default() };
    if let Some(f) = a.window_fill {
        opts.window_fill = f;
    }
    eprintln!("simulating {} iterations x {} strategies ...", opts.iterations, strategies.len() + opts.sparse.len());
    let rep = ckpt::simulate(&m, &c, &strategies, &opts)?;
    println!(
        "Per-iteration checkpointing: {} on {} ({} devices), {:.2} GB of state per device, {} iterations (first excluded)",
        rep.model,
        rep.cluster,
        rep.devices,
        rep.state_bytes_per_device / 1e9,
        opts.iterations
    );
    let none = rep.results.iter().find(|r| r.strategy == Strategy::None).map(|r| r.mean_iter_s);
    let cap = rep.results.iter().find(|r| r.strategy == Strategy::Capricorn).map(|r| r.mean_iter_s);
    println!(
        "  {:<16} {:>11} {:>10} {:>18} {:>10} {:>10} {:>12}",
        "strategy", "iteration", "overhead", "capricorn speedup", "accuracy", "profiled", "ckpt GB/it"
    );
    for r in &rep.results {
        let over = none.map(|n| format!("{:+.1}%", (r.mean_iter_s / n - 1.0) * 100.0)).unwrap_or_else(|| "-".into());
        let sp = cap.map(|c| format!("{:.2}x", r.mean_iter_s / c)).unwrap_or_else(|| "-".into());
        let acc = r.partition_accuracy.map(|x| format!("{:.0}%", x * 100.0)).unwrap_or_else(|| "-".into());
        println!(
            "  {:<16} {:>11} {:>10} {:>18} {:>10} {:>10} {:>12.2}",
            r.label,
            ms(r.mean_iter_s),
            over,
            sp,
            acc,
            r.profiling_activations,
            r.ckpt_bytes_per_iter / 1e9
        );
    }
    if let Some(p) = &a.svg {
        let pick = rep.results.iter().find(|r| r.strategy == Strategy::Capricorn).or(rep.results.last());
        if let Some(r) = pick {
            let (dag, tr) = r.trace.as_ref().expect("trace");
            // draw iterations 2 and 3
            let start = |it: usize| dag.ops.iter().position(|o| o.name == format!("it{it} start")).map(|i| tr.ops[i].end);
            let range = match (start(2), start(4)) {
                (Some(x), Some(y)) => Some((x, y)),
                _ => None,
            };
            write_svg(p, &svg::timeline(dag, tr, &format!("{}: {} on {}", r.strategy.name(), m.name, c.name), range))?;
        }
    }
    if let Some(p) = &a.json {
        write_json(p, &rep)?;
    }
    Ok(())
}

/// The paper-scale setting `bench ckpt` takes its storage bandwidth from.
pub const PAPER_MODEL: &str = "configs/models/moe-gpt-32e.toml";
/// Its cluster.
pub const PAPER_CLUSTER: &str = "configs/clusters/4x8-a100.toml";

/// One checkpoint's write time to the persistent tier over one training iteration at paper
/// scale (moe-gpt-32e on 4 x 8 A100, simulated without checkpoints; each device's share of its
/// node's storage bandwidth), with a line saying where it comes from. `root`: the repository
/// (where `configs/` is).
pub fn paper_write_ratio(root: &std::path::Path) -> Result<(f64, String)> {
    let (m, c) = load_inputs(&root.join(PAPER_MODEL), &root.join(PAPER_CLUSTER), None, None)?;
    let opts = CkptOptions { iterations: 4, ..Default::default() };
    let rep = ckpt::simulate(&m, &c, &[Strategy::None], &opts)?;
    let iter_s = rep.results.first().map(|r| r.mean_iter_s).context("the simulator returned no row")?;
    let per_device = c.host.storage_gbyte_s * 1e9 / f64::from(c.devices_per_node.max(1));
    let write_s = rep.state_bytes_per_device / per_device;
    let ratio = write_s / iter_s;
    Ok((
        ratio,
        format!(
            "{} on {}: {:.2} GB per device written at {:.2} GB/s (the node's {:.1} GB/s shared by {} devices) = {:.1} s, against a {:.2} s iteration: ratio {:.2}",
            m.name,
            c.name,
            rep.state_bytes_per_device / 1e9,
            per_device / 1e9,
            c.host.storage_gbyte_s,
            c.devices_per_node,
            write_s,
            iter_s,
            ratio
        ),
    ))
}

/// The repository root for `config` (the nearest ancestor of the config, or of the working
/// directory, holding the paper-scale cluster description).
pub fn repo_root(config: &std::path::Path) -> std::path::PathBuf {
    let abs = std::fs::canonicalize(config).unwrap_or_else(|_| config.to_path_buf());
    let cwd = std::env::current_dir().unwrap_or_default();
    abs.ancestors()
        .chain(cwd.ancestors())
        .find(|d| d.join(PAPER_CLUSTER).exists())
        .map(std::path::Path::to_path_buf)
        .unwrap_or(cwd)
}

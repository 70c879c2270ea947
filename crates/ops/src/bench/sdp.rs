//! `ironweave bench sdp`: sharded data parallelism on the emulated cluster, every strategy in one
//! invocation on the same training (same seed and data): replicated data parallelism, FSDP
//! FULL_SHARD with its all-rank group on each inter-host link in turn, HYBRID_SHARD, and HSDP
//! with the plan `ironweave plan sdp` makes for this bed. The bed's links are probed first (the
//! path between two ranks of a host too) and the planner learns them from the probe and the
//! ranks' compute from the replicated run; every row then carries the planner's prediction
//! beside the measurement, and the counters that show the mechanism: bytes each inter-host
//! link carried per iteration (its own kernel counter), and how much of the links' summed
//! capacity the collective phases used.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{bail, Context, Result};
use ironweave_plan::{sdp as psdp, ClusterDesc, CostModel, MeasuredOp, ModelDesc, ProfileTable};
use serde::{Deserialize, Serialize};

use crate::progress::{Mode, Progress};
use crate::rundir::median_after;
use crate::rundir::{ComputeCounters, SdpReport};
use crate::train::args::{ComputeArgs, TrainArgs};

/// `ironweave bench sdp`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct SdpBenchArgs {
    /// Training configuration (a dense GPT).
    #[arg(long, default_value = "configs/gpt-sdp.toml")]
    pub config: PathBuf,
    /// The emulated cluster (brought up if down, and down again after).
    #[arg(long, default_value = "topologies/2host-2link.toml")]
    pub topology: PathBuf,
    #[arg(long, default_value_t = 2)]
    pub ranks_per_host: usize,
    /// The workload as the planner sees it.
    #[arg(long, default_value = "configs/models/gpt-sdp-cpu.toml")]
    pub model: PathBuf,
    /// The bed as the planner sees it (its links' figures replaced by the probe's).
    #[arg(long, default_value = "configs/clusters/emulated-2host-2link.toml")]
    pub cluster: PathBuf,
    /// Iterations per run (the median skips the first two).
    #[arg(long, default_value_t = 8)]
    pub iters: u64,
    /// Seconds of streaming per link in the probe.
    #[arg(long, default_value_t = 2.0)]
    pub probe_seconds: f64,
    /// Where each run's report, the probe and the plan go.
    #[arg(long, default_value = "target/bench/sdp")]
    pub out: PathBuf,
    /// Also write the rows here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// How every row computes (cpu, or emulated accelerators: docs/EMULATION.md).
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// One strategy's row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// `replicated`, `full (a)`, `full (b)`, `hybrid`, `hsdp`.
    pub strategy: String,
    /// Median iteration time after two warm-up iterations, seconds.
    pub iter_time_s: f64,
    /// Parameters, gradients and both Adam moments each rank holds between iterations.
    pub state_bytes_per_rank: u64,
    /// Link → bytes it carried per iteration (both directions, counted by the kernel on every
    /// host's end of it).
    pub link_bytes: BTreeMap<String, u64>,
    /// Inter-host bytes per iteration / (the collective phases' time x the summed rates of
    /// every inter-host link, both directions).
    pub link_utilization: f64,
    /// Median seconds per iteration during which a collective of rank 0 was on the wire.
    pub comm_busy_s: f64,
    /// Median seconds of rank 0's compute per iteration.
    pub compute_s: f64,
    /// The planner's cost model on the probed rates and the measured compute (None for
    /// `replicated`, which the planner does not model).
    pub predicted_iter_time_s: Option<f64>,
    /// Predicted / measured.
    pub predicted_over_measured: Option<f64>,
    /// The faster single-link `full` row's iteration time over this row's.
    pub speedup_vs_full: f64,
    /// The strongest baseline's (every row but hsdp: replicated, full on either link or
    /// striped, hybrid on either link) iteration time over this row's.
    #[serde(default)]
    pub speedup_vs_best_baseline: f64,
    /// CPU the ranks' communication threads used over the run (collective threads, TCP
    /// readers and senders, striped lanes; all ranks) per byte the inter-host links carried,
    /// ns. On this bed every byte's CPU is paid on the cores that compute.
    #[serde(default)]
    pub cpu_ns_per_byte: Option<f64>,
    /// The communication threads' share of the processes' whole CPU over the run (a part of
    /// it: at most 1).
    #[serde(default)]
    pub comm_cpu_share: Option<f64>,
    /// Loss of the last iteration (the same in every row: the same training).
    pub final_loss: f32,
    /// The links of the all-rank part and of the cross-host all-reduce.
    pub links: (String, String),
    /// How the ranks computed; the machine's CPU busy share and each rank's device-busy
    /// share during the steady iterations.
    #[serde(flatten)]
    pub compute: ComputeCounters,
}

struct Variant {
    name: &'static str,
    sdp: &'static str,
    links: Option<&'static str>,
}

/// The rows, in table order. `full (striped a+b)` is FULL_SHARD on the transport's striping
/// (both links at once, balanced dynamically): FSDP at its best on this bed; `hybrid (a)` puts
/// HYBRID_SHARD's cross-host all-reduce on the faster link. HSDP must beat the strongest.
const VARIANTS: [Variant; 7] = [
    Variant { name: "replicated", sdp: "replicated", links: None },
    Variant { name: "full (a)", sdp: "full", links: Some("full=a,inter=b") },
    Variant { name: "full (b)", sdp: "full", links: Some("full=b,inter=a") },
    Variant { name: "full (striped a+b)", sdp: "full", links: Some("full=a+b,inter=b") },
    Variant { name: "hybrid", sdp: "hybrid", links: Some("full=a,inter=b") },
    Variant { name: "hybrid (a)", sdp: "hybrid", links: Some("full=b,inter=a") },
    // links: the plan's (see `run_all`)
    Variant { name: "hsdp", sdp: "hsdp", links: None },
];

/// Index of the hsdp row in [`VARIANTS`].
const HSDP: usize = 6;

/// Runs the bench; returns the rows.
pub fn bench(a: &SdpBenchArgs) -> Result<Vec<Row>> {
    if a.iters < 3 {
        bail!("--iters {} leaves no iteration after the two warm-up ones: use 3 or more", a.iters);
    }
    let topo = crate::cluster::Topology::load(&a.topology)?;
    if topo.hosts != 2 || topo.links.len() != 2 {
        bail!(
            "bench sdp runs on two hosts joined by two links (topologies/2host-2link.toml); {} has {} hosts and {} links",
            a.topology.display(),
            topo.hosts,
            topo.links.len()
        );
    }
    // fail on bad planner inputs before any run
    let model = crate::plan::load_model(&a.model, None)?;
    crate::plan::load_cluster(&a.cluster)?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let rows = crate::cluster::with_up(&topo, "bench sdp", || run_all(a, &topo, &model))?;
    print_table(&rows);
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&serde_json::json!({ "rows": rows }))?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(rows)
}

fn probe(a: &SdpBenchArgs, path: &Path) -> Result<()> {
    let exe = std::env::current_exe().context("locating the ironweave binary")?;
    let st = std::process::Command::new(exe)
        .args(["cluster", "probe", "--topology"])
        .arg(&a.topology)
        .args(["--ranks-per-host", &a.ranks_per_host.to_string(), "--seconds", &a.probe_seconds.to_string(), "--json"])
        .arg(path)
        .stdout(std::process::Stdio::null())
        .status()
        .context("starting the probe")?;
    if !st.success() {
        bail!("probing the bed failed ({st})");
    }
    Ok(())
}

/// The planner's inputs on this bed: the cluster with the probe's figures and the ranks'
/// compute as measured (`compute_s` per iteration on one rank).
fn planner_inputs(a: &SdpBenchArgs, probe: &Path, model: &ModelDesc, compute_s: f64) -> Result<(ClusterDesc, ProfileTable)> {
    let mut c = crate::plan::load_cluster(&a.cluster)?;
    crate::plan::apply_probe(&mut c, Some(probe))?;
    // the FLOPs the cost model counts per iteration: its compute time at the described speed
    let ls = psdp::layers(model, &c, &CostModel::new(&c))?;
    let flops = ls.iter().map(|l| l.compute_s).sum::<f64>() * c.flops();
    let mut prof = ProfileTable::default();
    prof.ops.insert("layer".into(), MeasuredOp { flops, seconds: compute_s });
    Ok((c, prof))
}

/// `c` with its inter-node links merged into one as fast as all of them (the transport's
/// striping, at its ideal) and as slow to start as the slowest.
fn striped(c: &ClusterDesc) -> ClusterDesc {
    use ironweave_plan::desc::Scope;
    let mut out = c.clone();
    let inter: Vec<_> = c.links.iter().filter(|l| l.scope == Scope::InterNode).cloned().collect();
    if let Some(first) = inter.first() {
        let mut one = first.clone();
        one.name = inter.iter().map(|l| l.name.as_str()).collect::<Vec<_>>().join("+");
        one.bandwidth_gbyte_s = inter.iter().map(|l| l.bandwidth_gbyte_s).sum();
        one.latency_us = inter.iter().map(|l| l.latency_us).fold(0.0, f64::max);
        out.links.retain(|l| l.scope != Scope::InterNode);
        out.links.push(one);
    }
    out
}

/// Predicted iteration with every layer's all-device share `g` (1: full, 0: hybrid).
fn predict(model: &ModelDesc, c: &ClusterDesc, prof: &ProfileTable, g: &[f64]) -> Result<f64> {
    let mut cm = CostModel::new(c);
    cm.profile = Some(prof);
    let ls = psdp::layers(model, c, &cm)?;
    Ok(ls.iter().zip(g.iter().copied().chain(std::iter::repeat(1.0))).map(|(l, x)| l.time(x)).sum())
}

fn run_all(a: &SdpBenchArgs, topo: &crate::cluster::Topology, model: &ModelDesc) -> Result<Vec<Row>> {
    let ranks = topo.hosts * a.ranks_per_host;
    let progress = Progress::new("bench sdp: step", 0, VARIANTS.len() as u64 + 2, Mode::detect());
    let probe_path = a.out.join("probe.json");
    probe(a, &probe_path)?;
    progress.step(1, &format!("probed the links ({})", probe_path.display()));
    let rates: Vec<f64> = topo.links.iter().map(|l| Ok(ironweave_units::parse_rate(&l.rate)? as f64)).collect::<Result<_>>()?;
    let plan_path = a.out.join("plan.json");
    let mut measured: Vec<(SdpReport, Vec<u64>)> = Vec::new();
    let mut planned: Option<(ClusterDesc, ProfileTable, psdp::SdpPlan)> = None;
    for (i, v) in VARIANTS.iter().enumerate() {
        if v.sdp == "hsdp" {
            // plan on this bed: probed links, the replicated run's compute
            let (c, prof) = planner_inputs(a, &probe_path, model, median_after(&measured[0].0.compute_s, 2))?;
            // the same compute for `plan sdp --profile` and `simulate sdp --profile`
            let m = &prof.ops["layer"];
            std::fs::write(
                a.out.join("profile.toml"),
                format!(
                    "# one rank's compute per iteration, measured by the replicated row of `ironweave bench sdp`\n[ops.layer]\nflops = {:e}\nseconds = {:e}\n",
                    m.flops, m.seconds
                ),
            )?;
            let mut cm = CostModel::new(&c);
            cm.profile = Some(&prof);
            let plan = psdp::plan(model, &c, &cm, &psdp::SdpOptions::default())?;
            std::fs::write(&plan_path, serde_json::to_vec_pretty(&serde_json::json!({ "plan": plan }))?)?;
            progress.step(
                i as u64 + 1,
                &format!(
                    "planned ({}): {:.1}% of the parameters sharded within the host, the all-rank part on {} and the cross-host all-reduce on {}, predicted {:.1} ms",
                    plan_path.display(),
                    plan.node_fraction_overall * 100.0,
                    plan.inter_link,
                    plan.rail_link,
                    plan.predicted_iter_s * 1e3
                ),
            );
            planned = Some((c, prof, plan));
        }
        let dir = a.out.join(v.name.replace([' ', '(', ')'], ""));
        let args = TrainArgs {
            ranks,
            ckpt: "none".into(),
            topology: Some(a.topology.clone()),
            ranks_per_host: a.ranks_per_host,
            iters: Some(a.iters),
            report_dir: dir.clone(),
            quiet: true,
            sdp: Some(v.sdp.into()),
            sdp_plan: (v.sdp == "hsdp").then(|| plan_path.clone()),
            // hsdp's parts on the links its plan assigned them (the planner solves both ways)
            sdp_links: match (&planned, v.sdp) {
                (Some((_, _, plan)), "hsdp") => Some(format!("full={},inter={}", plan.inter_link, plan.rail_link)),
                _ => v.links.map(String::from),
            },
            compute: a.compute.clone(),
            ..TrainArgs::new(&a.config)
        };
        let before = crate::cluster::link_tx_bytes(topo)?;
        let code = crate::train::sdp::run(&args)?;
        if code != 0 {
            bail!("the {} run failed (status {code}); see its output above", v.name);
        }
        let after = crate::cluster::link_tx_bytes(topo)?;
        // per link, summed over the hosts' ends
        let bytes: Vec<u64> =
            (0..topo.links.len()).map(|l| (0..topo.hosts).map(|h| after[h][l].saturating_sub(before[h][l])).sum()).collect();
        let rep: SdpReport = serde_json::from_slice(&std::fs::read(dir.join("report.json"))?)
            .with_context(|| format!("reading {}", dir.join("report.json").display()))?;
        progress.step(i as u64 + 2, &format!("{}: median iteration {:.1} ms", v.name, median_after(&rep.iter_time_s, 2) * 1e3));
        measured.push((rep, bytes));
    }
    let (c, prof, plan) = planned.context("the hsdp row was not planned")?;
    let nl = model.layers as usize + 1;
    let mut c_b = c.clone();
    // full on link b: the cost model with b as the only inter-node link
    c_b.links.retain(|l| l.name != topo.links[0].name);
    // hybrid with its cross-host all-reduce on a: the cost model with a as the only
    // inter-node link (the host group's shards stay within the host)
    let mut c_a = c.clone();
    c_a.links.retain(|l| l.name != topo.links[1].name);
    let predictions: Vec<Option<f64>> = vec![
        None,
        Some(predict(model, &c_a, &prof, &vec![1.0; nl])?),
        Some(predict(model, &c_b, &prof, &vec![1.0; nl])?),
        // FULL_SHARD striped over both links: one inter-host link as fast as both together
        Some(predict(model, &striped(&c), &prof, &vec![1.0; nl])?),
        Some(predict(model, &c_b, &prof, &vec![0.0; nl])?),
        Some(predict(model, &c_a, &prof, &vec![0.0; nl])?),
        Some(plan.predicted_iter_s),
    ];
    let iter_of = |r: &SdpReport| median_after(&r.iter_time_s, 2);
    let full_best = iter_of(&measured[1].0).min(iter_of(&measured[2].0));
    let best_baseline =
        measured.iter().enumerate().filter(|(i, _)| *i != HSDP).map(|(_, (r, _))| iter_of(r)).fold(f64::INFINITY, f64::min);
    let capacity: f64 = rates.iter().sum::<f64>() * 2.0;
    let rows = VARIANTS
        .iter()
        .zip(measured)
        .zip(predictions)
        .map(|((v, (rep, bytes)), pred)| {
            let it = iter_of(&rep);
            let n = rep.iter_time_s.len().max(1) as u64;
            let per_iter: Vec<u64> = bytes.iter().map(|b| b / n).collect();
            let busy = median_after(&rep.comm_busy_s, 2);
            let total: u64 = per_iter.iter().sum();
            Row {
                strategy: v.name.into(),
                iter_time_s: it,
                state_bytes_per_rank: rep.state_bytes_per_rank,
                link_bytes: topo.links.iter().map(|l| l.name.clone()).zip(per_iter).collect(),
                link_utilization: if busy > 0.0 { total as f64 / (busy * capacity) } else { 0.0 },
                comm_busy_s: busy,
                compute_s: median_after(&rep.compute_s, 2),
                predicted_iter_time_s: pred,
                predicted_over_measured: pred.map(|p| p / it),
                speedup_vs_full: full_best / it,
                speedup_vs_best_baseline: best_baseline / it,
                cpu_ns_per_byte: {
                    let b: u64 = bytes.iter().sum();
                    (b > 0 && rep.comm_cpu_ns > 0).then(|| rep.comm_cpu_ns as f64 / b as f64)
                },
                comm_cpu_share: (rep.process_cpu_ns > 0).then(|| rep.comm_cpu_ns as f64 / rep.process_cpu_ns as f64),
                final_loss: rep.loss.last().copied().unwrap_or(f32::NAN),
                links: rep.links.clone(),
                compute: rep.compute.clone(),
            }
        })
        .collect();
    progress.finish();
    Ok(rows)
}

fn print_table(rows: &[Row]) {
    println!("compute: {}\n", rows.first().map_or("cpu", |r| r.compute.mode_or_cpu()));
    println!(
        "| strategy | iteration (ms) | vs faster full | vs best baseline | predicted (ms) | predicted / measured | state per rank (MB) | link a (MB/iter) | link b (MB/iter) | link utilization | collective phases (ms) | compute (ms) | comm CPU per byte | final loss | machine CPU busy | device busy (mean of ranks) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let mb = |k: &str| r.link_bytes.get(k).map_or("-".into(), |b| format!("{:.1}", *b as f64 / 1e6));
        println!(
            "| {} | {:.1} | {:.2}x | {:.2}x | {} | {} | {:.1} | {} | {} | {:.2} | {:.1} | {:.1} | {} | {:.4} | {} | {} |",
            r.strategy,
            r.iter_time_s * 1e3,
            r.speedup_vs_full,
            r.speedup_vs_best_baseline,
            r.predicted_iter_time_s.map_or("-".into(), |p| format!("{:.1}", p * 1e3)),
            r.predicted_over_measured.map_or("-".into(), |p| format!("{p:.2}")),
            r.state_bytes_per_rank as f64 / 1e6,
            mb("a"),
            mb("b"),
            r.link_utilization,
            r.comm_busy_s * 1e3,
            r.compute_s * 1e3,
            r.cpu_ns_per_byte.map_or("-".into(), |c| format!("{c:.2} ns")),
            r.final_loss,
            r.compute.cpu_cell(),
            r.compute.device_cell()
        );
    }
}

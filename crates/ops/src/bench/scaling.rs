//! `ironweave bench scaling`: the same training at several rank counts in one invocation —
//! tokens/s, efficiency against a lone single-threaded rank, and the share of data-parallel
//! gradient communication hidden behind the backward pass; on an emulated cluster, the
//! bucketed and the single-bucket gradient paths side by side.

use std::path::PathBuf;

use crate::error::{bail, Context, Result};
use serde::Serialize;

use crate::progress::{Mode, Progress};
use crate::rundir::Report;
use crate::train::args::TrainArgs;
use crate::train::moe::run;

/// `ironweave bench scaling`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ScalingArgs {
    /// Training configuration.
    #[arg(long, default_value = "configs/moe-small.toml")]
    pub config: PathBuf,
    /// Rank counts to measure (on one host; ignored with --topology).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub ranks: Vec<usize>,
    /// Iterations per run (the first two are warm-up and not averaged).
    #[arg(long, default_value_t = 8)]
    pub iters: u64,
    /// Run on the emulated cluster of this topology file instead: bucketed vs single bucket.
    #[arg(long)]
    pub topology: Option<PathBuf>,
    /// Ranks per emulated host (with --topology).
    #[arg(long, default_value_t = 1)]
    pub ranks_per_host: usize,
    /// Also run every rank count above 1 with as many threads per rank as cores (the behaviour
    /// before threads were chosen per rank), for comparison.
    #[arg(long)]
    pub oversubscribed: bool,
    /// Gradient bucket size in KiB for the bucketed rows (default: the config's).
    #[arg(long)]
    pub bucket_kb: Option<usize>,
    /// Where the runs' reports, scaling.json and scaling.md go.
    #[arg(long, default_value = "target/bench/scaling")]
    pub out: PathBuf,
    /// Also write the rows here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One row.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub label: String,
    pub ranks: usize,
    pub threads_per_rank: usize,
    pub grad_path: &'static str,
    pub grad_buckets: usize,
    pub iter_time_s: f64,
    pub tokens_per_s: f64,
    /// tokens/s ÷ (min(ranks, cores) × tokens/s of one rank with one thread).
    pub efficiency: f64,
    /// Share of data-parallel communication time overlapped by backward compute.
    pub comm_hidden_fraction: Option<f64>,
    /// Seconds of data-parallel communication per iteration (rank 0).
    pub dp_comm_s: f64,
}

/// One training run without checkpoints; `on_cluster`: on the emulated cluster of --topology.
fn one(
    a: &ScalingArgs,
    progress: &mut (Progress, u64),
    name: &str,
    ranks: usize,
    threads: Option<usize>,
    bucket_kb: Option<usize>,
    on_cluster: bool,
) -> Result<Report> {
    let dir = a.out.join(name);
    let args = TrainArgs {
        ranks,
        ckpt: "none".into(),
        topology: if on_cluster { a.topology.clone() } else { None },
        ranks_per_host: a.ranks_per_host,
        iters: Some(a.iters),
        report_dir: dir.clone(),
        persist_every: 0,
        threads_per_rank: threads,
        bucket_kb,
        quiet: true,
        ..TrainArgs::new(&a.config)
    };
    let code = run(&args)?;
    if code != 0 {
        bail!("the {name} run failed (status {code}); see its output above");
    }
    let p = dir.join("report.json");
    let r: Report = serde_json::from_slice(&std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?)?;
    progress.1 += 1;
    progress.0.step(progress.1, &format!("{name}: {:.0} tokens/s", r.tokens_per_s()));
    Ok(r)
}

/// Runs every row; prints and writes the table.
pub fn bench(a: &ScalingArgs) -> Result<Vec<Row>> {
    if a.iters < 3 {
        bail!("--iters must be at least 3 (two warm-up iterations are not averaged)");
    }
    if a.ranks.is_empty() || a.ranks.contains(&0) {
        bail!("--ranks takes rank counts of at least 1, e.g. 1,2,4");
    }
    let cores = ironweave_transport::threads::available_cores();
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let runs = 1 + match &a.topology {
        Some(_) => 2,
        None => a.ranks.len() + if a.oversubscribed { a.ranks.iter().filter(|&&n| n > 1).count() } else { 0 },
    };
    let mut pr = (Progress::new("bench scaling: run", 0, runs as u64, Mode::detect()), 0u64);
    let pr = &mut pr;
    // the reference: one rank, one thread
    let reference = one(a, pr, "r1-t1", 1, Some(1), None, false)?;
    let base = reference.tokens_per_s();
    let row = |label: String, r: &Report, path: &'static str| Row {
        label,
        ranks: r.ranks,
        threads_per_rank: r.threads_per_rank,
        grad_path: if r.grad_buckets == 0 { "-" } else { path },
        grad_buckets: r.grad_buckets,
        iter_time_s: r.mean_iter_s(),
        tokens_per_s: r.tokens_per_s(),
        efficiency: r.tokens_per_s() / (r.ranks.min(cores) as f64 * base),
        comm_hidden_fraction: r.comm_hidden_fraction(),
        dp_comm_s: Report::steady(&r.dp_comm_s, 2),
    };
    let mut rows = vec![row("1 rank, 1 thread (reference)".into(), &reference, "-")];
    match &a.topology {
        None => {
            for &n in &a.ranks {
                let r = one(a, pr, &format!("r{n}"), n, None, a.bucket_kb, false)?;
                rows.push(row(format!("{n} rank{}, threads chosen per rank", if n == 1 { "" } else { "s" }), &r, "bucketed"));
            }
            if a.oversubscribed {
                for &n in a.ranks.iter().filter(|&&n| n > 1) {
                    let r = one(a, pr, &format!("r{n}-t{cores}"), n, Some(cores), a.bucket_kb, false)?;
                    rows.push(row(format!("{n} ranks, {cores} threads each (cores per rank)"), &r, "bucketed"));
                }
            }
        }
        Some(t) => {
            let topo = crate::cluster::Topology::load(t)?;
            let n = topo.hosts * a.ranks_per_host.max(1);
            let b = one(a, pr, "cluster-bucketed", n, None, a.bucket_kb, true)?;
            let s = one(a, pr, "cluster-single", n, None, Some(0), true)?;
            let label = |what: &str| format!("{n} ranks on {} ({} hosts), {what}", topo.name, topo.hosts);
            rows.push(row(label("bucketed during backward"), &b, "bucketed"));
            rows.push(row(label("one bucket after backward"), &s, "single"));
        }
    }
    pr.0.finish();
    let md = table(&rows, a.topology.is_some());
    print!("{md}");
    std::fs::write(a.out.join("scaling.md"), &md)?;
    let json = serde_json::to_vec_pretty(&rows)?;
    std::fs::write(a.out.join("scaling.json"), &json)?;
    if let Some(p) = &a.json {
        std::fs::write(p, &json).with_context(|| format!("writing {}", p.display()))?;
    }
    eprintln!("wrote {} and {}", a.out.join("scaling.md").display(), a.out.join("scaling.json").display());
    Ok(rows)
}

fn table(rows: &[Row], cluster: bool) -> String {
    let mut md = String::from(
        "| run | ranks | threads/rank | gradient path | buckets | mean iteration | tokens/s | efficiency | DP comm / iter | comm hidden |\n\
         |---|---:|---:|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} ms | {:.0} | {:.2} | {:.1} ms | {} |\n",
            r.label,
            r.ranks,
            r.threads_per_rank,
            r.grad_path,
            r.grad_buckets,
            r.iter_time_s * 1e3,
            r.tokens_per_s,
            r.efficiency,
            r.dp_comm_s * 1e3,
            r.comm_hidden_fraction.map(|h| format!("{:.0}%", h * 100.0)).unwrap_or_else(|| "-".into()),
        ));
    }
    if cluster {
        if let (Some(b), Some(s)) =
            (rows.iter().find(|r| r.grad_path == "bucketed"), rows.iter().find(|r| r.grad_path == "single"))
        {
            md.push_str(&format!(
                "\nbucketed vs single bucket: {:.2}x iteration speed\n",
                s.iter_time_s / b.iter_time_s.max(1e-12)
            ));
        }
    }
    md
}

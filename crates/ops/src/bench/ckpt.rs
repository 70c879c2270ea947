//! `ironweave bench ckpt`: every checkpoint strategy on the same training (same seed and
//! data), one run after the other, in one invocation; with `--topology`, on the emulated
//! cluster (brought up if needed), the inter-host links' own byte counters read around each
//! run. Rows say what each strategy cost against `none` and against each other, and carry the
//! counters that show the mechanism: checkpoint bytes on the inter-host links, bytes written to
//! the (emulated remote) storage, partition accuracy, profiling activations.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::error::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::progress::{Mode, Progress};
use crate::rundir::{median_after, ComputeCounters, Report};
use crate::train::args::{parse_strategy, ComputeArgs, TrainArgs};
use crate::train::moe::run;

/// The five strategies of the paper's comparison.
pub const FIVE: [&str; 5] = ["none", "blocking", "async", "gemini", "capricorn"];

/// `--strategies gemini-sweep`: Gemini's fill (0.7 to 1.0, chunks sized from the spans) and
/// two fixed chunk sizes at the whole span.
pub const GEMINI_SWEEP: [&str; 6] =
    ["gemini-fill0.7", "gemini-fill0.8", "gemini-fill0.9", "gemini", "gemini-chunk1M", "gemini-chunk4M"];

/// `ironweave bench ckpt`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct CkptBenchArgs {
    /// Training configuration.
    #[arg(long, default_value = "configs/moe-wide.toml")]
    pub config: PathBuf,
    /// Strategies to compare (`all`: none, blocking, async, gemini, capricorn,
    /// capricorn-always, capricorn-sparse, and capricorn-multilink when the topology has
    /// several links; `gemini-sweep`: Gemini's span fill 0.7-1.0 and chunk sizes,
    /// `gemini-fill0.8-chunk1M` one of them).
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub strategies: Vec<String>,
    /// Ranks.
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Iterations per strategy (the first two are warm-up and not counted).
    #[arg(long, default_value_t = 8)]
    pub iters: u64,
    /// Run on the emulated cluster of this topology file (brought up if it is not).
    #[arg(long)]
    pub topology: Option<PathBuf>,
    /// Ranks per emulated host (with --topology).
    #[arg(long, default_value_t = 2)]
    pub ranks_per_host: usize,
    /// Where the per-strategy reports, ckpt.json and ckpt.md go.
    #[arg(long, default_value = "target/bench/ckpt")]
    pub out: PathBuf,
    /// Also write the rows here (JSON).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Bandwidth of the emulated remote storage per host (`200mbit`, `1gbit`), or `auto`: the
    /// paper-scale ratio of one checkpoint's write time to one iteration (simulated on
    /// configs/clusters/4x8-a100.toml) applied to the measured `none` iteration, or `unlimited`
    /// (the local disk).
    #[arg(long, default_value = "auto")]
    pub storage_rate: String,
    /// Run every strategy this many times, interleaved (none, blocking, ..., none, blocking,
    /// ...); rows pool the rounds' steady iterations.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// One strategy's row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub strategy: String,
    /// Median iteration time after two warm-up iterations (pooled over the rounds), seconds.
    pub iter_time_s: f64,
    /// The same per round (their spread is the run-to-run noise).
    pub round_iter_time_s: Vec<f64>,
    /// Mean of the same iterations (pooled over the rounds): what a run costs, every K-th
    /// iteration's extra work included (`capricorn-sparse` snapshots every K). Targets are
    /// judged on it.
    pub mean_iter_s: f64,
    /// `mean_iter_s / none's - 1` (None without a `none` row).
    pub overhead_vs_none: Option<f64>,
    /// `iter_time_s / none's - 1`: the median's view, beside the mean's.
    #[serde(default)]
    pub overhead_vs_none_median: Option<f64>,
    /// Other strategy → its mean iteration time over this one's (above 1: this one is faster).
    pub speedup_vs: BTreeMap<String, f64>,
    /// Checkpoint bytes that crossed the inter-host links, counted on the links: this run's
    /// link bytes minus the `none` run's (same training traffic). None off the emulated cluster.
    pub ckpt_bytes_inter_host: Option<u64>,
    /// Every byte the inter-host links carried during the run, per link (training included).
    pub link_bytes: BTreeMap<String, u64>,
    /// Replica bytes the engine sent to holders on other hosts (its own count).
    pub ckpt_bytes_inter_host_sent: u64,
    /// Replica bytes per link the engine used (training link first).
    pub ckpt_bytes_per_link: Vec<u64>,
    /// Bytes written to the persistent tier (emulated remote storage).
    pub ckpt_bytes_storage: u64,
    /// Snapshots the engine did not take because the links did not keep up (all ranks, all
    /// rounds): a row whose strategy skipped snapshots checkpointed less often than asked.
    pub ckpt_snapshots_skipped: u64,
    /// The engine's memory passes per state byte as a sender and per replica byte as a holder
    /// (bytes it read and wrote over the bytes they were for; a copy is 2), all ranks and
    /// rounds; None where nothing was snapshotted or received.
    #[serde(default)]
    pub memory_passes: (Option<f64>, Option<f64>),
    /// The emulated storage's bandwidth per host, bytes/s (None: the local disk, unpaced).
    pub storage_bytes_per_s_per_host: Option<f64>,
    /// Mean time per steady iteration the training thread spent inside the engine, seconds.
    pub exposed_ckpt_s: f64,
    /// Iterations per checkpoint written to the persistent tier (storage strategies; 1: every
    /// iteration; `async-sustained` skips those its storage cannot take).
    #[serde(default)]
    pub storage_interval_iters: Option<f64>,
    /// CPU checkpointing cost per replicated byte, every thread counted, ns: the processes'
    /// whole CPU minus the `none` run's of the same round, summed over the rounds, over the
    /// replicated bytes (None: nothing replicated, or no `none` row). Paid on the cores that
    /// train; includes the snapshot copy, the replica threads, and the TCP readers that decode
    /// replica frames.
    #[serde(default)]
    pub ckpt_cpu_ns_per_byte: Option<f64>,
    /// The same per round (its spread is the noise of the difference).
    #[serde(default)]
    pub ckpt_cpu_ns_per_byte_rounds: Vec<f64>,
    /// The engine's replica sender and receiver threads alone, ns per replicated byte (a part
    /// of the above: socket reads on the transport's reader threads are not in it).
    #[serde(default)]
    pub replica_threads_cpu_ns_per_byte: Option<f64>,
    /// Replica bytes per iteration per rank (the engine's count over the run, every holder
    /// counted): what `capricorn-sparse` cuts.
    #[serde(default)]
    pub ckpt_bytes_per_iter: f64,
    pub partition_accuracy: Option<f64>,
    /// Every holder's view: the share of received chunks whose wire time fell inside an idle
    /// window of its own link (pooled over the rounds).
    #[serde(default)]
    pub wire_accuracy: Option<f64>,
    pub profiling_activations: u64,
    pub iterations: u64,
    pub state_bytes_per_rank: u64,
    pub last_committed_iter: Option<u64>,
    /// How the ranks computed; the machine's CPU busy share and each rank's device-busy share
    /// during the steady iterations, mean over the rounds.
    #[serde(flatten)]
    pub compute: ComputeCounters,
}

/// The strategies to run, `none` first (the others' baseline and the storage rate's).
pub fn expand(strategies: &[String], links: usize) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    for s in strategies {
        let s = s.trim();
        if s == "all" {
            out.extend(FIVE.iter().map(|x| x.to_string()));
            // the reference speculative activation is measured against
            out.push("capricorn-always".into());
            // fewer bytes: a snapshot every 4 iterations, a quarter per iteration
            out.push("capricorn-sparse".into());
            if links > 1 {
                out.push("capricorn-multilink".into());
            }
        } else if s == "gemini-sweep" {
            // Gemini at its best: the fill of its spans and its chunk size swept, the table says
            // which row was best
            out.extend(GEMINI_SWEEP.iter().map(|x| x.to_string()));
        } else {
            parse_strategy(s)?;
            if s == "capricorn-multilink" && links < 2 {
                bail!("capricorn-multilink needs a topology with two or more links (topologies/2host-2link.toml)");
            }
            out.push(s.to_string());
        }
    }
    let mut seen = Vec::new();
    out.retain(|s| {
        let new = !seen.contains(s);
        seen.push(s.clone());
        new
    });
    out.sort_by_key(|s| s != "none");
    if out.is_empty() {
        bail!("--strategies is empty");
    }
    Ok(out)
}

/// Runs the benchmark; returns the rows.
pub fn bench(a: &CkptBenchArgs) -> Result<Vec<Row>> {
    if a.iters < 3 {
        bail!("--iters must be at least 3 (two warm-up iterations are not counted)");
    }
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let topo = a.topology.as_deref().map(crate::cluster::Topology::load).transpose()?;
    let links = topo.as_ref().map_or(1, |t| t.links.len());
    let strategies = expand(&a.strategies, links)?;
    let storage_fixed: Option<Option<f64>> = match a.storage_rate.as_str() {
        "auto" => None,
        "unlimited" => Some(None),
        r => {
            // bytes per second
            let rate =
                ironweave_units::parse_rate(r).map_err(|e| crate::error::err!("--storage-rate: {e} (or auto, unlimited)"))?;
            if rate == 0 {
                bail!("--storage-rate must be above 0");
            }
            Some(Some(rate as f64))
        }
    };
    if storage_fixed.is_none() && strategies.first().map(String::as_str) != Some("none") {
        bail!("--storage-rate auto derives the rate from the `none` run: add none to --strategies or give a rate");
    }
    let ranks_per_host = if topo.is_some() { a.ranks_per_host.max(1) } else { a.ranks.max(1) };
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let go = || run_all(a, topo.as_ref(), &strategies, storage_fixed, ranks_per_host);
    match &topo {
        Some(t) => crate::cluster::with_up(t, "bench ckpt", go),
        None => go(),
    }
}

/// One run's report and the inter-host links' byte counts during it, `[host][link]`.
type RunOf = (Report, Option<Vec<Vec<u64>>>);

fn run_all(
    a: &CkptBenchArgs,
    topo: Option<&crate::cluster::Topology>,
    strategies: &[String],
    storage_fixed: Option<Option<f64>>,
    ranks_per_host: usize,
) -> Result<Vec<Row>> {
    let total = (strategies.len() * a.rounds) as u64;
    let progress = Progress::new("bench ckpt: run", 0, total, Mode::detect());
    // per strategy, per round: the report and the link counters' deltas [host][link]
    let mut runs: Vec<(String, Vec<RunOf>, Option<f64>)> = strategies.iter().map(|s| (s.clone(), Vec::new(), None)).collect();
    let mut storage_note = String::new();
    let mut storage_per_host: Option<f64> = storage_fixed.flatten();
    let mut done = 0u64;
    for round in 0..a.rounds {
        for (s, reps, storage) in runs.iter_mut() {
            let dir = if a.rounds == 1 { a.out.join(&*s) } else { a.out.join(format!("{s}-r{}", round + 1)) };
            let writes = matches!(s.as_str(), "blocking" | "async");
            let args = TrainArgs {
                ranks: a.ranks,
                ckpt: s.clone(),
                topology: a.topology.clone(),
                ranks_per_host: a.ranks_per_host,
                iters: Some(a.iters),
                report_dir: dir.clone(),
                persist_every: 0,
                quiet: true,
                storage_rate: storage_per_host.map(|r| format!("{}bit", (r * 8.0).round() as u64)),
                compute: a.compute.clone(),
                ..TrainArgs::new(&a.config)
            };
            let before = topo.map(crate::cluster::link_tx_bytes).transpose()?;
            let code = run(&args)?;
            if code != 0 {
                bail!("the {s} run failed (status {code}); see its output above");
            }
            let after = topo.map(crate::cluster::link_tx_bytes).transpose()?;
            let delta = match (before, after) {
                (Some(b), Some(x)) => Some(
                    x.iter().zip(&b).map(|(xs, bs)| xs.iter().zip(bs).map(|(x, b)| x.saturating_sub(*b)).collect()).collect(),
                ),
                _ => None,
            };
            let rep: Report = serde_json::from_slice(&std::fs::read(dir.join("report.json"))?)
                .with_context(|| format!("reading {}", dir.join("report.json").display()))?;
            done += 1;
            progress.step(
                done,
                &format!("{s} (round {}): median iteration {:.1} ms", round + 1, median_after(&rep.iter_time_s, 2) * 1e3),
            );
            if s == "none" && storage_fixed.is_none() && storage_per_host.is_none() {
                // the paper's ratio of one checkpoint's write time to one iteration, on this bed
                let root = crate::simulate::repo_root(&a.config);
                let (ratio, how) = crate::simulate::paper_write_ratio(&root)?;
                let t = median_after(&rep.iter_time_s, 2);
                let host_state = rep.state_bytes_per_rank as f64 * ranks_per_host as f64;
                let r = host_state / (ratio * t);
                storage_note = format!(
                    "emulated remote storage: {:.1} MB/s per host = {:.1} MB of state per host / ({ratio:.2} x the {:.0} ms none iteration); the ratio from {how}",
                    r / 1e6,
                    host_state / 1e6,
                    t * 1e3
                );
                eprintln!("bench ckpt: {storage_note}");
                storage_per_host = Some(r);
            }
            if writes {
                *storage = storage_per_host;
            }
            reps.push((rep, delta));
        }
    }
    progress.finish();
    let names: Vec<String> = topo.map(|t| t.links.iter().map(|l| l.name.clone()).collect()).unwrap_or_default();
    let link_sum = |d: &Option<Vec<Vec<u64>>>| -> Option<u64> { d.as_ref().map(|d| d.iter().flatten().sum()) };
    // first round's counters (every round moves the same bytes); pooled iteration times
    let none_links = runs.iter().find(|r| r.0 == "none").and_then(|r| link_sum(&r.1[0].1));
    let pooled = |reps: &[RunOf]| -> f64 {
        let all: Vec<f64> = reps.iter().flat_map(|(r, _)| r.iter_time_s.iter().skip(2).copied()).collect();
        median_after(&all, 0)
    };
    let pooled_mean = |reps: &[RunOf]| -> f64 {
        let all: Vec<f64> = reps.iter().flat_map(|(r, _)| r.iter_time_s.iter().skip(2).copied()).collect();
        all.iter().sum::<f64>() / all.len().max(1) as f64
    };
    let med: BTreeMap<String, f64> = runs.iter().map(|r| (r.0.clone(), pooled(&r.1))).collect();
    let mean: BTreeMap<String, f64> = runs.iter().map(|r| (r.0.clone(), pooled_mean(&r.1))).collect();
    // each round's none run: the CPU the same training took without checkpoints
    let none_cpu: Option<Vec<u64>> =
        runs.iter().find(|r| r.0 == "none").map(|r| r.1.iter().map(|(x, _)| x.process_cpu_ns).collect());
    let rows: Vec<Row> = runs
        .iter()
        .map(|(s, reps, storage)| {
            let (r, d) = &reps[0];
            let (t, m) = (med[s], mean[s]);
            // the whole processes' CPU minus none's, round by round, per replicated byte
            let extra_cpu: Option<Vec<(f64, u64)>> = none_cpu.as_ref().map(|n| {
                reps.iter().zip(n).map(|((r, _), n)| (r.process_cpu_ns as f64 - *n as f64, r.ckpt_bytes_replicated)).collect()
            });
            Row {
                strategy: s.clone(),
                iter_time_s: t,
                round_iter_time_s: reps.iter().map(|(r, _)| median_after(&r.iter_time_s, 2)).collect(),
                mean_iter_s: m,
                overhead_vs_none: mean.get("none").map(|n| m / n - 1.0),
                overhead_vs_none_median: med.get("none").map(|n| t / n - 1.0),
                speedup_vs: mean.iter().filter(|(k, _)| *k != s).map(|(k, v)| (k.clone(), v / m)).collect(),
                ckpt_bytes_inter_host: match (link_sum(d), none_links) {
                    (Some(x), Some(n)) => Some(x.saturating_sub(n)),
                    _ => None,
                },
                link_bytes: d
                    .as_ref()
                    .map(|d| names.iter().enumerate().map(|(l, n)| (n.clone(), d.iter().map(|h| h[l]).sum())).collect())
                    .unwrap_or_default(),
                ckpt_bytes_inter_host_sent: r.ckpt_bytes_inter_host_sent,
                ckpt_bytes_per_link: r.ckpt_bytes_per_link.clone(),
                ckpt_bytes_storage: r.ckpt_bytes_storage,
                ckpt_snapshots_skipped: reps.iter().map(|(r, _)| r.ckpt_snapshots_skipped).sum(),
                memory_passes: {
                    let all = reps.iter().fold(ironweave_ckpt::MemoryPasses::default(), |a, (r, _)| {
                        let m = &r.ckpt_memory;
                        ironweave_ckpt::MemoryPasses {
                            snapshot_bytes: a.snapshot_bytes + m.snapshot_bytes,
                            send_pass_bytes: a.send_pass_bytes + m.send_pass_bytes,
                            received_bytes: a.received_bytes + m.received_bytes,
                            recv_pass_bytes: a.recv_pass_bytes + m.recv_pass_bytes,
                        }
                    });
                    (all.send(), all.recv())
                },
                storage_bytes_per_s_per_host: *storage,
                exposed_ckpt_s: reps.iter().map(|(r, _)| Report::steady(&r.ckpt_exposed_s, 2)).sum::<f64>() / reps.len() as f64,
                storage_interval_iters: {
                    // whole-state writes over the run: bytes written / (state per rank x ranks)
                    let per = r.state_bytes_per_rank.saturating_mul(r.ranks as u64);
                    (r.ckpt_bytes_storage > 0 && per > 0 && (s.starts_with("async") || s == "blocking"))
                        .then(|| r.iterations as f64 / (r.ckpt_bytes_storage as f64 / per as f64))
                },
                ckpt_cpu_ns_per_byte: extra_cpu.as_ref().and_then(|x| {
                    let (cpu, bytes) = x.iter().fold((0.0, 0u64), |(c, b), (dc, db)| (c + dc, b + db));
                    (bytes > 0).then(|| cpu / bytes as f64)
                }),
                ckpt_cpu_ns_per_byte_rounds: extra_cpu
                    .iter()
                    .flatten()
                    .filter(|(_, b)| *b > 0)
                    .map(|(c, b)| c / *b as f64)
                    .collect(),
                replica_threads_cpu_ns_per_byte: {
                    let (cpu, bytes) = reps
                        .iter()
                        .fold((0u64, 0u64), |(c, b), (r, _)| (c + r.ckpt_engine_threads_cpu_ns, b + r.ckpt_bytes_replicated));
                    (bytes > 0).then(|| cpu as f64 / bytes as f64)
                },
                ckpt_bytes_per_iter: r.ckpt_bytes_replicated as f64 / (r.iterations.max(1) * r.ranks.max(1) as u64) as f64,
                partition_accuracy: {
                    let a: Vec<f64> = reps.iter().filter_map(|(r, _)| r.partition_accuracy).collect();
                    (!a.is_empty()).then(|| a.iter().sum::<f64>() / a.len() as f64)
                },
                wire_accuracy: {
                    let (inside, n) = reps.iter().fold((0.0, 0u64), |(i, n), (r, _)| {
                        (i + r.wire_accuracy.unwrap_or(0.0) * r.wire_chunks as f64, n + r.wire_chunks)
                    });
                    (n > 0).then(|| inside / n as f64)
                },
                profiling_activations: r.profiling_activations,
                iterations: r.iterations,
                state_bytes_per_rank: r.state_bytes_per_rank,
                last_committed_iter: r.last_committed_iter,
                compute: ComputeCounters::mean(reps.iter().map(|(r, _)| &r.compute)),
            }
        })
        .collect();
    let md = table(&rows, &storage_note);
    print!("{md}");
    std::fs::write(a.out.join("ckpt.md"), &md)?;
    let json = serde_json::json!({
        "config": a.config.display().to_string(),
        "compute": rows.first().map(|r| r.compute.mode.clone()).unwrap_or_default(),
        "rounds": a.rounds,
        "topology": a.topology.as_ref().map(|t| t.display().to_string()),
        "ranks": a.ranks,
        "ranks_per_host": ranks_per_host,
        "storage": storage_note,
        "rows": rows,
    });
    std::fs::write(a.out.join("ckpt.json"), serde_json::to_vec_pretty(&json)?)?;
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&json)?).with_context(|| format!("writing {}", p.display()))?;
    }
    eprintln!("wrote {} and {}", a.out.join("ckpt.md").display(), a.out.join("ckpt.json").display());
    Ok(rows)
}

fn mb(b: u64) -> String {
    format!("{:.1} MB", b as f64 / 1e6)
}

/// The Markdown table of the rows (pasteable into docs/BENCHMARKS.md). Ratios and overheads
/// are on the mean iteration (what a run costs); the median is beside it.
pub fn table(rows: &[Row], storage_note: &str) -> String {
    let mut md = format!("compute: {}\n\n", rows.first().map_or("cpu", |r| r.compute.mode_or_cpu()));
    md.push_str(
        "| strategy | mean iteration | median iteration | overhead vs none (mean / median) | capricorn's speedup over it (mean) | exposed checkpoint | replicated per iteration and rank | memory passes per byte (sender / holder) | checkpoint CPU per byte (every thread, vs none) | replica threads only | ckpt bytes on inter-host links | sent to other hosts (engine) | written to storage (emulated remote) | partition accuracy (sent, rank 0) | on the wire (every holder) | profiling activations | committed | machine CPU busy | device busy (mean of ranks) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let cap = rows.iter().find(|r| r.strategy == "capricorn").map(|r| r.mean_iter_s);
    let pct = |o: Option<f64>| o.map(|o| format!("{:+.1}%", o * 100.0)).unwrap_or_else(|| "-".into());
    for r in rows {
        md.push_str(&format!(
            "| {} | {:.1} ms | {:.1} ms | {} / {} | {} | {:.1} ms | {} | {} | {} | {} | {} | {} | {} | {} | {} | {}/{} | {} | {} | {} |\n",
            r.strategy,
            r.mean_iter_s * 1e3,
            r.iter_time_s * 1e3,
            pct(r.overhead_vs_none),
            pct(r.overhead_vs_none_median),
            cap.map(|c| format!("{:.2}x", r.mean_iter_s / c)).unwrap_or_else(|| "-".into()),
            r.exposed_ckpt_s * 1e3,
            if r.ckpt_bytes_per_iter > 0.0 { mb(r.ckpt_bytes_per_iter.round() as u64) } else { "-".into() },
            [r.memory_passes.0, r.memory_passes.1].map(|p| p.map_or("-".into(), |p| format!("{p:.2}"))).join(" / "),
            r.ckpt_cpu_ns_per_byte
                .map(|c| {
                    let rounds: Vec<String> = r.ckpt_cpu_ns_per_byte_rounds.iter().map(|x| format!("{x:.2}")).collect();
                    format!("{c:.2} ns ({})", rounds.join(", "))
                })
                .unwrap_or_else(|| "-".into()),
            r.replica_threads_cpu_ns_per_byte.map(|c| format!("{c:.2} ns")).unwrap_or_else(|| "-".into()),
            r.ckpt_bytes_inter_host.map(mb).unwrap_or_else(|| "-".into()),
            mb(r.ckpt_bytes_inter_host_sent),
            mb(r.ckpt_bytes_storage),
            r.partition_accuracy.map(|a| format!("{:.0}%", a * 100.0)).unwrap_or_else(|| "-".into()),
            r.wire_accuracy.map(|a| format!("{:.0}%", a * 100.0)).unwrap_or_else(|| "-".into()),
            r.profiling_activations,
            r.iterations,
            r.last_committed_iter.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
            r.compute.cpu_cell(),
            r.compute.device_cell(),
        ));
    }
    md.push_str(&best_gemini(rows));
    for r in rows.iter().filter(|r| r.storage_interval_iters.is_some()) {
        md.push_str(&format!(
            "\n{}: a checkpoint on the persistent tier every {:.1} iterations\n",
            r.strategy,
            r.storage_interval_iters.unwrap_or(0.0)
        ));
    }
    if !storage_note.is_empty() {
        md.push_str(&format!("\n{storage_note}\n"));
    }
    md
}

/// The baseline at its best: the Gemini row with the lowest mean iteration of this invocation,
/// and every Capricorn row's speedup over it (mean and median), the lines under the table.
pub fn best_gemini(rows: &[Row]) -> String {
    let Some(b) = rows.iter().filter(|r| r.strategy.starts_with("gemini")).min_by(|a, b| a.mean_iter_s.total_cmp(&b.mean_iter_s))
    else {
        return String::new();
    };
    let n = rows.iter().filter(|r| r.strategy.starts_with("gemini")).count();
    let mut md = format!(
        "\nbest Gemini row ({} of {n} in this invocation): {} (mean {:.1} ms, median {:.1} ms)\n",
        if n == 1 { "the only one" } else { "the fastest" },
        b.strategy,
        b.mean_iter_s * 1e3,
        b.iter_time_s * 1e3
    );
    for c in rows.iter().filter(|r| r.strategy.starts_with("capricorn")) {
        md.push_str(&format!(
            "{}'s speedup over it: {:.2}x (mean), {:.2}x (median)\n",
            c.strategy,
            b.mean_iter_s / c.mean_iter_s,
            b.iter_time_s / c.iter_time_s
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(strategy: &str, mean_ms: f64, median_ms: f64) -> Row {
        serde_json::from_value(serde_json::json!({
            "strategy": strategy, "iter_time_s": median_ms / 1e3, "round_iter_time_s": [median_ms / 1e3],
            "mean_iter_s": mean_ms / 1e3, "speedup_vs": {}, "link_bytes": {}, "ckpt_bytes_inter_host_sent": 0,
            "ckpt_bytes_per_link": [], "ckpt_bytes_storage": 0, "ckpt_snapshots_skipped": 0, "exposed_ckpt_s": 0.0,
            "profiling_activations": 0, "iterations": 10, "state_bytes_per_rank": 0,
        }))
        .unwrap()
    }

    #[test]
    fn the_best_gemini_is_the_lowest_mean_and_every_capricorn_row_is_measured_against_it() {
        // the fastest Gemini by mean, not by median (gemini-b has the lower median), nor the first
        let rows = [
            row("none", 100.0, 100.0),
            row("gemini-a", 150.0, 140.0),
            row("gemini-b", 160.0, 120.0),
            row("gemini-c", 130.0, 135.0),
            row("capricorn", 104.0, 108.0),
            row("capricorn-sparse", 117.0, 100.0),
        ];
        let md = best_gemini(&rows);
        assert!(
            md.contains("best Gemini row (the fastest of 3 in this invocation): gemini-c (mean 130.0 ms, median 135.0 ms)"),
            "{md}"
        );
        assert!(md.contains("capricorn's speedup over it: 1.25x (mean), 1.25x (median)"), "{md}");
        assert!(md.contains("capricorn-sparse's speedup over it: 1.11x (mean), 1.35x (median)"), "{md}");
        assert!(!md.contains("none"), "{md}");
        // one Gemini row is the only one; none at all: no lines
        assert!(best_gemini(&rows[..2]).contains("(the only one of 1 in this invocation): gemini-a"));
        assert_eq!(best_gemini(&[row("none", 1.0, 1.0), row("capricorn", 1.0, 1.0)]), "");
    }

    #[test]
    fn none_runs_first_and_all_adds_multilink_only_with_two_links() {
        let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(expand(&v(&["capricorn", "none"]), 1).unwrap(), v(&["none", "capricorn"]));
        let mut five_and_always = v(&FIVE);
        five_and_always.push("capricorn-always".into());
        five_and_always.push("capricorn-sparse".into());
        assert_eq!(expand(&v(&["all"]), 1).unwrap(), five_and_always);
        assert_eq!(expand(&v(&["all"]), 2).unwrap().last().unwrap(), "capricorn-multilink");
        assert!(expand(&v(&["capricorn-multilink"]), 1).unwrap_err().to_string().contains("two or more links"));
        // the Gemini sweep: every name of it is a strategy the runs accept
        let sweep = expand(&v(&["none", "gemini-sweep"]), 1).unwrap();
        assert_eq!(sweep.len(), 1 + GEMINI_SWEEP.len());
        assert!(sweep.iter().all(|s| crate::train::args::parse_strategy(s).is_ok()), "{sweep:?}");
        assert!(expand(&v(&["zip"]), 1).is_err());
        assert_eq!(median_after(&[9.0, 9.0, 3.0, 1.0, 2.0], 2), 2.0);
        assert_eq!(median_after(&[9.0, 9.0, 4.0, 1.0, 2.0, 3.0], 2), 2.5);
    }
}

//! `ironweave` (package ironweave-cli): the command line that wires the crates. `train` runs the
//! MoE workload on local ranks with a checkpoint engine and writes a report; `launch` starts
//! ranks of any program; `bench` measures beside peers; `report` turns a run into an HTML
//! page; `plan` and `simulate` run the planners and the simulator; `cluster` emulates hosts
//! and links; `doctor` lists backends; `selftest` holds the small rank programs the fault tests
//! run. Backends are reached only through the `ironweave` facade.

use ironweave_ops::{
    backend, bench, chaos, ckpt_bench, ckpt_replay, ckpt_selftest, ckpt_tool, cluster, launch, overlap, plan, progress, report,
    scaling, sdp, sdp_bench, selftest, simulate, snapbench, train,
};

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "ironweave",
    version,
    about = "ironweave: distributed training of MoE models — train with per-iteration checkpoints, launch ranks, benchmark against peers, plan (Oases, HSDP), simulate, emulate a cluster, report"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Start N local ranks of PROGRAM with the job in their environment.
    Launch {
        /// Number of ranks (default with --topology: hosts x --ranks-per-host).
        #[arg(short = 'n', long = "ranks")]
        ranks: Option<usize>,
        /// Run on the emulated cluster of this topology file (see `ironweave cluster up`).
        #[arg(long)]
        topology: Option<std::path::PathBuf>,
        /// Ranks per emulated host.
        #[arg(long, default_value_t = 1)]
        ranks_per_host: usize,
        /// Backend the ranks should use (exported as IRONWEAVE_BACKEND).
        #[arg(long, default_value = "tcp")]
        backend: String,
        /// Stop the job after this many seconds.
        #[arg(long)]
        timeout: Option<f64>,
        /// Do not prefix output lines with the rank.
        #[arg(long)]
        no_prefix: bool,
        /// Restart ranks that fail, up to this many times in all; a restarted rank runs with
        /// IRONWEAVE_GENERATION set to the job's next generation (see docs/ARCHITECTURE.md).
        #[arg(long, default_value_t = 0)]
        max_restarts: usize,
        /// Compute threads per rank (RAYON_NUM_THREADS and OMP_NUM_THREADS of every rank).
        /// Default: the user's RAYON_NUM_THREADS / OMP_NUM_THREADS, else cores / ranks per host.
        #[arg(long)]
        threads_per_rank: Option<usize>,
        /// The program and its arguments.
        #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// One self-contained HTML page (charts, timeline) from a train or bench run directory.
    Report {
        /// The run directory (target/train-report, target/bench/ckpt, target/bench/scaling, ...).
        dir: std::path::PathBuf,
        /// Where to write the page (default: DIR/report.html).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
        /// No progress bar or progress lines (tables and results are still printed).
        #[arg(long, global = true)]
        quiet: bool,
    },
    /// Train the MoE workload across local ranks (expert and data parallel) with a checkpoint
    /// every iteration; prints loss and tokens/s, writes report.json, trace.json, timeline.svg.
    Train(ironweave_ops::run::TrainArgs),
    /// Per-rank body of `train` (started by it).
    #[command(hide = true)]
    TrainWorker(train::WorkerArgs),
    /// Per-rank body of `train --tp` (started by it).
    #[command(hide = true)]
    TpWorker(overlap::TpWorkerArgs),
    /// A reliability campaign: a clean training run, then N runs with one random fault each
    /// (kill -9 of a rank, of a rank and its replica holder, at the checkpoint engine's fault
    /// points, a full persistent tier); each run's outcome against the clean run.
    Chaos(chaos::ChaosArgs),
    /// Per-rank body of `train --sdp` (started by it).
    #[command(hide = true)]
    SdpWorker(sdp::SdpWorkerArgs),
    /// One end of the socket probe `simulate ckpt --from-report` runs across the emulated link
    /// (started by it inside a host's namespace).
    #[command(hide = true)]
    SocketProbe(ckpt_replay::ProbeArgs),
    /// Plan a parallel layout with a cost model and HiGHS.
    Plan {
        #[command(subcommand)]
        what: PlanCmd,
    },
    /// Run a scenario (tp, sdp, ckpt) in the discrete-event simulator.
    Simulate {
        /// tp: Megatron vs the Oases plan; sdp: FSDP vs the HSDP plan; ckpt: five checkpoint strategies.
        scenario: String,
        #[command(flatten)]
        args: simulate::SimArgs,
    },
    /// Checkpoints on disk: what a persistent tier holds, verified.
    Ckpt {
        #[command(subcommand)]
        what: CkptCmd,
    },
    /// An emulated cluster: hosts in network namespaces joined by rate-limited links.
    Cluster {
        #[command(subcommand)]
        what: ClusterCmd,
    },
    /// Per-rank body of `bench collectives` (started by it).
    #[command(hide = true)]
    BenchWorker {
        #[arg(long)]
        backend: String,
        #[arg(long, default_value = "")]
        link: String,
        #[arg(long, value_delimiter = ',')]
        ops: Vec<String>,
        #[arg(long, value_delimiter = ',')]
        sizes: Vec<String>,
        #[arg(long)]
        dtype: String,
        #[arg(long)]
        min_time: f64,
        #[arg(long)]
        out: Option<String>,
    },
    /// Per-rank body of `cluster probe` (started by it).
    #[command(hide = true)]
    ProbeWorker {
        #[arg(long)]
        seconds: f64,
        #[arg(long)]
        out: String,
        #[arg(long, default_value_t = 1)]
        ranks_per_host: usize,
    },
    /// Which backends this build has, which work on this machine (and why not), and the
    /// links each one finds.
    #[command(alias = "info")]
    Doctor {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Small rank programs used by the fault tests (ok, loop, mismatch).
    #[command(hide = true)]
    Selftest {
        scenario: String,
        #[arg(long, default_value = "tcp")]
        backend: String,
    },
}

#[derive(Debug, Subcommand)]
enum PlanCmd {
    /// Oases: per sub-layer tensor-parallel degree and sub-batches, against Megatron.
    Tmp(PlanArgs),
    /// HSDP: per layer split of parameter traffic over the links, against FSDP.
    Sdp(PlanArgs),
}

#[derive(Debug, clap::Args)]
struct PlanArgs {
    /// Model description (configs/models/*.toml).
    #[arg(long)]
    model: std::path::PathBuf,
    /// Cluster description (configs/clusters/*.toml).
    #[arg(long)]
    cluster: std::path::PathBuf,
    /// Measured compute throughputs overriding the analytic ones (TOML `[ops.<kind>] flops, seconds`).
    #[arg(long)]
    profile: Option<std::path::PathBuf>,
    /// Also write the plan as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// TMP: solve with HiGHS branch and bound even where the exact chain algorithms apply.
    #[arg(long)]
    highs: bool,
    /// Override the model's global batch (sequences per iteration), e.g. to scale it with the cluster.
    #[arg(long)]
    global_batch: Option<u32>,
    /// Use link figures measured by `ironweave cluster probe --json FILE` instead of the description's.
    #[arg(long)]
    probe: Option<std::path::PathBuf>,
}

#[derive(Debug, Subcommand)]
enum CkptCmd {
    /// The iterations of a persistent tier, the layout that wrote the newest complete one, its
    /// global tensors and owner slices; every file and tensor verified; the layout-free digest.
    Inspect {
        /// The directory (`<report dir>/persist`).
        dir: std::path::PathBuf,
        /// Iteration (default: the newest every rank finished writing).
        #[arg(long)]
        iter: Option<u64>,
        /// Also write the whole inspection (every tensor and slice) here as JSON.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// Rewrite a MoE checkpoint for another world size (experts e on rank e mod ranks): every
    /// rank's files and manifest, as that job's persistent tier would write them.
    Reshard {
        /// The source directory (`<report dir>/persist`).
        dir: std::path::PathBuf,
        /// Where the result goes (a new directory).
        #[arg(long)]
        to: std::path::PathBuf,
        /// World size of the result.
        #[arg(long)]
        ranks: usize,
        /// The model's training configuration (its parameters' names and shapes).
        #[arg(long)]
        config: std::path::PathBuf,
        /// Iteration (default: the newest every rank finished writing).
        #[arg(long)]
        iter: Option<u64>,
    },
}

#[derive(Debug, Subcommand)]
enum ClusterCmd {
    /// Create the hosts and links (needs root).
    Up {
        #[arg(long)]
        topology: std::path::PathBuf,
    },
    /// Remove what `up` created; succeeds when nothing is there.
    Down {
        #[arg(long)]
        topology: std::path::PathBuf,
    },
    /// Show the hosts and links.
    Status {
        #[arg(long)]
        topology: std::path::PathBuf,
    },
    /// Measure every link's latency and bandwidth between hosts 0 and 1.
    Probe {
        #[arg(long)]
        topology: std::path::PathBuf,
        /// Seconds of streaming per link.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Write the measurements as JSON here.
        #[arg(long)]
        json: Option<String>,
        /// Ranks per host: with 2 or more, the path between two ranks of host 0 is measured
        /// too (reported as link `host`, the intra-node link of a planner's cluster).
        #[arg(long, default_value_t = 1)]
        ranks_per_host: usize,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
    /// Tokens/s of the same training at 1, 2, 4 ranks (threads chosen per rank), efficiency
    /// against one single-threaded rank, share of gradient communication hidden behind
    /// backward; with --topology, bucketed vs single-bucket gradients on the emulated cluster.
    Scaling(scaling::ScalingArgs),
    /// Tensor parallelism on the emulated cluster: Megatron's schedule against Oases'
    /// (sub-batches overlapping collectives with compute), on a slow and a fast link; each
    /// row with the share of communication hidden and the overlap model's prediction.
    Overlap(overlap::OverlapArgs),
    /// Sharded data parallelism on the emulated 2-host, 2-link cluster: replicated, FULL_SHARD
    /// on each link, HYBRID_SHARD and HSDP with the planner's plan, in one run; each row with
    /// the planner's prediction, bytes per link and link utilization.
    Sdp(sdp_bench::SdpBenchArgs),
    /// A MoE checkpoint of N ranks loaded onto other world sizes (other expert placements),
    /// beside `cat` of its files; the page cache dropped before each timing (root).
    Reshard(ckpt_tool::ReshardBenchArgs),
    /// Collectives over local processes, nccl-tests style, each row verified.
    Collectives {
        /// Number of ranks (processes).
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// Backend: tcp (default), ucx, verbs, nccl.
        #[arg(long, default_value = "tcp")]
        backend: String,
        /// Comma-separated: allreduce, allgather, reducescatter, alltoall, broadcast.
        #[arg(long, value_delimiter = ',', default_value = "allreduce,allgather,reducescatter,alltoall")]
        ops: Vec<String>,
        /// Comma-separated sizes in bytes with K/M/G suffixes (total buffer, as nccl-tests).
        #[arg(long, value_delimiter = ',', default_value = "4K,1M,16M")]
        sizes: Vec<String>,
        /// Element type.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Seconds each timed loop should last (at least 3 iterations).
        #[arg(long, default_value_t = 0.3)]
        min_time: f64,
        /// Write the rows as JSON here.
        #[arg(long)]
        json: Option<String>,
        /// Run on the emulated cluster of this topology file.
        #[arg(long)]
        topology: Option<std::path::PathBuf>,
        /// Ranks per emulated host (with --topology).
        #[arg(long, default_value_t = 1)]
        ranks_per_host: usize,
        /// Which link: a link name; `all` (striped over every link: all-gather and
        /// reduce-scatter balance dynamically over two links, the rest splits by rate);
        /// `all-static` (every collective split by rate); `all:F1,F2` (split by these
        /// fractions); or the default link.
        #[arg(long, default_value = "")]
        link: String,
    },
    /// The same training under each checkpoint strategy, one after the other (same seed and
    /// data): iteration time, overhead vs `none`, Capricorn's speedup over each.
    Ckpt {
        /// Training configuration.
        #[arg(long, default_value = "configs/moe-wide.toml")]
        config: std::path::PathBuf,
        /// Strategies to compare (`all`: none, blocking, async, gemini, capricorn,
        /// capricorn-always, capricorn-sparse, and capricorn-multilink when the topology has
        /// several links; `gemini-sweep`: Gemini's
        /// span fill 0.7-1.0 and chunk sizes, `gemini-fill0.8-chunk1M` one of them).
        #[arg(long, value_delimiter = ',', default_value = "all")]
        strategies: Vec<String>,
        /// Ranks.
        #[arg(long, default_value_t = 4)]
        ranks: usize,
        /// Iterations per strategy (the first two are warm-up and not counted).
        #[arg(long, default_value_t = 8)]
        iters: u64,
        /// Run on the emulated cluster of this topology file (brought up if it is not).
        #[arg(long)]
        topology: Option<std::path::PathBuf>,
        /// Ranks per emulated host (with --topology).
        #[arg(long, default_value_t = 2)]
        ranks_per_host: usize,
        /// Where the per-strategy reports, ckpt.json and ckpt.md go.
        #[arg(long, default_value = "target/bench/ckpt")]
        out: std::path::PathBuf,
        /// Also write the rows here (JSON).
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// Bandwidth of the emulated remote storage per host (`200mbit`, `1gbit`), or `auto`:
        /// the paper-scale ratio of one checkpoint's write time to one iteration (simulated
        /// on configs/clusters/4x8-a100.toml) applied to the measured `none` iteration, or
        /// `unlimited` (the local disk).
        #[arg(long, default_value = "auto")]
        storage_rate: String,
        /// Run every strategy this many times, interleaved (none, blocking, ..., none,
        /// blocking, ...); rows pool the rounds' steady iterations.
        #[arg(long, default_value_t = 1)]
        rounds: usize,
    },
    /// Snapshot a state to host memory (ironweave-ckpt vs memcpy) and to the persistent tier
    /// (vs a sequential write); `cargo xtask bench snapshot` adds torch.save and torchsnapshot.
    Snapshot {
        /// State size (K/M/G suffixes).
        #[arg(long, default_value = "1G")]
        bytes: String,
        /// Timed repetitions (best is reported).
        #[arg(long, default_value_t = 3)]
        repeat: usize,
        /// Directory for the persistent writes.
        #[arg(long, default_value = "target/bench/snapshot")]
        dir: std::path::PathBuf,
        /// Write the results as JSON here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
}

/// Keeps freed blocks in the process: training allocates and frees the same few-MB tensors
/// every layer, and glibc's defaults hand such blocks back to the kernel (mmap above 128 KiB,
/// trim above 128 KiB free), so every reuse faulted in fresh zeroed pages — 12% of a 2-rank
/// moe-small run's time in the kernel's page-fault path (perf).
fn keep_freed_memory() {
    // 32 MiB is the largest mmap threshold glibc accepts on 64-bit (a larger one is refused).
    // SAFETY: mallopt only changes allocator thresholds; called first thing in main, before
    // any other thread exists. A refusal (0) leaves glibc's defaults: slower, still correct.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

fn main() {
    keep_freed_memory();
    let cli = Cli::parse();
    // a bench's --quiet reaches every process it starts (ranks, workers) through the
    // environment; set before any thread exists (`train --quiet` hands it to its ranks itself)
    if matches!(&cli.cmd, Cmd::Bench { quiet: true, .. }) {
        std::env::set_var(progress::QUIET_VAR, "1");
    }
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ironweave: error: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

fn cluster_cmd(what: ClusterCmd) -> Result<i32> {
    match what {
        ClusterCmd::Up { topology } => {
            let t = cluster::Topology::load(&topology)?;
            cluster::up(&t)?;
            cluster::status(&t)?;
            Ok(0)
        }
        ClusterCmd::Down { topology } => {
            let t = cluster::Topology::load(&topology)?;
            cluster::down(&t)?;
            println!("cluster {:?}: down", t.name);
            Ok(0)
        }
        ClusterCmd::Status { topology } => {
            let t = cluster::Topology::load(&topology)?;
            Ok(if cluster::status(&t)? { 0 } else { 3 })
        }
        ClusterCmd::Probe { topology, seconds, json, ranks_per_host } => {
            let rph = ranks_per_host.max(1);
            let t = cluster::Topology::load(&topology)?;
            if t.hosts < 2 {
                bail!("probing needs at least two hosts");
            }
            if !cluster::status(&t)? {
                bail!("cluster {:?} is not up: run `ironweave cluster up --topology {}`", t.name, topology.display());
            }
            let exe = std::env::current_exe().context("locating the ironweave binary")?;
            let out = std::env::temp_dir().join(format!("ironweave-probe-{}.json", std::process::id()));
            eprintln!(
                "probing {} links between host 0 and host 1{}, {seconds} s of streaming each",
                t.links.len(),
                if rph > 1 { " and the path between two ranks of host 0" } else { "" }
            );
            let spec = launch::LaunchSpec {
                ranks: t.hosts * rph,
                program: exe.to_string_lossy().into_owned(),
                args: vec![
                    "probe-worker".into(),
                    "--seconds".into(),
                    seconds.to_string(),
                    "--out".into(),
                    out.to_string_lossy().into_owned(),
                    "--ranks-per-host".into(),
                    rph.to_string(),
                ],
                prefix: true,
                env: vec![],
                timeout: None,
                topology: Some((t.clone(), rph)),
                max_restarts: 0,
                threads_per_rank: None,
            };
            launch::install_signal_handlers();
            match launch::run(&spec)? {
                launch::Outcome::Success => {}
                other => bail!("the probe ranks did not finish: {other:?}"),
            }
            let text = std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?;
            let _ = std::fs::remove_file(&out);
            let probes: Vec<ironweave_transport::probe::LinkProbe> = serde_json::from_slice(&text)?;
            println!("| link | declared (Mbit/s) | measured (Mbit/s) | measured / declared | latency (us) |\n|---|---:|---:|---:|---:|");
            for p in &probes {
                let m = p.bandwidth_bytes_per_s * 8.0 / 1e6;
                let (d, ratio) = match p.declared_bytes_per_s {
                    Some(d) => (format!("{:.0}", d * 8.0 / 1e6), format!("{:.3}", m / (d * 8.0 / 1e6))),
                    None => ("-".into(), "-".into()),
                };
                println!("| {} | {d} | {m:.0} | {ratio} | {:.1} |", p.name, p.latency_s * 1e6);
            }
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_vec_pretty(&probes)?).with_context(|| format!("writing {path}"))?;
            }
            Ok(0)
        }
    }
}

fn run(cli: Cli) -> Result<i32> {
    match cli.cmd {
        Cmd::Launch { ranks, topology, ranks_per_host, backend, timeout, no_prefix, max_restarts, threads_per_rank, command } => {
            backend::check(&backend)?;
            let topology = match topology {
                Some(p) => Some((cluster::Topology::load(&p)?, ranks_per_host.max(1))),
                None => None,
            };
            let ranks = match (ranks, &topology) {
                (Some(n), _) => n,
                (None, Some((t, k))) => t.hosts * k,
                (None, None) => bail!("give the number of ranks with -n (or a --topology)"),
            };
            launch::install_signal_handlers();
            let spec = launch::LaunchSpec {
                topology,
                ranks,
                program: command[0].clone(),
                args: command[1..].to_vec(),
                prefix: !no_prefix,
                env: vec![("IRONWEAVE_BACKEND".into(), backend)],
                timeout: timeout.map(Duration::from_secs_f64),
                max_restarts,
                threads_per_rank,
            };
            Ok(launch::run(&spec)?.exit_code())
        }
        Cmd::Bench {
            what: BenchCmd::Ckpt { config, strategies, ranks, iters, topology, ranks_per_host, out, json, storage_rate, rounds },
            ..
        } => {
            launch::install_signal_handlers();
            let a = ckpt_bench::CkptBenchArgs {
                config,
                strategies,
                ranks,
                iters,
                topology,
                ranks_per_host,
                out,
                json,
                storage_rate,
                rounds,
            };
            ckpt_bench::bench(&a)?;
            Ok(0)
        }
        Cmd::Bench { what: BenchCmd::Reshard(a), .. } => {
            ckpt_tool::bench(&a)?;
            Ok(0)
        }
        Cmd::Bench { what: BenchCmd::Sdp(a), .. } => {
            launch::install_signal_handlers();
            sdp_bench::bench(&a)?;
            Ok(0)
        }
        Cmd::Bench { what: BenchCmd::Overlap(a), .. } => {
            launch::install_signal_handlers();
            overlap::bench(&a)?;
            Ok(0)
        }
        Cmd::Chaos(a) => {
            launch::install_signal_handlers();
            let rs = chaos::run(&a)?;
            // a campaign fails on a hang or a wrong final state; runs that could not be
            // survived are in the table with their error
            Ok(if rs.iter().any(|r| r.hang || (r.finished && !r.final_state_matches)) { 1 } else { 0 })
        }
        Cmd::SdpWorker(a) => {
            sdp::worker(&a)?;
            Ok(0)
        }
        Cmd::SocketProbe(a) => {
            ckpt_replay::probe_end(&a)?;
            Ok(0)
        }
        Cmd::TpWorker(a) => {
            overlap::worker(&a)?;
            Ok(0)
        }
        Cmd::Bench { what: BenchCmd::Scaling(a), .. } => {
            launch::install_signal_handlers();
            scaling::bench(&a)?;
            Ok(0)
        }
        Cmd::Bench { what: BenchCmd::Snapshot { bytes, repeat, dir, json }, .. } => {
            snapbench::run(bench::parse_size(&bytes)? as u64, repeat, &dir, json.as_deref())?;
            Ok(0)
        }
        Cmd::Bench {
            what: BenchCmd::Collectives { ranks, backend, ops, sizes, dtype, min_time, json, topology, ranks_per_host, link },
            ..
        } => {
            backend::check(&backend)?;
            bench::check_args(&ops, &sizes, &dtype)?;
            let topology = match topology {
                Some(p) => Some((cluster::Topology::load(&p)?, ranks_per_host.max(1))),
                None => None,
            };
            let ranks = topology.as_ref().map_or(ranks, |(t, k)| t.hosts * k);
            launch::install_signal_handlers();
            let exe = std::env::current_exe().context("locating the ironweave binary")?;
            let out = std::env::temp_dir().join(format!("ironweave-bench-{}.json", std::process::id()));
            let _ = std::fs::remove_file(&out);
            eprintln!(
                "ironweave bench collectives: {ranks} ranks over {backend}, {} ops x {} sizes, dtype {dtype}",
                ops.len(),
                sizes.len()
            );
            let spec = launch::LaunchSpec {
                ranks,
                program: exe.to_string_lossy().into_owned(),
                args: vec![
                    "bench-worker".into(),
                    "--backend".into(),
                    backend.clone(),
                    "--link".into(),
                    link.clone(),
                    "--ops".into(),
                    ops.join(","),
                    "--sizes".into(),
                    sizes.join(","),
                    "--dtype".into(),
                    dtype.clone(),
                    "--min-time".into(),
                    min_time.to_string(),
                    "--out".into(),
                    out.to_string_lossy().into_owned(),
                ],
                prefix: true,
                env: vec![],
                timeout: None,
                topology,
                max_restarts: 0,
                threads_per_rank: None,
            };
            match launch::run(&spec)? {
                launch::Outcome::Success => {}
                other => bail!("the benchmark ranks did not finish: {other:?}"),
            }
            let mut rows: Vec<bench::Row> =
                serde_json::from_slice(&std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?)?;
            let _ = std::fs::remove_file(&out);
            for r in rows.iter_mut() {
                r.memcpy_gbps = bench::memcpy_gbps(r.bytes);
            }
            println!("{}", bench::table(&rows));
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_vec_pretty(&rows)?).with_context(|| format!("writing {path}"))?;
                eprintln!("wrote {path}");
            }
            let bad: Vec<String> =
                rows.iter().filter(|r| !r.verified).map(|r| format!("{} {}", r.op, bench::human(r.bytes))).collect();
            if !bad.is_empty() {
                eprintln!("ironweave: {} rows failed verification: {}", bad.len(), bad.join(", "));
                return Ok(2);
            }
            Ok(0)
        }
        Cmd::BenchWorker { backend, link, ops, sizes, dtype, min_time, out } => {
            bench::worker(&backend, &link, &ops, &sizes, &dtype, min_time, out.as_deref())?;
            Ok(0)
        }
        Cmd::ProbeWorker { seconds, out, ranks_per_host } => {
            let comm = backend::connect("tcp")?;
            let mut probes = Vec::new();
            let (rph, stream) = (ranks_per_host.max(1), Duration::from_secs_f64(seconds));
            for i in 0..comm.links().len() {
                // host 0's first rank and host 1's first rank
                let p = ironweave_transport::probe::probe_link(&comm, i, 0, rph, stream)?;
                probes.extend(p.filter(|_| comm.rank() == 0));
            }
            if rph > 1 {
                // two ranks of host 0: the path between them never leaves the host
                let p = ironweave_transport::probe::probe_link(&comm, 0, 0, 1, stream)?;
                probes.extend(p.filter(|_| comm.rank() == 0).map(|p| ironweave_transport::probe::LinkProbe {
                    name: "host".into(),
                    declared_bytes_per_s: None,
                    ..p
                }));
            }
            if comm.rank() == 0 {
                std::fs::write(&out, serde_json::to_vec_pretty(&probes)?).with_context(|| format!("writing {out}"))?;
            }
            comm.barrier()?;
            Ok(0)
        }
        Cmd::Cluster { what } => cluster_cmd(what),
        Cmd::Ckpt { what: CkptCmd::Reshard { dir, to, ranks, config, iter } } => {
            let (cfg, _) = ironweave_ops::run::load_config(&config)?;
            let r = ckpt_tool::reshard(&dir, iter, &to, ranks, &cfg)?;
            println!(
                "resharded iteration {} from {} to {} ranks into {}: {:.1} MB read in {:.2} s, {:.1} MB written in {:.2} s; global_state_sha256 {}",
                r.iter,
                r.from_world,
                r.to_world,
                to.display(),
                r.bytes_read as f64 / 1e6,
                r.load_s,
                r.bytes_written as f64 / 1e6,
                r.write_s,
                r.global_state_sha256
            );
            Ok(0)
        }
        Cmd::Ckpt { what: CkptCmd::Inspect { dir, iter, json } } => {
            let i = ckpt_tool::inspect(&dir, iter)?;
            print!("{}", ckpt_tool::summary(&i));
            if let Some(p) = json {
                std::fs::write(&p, serde_json::to_vec_pretty(&i)?).with_context(|| format!("writing {}", p.display()))?;
            }
            Ok(0)
        }
        Cmd::Train(args) => Ok(ironweave_ops::train(&args)?),
        Cmd::Report { dir, out } => {
            let p = report::write(&dir, out.as_deref())?;
            println!("{}", p.display());
            Ok(0)
        }
        Cmd::TrainWorker(a) => {
            train::worker(&a)?;
            Ok(0)
        }
        Cmd::Simulate { scenario, args } => {
            simulate::run(&scenario, &args)?;
            Ok(0)
        }
        Cmd::Plan { what } => {
            match what {
                PlanCmd::Tmp(a) => plan::tmp(
                    &a.model,
                    &a.cluster,
                    a.profile.as_deref(),
                    a.json.as_deref(),
                    a.highs,
                    a.global_batch,
                    a.probe.as_deref(),
                )?,
                PlanCmd::Sdp(a) => {
                    plan::sdp(&a.model, &a.cluster, a.profile.as_deref(), a.json.as_deref(), a.global_batch, a.probe.as_deref())?
                }
            }
            Ok(0)
        }
        Cmd::Doctor { json } => {
            let reports = backend::doctor();
            if json {
                println!("{}", serde_json::to_string_pretty(&reports)?);
            } else {
                for r in &reports {
                    let state = match (r.compiled, r.usable) {
                        (false, _) => "not compiled",
                        (true, true) => "usable",
                        (true, false) => "NOT usable",
                    };
                    println!("{:<6} {:<13} {}", r.backend, state, r.detail);
                    for l in &r.links {
                        println!("       {} {:<16} {}", if l.usable { "ok " } else { "BAD" }, l.name, l.detail);
                    }
                }
            }
            Ok(0)
        }
        Cmd::Selftest { scenario, backend } if scenario == "ckpt" => {
            let _ = backend;
            ckpt_selftest::run()?;
            Ok(0)
        }
        Cmd::Selftest { scenario, backend } => {
            selftest::run(&scenario, &backend)?;
            Ok(0)
        }
    }
}

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

use anyhow::{Context, Result};
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
    Launch(launch::LaunchArgs),
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
        what: cluster::ClusterCmd,
    },
    /// Per-rank body of `bench collectives` (started by it).
    #[command(hide = true)]
    BenchWorker(bench::BenchWorkerArgs),
    /// Per-rank body of `cluster probe` (started by it).
    #[command(hide = true)]
    ProbeWorker(cluster::ProbeWorkerArgs),
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
    #[command(alias = "tmp")]
    Tp(PlanArgs),
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
    Collectives(bench::CollectivesArgs),
    /// The same training under each checkpoint strategy, one after the other (same seed and
    /// data): iteration time, overhead vs `none`, Capricorn's speedup over each.
    Ckpt(ckpt_bench::CkptBenchArgs),
    /// Snapshot a state to host memory (ironweave-ckpt vs memcpy) and to the persistent tier
    /// (vs a sequential write); `cargo xtask bench snapshot` adds torch.save and torchsnapshot.
    Snapshot(snapbench::SnapshotArgs),
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

fn run(cli: Cli) -> Result<i32> {
    match cli.cmd {
        Cmd::Launch(a) => Ok(launch::command(&a)?),
        Cmd::Bench { what: BenchCmd::Ckpt(a), .. } => {
            launch::install_signal_handlers();
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
        Cmd::Bench { what: BenchCmd::Snapshot(a), .. } => Ok(snapbench::command(&a)?),
        Cmd::Bench { what: BenchCmd::Collectives(a), .. } => {
            launch::install_signal_handlers();
            Ok(bench::collectives(&a)?)
        }
        Cmd::BenchWorker(a) => {
            bench::worker(&a)?;
            Ok(0)
        }
        Cmd::ProbeWorker(a) => {
            cluster::probe_worker(&a)?;
            Ok(0)
        }
        Cmd::Cluster { what } => {
            if matches!(what, cluster::ClusterCmd::Probe(_)) {
                launch::install_signal_handlers();
            }
            Ok(cluster::command(&what)?)
        }
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
                PlanCmd::Tp(a) => plan::tp(
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
        Cmd::Doctor { json } => Ok(backend::doctor_command(json)?),
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

//! `ironweave` (package ironweave-cli): the command line that wires the crates. `train` runs the
//! MoE workload on local ranks with a checkpoint engine and writes a report; `launch` starts
//! ranks of any program; `bench` measures beside peers; `report` turns a run into an HTML
//! page; `plan` and `simulate` run the planners and the simulator; `cluster` emulates hosts
//! and links; `doctor` lists backends; `selftest` holds the small rank programs the fault tests
//! run. Backends are reached only through the `ironweave` facade.

use ironweave_ops::{backend, bench, chaos, ckpt, cluster, launch, plan, report, selftest, simulate, train};

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
    Report(report::ReportArgs),
    /// Benchmarks.
    Bench(bench::BenchArgs),
    /// Train the MoE workload across local ranks (expert and data parallel) with a checkpoint
    /// every iteration; prints loss and tokens/s, writes report.json, trace.json, timeline.svg.
    Train(Box<train::TrainArgs>),
    /// Per-rank body of `train` (started by it).
    #[command(hide = true)]
    TrainWorker(train::moe::WorkerArgs),
    /// Per-rank body of `train --tp` (started by it).
    #[command(hide = true)]
    TpWorker(train::tp::TpWorkerArgs),
    /// Per-rank body of `train --sdp` (started by it).
    #[command(hide = true)]
    SdpWorker(train::sdp::SdpWorkerArgs),
    /// A reliability campaign: a clean training run, then N runs with one random fault each
    /// (kill -9 of a rank, of a rank and its replica holder, at the checkpoint engine's fault
    /// points, a full persistent tier); each run's outcome against the clean run.
    Chaos(chaos::ChaosArgs),
    /// One end of the socket probe `simulate ckpt --from-report` runs across the emulated link
    /// (started by it inside a host's namespace).
    #[command(hide = true)]
    SocketProbe(simulate::replay::ProbeArgs),
    /// Plan a parallel layout with a cost model and HiGHS.
    Plan {
        #[command(subcommand)]
        what: plan::PlanCmd,
    },
    /// Run a scenario (tp, sdp, ckpt) in the discrete-event simulator.
    Simulate(simulate::SimulateArgs),
    /// Checkpoints on disk: what a persistent tier holds, verified; loading onto another world size.
    Ckpt {
        #[command(subcommand)]
        what: ckpt::CkptCmd,
    },
    /// An emulated cluster: hosts in network namespaces joined by rate-limited links.
    Cluster {
        #[command(subcommand)]
        what: cluster::ClusterCmd,
    },
    /// Per-rank body of `bench collectives` (started by it).
    #[command(hide = true)]
    BenchWorker(bench::collectives::BenchWorkerArgs),
    /// Per-rank body of `cluster probe` (started by it).
    #[command(hide = true)]
    ProbeWorker(cluster::ProbeWorkerArgs),
    /// Which backends this build has, which work on this machine (and why not), and the
    /// links each one finds.
    #[command(alias = "info")]
    Doctor(backend::DoctorArgs),
    /// Small rank programs used by the fault tests (ok, loop, mismatch, ckpt, ...).
    #[command(hide = true)]
    Selftest(selftest::SelftestArgs),
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
    let code = match run(&cli.cmd) {
        Ok(code) => code,
        Err(e) => match e.downcast_ref::<ironweave_ops::Error>().and_then(ironweave_ops::Error::exit_status) {
            // a run that chose its exit status has said why
            Some(code) => code,
            None => {
                eprintln!("ironweave: error: {e:#}");
                1
            }
        },
    };
    std::process::exit(code);
}

/// One command: one function of `ironweave_ops`, its exit status.
fn run(cmd: &Cmd) -> anyhow::Result<i32> {
    let code = match cmd {
        Cmd::Launch(a) => launch::command(a),
        Cmd::Report(a) => report::command(a),
        Cmd::Bench(a) => bench::command(a),
        Cmd::Train(a) => train::run(a),
        Cmd::TrainWorker(a) => train::moe::worker(a).map(|()| 0),
        Cmd::TpWorker(a) => train::tp::worker(a).map(|()| 0),
        Cmd::SdpWorker(a) => train::sdp::worker(a).map(|()| 0),
        Cmd::Chaos(a) => chaos::command(a),
        Cmd::SocketProbe(a) => simulate::replay::probe_end(a).map(|()| 0),
        Cmd::Plan { what } => plan::command(what),
        Cmd::Simulate(a) => simulate::command(a),
        Cmd::Ckpt { what } => ckpt::command(what),
        Cmd::Cluster { what } => cluster::command(what),
        Cmd::BenchWorker(a) => bench::collectives::worker(a).map(|()| 0),
        Cmd::ProbeWorker(a) => cluster::probe_worker(a).map(|()| 0),
        Cmd::Doctor(a) => backend::doctor_command(a),
        Cmd::Selftest(a) => selftest::command(a),
    }?;
    Ok(code)
}

//! `ironweave bench`: each benchmark one `Args` struct and one function, measured beside its
//! peers in one run — [`collectives`] (nccl-tests style), [`ckpt`] (the checkpoint
//! strategies), [`sdp`] (sharded data parallelism on two links), [`overlap`] (tensor-parallel
//! schedules), [`scaling`] (ranks and buckets), [`reshard`] (loading onto other world sizes),
//! [`snapshot`] (a state to memory and to disk). Each writes JSON and a table under its
//! `--out` directory.

pub mod ckpt;
pub mod collectives;
pub mod overlap;
pub mod reshard;
pub mod scaling;
pub mod sdp;
pub mod snapshot;

use crate::error::Result;

/// `ironweave bench`'s options: the benchmark, and whether to show progress.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchCmd,
    /// No progress bar or progress lines (tables and results are still printed).
    #[arg(long, global = true)]
    pub quiet: bool,
}

/// The benchmarks.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum BenchCmd {
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
    Sdp(sdp::SdpBenchArgs),
    /// A MoE checkpoint of N ranks loaded onto other world sizes (other expert placements),
    /// beside `cat` of its files; the page cache dropped before each timing (root).
    Reshard(reshard::ReshardBenchArgs),
    /// Collectives over local processes, nccl-tests style, each row verified.
    Collectives(collectives::CollectivesArgs),
    /// The same training under each checkpoint strategy, one after the other (same seed and
    /// data): iteration time, overhead vs `none`, Capricorn's speedup over each.
    Ckpt(ckpt::CkptBenchArgs),
    /// Snapshot a state to host memory (ironweave-ckpt vs memcpy) and to the persistent tier
    /// (vs a sequential write); `cargo xtask bench snapshot` adds torch.save and torchsnapshot.
    Snapshot(snapshot::SnapshotArgs),
}

/// `ironweave bench NAME`: runs the benchmark (SIGINT and SIGTERM reach the ranks it starts);
/// `--quiet` reaches every process it starts through the environment. Call it before any
/// thread exists (it sets that variable).
pub fn command(a: &BenchArgs) -> Result<i32> {
    if a.quiet {
        std::env::set_var(crate::progress::QUIET_VAR, "1");
    }
    if !matches!(a.what, BenchCmd::Reshard(_) | BenchCmd::Snapshot(_)) {
        crate::launch::install_signal_handlers();
    }
    match &a.what {
        BenchCmd::Scaling(a) => scaling::bench(a).map(drop)?,
        BenchCmd::Overlap(a) => overlap::bench(a)?,
        BenchCmd::Sdp(a) => sdp::bench(a).map(drop)?,
        BenchCmd::Reshard(a) => reshard::bench(a).map(drop)?,
        BenchCmd::Collectives(a) => return collectives::collectives(a),
        BenchCmd::Ckpt(a) => ckpt::bench(a).map(drop)?,
        BenchCmd::Snapshot(a) => return snapshot::command(a),
    }
    Ok(0)
}

//! ironweave-ops: every capability of the `ironweave` command as a library function, the way
//! cargo's commands call `cargo::ops`. The binary (crates/cli) parses arguments, calls one
//! function here and prints; xtask and user programs can call the same functions.
//!
//! The modules form layers, each importing only those below it (no circle):
//!
//! - base: [`error`], [`progress`], [`cluster`] (the emulated cluster), [`launch`] (starting
//!   ranks), [`backend`], [`run`] (options and reports every training run shares);
//! - runs: [`mod@train`] (data and expert parallel, on [`ironweave::elastic`]), [`sdp`] (sharded,
//!   on the same runtime), [`overlap`] (tensor parallel), [`report`] (the HTML page);
//! - planning and replay: [`plan`], [`ckpt_replay`], [`simulate`];
//! - benches and campaigns over runs: [`mod@bench`] (collectives), [`ckpt_bench`], [`sdp_bench`],
//!   [`scaling`], [`snapbench`], [`chaos`];
//! - the small rank programs the fault tests run: [`selftest`], [`ckpt_selftest`].
//!
//! ```no_run
//! // `ironweave train --config configs/moe-tiny.toml --ranks 2 --iters 5`, from a program
//! let mut args = ironweave_ops::run::TrainArgs::new(std::path::Path::new("configs/moe-tiny.toml"));
//! args.ranks = 2;
//! args.iters = Some(5);
//! let status = ironweave_ops::train(&args)?;
//! assert_eq!(status, 0);
//! # Ok::<(), ironweave_ops::Error>(())
//! ```
//!
//! ```
//! // the `--fail` and `--ckpt` syntax of `ironweave train`, as a program checks it
//! let (ranks, iter) = ironweave_ops::run::parse_fail("rank=1+2,iter=5")?;
//! assert_eq!((ranks, iter), (vec![1, 2], 5));
//! assert!(ironweave_ops::run::parse_strategy("capricorn-multilink")?.multilink);
//! assert!(ironweave_ops::run::parse_fail("iter=0").is_err());
//! # Ok::<(), ironweave_ops::Error>(())
//! ```

pub mod backend;
pub mod bench;
pub mod chaos;
pub mod ckpt_bench;
pub mod ckpt_replay;
pub mod ckpt_selftest;
pub mod ckpt_tool;
pub mod cluster;
pub mod error;
pub mod launch;
pub mod overlap;
pub mod plan;
pub mod progress;
pub mod report;
pub mod run;
pub mod scaling;
pub mod sdp;
pub mod sdp_bench;
pub mod selftest;
pub mod simulate;
pub mod snapbench;
pub mod topology;
pub mod train;

pub use error::{Error, Result};

/// `ironweave train`: sharded (`--sdp`), tensor parallel (`--tp`, `--schedule`, `--tp-plan`)
/// or data and expert parallel; returns the command's exit status.
pub fn train(a: &run::TrainArgs) -> Result<i32> {
    if a.resume_from.is_some() && (a.tp.is_some() || a.tp_plan.is_some()) {
        error::bail!(
            "--resume-from loads onto another layout for the data- and expert-parallel and the --sdp runs so far; --tp runs resume from their own in-memory and persistent checkpoints"
        );
    }
    if a.sdp.is_some() || a.sdp_plan.is_some() {
        if a.tp.is_some() || a.tp_plan.is_some() {
            error::bail!("--sdp and --tp do not combine yet: choose one");
        }
        return sdp::run(a);
    }
    if a.tp.is_some() || a.schedule.is_some() || a.sub_batches.is_some() || a.tp_plan.is_some() {
        return overlap::run(a);
    }
    train::run(a)
}

/// A rank's options parsed back from the command line its parent wrote (`to_argv`: the hidden
/// subcommand's name first), as the rank's own parser does: the round-trip tests of every
/// struct a parent and its ranks share.
#[cfg(test)]
pub(crate) fn parse_back<A: clap::Args + clap::FromArgMatches>(argv: &[String]) -> A {
    let cmd = A::augment_args(clap::Command::new("rank"));
    A::from_arg_matches(&cmd.try_get_matches_from(argv).expect("the rank parses its command line")).expect("and takes it")
}

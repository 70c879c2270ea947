//! ironweave-ops: every capability of the `ironweave` command as a library function, the way
//! cargo's commands call `cargo::ops`. The binary (crates/cli) parses arguments into one `Args`
//! struct of this crate, calls one function here and exits with its status; xtask and user
//! programs can call the same functions.
//!
//! The modules are folders by job, in layers, each importing only those below it (no circle;
//! `cargo xtask tidy` checks both):
//!
//! - base: [`error`], [`progress`], [`topology`] (the emulated cluster's file), [`backend`],
//!   [`rundir`] (what a run directory's files hold), [`launch`] (starting ranks), [`cluster`]
//!   (the emulated cluster);
//! - [`plan`] (the planners) and [`report`] (the HTML page of a run directory);
//! - [`mod@train`]: `ironweave train` and its ranks (data and expert parallel, sharded, tensor
//!   parallel, on [`ironweave::elastic`]);
//! - [`simulate`] (the simulator, and replaying a run's checkpoint in it), [`ckpt`]
//!   (inspecting and resharding a persistent tier);
//! - [`mod@bench`] (every benchmark) and [`chaos`] (the reliability campaign), which run the above;
//! - [`selftest`]: the small rank programs the fault tests run.
//!
//! ```no_run
//! // `ironweave train --config configs/moe-tiny.toml --ranks 2 --iters 5`, from a program
//! let mut args = ironweave_ops::train::TrainArgs::new(std::path::Path::new("configs/moe-tiny.toml"));
//! args.ranks = 2;
//! args.iters = Some(5);
//! let status = ironweave_ops::train::run(&args)?;
//! assert_eq!(status, 0);
//! # Ok::<(), ironweave_ops::Error>(())
//! ```
//!
//! ```
//! // the `--fail` and `--ckpt` syntax of `ironweave train`, as a program checks it
//! use ironweave_ops::train::args::{parse_fail, parse_strategy};
//! let (ranks, iter) = parse_fail("rank=1+2,iter=5")?;
//! assert_eq!((ranks, iter), (vec![1, 2], 5));
//! assert!(parse_strategy("capricorn-multilink")?.multilink);
//! assert!(parse_fail("iter=0").is_err());
//! # Ok::<(), ironweave_ops::Error>(())
//! ```

pub mod backend;
pub mod bench;
pub mod chaos;
pub mod ckpt;
pub mod cluster;
pub mod error;
pub mod launch;
pub mod plan;
pub mod progress;
pub mod report;
pub mod rundir;
pub mod selftest;
pub mod simulate;
pub mod topology;
pub mod train;

pub use error::{Error, Result};

/// A rank's command line as its typed struct writes it (`to_argv`): the hidden subcommand, then
/// `--name=value` per option (so an empty value, or one starting with `-`, stays one argument).
pub(crate) struct Argv(Vec<String>);

impl Argv {
    pub(crate) fn new(subcommand: &str) -> Self {
        Argv(vec![subcommand.to_string()])
    }

    pub(crate) fn opt(mut self, name: &str, v: impl std::fmt::Display) -> Self {
        self.0.push(format!("--{name}={v}"));
        self
    }

    pub(crate) fn some(self, name: &str, v: Option<impl std::fmt::Display>) -> Self {
        match v {
            Some(v) => self.opt(name, v),
            None => self,
        }
    }

    /// A comma-separated list (left out when empty).
    pub(crate) fn list(self, name: &str, v: &[impl std::fmt::Display]) -> Self {
        if v.is_empty() {
            return self;
        }
        let joined = v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
        self.opt(name, joined)
    }

    pub(crate) fn done(self) -> Vec<String> {
        self.0
    }
}

/// A rank's options parsed back from the command line its parent wrote (`to_argv`: the hidden
/// subcommand's name first), as the rank's own parser does: the round-trip tests of every
/// struct a parent and its ranks share.
#[cfg(test)]
pub(crate) fn parse_back<A: clap::Args + clap::FromArgMatches>(argv: &[String]) -> A {
    let cmd = A::augment_args(clap::Command::new("rank"));
    A::from_arg_matches(&cmd.try_get_matches_from(argv).expect("the rank parses its command line")).expect("and takes it")
}

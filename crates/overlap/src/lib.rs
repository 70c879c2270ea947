//! ironweave-overlap: the overlap scheduler of Oases-style tensor parallelism.
//!
//! Work is described as a [`Program`]: a chain of *stages* that every sub-batch passes through,
//! each stage a compute task optionally followed by a collective on one of the rank's groups
//! (tensor-parallel, data-parallel), plus *tails*: collectives over a whole stage's result
//! (data-parallel gradients). [`schedule::steps`] turns a program and a [`Schedule`] into the
//! exact order of `Run` / `Issue` / `Wait` steps a rank executes — a pure function, tested
//! without processes — and [`exec::execute`] runs those steps: compute on the caller's thread
//! (the compute lane), collectives on the communicators' collective threads through the
//! transport's non-blocking operations (the communication lane). [`schedule::predict`] replays
//! the same steps on measured durations, which is the overlap-aware cost of a schedule.
//!
//! Where it sits: above `ironweave-transport` only. It knows nothing about candle or the model:
//! the model code in `ironweave-train` supplies the compute through the [`exec::Work`] trait.

mod error;
pub mod exec;
pub mod schedule;
pub mod trace;

pub use error::{OverlapError, Result};
pub use exec::{execute, ExecStats, Work};
pub use schedule::{steps, CollOp, CommSpec, Program, Schedule, Stage, Step, Tail};
pub use trace::{covered_s, Lane, Span};

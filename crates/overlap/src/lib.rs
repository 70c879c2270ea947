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
//!
//! ```
//! use ironweave_overlap::{steps, CommSpec, Program, Schedule, Stage};
//! use ironweave_transport::ReduceOp;
//! // two sub-layers whose outputs are all-reduced over group 0, then the head; two sub-batches
//! let sum = Some(CommSpec::all_reduce(0, ReduceOp::Sum));
//! let p = Program {
//!     stages: vec![
//!         Stage { name: "attn".into(), comm: sum },
//!         Stage { name: "mlp".into(), comm: sum },
//!         Stage { name: "head".into(), comm: None },
//!     ],
//!     tails: vec![],
//!     sub_batches: 2,
//! };
//! // the same work in both schedules; Oases orders it so collectives overlap compute
//! let (m, o) = (steps(&p, Schedule::Megatron)?, steps(&p, Schedule::Oases)?);
//! assert_eq!(m.len(), o.len());
//! assert_ne!(m, o);
//! # Ok::<(), ironweave_overlap::OverlapError>(())
//! ```

mod error;
pub mod exec;
pub mod schedule;
pub mod trace;

pub use error::{OverlapError, Result};
pub use exec::{execute, ExecStats, Work};
pub use schedule::{steps, CollOp, CommSpec, Program, Schedule, Stage, Step, Tail};
pub use trace::{covered_s, Lane, Span};

//! ironweave-sim: a deterministic discrete-event cluster simulator on `ironweave-plan`'s cost
//! models.
//!
//! - [`engine`]: op DAGs on compute streams and links; links share bandwidth between
//!   concurrent flows, training first when a link gives it priority. Virtual time only.
//! - [`ckpt`]: MoE training with per-iteration checkpoints under the five strategies
//!   (none, blocking, async, gemini, capricorn).
//! - [`tp`]: tensor parallelism, Megatron's schedule vs the Oases plan.
//! - [`sdp`]: sharded data parallelism, FSDP over one link vs the HSDP plan.
//! - [`load`]: expert-load dynamics (seeded generator with temporal locality, or a trace).
//! - [`replay`]: a measured checkpoint run on the emulated cluster, replayed under every
//!   strategy (`ironweave simulate ckpt --from-report`).
//! - [`svg`]: SVG timelines.
//!
//! Where it sits: above `ironweave-plan` (descriptions, cost model, planners), below the CLI
//! (`ironweave simulate`). It does no IO and reads no clock.
//!
//! ```
//! use ironweave_sim::engine::{run, Class, Dag};
//! // 10 ms of compute, then 1 MB over a 1 GB/s link: 11 ms of virtual time
//! let mut d = Dag::default();
//! let gpu = d.stream("gpu0");
//! let link = d.link("nvlink", 1e9, false);
//! let c = d.compute("forward", "compute", gpu, 0.010, vec![]);
//! d.transfer("grads", "all-reduce", link, 1e6, 0.0, Class::Training, vec![c]);
//! let t = run(&d)?;
//! assert!((t.makespan - 0.011).abs() < 1e-9);
//! # Ok::<(), ironweave_sim::SimError>(())
//! ```

pub mod ckpt;
pub mod engine;
mod error;
pub mod load;
pub mod replay;
pub mod sdp;
pub mod svg;
pub mod tp;

pub use error::{Result, SimError};

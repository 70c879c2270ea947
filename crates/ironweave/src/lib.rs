//! ironweave: fast, reliable training of large models — Mixture-of-Experts above all — across
//! many devices. This is the crate a program depends on: it picks the transport backend (cargo
//! features `tcp` (default), `ucx`, `verbs`, `nccl`; the choice at run time is
//! `IRONWEAVE_BACKEND` or an argument), joins the job its launcher described (`ironweave
//! launch`, torchrun, srun, mpirun), and re-exports the crates below it:
//!
//! - [`transport`]: the [`Communicator`] (point-to-point, collectives, sub-groups, several links);
//! - [`profile`]: per-layer timers, link timelines, idle windows, expert-load drift;
//! - [`ckpt`]: the Capricorn checkpoint engine (per-iteration in-memory checkpoints replicated
//!   to peers, commit, recovery, persistent tier);
//! - [`plan`]: cost models and the Oases (tensor-parallel) and HSDP (sharded data-parallel)
//!   planners.
//!
//! ```no_run
//! // a rank of a job started by `ironweave launch -n 2 -- my-program`
//! let comm = ironweave::init_from_env()?;
//! let mut grads = vec![1.0f32; 1024];
//! comm.all_reduce(&mut grads, ironweave::ReduceOp::Avg)?;
//! # Ok::<(), ironweave::Error>(())
//! ```
//!
//! The same code on a world of one (the job's environment set by hand here, as a launcher sets
//! it):
//!
//! ```
//! let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
//! for (k, v) in [("IRONWEAVE_RANK", "0"), ("IRONWEAVE_WORLD_SIZE", "1"), ("IRONWEAVE_MASTER_ADDR", "127.0.0.1")] {
//!     std::env::set_var(k, v);
//! }
//! std::env::set_var("IRONWEAVE_MASTER_PORT", port.to_string());
//! let comm = ironweave::init_from_env()?;
//! let mut grads = vec![2.0f32; 4];
//! comm.all_reduce(&mut grads, ironweave::ReduceOp::Avg)?;
//! assert_eq!((comm.size(), grads[0]), (1, 2.0));
//! # Ok::<(), ironweave::Error>(())
//! ```

#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backend;
#[cfg(feature = "candle")]
#[cfg_attr(docsrs, doc(cfg(feature = "candle")))]
pub mod candle;
pub mod checkpointer;
mod doctor;
pub mod elastic;

pub use backend::{connect, init, init_from_env, Backend, LinkReport};
pub use doctor::{doctor, BackendReport};
pub use ironweave_ckpt as ckpt;
pub use ironweave_plan as plan;
pub use ironweave_profile as profile;
pub use ironweave_sdp as sdp;
pub use ironweave_transport as transport;
pub use ironweave_transport::rendezvous::JobEnv;
pub use ironweave_transport::{CommOptions, Communicator, Error, ReduceOp, Result};
/// The workspace's one seedable generator (same numbers on every machine): for a program's
/// deterministic batches, which a recovered run must draw again exactly.
pub use ironweave_units::SplitMix64;

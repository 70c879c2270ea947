//! ironweave-sdp: sharded data parallelism, framework-light (like the checkpoint engine, it
//! owns flat per-layer buffers and their shards; the model supplies the compute).
//!
//! Per layer, the parameters, their gradients and both Adam moments are held as shards. Before
//! a layer's forward (and again before its backward) its parameters are all-gathered —
//! [`ShardEngine::start_gather`] returns a handle, so the next layer's gather can be in flight
//! while the current one computes; after its backward its gradients are reduce-scattered
//! ([`ShardEngine::start_reduce`]); [`ShardEngine::step`] runs Adam on the local shards only.
//! Gathered parameters belong to the caller and are dropped after use.
//!
//! Strategies ([`Strategy`]):
//! - `replicated`: plain data parallelism (every rank holds everything; gradients all-reduced);
//! - `full` (FSDP FULL_SHARD): one group of all ranks;
//! - `hybrid` (HYBRID_SHARD): sharded within the host, each shard's gradients all-reduced
//!   across hosts;
//! - `hsdp`: each layer's parameters split by a fraction into a part sharded over all ranks
//!   and a part sharded within the host (its shard gradients all-reduced across hosts); the
//!   groups' collectives run **at the same time on different links** — each group is a
//!   communicator on its own link (`on_link` + `split`), with its own collective thread.
//!
//! [`ddp`] is the `replicated` strategy's other form, for models that compute whole gradients:
//! gradients averaged in buckets while the backward pass runs (PyTorch DDP's design).
//!
//! Where it sits: above `ironweave-transport` (groups, non-blocking collectives), below the
//! trainer, the candle adapter of the `ironweave` facade and the CLI. No IO besides the
//! collectives; no clock.
//!
//! ```
//! use ironweave_sdp::{Adam, Groups, ShardEngine, Strategy};
//! // two ranks (threads of this process) shard one layer of 6 parameters: 3 each
//! let worlds = ironweave_transport::inproc::communicators(2)?;
//! let held: Vec<u64> = std::thread::scope(|s| {
//!     let hs: Vec<_> = worlds
//!         .iter()
//!         .map(|w| {
//!             s.spawn(move || {
//!                 let groups = Groups::new(w, 2, 0, 0).unwrap();
//!                 let mut e = ShardEngine::new(groups, Strategy::Full, &[vec![0.5; 6]], &[], Adam::default()).unwrap();
//!                 let full = e.start_gather(0).unwrap().wait().unwrap();
//!                 assert_eq!(full, vec![0.5; 6]);
//!                 let r = e.start_reduce(0, &[1.0; 6]).unwrap();
//!                 e.finish_reduce(r).unwrap();
//!                 e.step().unwrap();
//!                 e.state_bytes()
//!             })
//!         })
//!         .collect();
//!     hs.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! assert_eq!(held, vec![3 * 4 * 4, 3 * 4 * 4]); // parameters, gradients and moments of 3
//! # Ok::<(), ironweave_transport::Error>(())
//! ```

mod adam;
pub mod ddp;
mod engine;
mod groups;
mod trace;

pub use adam::{adam_update, Adam};
pub use engine::{CheckpointTensor, Gather, Reduce, ShardEngine};
pub use groups::{Groups, Strategy};
pub use trace::{CollSpan, Lane};

/// Errors of the sharded engine.
#[derive(Debug, thiserror::Error)]
pub enum SdpError {
    /// A collective failed.
    #[error(transparent)]
    Transport(#[from] ironweave_transport::Error),
    /// Arguments that cannot work.
    #[error("invalid: {0}")]
    Invalid(String),
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, SdpError>;

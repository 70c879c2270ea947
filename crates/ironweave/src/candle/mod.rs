//! The candle adapter (feature `candle`): train any candle model's [`VarMap`](candle_nn::VarMap) data parallel —
//! gradients averaged in buckets while the backward pass runs — or sharded (`full`, `hybrid`,
//! `hsdp` through [`ironweave_sdp`]), with the whole state (parameters, both Adam moments,
//! the step) registered with the checkpoint engine in one call ([`Trainer::state_specs`],
//! [`Trainer::state`], [`Trainer::restore`]), so [`crate::elastic`] can recover it from peers'
//! memory.
//!
//! **Overlap needs stages.** candle computes every gradient in one `backward()` call, with no
//! hook per parameter. A model that implements [`Staged`] (its forward as a chain of stages,
//! each a function of the previous stage's output) is run backward stage by stage: the last
//! stage from the loss, each earlier one from the gradient of its output
//! (`sum(out * grad)`'s backward gives exactly `grad` at `out`), and a bucket is averaged as
//! soon as the stage that last touches its parameters is done, while the earlier stages
//! compute. Which stage touches which parameter is learned in the first step after the trainer
//! is built or rebound (which averages everything at the end): every rank of a job buckets
//! alike, a restarted one too. A model that is one [`Whole`] stage gets the same results without
//! the overlap.
//!
//! **The optimizer is ours**: AdamW ([`ironweave_sdp::Adam`]) on host copies of the
//! parameters, the same update element by element as the sharded engine's, so replicated and
//! sharded runs agree and the moments can be checkpointed (candle-nn's `AdamW` keeps its
//! moments private). Parameters must be `f32` (on the CPU device; other devices are not
//! supported by this adapter yet).
//!
//! **What sharding saves here**: the state kept between steps and checkpointed — parameter
//! shards and both moments — is `1/world` of the replicated state under `full`
//! ([`Trainer::state_bytes`]); the model's own `Var`s still hold the gathered parameters during
//! a step (candle models own their tensors), like FSDP without resharding after forward.
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use ironweave::candle::{Layout, Trainer, TrainerConfig, Whole};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // one process is a world of one: the same code runs on every rank of a job
//! let comm = std::sync::Arc::new(ironweave::transport::inproc::communicators(1)?.remove(0));
//! let vm = VarMap::new();
//! let lin = candle_nn::linear(4, 1, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu).pp("lin"))?;
//! let mut t = Trainer::new(&vm, &comm, Layout::DataParallel, TrainerConfig::default())?;
//! let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
//! let s = t.step(&Whole(&lin), &x, |y| y.sqr()?.mean_all())?;
//! println!("loss {}", s.loss);
//! assert_eq!(t.state_specs().len(), 3 * 2 + 1); // weight, bias, their moments, the step
//! # Ok(()) }
//! ```

mod staged;
mod trainer;

pub use staged::{init_uniform, init_uniform_per_variable, Staged, Whole};
pub use trainer::Trainer;

use ironweave_sdp::ddp::{self, GradSyncStats};
use ironweave_sdp::{Adam, Strategy};

/// Errors of the adapter.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// candle failed (a forward, a backward, a tensor copy).
    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// A collective failed.
    #[error(transparent)]
    Transport(#[from] ironweave_transport::Error),
    /// The sharded engine refused.
    #[error(transparent)]
    Sdp(#[from] ironweave_sdp::SdpError),
    /// A model the adapter cannot train, or a checkpoint that does not fit it.
    #[error("{0}")]
    Invalid(String),
}

/// Result of the adapter.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How the parameters are held.
#[derive(Debug, Clone, PartialEq)]
pub enum Layout {
    /// Every rank holds everything; gradients averaged in buckets during backward.
    DataParallel,
    /// Sharded through [`ShardEngine`](ironweave_sdp::ShardEngine): `full` (over all ranks), `hybrid` (within the host,
    /// shard gradients all-reduced across hosts) or `hsdp` (each unit split by `fractions`
    /// between an all-rank part and a host part on different links). `replicated` runs the
    /// engine's all-reduce instead of the buckets.
    Sharded {
        /// The strategy.
        strategy: Strategy,
        /// Consecutive ranks per host.
        ranks_per_host: usize,
        /// `hsdp`: the share of each unit sharded over all ranks (one per unit, or one for
        /// all; ignored otherwise).
        fractions: Vec<f64>,
        /// Link of the all-rank part (0: the first).
        full_link: usize,
        /// Link of the cross-host all-reduce.
        inter_link: usize,
    },
}

impl Layout {
    /// `strategy` over all ranks of one host group of `ranks_per_host`, on the first link.
    pub fn sharded(strategy: Strategy, ranks_per_host: usize) -> Layout {
        Layout::Sharded { strategy, ranks_per_host, fractions: vec![0.5], full_link: 0, inter_link: 0 }
    }
}

/// The trainer's settings.
#[derive(Debug, Clone, Copy)]
pub struct TrainerConfig {
    /// AdamW (decoupled weight decay on every parameter).
    pub adam: Adam,
    /// Bucket size of the data-parallel averaging and of the sharded units, bytes (`None`:
    /// one bucket, averaged after the whole backward).
    pub bucket_bytes: Option<usize>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig { adam: Adam::default(), bucket_bytes: Some(ddp::DEFAULT_BUCKET_BYTES) }
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepStats {
    /// The loss averaged over ranks.
    pub loss: f32,
    /// The data-parallel averaging (buckets, time on the wire, share hidden behind backward).
    pub sync: GradSyncStats,
}

//! ironweave-train: the reference workload — a GPT-style decoder with Mixture-of-Experts
//! feed-forward layers, trained on CPU with candle on real text (byte-level), layer by layer
//! so the profiler times each layer's forward and backward.
//!
//! Where it sits: on top of `ironweave-profile` (timers, expert load) and, as the workload
//! grows, the transport (expert and data parallelism) and `ironweave-ckpt` (per-iteration
//! checkpoints). Today it trains in one process with every expert local.

pub mod config;
pub mod data;
pub mod dist;
mod error;
pub mod model;
pub mod trainer;

pub use config::TrainConfig;
pub use error::{Result, TrainError};
pub use trainer::{StepReport, Trainer};

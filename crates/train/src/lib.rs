//! ironweave-train: the reference workload — a GPT-style decoder with Mixture-of-Experts
//! feed-forward layers, trained on CPU with candle on real text (byte-level), layer by layer
//! so the profiler times each layer's forward and backward.
//!
//! Where it sits: on top of `ironweave-profile` (timers, expert load), the transport (expert
//! parallelism over `all_to_all_v`, data parallelism with dense gradients averaged in buckets
//! during the backward pass) and `ironweave-ckpt` (the state layout it checkpoints). One
//! process per rank; `ironweave train` in crates/cli launches the ranks and wires the engine.
//!
//! ```
//! use ironweave_train::TrainConfig;
//! // the shipped configurations parse, and say what they train
//! let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/moe-tiny.toml")).unwrap();
//! let cfg = TrainConfig::from_toml_str(&text)?;
//! assert!(cfg.model.layers > 0 && cfg.model.experts > 1);
//! # Ok::<(), ironweave_train::TrainError>(())
//! ```

pub mod buckets;
pub mod config;
pub mod data;
pub mod device;
pub mod dist;
pub mod emulated;
mod error;
mod gelu;
pub mod model;
pub mod routing;
pub mod sdp;
pub mod tp;
pub mod trainer;

pub use config::TrainConfig;
pub use error::{Result, TrainError};
pub use trainer::{StepReport, Trainer};

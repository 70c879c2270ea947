//! Training configuration (TOML under `configs/`).

use serde::Deserialize;

use crate::error::{Result, TrainError};

/// The model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelCfg {
    /// Transformer layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Sequence length (bytes).
    pub seq: usize,
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts per token (1 or 2).
    pub top_k: usize,
    /// Expert capacity: `capacity_factor × tokens × top_k / experts`.
    pub capacity_factor: f64,
    /// Every `moe_every`-th layer is MoE (1: all).
    #[serde(default = "one")]
    pub moe_every: usize,
    /// Feed-forward width multiple.
    #[serde(default = "four")]
    pub ffn_mult: usize,
    /// Weight of the load-balancing loss.
    #[serde(default = "aux")]
    pub aux_loss_coef: f64,
}

/// The optimisation.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainCfg {
    /// Sequences per rank per iteration.
    pub batch: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// AdamW decoupled weight decay (matrices only).
    #[serde(default)]
    pub weight_decay: f64,
    /// Seed of initialisation and data sampling.
    pub seed: u64,
    /// Default number of iterations.
    #[serde(default = "thirty")]
    pub iters: u64,
    /// Data parallelism: dense gradients are averaged in buckets of this many KiB while the
    /// backward pass goes on (0: one bucket after the whole backward).
    #[serde(default = "bucket_kb")]
    pub bucket_kb: usize,
}

/// The data.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataCfg {
    /// Text file, relative to the repository root (or absolute).
    pub path: String,
}

/// A whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Name.
    pub name: String,
    /// Model.
    pub model: ModelCfg,
    /// Optimisation.
    pub train: TrainCfg,
    /// Data.
    pub data: DataCfg,
}

fn one() -> usize {
    1
}
fn four() -> usize {
    4
}
fn aux() -> f64 {
    0.01
}
fn thirty() -> u64 {
    30
}
fn bucket_kb() -> usize {
    crate::buckets::DEFAULT_BUCKET_KB
}

impl TrainConfig {
    /// Parse and check.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let c: TrainConfig = toml::from_str(text).map_err(|e| TrainError::Config(e.to_string()))?;
        let m = &c.model;
        let bad = |why: &str| Err(TrainError::Config(format!("{}: {why}", c.name)));
        if m.layers == 0 || m.hidden == 0 || m.heads == 0 || m.seq < 2 || m.experts == 0 || m.moe_every == 0 || m.ffn_mult == 0 {
            return bad("layers, hidden, heads, experts, moe_every, ffn_mult must be ≥ 1 and seq ≥ 2");
        }
        if m.hidden % m.heads != 0 {
            return bad("hidden must be a multiple of heads");
        }
        if m.top_k == 0 || m.top_k > m.experts {
            return bad("1 ≤ top_k ≤ experts");
        }
        if !(m.capacity_factor > 0.0 && m.capacity_factor.is_finite()) {
            return bad("capacity_factor must be positive");
        }
        if c.train.batch == 0 || c.train.lr.is_nan() || c.train.lr <= 0.0 {
            return bad("batch ≥ 1 and lr > 0");
        }
        Ok(c)
    }

    /// Whether layer `l` is MoE.
    pub fn is_moe(&self, l: usize) -> bool {
        (l + 1) % self.model.moe_every == 0
    }
}

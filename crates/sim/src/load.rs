//! Expert load: a seeded generator with temporal locality, or a recorded trace.

use serde::{Deserialize, Serialize};

use crate::error::{Result, SimError};

/// SplitMix64 (seeded, the same on every machine).
pub use ironweave_units::SplitMix64 as Rng;

/// Parameters of the synthetic expert-load process: per MoE layer, expert popularity logits
/// follow `x ← a·x + (1-a)·μ + σ·ε`, and with probability `shift_prob` per iteration a layer's
/// preferred experts `μ` are redrawn (a topic change in the data).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyntheticLoad {
    /// Seed.
    pub seed: u64,
    /// Temporal locality `a` in [0, 1).
    pub locality: f64,
    /// Noise per iteration.
    pub sigma: f64,
    /// Spread of the preferred logits (skew of the load).
    pub skew: f64,
    /// Probability per layer and iteration of a shift.
    pub shift_prob: f64,
}

impl Default for SyntheticLoad {
    fn default() -> Self {
        SyntheticLoad { seed: 1, locality: 0.9, sigma: 0.1, skew: 0.25, shift_prob: 0.05 }
    }
}

/// A recorded trace: `iterations[i][m][e]` tokens routed to expert `e` of MoE layer `m` at iteration `i`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadTrace {
    /// Experts per MoE layer.
    pub experts: u32,
    /// Token counts.
    pub iterations: Vec<Vec<Vec<f64>>>,
}

impl LoadTrace {
    /// Check shape and values against `moe_layers` layers of `experts` experts.
    pub fn validate(&self, moe_layers: usize, experts: u32) -> Result<()> {
        if self.experts != experts {
            return Err(SimError::Invalid(format!("load trace has {} experts, the model {}", self.experts, experts)));
        }
        if self.iterations.is_empty() {
            return Err(SimError::Invalid("load trace has no iterations".into()));
        }
        for (i, it) in self.iterations.iter().enumerate() {
            if it.len() != moe_layers {
                return Err(SimError::Invalid(format!(
                    "load trace iteration {i} has {} MoE layers, the model {moe_layers}",
                    it.len()
                )));
            }
            for (m, l) in it.iter().enumerate() {
                if l.len() != experts as usize || l.iter().any(|v| !v.is_finite() || *v < 0.0) || l.iter().sum::<f64>() <= 0.0 {
                    return Err(SimError::Invalid(format!(
                        "load trace iteration {i} layer {m}: need {experts} non-negative counts with a positive sum"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Where expert loads come from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum LoadSource {
    /// The seeded generator.
    Synthetic(SyntheticLoad),
    /// A recorded trace (cycled if shorter than the run).
    Trace(LoadTrace),
}

/// Per iteration, per MoE layer, the share of tokens each expert receives (sums to 1).
pub fn shares(src: &LoadSource, iterations: usize, moe_layers: usize, experts: u32) -> Result<Vec<Vec<Vec<f64>>>> {
    let e = experts as usize;
    match src {
        LoadSource::Trace(t) => {
            t.validate(moe_layers, experts)?;
            Ok((0..iterations)
                .map(|i| {
                    t.iterations[i % t.iterations.len()]
                        .iter()
                        .map(|l| {
                            let s: f64 = l.iter().sum();
                            l.iter().map(|v| v / s).collect()
                        })
                        .collect()
                })
                .collect())
        }
        LoadSource::Synthetic(p) => {
            if !(0.0..1.0).contains(&p.locality) || !(0.0..=1.0).contains(&p.shift_prob) || p.sigma < 0.0 || p.skew < 0.0 {
                return Err(SimError::Invalid(
                    "synthetic load: locality in [0,1), shift_prob in [0,1], sigma and skew ≥ 0".into(),
                ));
            }
            let mut rng = Rng::new(p.seed);
            let mut mu: Vec<Vec<f64>> = (0..moe_layers).map(|_| (0..e).map(|_| p.skew * rng.normal()).collect()).collect();
            let mut x = mu.clone();
            let mut out = Vec::with_capacity(iterations);
            for _ in 0..iterations {
                let mut it = Vec::with_capacity(moe_layers);
                for m in 0..moe_layers {
                    if rng.unit() < p.shift_prob {
                        mu[m] = (0..e).map(|_| p.skew * rng.normal()).collect();
                    }
                    for k in 0..e {
                        x[m][k] = p.locality * x[m][k] + (1.0 - p.locality) * mu[m][k] + p.sigma * rng.normal();
                    }
                    let mx = x[m].iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = x[m].iter().map(|v| (v - mx).exp()).collect();
                    let s: f64 = w.iter().sum();
                    it.push(w.iter().map(|v| v / s).collect());
                }
                out.push(it);
            }
            Ok(out)
        }
    }
}

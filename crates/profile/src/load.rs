//! Expert load per MoE layer and Capricorn's speculative activation: profile and re-partition
//! only when the load has drifted from the load the current plan was made with.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::error::{ProfileError, Result};

/// Tokens routed to each expert of each MoE layer in one iteration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertLoad {
    /// `tokens[m][e]`: MoE layer `m`, expert `e`.
    pub tokens: Vec<Vec<u64>>,
}

impl ExpertLoad {
    /// Check that every layer has the same number of experts as `other`.
    pub fn same_shape(&self, other: &ExpertLoad) -> bool {
        self.tokens.len() == other.tokens.len() && self.tokens.iter().zip(&other.tokens).all(|(a, b)| a.len() == b.len())
    }

    /// Worst-layer total-variation distance between the two loads' distributions, in [0, 1]
    /// (a layer with no tokens counts as uniform).
    pub fn drift(&self, other: &ExpertLoad) -> Result<f64> {
        if !self.same_shape(other) {
            return Err(ProfileError::Shape(format!(
                "expert load shapes differ: {:?} vs {:?} experts per layer",
                self.tokens.iter().map(Vec::len).collect::<Vec<_>>(),
                other.tokens.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        Ok(tv(&shares(self), &shares(other)))
    }
}

/// The last few iterations' loads.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExpertLoadTracker {
    keep: usize,
    history: VecDeque<(u64, ExpertLoad)>,
}

impl ExpertLoadTracker {
    /// Keep the last `keep` iterations.
    pub fn new(keep: usize) -> Self {
        ExpertLoadTracker { keep: keep.max(1), history: VecDeque::new() }
    }
    /// Record iteration `iter`'s load.
    pub fn record(&mut self, iter: u64, load: ExpertLoad) {
        self.history.push_back((iter, load));
        while self.history.len() > self.keep {
            self.history.pop_front();
        }
    }
    /// The newest load.
    pub fn latest(&self) -> Option<&(u64, ExpertLoad)> {
        self.history.back()
    }
    /// All kept loads, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &(u64, ExpertLoad)> {
        self.history.iter()
    }
}

/// Decides, each iteration, whether to run profiling and re-partitioning.
///
/// One iteration's expert load is noisy (a few thousand routing decisions over a handful of
/// experts move the shares by more than any useful threshold from one iteration to the next),
/// so the decision looks at a smoothed load: an exponentially weighted moving average of each
/// layer's expert shares, `s ← α·shares + (1 − α)·s`. Profiling runs when the smoothed load has
/// drifted (worst-layer total-variation distance) past `threshold` from the smoothed load at
/// the last profiled iteration. α trades noise against reaction: a sustained shift of size D
/// shows as `(1 − (1 − α)^n)·D` after n iterations.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpeculativeActivation {
    /// Drift of the smoothed load above which the plan is considered stale.
    pub threshold: f64,
    /// Weight of the newest iteration in the smoothed load (1: no smoothing).
    pub alpha: f64,
    smoothed: Option<Vec<Vec<f64>>>,
    reference: Option<Vec<Vec<f64>>>,
    activations: u64,
}

/// Each layer's expert shares (a layer with no tokens counts as uniform).
fn shares(load: &ExpertLoad) -> Vec<Vec<f64>> {
    load.tokens
        .iter()
        .map(|l| {
            let s: u64 = l.iter().sum();
            if s == 0 {
                vec![1.0 / l.len().max(1) as f64; l.len()]
            } else {
                l.iter().map(|&v| v as f64 / s as f64).collect()
            }
        })
        .collect()
}

/// Worst-layer total-variation distance between two share tables of the same shape.
fn tv(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter().zip(b).map(|(x, y)| 0.5 * x.iter().zip(y).map(|(p, q)| (p - q).abs()).sum::<f64>()).fold(0.0, f64::max)
}

fn same_shape(a: &[Vec<f64>], b: &[Vec<f64>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.len() == y.len())
}

impl SpeculativeActivation {
    /// Default smoothing weight. With the engine's default threshold (0.3) it re-profiles 6%
    /// of moe-small's recorded iterations (after the first 10; the raw load: 14%) and catches
    /// the router's preferred experts flipping within 2 iterations
    /// (`crates/profile/tests/profile.rs`, on `tests/data/moe-small-load.json`).
    pub const DEFAULT_ALPHA: f64 = 0.3;

    /// Re-profile when the smoothed drift exceeds `threshold`, with the default smoothing.
    pub fn new(threshold: f64) -> Self {
        Self::with_alpha(threshold, Self::DEFAULT_ALPHA)
    }

    /// Re-profile when the drift of the load smoothed with weight `alpha` (clamped to
    /// (0, 1]; 1: the raw load) exceeds `threshold`.
    pub fn with_alpha(threshold: f64, alpha: f64) -> Self {
        let alpha = if alpha.is_finite() { alpha.clamp(1e-3, 1.0) } else { 1.0 };
        SpeculativeActivation { threshold, alpha, smoothed: None, reference: None, activations: 0 }
    }

    /// Takes iteration's `load` into the smoothed load and decides whether this iteration is
    /// profiled: always the first time and when the layers' shape changes, then only when the
    /// smoothed load drifted past the threshold from the one at the last profiled iteration
    /// (which it then becomes). Call once per iteration, in order.
    pub fn decide(&mut self, load: &ExpertLoad) -> bool {
        let now = shares(load);
        let smoothed = match self.smoothed.take() {
            Some(s) if same_shape(&s, &now) => s
                .iter()
                .zip(&now)
                .map(|(a, b)| a.iter().zip(b).map(|(x, y)| self.alpha * y + (1.0 - self.alpha) * x).collect())
                .collect(),
            _ => now,
        };
        let profile = match &self.reference {
            Some(r) if same_shape(r, &smoothed) => tv(r, &smoothed) > self.threshold,
            _ => true,
        };
        if profile {
            self.reference = Some(smoothed.clone());
            self.activations += 1;
        }
        self.smoothed = Some(smoothed);
        profile
    }

    /// Whether a load has been seen (by [`Self::decide`] or [`Self::prime`]).
    pub fn primed(&self) -> bool {
        self.reference.is_some()
    }

    /// Takes the load of an iteration that was profiled for another reason (the first one,
    /// before any load was known) as the reference, without counting an activation.
    pub fn prime(&mut self, load: &ExpertLoad) {
        let now = shares(load);
        self.reference = Some(now.clone());
        self.smoothed = Some(now);
    }

    /// How many times profiling ran.
    pub fn activations(&self) -> u64 {
        self.activations
    }
}

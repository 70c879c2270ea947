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
        let share = |l: &[u64]| -> Vec<f64> {
            let s: u64 = l.iter().sum();
            if s == 0 {
                vec![1.0 / l.len().max(1) as f64; l.len()]
            } else {
                l.iter().map(|&v| v as f64 / s as f64).collect()
            }
        };
        Ok(self
            .tokens
            .iter()
            .zip(&other.tokens)
            .map(|(a, b)| {
                let (a, b) = (share(a), share(b));
                0.5 * a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum::<f64>()
            })
            .fold(0.0, f64::max))
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
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpeculativeActivation {
    /// Drift above which the plan is considered stale.
    pub threshold: f64,
    reference: Option<ExpertLoad>,
    activations: u64,
}

impl SpeculativeActivation {
    /// Re-profile when drift exceeds `threshold`.
    pub fn new(threshold: f64) -> Self {
        SpeculativeActivation { threshold, reference: None, activations: 0 }
    }

    /// Whether the iteration whose (predicted or just measured) load is `load` should be
    /// profiled: always the first time, then only when `load` drifted past the threshold from
    /// the load of the last profiled iteration, or when its shape changed.
    pub fn should_profile(&self, load: &ExpertLoad) -> bool {
        match &self.reference {
            None => true,
            Some(r) => r.drift(load).map(|d| d > self.threshold).unwrap_or(true),
        }
    }

    /// The iteration with `load` was profiled; its load becomes the reference.
    pub fn profiled(&mut self, load: ExpertLoad) {
        self.reference = Some(load);
        self.activations += 1;
    }

    /// How many times profiling ran.
    pub fn activations(&self) -> u64 {
        self.activations
    }
}

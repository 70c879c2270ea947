//! Air-quality forecasting with domain-adversarial transfer, trained on ironweave as a user
//! would: a hybrid recurrent network (1D-CNN, bi-GRU, bi-LSTM, regression head, domain
//! classifier behind a gradient-reversal layer) forecasts daily PM10 at German AirBase
//! stations, learning from stations of several source states to forecast well in a target state
//! with little data.
//!
//! It sits on the public [`ironweave`] facade and candle only — the second model family of the
//! workspace and the test that a user's own model gets data-parallel training and Capricorn's
//! per-iteration in-memory checkpoints (and `kill -9` recovery) without reaching into
//! ironweave's internals. The layers:
//!
//! - [`rdata`]: a reader of R's XDR serialization (the `.rda` files Debian ships);
//! - [`data`]: the AirBase PM10 set of `r-cran-spacetime` (stations, states, series);
//! - [`pipeline`]: domains, the chronological split, windows, normalisation, masked batches;
//! - [`model`]: the network, the reversal layer, both adversarial strategies;
//! - [`train`]: the task (which stations teach what), training on any ironweave communicator,
//!   the elastic worker for `ironweave launch`, evaluation;
//! - [`experiment`]: the grid of methods × source domains × seeds and its table;
//! - [`hourly`]: multivariate input: the Beijing hourly series, PM2.5 alone or with meteorology;
//! - [`report`]: the HTML report (loss curves, forecast vs observed, the station map);
//! - [`run`]: one training run as a rank of an `ironweave launch` job, then scoring and the report.

#![warn(missing_docs)]

pub mod baselines;
pub mod beijing;
pub mod data;
pub mod domains;
pub mod experiment;
pub mod hourly;
pub mod metrics;
pub mod model;
pub mod pipeline;
pub mod rdata;
pub mod report;
pub mod run;
pub mod train;

/// Errors of the forecaster.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The data is missing or not what it should be; the message says what to install.
    #[error("{0}")]
    Data(String),
    /// An R data file this reader cannot read.
    #[error("R data format: {0}")]
    Format(String),
    /// A setting that cannot work (unknown state, too few sources, ...).
    #[error("invalid setting: {0}")]
    Config(String),
    /// candle failed.
    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// ironweave's candle adapter failed.
    #[error(transparent)]
    Trainer(#[from] ironweave::candle::Error),
    /// A collective failed.
    #[error(transparent)]
    Transport(#[from] ironweave::Error),
    /// The job failed (ironweave's elastic runtime); `code` is the exit status to end with
    /// (75: a committed iteration was lost, restarting cannot help).
    #[error("{message}")]
    Job {
        /// Exit status.
        code: i32,
        /// What happened.
        message: String,
    },
    /// Writing results failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being written or read.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// Result of the forecaster.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Batches are a function of (seed, iteration, rank), so a recovered run draws what the
/// uninterrupted one drew: ironweave's [`SplitMix64`](ironweave::SplitMix64) seeded from
/// several words.
#[derive(Debug, Clone)]
pub struct Rng(ironweave::SplitMix64);

impl Rng {
    /// Seeded from any number of words: each is folded into the state, which is then replaced
    /// by SplitMix64's mixed output. (Folding alone, with the state only advanced by its
    /// constant, made (seed, iteration, rank) triples share streams: rank 1 at iteration 1
    /// drew rank 0's batch of iteration 2.)
    pub fn new(words: &[u64]) -> Rng {
        let mut g = ironweave::SplitMix64(0x243F_6A88_85A3_08D3);
        for &w in words {
            g.0 ^= w;
            g.0 = g.next_u64();
        }
        Rng(g)
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (`n > 0`; multiply-shift, no modulo bias).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;
    use std::collections::HashSet;

    #[test]
    fn every_seed_iteration_and_rank_draws_its_own_batch() {
        // 10 seeds x 25 iterations x 4 ranks: 1,000 batches of 64 windows out of 100,000
        let mut seen = HashSet::new();
        let mut windows = HashSet::new();
        for seed in 1..=10u64 {
            for iter in 1..=25u64 {
                for rank in 0..4u64 {
                    let mut r = Rng::new(&[seed, iter, rank]);
                    let batch: Vec<usize> = (0..64).map(|_| r.below(100_000)).collect();
                    windows.extend(batch.iter().copied());
                    seen.insert(batch);
                }
            }
        }
        assert_eq!(seen.len(), 1000, "batches shared between (seed, iteration, rank) triples");
        // 64,000 draws from 100,000: about 47,000 distinct windows if independent
        assert!(windows.len() > 45_000, "{} distinct windows", windows.len());
    }
}

//! Forecast errors: one accumulator of squared and absolute errors and of the observations'
//! moments, read out as RMSE, MAE and R². The daily German forecasts (per horizon day) and the
//! hourly Beijing forecasts (per lead in hours) are scored by the same arithmetic.

use serde::{Deserialize, Serialize};

/// Sums over (forecast, observation) pairs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ErrorSums {
    se: f64,
    ae: f64,
    so: f64,
    so2: f64,
    n: usize,
}

impl ErrorSums {
    /// Adds one forecast of an observed value (a missing observation is the caller's to skip).
    pub fn add(&mut self, forecast: f32, observed: f32) {
        let (p, o) = (f64::from(forecast), f64::from(observed));
        let e = p - o;
        self.se += e * e;
        self.ae += e.abs();
        self.so += o;
        self.so2 += o * o;
        self.n += 1;
    }

    /// Adds everything `other` summed.
    pub fn merge(&mut self, other: &ErrorSums) {
        self.se += other.se;
        self.ae += other.ae;
        self.so += other.so;
        self.so2 += other.so2;
        self.n += other.n;
    }

    /// Root mean squared error (NaN with nothing added).
    pub fn rmse(&self) -> f64 {
        self.mean(self.se).sqrt()
    }

    /// Mean absolute error (NaN with nothing added).
    pub fn mae(&self) -> f64 {
        self.mean(self.ae)
    }

    /// 1 − squared error / the observations' sum of squared deviations (NaN with fewer than
    /// two observations or constant ones).
    pub fn r2(&self) -> f64 {
        if self.n < 2 {
            return f64::NAN;
        }
        let sst = self.so2 - self.so * self.so / self.n as f64;
        if sst > 0.0 {
            1.0 - self.se / sst
        } else {
            f64::NAN
        }
    }

    /// The scores at `lead`.
    pub fn at(&self, lead: usize) -> LeadMetrics {
        LeadMetrics { lead, rmse: self.rmse(), mae: self.mae(), r2: self.r2(), n: self.n }
    }

    fn mean(&self, x: f64) -> f64 {
        if self.n == 0 {
            f64::NAN
        } else {
            x / self.n as f64
        }
    }
}

/// Errors at one lead (days ahead for the daily forecasts, hours ahead for the hourly ones),
/// µg/m³.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LeadMetrics {
    /// Steps ahead.
    pub lead: usize,
    /// Root mean squared error.
    pub rmse: f64,
    /// Mean absolute error.
    pub mae: f64,
    /// 1 − squared error / variance of the observations scored.
    pub r2: f64,
    /// Observed targets scored.
    pub n: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_match_their_definitions() {
        let mut s = ErrorSums::default();
        for (p, o) in [(1.0, 2.0), (4.0, 4.0), (3.0, 6.0)] {
            s.add(p, o);
        }
        // errors -1, 0, -3; observations 2, 4, 6 (mean 4, squared deviations 8)
        let m = s.at(2);
        assert_eq!((m.lead, m.n), (2, 3));
        assert!((m.rmse - (10.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert!((m.mae - 4.0 / 3.0).abs() < 1e-12);
        assert!((m.r2 - (1.0 - 10.0 / 8.0)).abs() < 1e-12);
        let mut halves = ErrorSums::default();
        halves.add(1.0, 2.0);
        let mut rest = ErrorSums::default();
        rest.add(4.0, 4.0);
        rest.add(3.0, 6.0);
        halves.merge(&rest);
        assert_eq!(halves, s);
        let empty = ErrorSums::default().at(1);
        assert!(empty.rmse.is_nan() && empty.mae.is_nan() && empty.r2.is_nan() && empty.n == 0);
    }
}

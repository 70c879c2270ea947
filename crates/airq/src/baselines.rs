//! The forecasts a forecaster is expected to beat, fitted on exactly what the networks learn
//! from (the sources' training windows and the target's labelled ones:
//! `train::Prepared::training_windows`): a seasonal climatology and a ridge autoregression,
//! both closed form and deterministic. Persistence needs no fitting (`train::predict`).

use crate::data::AirData;
use crate::pipeline::{Norm, Window};
use crate::{Error, Result};

/// Days either side of a day of year pooled into its climatological mean: with few labelled
/// days a single calendar day has too few observations.
pub const CLIMATOLOGY_HALF_WIDTH: usize = 15;

/// Lags of the ridge autoregression (the window's input days).
pub const RIDGE_LAGS: usize = 14;

/// The ridge penalty on the standardised lags (the intercept is not penalised).
pub const RIDGE_PENALTY: f64 = 1.0;

/// Calendar slot 0..366 of day `d` of the series (a 4-year cycle folded onto one year).
fn slot(data: &AirData, d: usize) -> usize {
    let phase = ((data.first_day + d as i64).rem_euclid(1461) as f64 / 365.25).fract();
    ((phase * 366.0) as usize).min(365)
}

/// Day-of-year mean of the observed targets of the training windows, smoothed over
/// ±[`CLIMATOLOGY_HALF_WIDTH`] days; the overall mean where a slot has nothing near it.
#[derive(Debug, Clone)]
pub struct Climatology {
    mean: Vec<f32>,
}

impl Climatology {
    /// Fits on the observed target days (`horizon` after each) of `training` windows.
    pub fn fit(d: &AirData, training: &[Window], horizon: usize) -> Result<Climatology> {
        let h = horizon;
        let (mut sum, mut n) = (vec![0f64; 366], vec![0u64; 366]);
        // each observed target day once per station
        let mut seen = std::collections::HashSet::new();
        for w in training {
            let x = d.series(usize::from(w.station));
            for day in w.day as usize + 1..=w.day as usize + h {
                if x[day].is_finite() && seen.insert((w.station, day as u32)) {
                    sum[slot(d, day)] += f64::from(x[day]);
                    n[slot(d, day)] += 1;
                }
            }
        }
        let total: u64 = n.iter().sum();
        if total == 0 {
            return Err(Error::Config("climatology: no observed training targets to average".into()));
        }
        let overall = sum.iter().sum::<f64>() / total as f64;
        let k = CLIMATOLOGY_HALF_WIDTH as i64;
        let mean = (0..366i64)
            .map(|s| {
                let (mut a, mut c) = (0f64, 0u64);
                for o in -k..=k {
                    let j = (s + o).rem_euclid(366) as usize;
                    a += sum[j];
                    c += n[j];
                }
                (if c > 0 { a / c as f64 } else { overall }) as f32
            })
            .collect();
        Ok(Climatology { mean })
    }

    /// The forecast of each horizon day of `ws`.
    pub fn predict(&self, data: &AirData, ws: &[Window], horizon: usize) -> Vec<Vec<f32>> {
        ws.iter().map(|w| (1..=horizon).map(|h| self.mean[slot(data, w.day as usize + h)]).collect()).collect()
    }
}

/// Ridge regression per horizon day on the window's last [`RIDGE_LAGS`] days (normalised;
/// a missing day is the mean, with a flag per lag saying it was missing) and the day of
/// year (sine and cosine of today), closed form.
#[derive(Debug, Clone)]
pub struct RidgeAr {
    /// Per horizon day: intercept, then the features' weights.
    weights: Vec<Vec<f64>>,
    mean: f64,
    std: f64,
}

const FEATURES: usize = 2 * RIDGE_LAGS + 2;

fn features(data: &AirData, w: Window, mean: f64, std: f64, out: &mut [f64; FEATURES]) {
    let x = data.series(usize::from(w.station));
    let t = w.day as usize;
    for l in 0..RIDGE_LAGS {
        let v = t.checked_sub(l).map(|i| x[i]).filter(|v| v.is_finite());
        out[l] = v.map_or(0.0, |v| (f64::from(v) - mean) / std);
        out[RIDGE_LAGS + l] = if v.is_some() { 0.0 } else { 1.0 };
    }
    let doy = ((data.first_day + t as i64).rem_euclid(1461) as f64 / 365.25).fract() * std::f64::consts::TAU;
    out[2 * RIDGE_LAGS] = doy.sin();
    out[2 * RIDGE_LAGS + 1] = doy.cos();
}

impl RidgeAr {
    /// Fits on the `training` windows' observed targets (`horizon` days after each),
    /// normalised by `norm`.
    pub fn fit(d: &AirData, training: &[Window], horizon: usize, norm: Norm) -> Result<RidgeAr> {
        let h = horizon;
        let (mean, std) = (f64::from(norm.mean), f64::from(norm.std));
        let p = FEATURES + 1;
        // per horizon day: the normal equations over the windows observed that day
        let mut eqs: Vec<NormalEquations> = (0..h).map(|_| NormalEquations::new(p, 1)).collect();
        let mut f = [0f64; FEATURES];
        let mut row = vec![0f64; p];
        for &w in training {
            features(d, w, mean, std, &mut f);
            row[0] = 1.0;
            row[1..].copy_from_slice(&f);
            let x = d.series(usize::from(w.station));
            for (k, eq) in eqs.iter_mut().enumerate() {
                let y = x[w.day as usize + 1 + k];
                if y.is_finite() {
                    eq.add(&row, &[(f64::from(y) - mean) / std]);
                }
            }
        }
        let weights = eqs
            .into_iter()
            .enumerate()
            .map(|(k, eq)| {
                if eq.rows() == 0 {
                    return Err(Error::Config(format!(
                        "ridge autoregression: no observed training target {} day(s) ahead",
                        k + 1
                    )));
                }
                eq.solve_ridge(RIDGE_PENALTY)
                    .and_then(|mut w| w.pop())
                    .ok_or_else(|| Error::Config("ridge autoregression: singular normal equations".into()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RidgeAr { weights, mean, std })
    }

    /// The forecast of each horizon day of `ws`, µg/m³.
    pub fn predict(&self, data: &AirData, ws: &[Window]) -> Vec<Vec<f32>> {
        let mut f = [0f64; FEATURES];
        ws.iter()
            .map(|&w| {
                features(data, w, self.mean, self.std, &mut f);
                self.weights
                    .iter()
                    .map(|b| {
                        let z = b[0] + b[1..].iter().zip(&f).map(|(a, x)| a * x).sum::<f64>();
                        (z * self.std + self.mean) as f32
                    })
                    .collect()
            })
            .collect()
    }
}

/// The normal equations of least-squares fits that share their rows and differ in their
/// targets: X'X (its upper triangle accumulated) and X'y per target. The daily ridge (one
/// target per horizon day, each over the windows observed that day) and the hourly ridge (one
/// system, a target per lead) both accumulate here.
#[derive(Debug, Clone)]
pub(crate) struct NormalEquations {
    p: usize,
    xtx: Vec<f64>,
    xty: Vec<Vec<f64>>,
    rows: usize,
}

impl NormalEquations {
    /// Empty equations for `p` weights (the first an intercept) and `targets` targets.
    pub(crate) fn new(p: usize, targets: usize) -> NormalEquations {
        NormalEquations { p, xtx: vec![0.0; p * p], xty: vec![vec![0.0; p]; targets], rows: 0 }
    }

    /// Adds one row `x` (length p) with a value `ys[t]` per target.
    pub(crate) fn add(&mut self, x: &[f64], ys: &[f64]) {
        let p = self.p;
        for i in 0..p {
            let xi = x[i];
            if xi == 0.0 {
                continue;
            }
            let row = &mut self.xtx[i * p..(i + 1) * p];
            for j in i..p {
                row[j] += xi * x[j];
            }
        }
        for (b, &y) in self.xty.iter_mut().zip(ys) {
            for i in 0..p {
                b[i] += x[i] * y;
            }
        }
        self.rows += 1;
    }

    /// Rows added.
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// The ridge weights of each target: `penalty` on every weight but the intercept; `None`
    /// if the system is singular.
    pub(crate) fn solve_ridge(mut self, penalty: f64) -> Option<Vec<Vec<f64>>> {
        let p = self.p;
        for i in 0..p {
            for j in 0..i {
                self.xtx[i * p + j] = self.xtx[j * p + i];
            }
            if i > 0 {
                self.xtx[i * p + i] += penalty;
            }
        }
        self.xty.iter().map(|b| solve_spd(&mut self.xtx.clone(), b, p)).collect()
    }
}

/// Solves `a x = b` for a symmetric positive definite `n × n` matrix `a` (row-major) by
/// Cholesky; `None` if it is not positive definite.
pub(crate) fn solve_spd(a: &mut [f64], b: &[f64], n: usize) -> Option<Vec<f64>> {
    // a = L L', L stored in the lower triangle of a
    for j in 0..n {
        let mut s = a[j * n + j];
        for k in 0..j {
            s -= a[j * n + k] * a[j * n + k];
        }
        if s <= 0.0 || !s.is_finite() {
            return None;
        }
        let l = s.sqrt();
        a[j * n + j] = l;
        for i in j + 1..n {
            let mut s = a[i * n + j];
            for k in 0..j {
                s -= a[i * n + k] * a[j * n + k];
            }
            a[i * n + j] = s / l;
        }
    }
    let mut y = b.to_vec();
    for i in 0..n {
        for k in 0..i {
            y[i] -= a[i * n + k] * y[k];
        }
        y[i] /= a[i * n + i];
    }
    for i in (0..n).rev() {
        for k in i + 1..n {
            y[i] -= a[k * n + i] * y[k];
        }
        y[i] /= a[i * n + i];
    }
    Some(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{State, Station};
    use crate::pipeline::{windows, WindowSpec};

    /// One station, `days` days of `f(day)`.
    fn one_station(days: usize, f: impl Fn(usize) -> f32) -> AirData {
        AirData {
            stations: vec![Station { code: "X".into(), lon: 0.0, lat: 0.0, state: 0 }],
            states: vec![State { name: "S".into(), rings: vec![] }],
            first_day: 0,
            days,
            pm10: (0..days).map(f).collect(),
        }
    }

    #[test]
    fn ridge_recovers_an_autoregression_and_climatology_a_season() {
        // x(t+1) = 0.6 x(t) + 8 + a seasonal swing: linear in the last day and the day of year
        let mut x = vec![20f32];
        for t in 0..2000usize {
            let doy = ((t as f64 / 365.25).fract() * std::f64::consts::TAU) as f32;
            x.push(0.6 * x[t] + 8.0 + 3.0 * doy.sin());
        }
        let d = one_station(x.len(), |t| x[t]);
        let spec = WindowSpec::default();
        let ws = windows(&d, &[0], 0..1500, &spec);
        let norm = crate::pipeline::Norm::fit_parts(&d, &[(&[0], 0..1500)]).unwrap();
        let r = RidgeAr::fit(&d, &ws, spec.horizon, norm).unwrap();
        let test = windows(&d, &[0], 1500..2000, &spec);
        let p = r.predict(&d, &test);
        let err = test.iter().zip(&p).map(|(w, p)| (p[0] - x[w.day as usize + 1]).abs()).fold(0f32, f32::max);
        // the series spans ~17..23: the fit is within a small fraction of it
        assert!(err < 0.3, "largest error {err}");
        // a pure season: the smoothed day-of-year mean follows it within its smoothing
        let d = one_station(1461 * 2, |t| 30.0 + 10.0 * ((t as f64 / 365.25).fract() * std::f64::consts::TAU).sin() as f32);
        let ws = windows(&d, &[0], 0..1461, &spec);
        let c = Climatology::fit(&d, &ws, spec.horizon).unwrap();
        let test = windows(&d, &[0], 1461..2900, &spec);
        let p = c.predict(&d, &test, spec.horizon);
        let err = test.iter().zip(&p).map(|(w, p)| (p[0] - d.pm10[w.day as usize + 1]).abs()).fold(0f32, f32::max);
        // ±15 days of a 10-amplitude sine: at most 10 (1 - sinc) ≈ 0.3 off at the peaks
        assert!(err < 0.5, "largest error {err}");
        // nothing to learn from is an error, not a forecast of NaN
        assert!(Climatology::fit(&d, &[], spec.horizon).is_err());
        assert!(RidgeAr::fit(&d, &[], spec.horizon, norm).is_err());
    }

    #[test]
    fn cholesky_solves_a_known_system() {
        // [[4, 2], [2, 3]] x = [2, 1] -> x = [0.5, 0]
        let mut a = vec![4.0, 2.0, 2.0, 3.0];
        let x = solve_spd(&mut a, &[2.0, 1.0], 2).unwrap();
        assert!((x[0] - 0.5).abs() < 1e-12 && x[1].abs() < 1e-12, "{x:?}");
        let mut bad = vec![1.0, 2.0, 2.0, 1.0];
        assert!(solve_spd(&mut bad, &[1.0, 1.0], 2).is_none());
    }
}

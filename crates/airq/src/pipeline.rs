//! From station series to training windows: domains (states), a chronological split, windows
//! of the past `lookback` days → the next `horizon` days, a normalisation fitted on training
//! data only, and batches with the missing targets masked out of the loss.
//!
//! **Missing values.** About half the values are missing. An input day that is missing enters
//! the network as value 0 *and* an "observed" flag 0 (a separate input channel), so the network
//! can tell "missing" from "average"; a window needs `min_observed` of its input days and the
//! last one (today: persistence needs it, and every method is scored on the same windows). A
//! missing target is left out of the loss by a 0 in the mask, never filled.
//!
//! **No leaks.** A window belongs to the split its *target* days fall in (all of them);
//! inputs may reach back into the previous split (that is the past, known at forecast time).
//! The normalisation's mean and spread come from the training split of the stations a model
//! trains on.

use std::ops::Range;

use serde::Serialize;

use crate::data::AirData;
use crate::{Error, Result};

/// Input channels per day: normalised PM10 (0 where missing), observed flag, and the season
/// (sin and cos of the day of the year).
pub const CHANNELS: usize = 4;

/// A chronological split of the series, in days from its first day.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Split {
    /// Training days (1998–2005).
    pub train: Range<usize>,
    /// Validation days (2006–2007).
    pub val: Range<usize>,
    /// Test days (2008–2009).
    pub test: Range<usize>,
}

impl Split {
    /// 1998–2005 / 2006–2007 / 2008–2009 of the 4383-day series.
    pub fn by_years(days: usize) -> Result<Split> {
        let (a, b) = (2922, 3652); // 1998-01-01 + 8 years (2 leap days); + 2 years
        if days < b + 2 {
            return Err(Error::Data(format!("a series of {days} days is too short for the 1998–2005/2006–07/2008–09 split")));
        }
        Ok(Split { train: 0..a, val: a..b, test: b..days })
    }

    /// The same split over a shorter series (tests on a slice): 2/3, 1/6, 1/6.
    pub fn proportional(days: usize) -> Split {
        let a = days * 2 / 3;
        let b = a + (days - a) / 2;
        Split { train: 0..a, val: a..b, test: b..days }
    }
}

/// Window shape and validity rules.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WindowSpec {
    /// Past days in a window's input.
    pub lookback: usize,
    /// Future days forecast (1: tomorrow).
    pub horizon: usize,
    /// Share of the input days that must be observed.
    pub min_observed: f64,
}

impl Default for WindowSpec {
    fn default() -> Self {
        WindowSpec { lookback: 14, horizon: 3, min_observed: 0.5 }
    }
}

/// One window: station `station`, input days `day + 1 - lookback ..= day`, targets
/// `day + 1 ..= day + horizon`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Station index.
    pub station: u16,
    /// The last input day ("today").
    pub day: u32,
}

/// Mean and spread of PM10 for normalising.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Norm {
    /// Mean, µg/m³.
    pub mean: f32,
    /// Standard deviation, µg/m³.
    pub std: f32,
}

impl Norm {
    /// Fitted on the observed values of `stations` within `days`.
    pub fn fit(data: &AirData, stations: &[usize], days: Range<usize>) -> Result<Norm> {
        Norm::fit_parts(data, &[(stations, days)])
    }

    /// Fitted on the observed values of each part's stations within its days.
    pub fn fit_parts(data: &AirData, parts: &[(&[usize], Range<usize>)]) -> Result<Norm> {
        let (mut n, mut s, mut s2) = (0f64, 0f64, 0f64);
        for (stations, days) in parts {
            for &st in *stations {
                for &v in &data.series(st)[days.clone()] {
                    if v.is_finite() {
                        n += 1.0;
                        s += f64::from(v);
                        s2 += f64::from(v) * f64::from(v);
                    }
                }
            }
        }
        if n < 2.0 {
            let stations: Vec<&[usize]> = parts.iter().map(|p| p.0).collect();
            return Err(Error::Data(format!("no observed training values at stations {stations:?} to normalise with")));
        }
        let mean = s / n;
        let var = (s2 / n - mean * mean).max(1e-6);
        Ok(Norm { mean: mean as f32, std: var.sqrt() as f32 })
    }
}

/// The valid windows of `stations` whose targets all lie in `days`.
pub fn windows(data: &AirData, stations: &[usize], days: Range<usize>, spec: &WindowSpec) -> Vec<Window> {
    let mut out = Vec::new();
    let need = (spec.min_observed * spec.lookback as f64).ceil() as usize;
    // targets t + 1 ..= t + horizon inside `days`; inputs t + 1 - lookback ..= t inside the series
    let lo = days.start.saturating_sub(1).max(spec.lookback.max(1) - 1);
    let hi = days.end.min(data.days).saturating_sub(spec.horizon);
    for &st in stations {
        let x = data.series(st);
        for t in lo..hi {
            let input = &x[t + 1 - spec.lookback..=t];
            let targets = &x[t + 1..=t + spec.horizon];
            if !x[t].is_finite() || !targets.iter().any(|v| v.is_finite()) {
                continue;
            }
            if input.iter().filter(|v| v.is_finite()).count() < need {
                continue;
            }
            out.push(Window { station: st as u16, day: t as u32 });
        }
    }
    out
}

/// A batch laid out for the model: inputs `[n, lookback, CHANNELS]`, targets and mask
/// `[n, horizon]` (mask 0: missing or not to be learned from), and a domain label per window.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    /// Windows in the batch.
    pub n: usize,
    /// Inputs, row-major `[n, lookback, CHANNELS]`.
    pub x: Vec<f32>,
    /// Normalised targets (0 where masked).
    pub y: Vec<f32>,
    /// 1 where the target counts in the regression loss.
    pub mask: Vec<f32>,
    /// Domain label per window (its meaning is the method's).
    pub domain: Vec<u32>,
}

impl Batch {
    /// Appends `w`; `labelled: false` masks all its targets (a target-domain window whose
    /// label the model may not see).
    pub fn push(&mut self, data: &AirData, norm: &Norm, spec: &WindowSpec, w: Window, labelled: bool, domain: u32) {
        let x = data.series(usize::from(w.station));
        let t = w.day as usize;
        let first = t + 1 - spec.lookback;
        for (i, &v) in x[first..=t].iter().enumerate() {
            let d = first + i;
            let doy = ((data.first_day + d as i64).rem_euclid(1461) as f64 / 365.25).fract() * std::f64::consts::TAU;
            let (val, obs) = if v.is_finite() { ((v - norm.mean) / norm.std, 1.0) } else { (0.0, 0.0) };
            self.x.extend([val, obs, doy.sin() as f32, doy.cos() as f32]);
        }
        for &v in &x[t + 1..=t + spec.horizon] {
            let ok = labelled && v.is_finite();
            self.y.push(if ok { (v - norm.mean) / norm.std } else { 0.0 });
            self.mask.push(if ok { 1.0 } else { 0.0 });
        }
        self.domain.push(domain);
        self.n += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{State, Station};

    fn toy(series: &[f32]) -> AirData {
        AirData {
            stations: vec![Station { code: "X".into(), lon: 0.0, lat: 0.0, state: 0 }],
            states: vec![State { name: "S".into(), rings: vec![] }],
            first_day: 10227,
            days: series.len(),
            pm10: series.to_vec(),
        }
    }

    #[test]
    fn windows_need_today_and_enough_observed_inputs_and_stay_in_their_split() {
        let nan = f32::NAN;
        // days:        0    1    2    3    4    5    6    7    8    9
        let d = toy(&[1.0, nan, 3.0, 4.0, nan, 6.0, 7.0, nan, nan, 10.0]);
        let spec = WindowSpec { lookback: 3, horizon: 2, min_observed: 0.6 };
        let w: Vec<u32> = windows(&d, &[0], 0..10, &spec).iter().map(|w| w.day).collect();
        // today observed, >= 2 of 3 inputs observed, >= 1 target observed, targets within 0..10
        assert_eq!(w, vec![2, 3, 5]);
        // targets must fall in the split: nothing whose targets cross 6
        let w: Vec<u32> = windows(&d, &[0], 0..6, &spec).iter().map(|w| w.day).collect();
        assert_eq!(w, vec![2, 3]);
        let w: Vec<u32> = windows(&d, &[0], 6..10, &spec).iter().map(|w| w.day).collect();
        assert_eq!(w, vec![5], "inputs reach back, targets start at 6 or later");
    }

    #[test]
    fn missing_targets_are_masked_not_zero_filled_into_the_loss() {
        let nan = f32::NAN;
        let d = toy(&[10.0, 20.0, 30.0, nan, 50.0, 60.0]);
        let spec = WindowSpec { lookback: 2, horizon: 2, min_observed: 0.5 };
        let norm = Norm::fit(&d, &[0], 0..5).unwrap();
        assert_eq!(norm.mean, 27.5, "fitted on the days given only");
        let mut b = Batch::default();
        b.push(&d, &norm, &spec, Window { station: 0, day: 2 }, true, 0);
        assert_eq!(b.mask, vec![0.0, 1.0], "day 3 missing, day 4 observed");
        assert_eq!(b.y[0], 0.0);
        assert!((b.y[1] - (50.0 - 27.5) / norm.std).abs() < 1e-6);
        // inputs: value and an observed flag per day
        assert_eq!(b.x.len(), 2 * CHANNELS);
        assert_eq!((b.x[1], b.x[CHANNELS + 1]), (1.0, 1.0));
        let mut u = Batch::default();
        u.push(&d, &norm, &spec, Window { station: 0, day: 2 }, false, 1);
        assert_eq!(u.mask, vec![0.0, 0.0], "an unlabelled window teaches the regression nothing");
        let mut m = Batch::default();
        m.push(&d, &norm, &spec, Window { station: 0, day: 3 }, true, 0);
        assert_eq!((m.x[CHANNELS], m.x[CHANNELS + 1]), (0.0, 0.0), "a missing input day is flagged");
    }

    #[test]
    fn the_loss_ignores_masked_targets_whatever_the_prediction() {
        let y = [1.0f32, 0.0, -1.0];
        let mask = [1.0f32, 0.0, 1.0];
        let a = crate::model::masked_mse_host(&[0.0, 100.0, 0.0], &y, &mask);
        let b = crate::model::masked_mse_host(&[0.0, -7.0, 0.0], &y, &mask);
        assert_eq!(a, b);
        assert_eq!(a, 1.0);
    }
}

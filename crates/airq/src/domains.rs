//! Domains with real shift: the stations regrouped by what their series look like instead of
//! by state. German states' rural-background PM10 series are nearly indistinguishable (the
//! domain probe of docs/AIR-QUALITY.md is 0–6 points above chance), so there is little for an
//! adversary to remove; grouped by their level and their winter peak, the domains differ by
//! construction, and the same experiment asks whether the adversary pays where the shift is real.
//!
//! Each station's level is its mean PM10 over the training days, its winter peak the ratio of
//! its November–February mean to its May–August mean; each is split at the median over the
//! stations, which gives four domains that take the place of the states: `low-flat`,
//! `low-winter`, `high-flat`, `high-winter`. Only training days are read, so the grouping knows
//! nothing of the test years.

use std::ops::Range;

use crate::data::{civil, AirData, State};
use crate::{Error, Result};

/// The four domains' names, in index order (`level-season`).
pub const NAMES: [&str; 4] = ["low-flat", "low-winter", "high-flat", "high-winter"];

/// Observed training days a station needs for its profile (fewer: it is left out, in no domain).
pub const MIN_DAYS: usize = 120;

/// A station's profile over the training days.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Profile {
    /// Mean PM10, µg/m³.
    pub level: f64,
    /// November–February mean over May–August mean.
    pub winter_peak: f64,
}

/// The profile of every station (`None`: fewer than [`MIN_DAYS`] observed days in either
/// season or overall).
pub fn profiles(data: &AirData, train: Range<usize>) -> Vec<Option<Profile>> {
    let month = |d: usize| -> u32 { civil(data.first_day + d as i64)[5..7].parse().unwrap_or(1) };
    let months: Vec<u32> = train.clone().map(month).collect();
    (0..data.stations.len())
        .map(|s| {
            let x = data.series(s);
            let (mut all, mut win, mut sum) = ((0f64, 0usize), (0f64, 0usize), (0f64, 0usize));
            for (d, &m) in train.clone().zip(&months) {
                let v = x[d];
                if !v.is_finite() {
                    continue;
                }
                let v = f64::from(v);
                all = (all.0 + v, all.1 + 1);
                if matches!(m, 11 | 12 | 1 | 2) {
                    win = (win.0 + v, win.1 + 1);
                } else if (5..=8).contains(&m) {
                    sum = (sum.0 + v, sum.1 + 1);
                }
            }
            let enough = all.1 >= MIN_DAYS && win.1 >= MIN_DAYS / 4 && sum.1 >= MIN_DAYS / 4 && sum.0 > 0.0;
            enough.then(|| Profile { level: all.0 / all.1 as f64, winter_peak: (win.0 / win.1 as f64) / (sum.0 / sum.1 as f64) })
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl AirData {
    /// The stations grouped into the four profile domains of [`NAMES`] in place of the states
    /// (their polygons dropped); a station without a profile is left out.
    pub fn by_profile(mut self, train: Range<usize>) -> Result<AirData> {
        if self.beijing().is_some() {
            return Err(Error::Config("profile domains regroup the German stations: add no irrelevant source to them".into()));
        }
        let p = profiles(&self, train);
        let known: Vec<Profile> = p.iter().flatten().copied().collect();
        if known.len() < 8 {
            return Err(Error::Data(format!(
                "{} stations have {MIN_DAYS} observed training days; profile domains need at least 8",
                known.len()
            )));
        }
        let (lm, wm) = (median(known.iter().map(|x| x.level).collect()), median(known.iter().map(|x| x.winter_peak).collect()));
        self.states = NAMES.iter().map(|n| State { name: (*n).into(), rings: Vec::new() }).collect();
        let days = self.days;
        let (mut stations, mut pm10) = (Vec::new(), Vec::new());
        for (i, (st, prof)) in self.stations.iter().zip(&p).enumerate() {
            if let Some(x) = prof {
                let mut st = st.clone();
                st.state = usize::from(x.level > lm) * 2 + usize::from(x.winter_peak > wm);
                stations.push(st);
                pm10.extend_from_slice(&self.pm10[i * days..(i + 1) * days]);
            }
        }
        self.stations = stations;
        self.pm10 = pm10;
        Ok(self)
    }

    /// Whether the domains are [`AirData::by_profile`]'s.
    pub fn is_by_profile(&self) -> bool {
        self.states.first().is_some_and(|s| s.name == NAMES[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Station;

    /// Two years from 1998-01-01; station `i` at level `10 + 10·(i / 4)` with a winter bump
    /// of `5·(i % 2)` and station 8 never observed.
    fn data() -> AirData {
        let days = 730;
        let first_day = 10_227; // 1998-01-01
        let mut pm10 = Vec::new();
        let mut stations = Vec::new();
        for i in 0..9usize {
            stations.push(Station { code: format!("S{i}"), lon: 8.0, lat: 52.0, state: 0 });
            for d in 0..days {
                let m: u32 = civil(first_day + d as i64)[5..7].parse().unwrap();
                let winter = if matches!(m, 11 | 12 | 1 | 2) { 5.0 * (i % 2) as f32 } else { 0.0 };
                pm10.push(if i == 8 { f32::NAN } else { 10.0 + 10.0 * (i / 4) as f32 + winter + (i % 4) as f32 * 0.1 });
            }
        }
        let states = vec![State { name: "Niedersachsen".into(), rings: Vec::new() }];
        AirData { stations, states, first_day, days, pm10 }
    }

    #[test]
    fn stations_are_grouped_by_level_and_winter_peak() {
        let d = data().by_profile(0..730).unwrap();
        assert!(d.is_by_profile());
        assert_eq!(d.stations.len(), 8, "the station without observations is left out");
        let groups: Vec<&str> = d.stations.iter().map(|s| d.states[s.state].name.as_str()).collect();
        assert_eq!(
            groups,
            ["low-flat", "low-winter", "low-flat", "low-winter", "high-flat", "high-winter", "high-flat", "high-winter"]
        );
        // the series moved with their stations
        assert!((d.series(7)[200] - 20.3).abs() < 1e-4, "{}", d.series(7)[200]);
    }

    #[test]
    fn too_few_profiles_is_an_error() {
        let mut d = data();
        d.pm10[..4 * 730].iter_mut().for_each(|x| *x = f32::NAN);
        let e = d.by_profile(0..730).unwrap_err().to_string();
        assert!(e.contains("at least 8"), "{e}");
    }
}

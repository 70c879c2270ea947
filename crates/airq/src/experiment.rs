//! The experiment grid: every method × number of source states × seed on one target, all in
//! one run (the baselines beside the adversarial methods), each model trained in-process on a
//! world of one, scored on the target's, the sources' and a never-seen state's test years; and
//! the table of means and spreads.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::baselines::{Climatology, RidgeAr};
use crate::data::AirData;
use crate::metrics::LeadMetrics;
use crate::pipeline::Split;
use crate::train::{evaluate, evaluate_with, fit, Evaluation, FitConfig, Forecaster, Method, Prepared, Task};
use crate::{Error, Result};

/// What to run.
#[derive(Debug, Clone, Serialize)]
pub struct Grid {
    /// Target state.
    pub target: String,
    /// The state never seen in training.
    pub unseen: Option<String>,
    /// Numbers of source states (`None`: all).
    pub sources: Vec<Option<usize>>,
    /// Seeds.
    pub seeds: Vec<u64>,
    /// Methods.
    pub methods: Vec<Method>,
    /// Training settings (the seed is replaced by each of `seeds`).
    pub fit: FitConfig,
    /// Labelled target days.
    pub target_days: usize,
    /// Target days the domain classifier sees unlabelled (0: the labelled ones).
    pub unlabelled_days: usize,
    /// Add the irrelevant source (Beijing PM2.5, [`crate::beijing`]) to every method's sources;
    /// the data must have been loaded [`AirData::with_beijing`].
    #[serde(default)]
    pub irrelevant: bool,
    /// The adversaries' final reversal weights to try (`[1.0]`: the paper's schedule alone);
    /// with several, each adversary's table row is the one whose mean target RMSE over seeds
    /// on the validation years is lowest ([`choose_lambda`]), never chosen on the test years.
    pub lambdas: Vec<f64>,
    /// The domains are the stations grouped by level and winter peak
    /// ([`crate::domains`]), not the states; the data must have been regrouped.
    pub by_profile: bool,
}

impl Grid {
    /// One line naming every setting that decides the table's numbers; `airq experiment`
    /// prints it above the table and docs/AIR-QUALITY.md carries it under each command (a test
    /// runs each documented command with `--dry-run` and compares).
    pub fn settings(&self) -> String {
        let k: Vec<String> = self.sources.iter().map(|&k| k_label(k)).collect();
        let seeds: Vec<String> = self.seeds.iter().map(u64::to_string).collect();
        let methods: Vec<&str> = self.methods.iter().map(|m| m.name()).collect();
        let f = &self.fit;
        format!(
            "settings: target {}, unseen {}, target days {}, unlabelled days {}, sources {}, seeds {}, iterations {}, batch {}, lr {}, conv {}, hidden {}, methods {}",
            self.target,
            self.unseen.as_deref().unwrap_or("none"),
            self.target_days,
            if self.unlabelled_days == 0 {
                "= target days".to_string()
            } else {
                crate::train::effective_unlabelled_days(self.target_days, self.unlabelled_days).to_string()
            },
            k.join(","),
            seeds.join(","),
            f.iterations,
            f.batch,
            f.lr,
            f.conv,
            f.hidden,
            methods.join(",")
        ) + if self.irrelevant { ", irrelevant source Beijing" } else { "" }
            + &self.lambda_setting()
            + if self.by_profile { ", domains by level and winter peak" } else { "" }
    }

    fn lambda_setting(&self) -> String {
        let l: Vec<String> = self.lambdas.iter().map(f64::to_string).collect();
        match self.lambdas.as_slice() {
            [x] if *x == 1.0 => String::new(),
            [_] => format!(", lambda {}", l[0]),
            _ => format!(", lambda {} chosen on the validation years", l.join(",")),
        }
    }
}

/// One trained (or persistence) model's scores.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// The method.
    pub method: Method,
    /// Source states used (names; empty for target-only and persistence).
    pub sources: Vec<String>,
    /// The grid's source count label (`1`, `2`, `all`, or `-`).
    pub k: String,
    /// Seed.
    pub seed: u64,
    /// The reversal layer's final weight (adversaries).
    #[serde(default)]
    pub lambda: Option<f64>,
    /// Scores.
    pub eval: Evaluation,
    /// The training domain loss over the last tenth of the iterations (adversarial methods).
    pub final_domain_loss: Option<f64>,
    /// Wall time of training and scoring, seconds.
    pub seconds: f64,
    /// The learned weight of each source (`grl-weighted`), in the order of `sources`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_weights: Option<Vec<f64>>,
}

fn k_label(k: Option<usize>) -> String {
    k.map_or_else(|| "all".into(), |k| k.to_string())
}

/// Runs the grid; `progress(done, total, last)` after each run.
pub fn run(data: Arc<AirData>, grid: &Grid, mut progress: impl FnMut(usize, usize, &RunResult)) -> Result<Vec<RunResult>> {
    if grid.seeds.is_empty() || grid.methods.is_empty() {
        return Err(Error::Config("the grid needs at least one seed and one method".into()));
    }
    if grid.lambdas.is_empty() || grid.lambdas.iter().any(|l| !l.is_finite() || *l < 0.0) {
        return Err(Error::Config(format!("--lambdas {:?}: give one or more finite weights ≥ 0", grid.lambdas)));
    }
    if grid.by_profile != data.is_by_profile() {
        return Err(Error::Config(
            "the grid's domains and the data's differ: regroup the data with AirData::by_profile for a profile grid, only then"
                .into(),
        ));
    }
    // settings that would fail in the middle of the grid fail before its first run
    for m in [Method::TargetOnly, Method::FineTune] {
        if grid.target_days == 0 && grid.methods.contains(&m) {
            return Err(Error::Config(format!(
                "--target-days 0 leaves {} nothing to learn from the target: drop it from --methods",
                m.name()
            )));
        }
    }
    if grid.target_days == 0
        && grid.unlabelled_days == 0
        && grid.methods.iter().any(|m| m.adversary() != crate::model::Adversary::None)
    {
        return Err(Error::Config(
            "--target-days 0 leaves the domain classifiers no target windows: give --unlabelled-days N (the unsupervised setting)".into(),
        ));
    }
    let split = Split::by_years(data.days)?;
    let comm = Arc::new(ironweave::transport::inproc::communicators(1)?.remove(0));
    // (method, k, seed): persistence once, target-only once per seed, the closed-form
    // baselines once per k (they do not depend on the seed), the others per k and seed
    // (method, k, seed, λ): the adversaries once per λ of the grid
    let mut jobs: Vec<(Method, Option<usize>, u64, Option<f64>)> = Vec::new();
    for &m in &grid.methods {
        match m {
            Method::Persistence => jobs.push((m, None, 0, None)),
            Method::TargetOnly => jobs.extend(grid.seeds.iter().map(|&s| (m, None, s, None))),
            Method::Climatology | Method::RidgeAr => jobs.extend(grid.sources.iter().map(|&k| (m, k, 0, None))),
            _ if m.adversary() != crate::model::Adversary::None => {
                for &k in &grid.sources {
                    for &l in &grid.lambdas {
                        jobs.extend(grid.seeds.iter().map(|&s| (m, k, s, Some(l))));
                    }
                }
            }
            _ => {
                for &k in &grid.sources {
                    jobs.extend(grid.seeds.iter().map(|&s| (m, k, s, None)));
                }
            }
        }
    }
    let total = jobs.len();
    let mut out = Vec::with_capacity(total);
    for (i, (m, k, seed, lambda)) in jobs.into_iter().enumerate() {
        let t0 = Instant::now();
        let mut task = Task::nearest(&data, &grid.target, k, grid.unseen.as_deref(), split.clone())?;
        if grid.irrelevant {
            task.sources.push(data.beijing().ok_or_else(|| {
                Error::Config(
                    "the grid adds the irrelevant source, and the data was loaded without it (AirData::with_beijing)".into(),
                )
            })?);
        }
        task.target_days = grid.target_days;
        task.unlabelled_days = grid.unlabelled_days;
        let sources =
            if m.uses_sources() { task.sources.iter().map(|&s| data.states[s].name.clone()).collect() } else { Vec::new() };
        let prep = Prepared::new(data.clone(), task, m)?;
        let mut source_weights = None;
        let (eval, final_domain_loss) = if m == Method::Persistence {
            (evaluate(None, &prep)?, None)
        } else if m == Method::Climatology {
            let c = Climatology::fit(&prep.data, &prep.training_windows(), prep.task.spec.horizon)?;
            (evaluate_with(Forecaster::Climatology(&c), &prep)?, None)
        } else if m == Method::RidgeAr {
            let r = RidgeAr::fit(&prep.data, &prep.training_windows(), prep.task.spec.horizon, prep.norm)?;
            (evaluate_with(Forecaster::RidgeAr(&r), &prep)?, None)
        } else {
            let f = fit(&prep, &comm, &FitConfig { seed, lambda: lambda.unwrap_or(grid.fit.lambda), ..grid.fit })?;
            let tail = &f.losses[f.losses.len() - (f.losses.len() / 10).max(1)..];
            let dom = (m.adversary() != crate::model::Adversary::None)
                .then(|| tail.iter().map(|l| f64::from(l.domain)).sum::<f64>() / tail.len() as f64);
            source_weights = f.net.source_weights();
            (evaluate(Some(&f.net), &prep)?, dom)
        };
        let r = RunResult {
            method: m,
            sources,
            k: if m.uses_sources() { k_label(k) } else { "-".into() },
            seed,
            lambda,
            eval,
            final_domain_loss,
            seconds: t0.elapsed().as_secs_f64(),
            source_weights,
        };
        progress(i + 1, total, &r);
        out.push(r);
    }
    Ok(out)
}

pub(crate) fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let sd = if v.len() > 1 { (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt() } else { 0.0 };
    (m, sd)
}

pub(crate) fn cell(v: &[f64]) -> String {
    if v.is_empty() || v.iter().any(|x| !x.is_finite()) {
        return "–".into();
    }
    let (m, sd) = mean_sd(v);
    if v.len() > 1 {
        format!("{m:.2} ± {sd:.2}")
    } else {
        format!("{m:.2}")
    }
}

/// Two-sided 95% quantile of Student's t with `df` degrees of freedom.
pub(crate) fn t95(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110,
        2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
    ];
    T.get(df.saturating_sub(1)).copied().unwrap_or(1.96)
}

/// `mean [lo, hi]` of paired differences: the 95% interval of their mean over seeds.
pub(crate) fn paired_cell(d: &[f64]) -> String {
    if d.is_empty() || d.iter().any(|x| !x.is_finite()) {
        return "–".into();
    }
    let (m, sd) = mean_sd(d);
    if d.len() < 2 {
        return format!("{m:+.2}");
    }
    let half = t95(d.len() - 1) * sd / (d.len() as f64).sqrt();
    format!("{m:+.2} [{:+.2}, {:+.2}]", m - half, m + half)
}

/// The markdown table: one row per (method, source count), means ± sample standard deviation
/// over seeds; `vs persistence` is the target RMSE's ratio to persistence's (below 1: better);
/// `Δ vs no-classifier` the target RMSE minus no-classifier's with the same sources, paired by
/// seed, with the 95% interval of its mean (a closed-form baseline, fitted once: minus
/// no-classifier's mean, no interval); `vs source-only` the sources' RMSE over source-only's
/// (paired by seed where both were trained); `domain probe` is the balanced accuracy (chance in
/// brackets) of a linear probe telling the domains apart from the features: the adversary's
/// counter, measured alike for every network.
/// With several λ in the grid, each adversary's row is its λ with the lowest mean target RMSE on
/// the validation years (named in the method cell).
pub fn table(results: &[RunResult]) -> String {
    let several = lambdas_of(results).len() > 1;
    let chosen = choose_lambda(results);
    let results = chosen.as_slice();
    let pers = results.iter().find(|r| r.method == Method::Persistence).map(|r| r.eval.target.rmse);
    let mut s = String::from(
        "| sources | method | seeds | target RMSE | target MAE | target R² | target RMSE, days 1–3 | vs persistence | Δ RMSE vs no-classifier (95% CI) | sources RMSE | vs source-only | unseen-state RMSE | domain probe (chance) |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let keys = row_keys(results);
    let find = |k: &str, m: Method, seed: Option<u64>| -> Vec<&RunResult> {
        results.iter().filter(|r| r.k == k && r.method == m && seed.is_none_or(|s| r.seed == s)).collect()
    };
    // `x` of each run against the same of `other`'s runs with the same k: paired by seed when
    // both were trained, else against `other`'s mean
    let against = |rs: &[&RunResult], k: &str, other: Method, x: &dyn Fn(&RunResult) -> Option<f64>, op: fn(f64, f64) -> f64| {
        let all = find(k, other, None);
        let mean: Vec<f64> = all.iter().filter_map(|r| x(r)).collect();
        rs.iter()
            .filter_map(|r| {
                let a = x(r)?;
                if r.method.trained() {
                    let b = find(k, other, Some(r.seed)).first().and_then(|o| x(o))?;
                    Some(op(a, b))
                } else {
                    (!mean.is_empty()).then(|| op(a, mean.iter().sum::<f64>() / mean.len() as f64))
                }
            })
            .collect::<Vec<f64>>()
    };
    for (k, m) in keys {
        let rs: Vec<&RunResult> = find(&k, m, None);
        let f = |g: &dyn Fn(&RunResult) -> Option<f64>| -> Vec<f64> { rs.iter().filter_map(|r| g(r)).collect() };
        let rmse = f(&|r| Some(r.eval.target.rmse));
        let ratio = match pers {
            Some(p) if p > 0.0 => cell(&rmse.iter().map(|x| x / p).collect::<Vec<_>>()),
            _ => "–".into(),
        };
        let dom = f(&|r| r.eval.probe.map(|d| d.balanced_accuracy));
        let dom = match rs.iter().find_map(|r| r.eval.probe) {
            Some(d) => format!("{} ({:.2})", cell(&dom), d.chance),
            None => "–".into(),
        };
        let delta = if m == Method::NoClassifier || k == "-" {
            "–".into()
        } else {
            let d = against(&rs, &k, Method::NoClassifier, &|r| Some(r.eval.target.rmse), |a, b| a - b);
            if m.trained() {
                paired_cell(&d)
            } else {
                d.first().map_or("–".into(), |x| format!("{x:+.2}"))
            }
        };
        let vs_src = if m == Method::SourceOnly || k == "-" {
            "–".into()
        } else {
            cell(&against(&rs, &k, Method::SourceOnly, &|r| r.eval.sources.as_ref().map(|x| x.rmse), |a, b| a / b))
        };
        let name = match rs.first().and_then(|r| r.lambda) {
            Some(l) if several => format!("{} (λ {l})", m.name()),
            _ => m.name().to_string(),
        };
        s += &format!(
            "| {k} | {name} | {} | {} | {} | {} | {} | {ratio} | {delta} | {} | {vs_src} | {} | {dom} |\n",
            rs.len(),
            cell(&rmse),
            cell(&f(&|r| Some(r.eval.target.mae))),
            cell(&f(&|r| Some(r.eval.target.r2))),
            cell(&f(&|r| Some(r.eval.target.rmse_horizon))),
            cell(&f(&|r| r.eval.sources.as_ref().map(|x| x.rmse))),
            cell(&f(&|r| r.eval.unseen.as_ref().map(|x| x.rmse))),
        );
    }
    s
}

/// The (source count, method) pairs of `results` in table order: baselines without sources
/// first, then by source count, methods in [`Method::ALL`]'s order.
fn row_keys(results: &[RunResult]) -> Vec<(String, Method)> {
    let mut keys: Vec<(String, Method)> = Vec::new();
    for r in results {
        if !keys.contains(&(r.k.clone(), r.method)) {
            keys.push((r.k.clone(), r.method));
        }
    }
    let order = |k: &str| match k {
        "-" => 0,
        "all" => usize::MAX,
        n => n.parse().unwrap_or(usize::MAX - 1),
    };
    keys.sort_by_key(|(k, m)| (order(k), Method::ALL.iter().position(|x| x == m)));
    keys
}

/// The target's test scores per horizon day: RMSE, MAE and R² (means over seeds) and the
/// RMSE's ratio to persistence's on the same day, one row per (method, source count) as in
/// [`table`] (λ chosen the same way). Empty when no run scored per day (results written
/// before the scores were kept per day).
pub fn horizon_table(results: &[RunResult]) -> String {
    let chosen = choose_lambda(results);
    let results = chosen.as_slice();
    let horizon = results.iter().map(|r| r.eval.target.days.len()).max().unwrap_or(0);
    if horizon == 0 {
        return String::new();
    }
    let pers: Vec<Option<f64>> = (0..horizon)
        .map(|h| results.iter().find(|r| r.method == Method::Persistence).and_then(|r| r.eval.target.days.get(h)).map(|d| d.rmse))
        .collect();
    let mut s = String::from("| sources | method | seeds |");
    let mut rule = String::from("|---|---|---|");
    for h in 1..=horizon {
        s += &format!(" day {h} RMSE | day {h} MAE | day {h} R² | day {h} vs persistence |");
        rule += "---|---|---|---|";
    }
    s += &format!("\n{rule}\n");
    for (k, m) in row_keys(results) {
        let rs: Vec<&RunResult> = results.iter().filter(|r| r.k == k && r.method == m).collect();
        s += &format!("| {k} | {} | {} |", m.name(), rs.len());
        for (h, p) in pers.iter().enumerate() {
            let get = |f: fn(&LeadMetrics) -> f64| {
                mean_sd(&rs.iter().filter_map(|r| r.eval.target.days.get(h).map(f)).collect::<Vec<_>>()).0
            };
            let rmse = get(|d| d.rmse);
            let vs = match p {
                Some(p) if *p > 0.0 && rmse.is_finite() => format!("{:.2}", rmse / p),
                _ => "–".into(),
            };
            let num = |x: f64| if x.is_finite() { format!("{x:.2}") } else { "–".into() };
            s += &format!(" {} | {} | {} | {vs} |", num(rmse), num(get(|d| d.mae)), num(get(|d| d.r2)));
        }
        s += "\n";
    }
    s
}

/// The distinct λ of the adversaries' runs, ascending.
fn lambdas_of(results: &[RunResult]) -> Vec<f64> {
    let mut l: Vec<f64> = results.iter().filter_map(|r| r.lambda).collect();
    l.sort_by(f64::total_cmp);
    l.dedup();
    l
}

/// Mean target RMSE on the validation years of the runs of (k, method, λ).
fn val_rmse(results: &[RunResult], k: &str, m: Method, l: f64) -> f64 {
    let v: Vec<f64> =
        results.iter().filter(|r| r.k == k && r.method == m && r.lambda == Some(l)).map(|r| r.eval.target_val.rmse).collect();
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// The runs the tables show: every run without a λ, and of each adversary (per source count)
/// only the runs of its λ with the lowest mean target RMSE on the validation years (ties: the
/// smaller λ). The test years play no part in the choice.
pub fn choose_lambda(results: &[RunResult]) -> Vec<RunResult> {
    let best = |k: &str, m: Method| -> Option<f64> {
        let mut ls: Vec<f64> = results.iter().filter(|r| r.k == k && r.method == m).filter_map(|r| r.lambda).collect();
        ls.sort_by(f64::total_cmp);
        ls.dedup();
        ls.into_iter().min_by(|&a, &b| val_rmse(results, k, m, a).total_cmp(&val_rmse(results, k, m, b)))
    };
    results.iter().filter(|r| r.lambda.is_none() || r.lambda == best(&r.k, r.method)).cloned().collect()
}

/// With several λ: every adversary's mean target RMSE per λ on the validation years (what
/// chose) and on the test years (what the table reports for the chosen one).
pub fn lambda_table(results: &[RunResult]) -> String {
    let mut s = String::from(
        "| sources | method | λ | seeds | target RMSE, validation years | target RMSE, test years | chosen |\n|---|---|---|---|---|---|---|\n",
    );
    let chosen = choose_lambda(results);
    let mut keys: Vec<(String, Method, u64)> = Vec::new();
    for r in results {
        if let Some(l) = r.lambda {
            if !keys.contains(&(r.k.clone(), r.method, l.to_bits())) {
                keys.push((r.k.clone(), r.method, l.to_bits()));
            }
        }
    }
    for (k, m, lb) in keys {
        let l = f64::from_bits(lb);
        let rs: Vec<&RunResult> = results.iter().filter(|r| r.k == k && r.method == m && r.lambda == Some(l)).collect();
        let val: Vec<f64> = rs.iter().map(|r| r.eval.target_val.rmse).collect();
        let test: Vec<f64> = rs.iter().map(|r| r.eval.target.rmse).collect();
        let is = chosen.iter().any(|r| r.k == k && r.method == m && r.lambda == Some(l));
        s += &format!(
            "| {k} | {} | {l} | {} | {} | {} | {} |\n",
            m.name(),
            rs.len(),
            cell(&val),
            cell(&test),
            if is { "yes" } else { "" }
        );
    }
    s
}

/// Claim (b): what adding the irrelevant source changed, per (sources, method) — the target
/// RMSE of each seed with it minus without it, with the 95% interval of the mean change; and
/// that change minus no-classifier's (paired by seed): below zero, the method suffers less
/// from the irrelevant source than the plain network, which is what the paper claims of the
/// adversaries.
pub fn change_table(without: &[RunResult], with: &[RunResult]) -> String {
    let (without, with) = (choose_lambda(without), choose_lambda(with));
    let (without, with) = (without.as_slice(), with.as_slice());
    let mut s = String::from(
        "| sources | method | seeds | target RMSE without | with | change (95% CI) | change minus no-classifier's (95% CI) |\n\
         |---|---|---|---|---|---|---|\n",
    );
    let mut keys: Vec<(String, Method)> = Vec::new();
    for r in with {
        if !keys.contains(&(r.k.clone(), r.method)) {
            keys.push((r.k.clone(), r.method));
        }
    }
    let change = |k: &str, m: Method| -> Vec<(u64, f64)> {
        with.iter()
            .filter(|r| r.k == k && r.method == m)
            .filter_map(|r| {
                let b = without.iter().find(|o| o.k == k && o.method == m && o.seed == r.seed)?;
                Some((r.seed, r.eval.target.rmse - b.eval.target.rmse))
            })
            .collect()
    };
    for (k, m) in keys {
        let c = change(&k, m);
        if c.is_empty() {
            continue;
        }
        let rmse = |rs: &[RunResult]| -> Vec<f64> {
            rs.iter().filter(|r| r.k == k && r.method == m).map(|r| r.eval.target.rmse).collect()
        };
        let plain = change(&k, Method::NoClassifier);
        let rel: Vec<f64> =
            c.iter().filter_map(|(seed, x)| plain.iter().find(|(s2, _)| s2 == seed).map(|(_, p)| x - p)).collect();
        let vals: Vec<f64> = c.iter().map(|x| x.1).collect();
        s += &format!(
            "| {k} | {} | {} | {} | {} | {} | {} |\n",
            m.name(),
            c.len(),
            cell(&rmse(without)),
            cell(&rmse(with)),
            paired_cell(&vals),
            if m == Method::NoClassifier { "–".into() } else { paired_cell(&rel) },
        );
    }
    s
}

/// The learned source weights of `grl-weighted` (empty when no result has any): a row per
/// source count, each source's weight as mean ± sd over seeds, heaviest first (they average 1).
pub fn weights_table(results: &[RunResult]) -> String {
    let mut s = String::new();
    let mut ks: Vec<&str> = Vec::new();
    for r in results.iter().filter(|r| r.source_weights.is_some()) {
        if !ks.contains(&r.k.as_str()) {
            ks.push(&r.k);
        }
    }
    if ks.is_empty() {
        return s;
    }
    s += "| sources | method | seeds | learned weight per source, mean ± sd over seeds (they average 1) |\n|---|---|---|---|\n";
    for k in ks {
        let rs: Vec<&RunResult> = results.iter().filter(|r| r.k == k && r.source_weights.is_some()).collect();
        let mut per: Vec<(String, Vec<f64>)> = Vec::new();
        for r in &rs {
            for (name, w) in r.sources.iter().zip(r.source_weights.iter().flatten()) {
                match per.iter_mut().find(|(n, _)| n == name) {
                    Some((_, v)) => v.push(*w),
                    None => per.push((name.clone(), vec![*w])),
                }
            }
        }
        per.sort_by(|a, b| mean_sd(&b.1).0.total_cmp(&mean_sd(&a.1).0));
        let cells: Vec<String> = per.iter().map(|(n, v)| format!("{n} {}", cell(v))).collect();
        s += &format!("| {k} | {} | {} | {} |\n", Method::Weighted.name(), rs.len(), cells.join("; "));
    }
    s
}

/// One adversary in one setting: its gain over the network without a classifier against the
/// domain information in that network's features.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GainPoint {
    /// The experiment: target, labelled days, domains.
    pub setting: String,
    /// Source count label.
    pub k: String,
    /// `grl-multiclass` or `grl-per-source`.
    pub method: String,
    /// Its λ (chosen on the validation years where the run tried several).
    pub lambda: Option<f64>,
    /// No-classifier's probe balanced accuracy minus chance, mean over seeds: how much the
    /// plain network's features say about the domain.
    pub probe_excess: f64,
    /// No-classifier's target RMSE minus the adversary's, paired by seed, mean (above 0: the
    /// adversary is better).
    pub gain: f64,
    /// The 95% t half-width of `gain`.
    pub half_width: f64,
    /// Seeds paired.
    pub seeds: usize,
}

/// The [`GainPoint`]s of one `results.json` of `airq experiment`.
pub fn gain_points(json: &str) -> Result<Vec<GainPoint>> {
    let bad = |what: &str| Error::Data(format!("not the results.json of `airq experiment`: {what}"));
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| bad(&e.to_string()))?;
    let g = &v["grid"];
    let target = g["target"].as_str().ok_or_else(|| bad("no grid.target"))?;
    let days = g["target_days"].as_u64().ok_or_else(|| bad("no grid.target_days"))?;
    let unl = g["unlabelled_days"].as_u64().unwrap_or(0);
    let mut setting = format!("{target}, {days} labelled days");
    if days == 0 {
        setting += &format!(" ({unl} unlabelled)");
    }
    if g["irrelevant"].as_bool() == Some(true) {
        setting += ", + Beijing";
    }
    if g["by_profile"].as_bool() == Some(true) {
        setting += ", profile domains";
    }
    struct Run {
        method: String,
        k: String,
        seed: u64,
        lambda: Option<f64>,
        test: f64,
        val: f64,
        probe: Option<f64>,
    }
    let runs: Vec<Run> = v["results"]
        .as_array()
        .ok_or_else(|| bad("no results"))?
        .iter()
        .map(|r| -> Result<Run> {
            let f = |x: &serde_json::Value| x.as_f64().unwrap_or(f64::NAN);
            Ok(Run {
                method: r["method"].as_str().ok_or_else(|| bad("a result without a method"))?.to_string(),
                k: r["k"].as_str().ok_or_else(|| bad("a result without k"))?.to_string(),
                seed: r["seed"].as_u64().ok_or_else(|| bad("a result without a seed"))?,
                // results written before `--lambdas` carry no λ: the adversaries then ran at 1
                lambda: r["lambda"].as_f64().or_else(|| {
                    let m = r["method"].as_str();
                    matches!(m, Some("MultiClass" | "PerSource" | "Weighted")).then_some(1.0)
                }),
                test: f(&r["eval"]["target"]["rmse"]),
                val: f(&r["eval"]["target_val"]["rmse"]),
                probe: r["eval"]["probe"]
                    .is_object()
                    .then(|| f(&r["eval"]["probe"]["balanced_accuracy"]) - f(&r["eval"]["probe"]["chance"])),
            })
        })
        .collect::<Result<_>>()?;
    let mut out = Vec::new();
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in &runs {
        if r.lambda.is_some() && !keys.contains(&(r.k.clone(), r.method.clone())) {
            keys.push((r.k.clone(), r.method.clone()));
        }
    }
    for (k, m) in keys {
        let plain: Vec<&Run> = runs.iter().filter(|r| r.k == k && r.method == "NoClassifier").collect();
        let probes: Vec<f64> = plain.iter().filter_map(|r| r.probe).collect();
        if plain.is_empty() || probes.is_empty() {
            continue;
        }
        let mut ls: Vec<f64> = runs.iter().filter(|r| r.k == k && r.method == m).filter_map(|r| r.lambda).collect();
        ls.sort_by(f64::total_cmp);
        ls.dedup();
        let val = |l: f64| {
            let v: Vec<f64> = runs.iter().filter(|r| r.k == k && r.method == m && r.lambda == Some(l)).map(|r| r.val).collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        };
        let Some(l) = ls.into_iter().min_by(|&a, &b| val(a).total_cmp(&val(b))) else { continue };
        let d: Vec<f64> = runs
            .iter()
            .filter(|r| r.k == k && r.method == m && r.lambda == Some(l))
            .filter_map(|r| plain.iter().find(|p| p.seed == r.seed).map(|p| p.test - r.test))
            .collect();
        if d.is_empty() {
            continue;
        }
        let (gain, sd) = mean_sd(&d);
        let name = match m.as_str() {
            "MultiClass" => Method::MultiClass.name(),
            "PerSource" => Method::PerSource.name(),
            "Weighted" => Method::Weighted.name(),
            o => return Err(bad(&format!("an adversary `{o}`"))),
        };
        out.push(GainPoint {
            setting: setting.clone(),
            k,
            method: name.to_string(),
            lambda: Some(l),
            probe_excess: probes.iter().sum::<f64>() / probes.len() as f64,
            gain,
            half_width: if d.len() > 1 { t95(d.len() - 1) * sd / (d.len() as f64).sqrt() } else { 0.0 },
            seeds: d.len(),
        });
    }
    Ok(out)
}

/// The points of [`gain_points`] as a markdown table.
pub fn gain_table(points: &[GainPoint]) -> String {
    let mut s = String::from(
        "| setting | sources | method | λ | seeds | probe above chance (no-classifier) | gain over no-classifier, µg/m³ (95% CI) |\n|---|---|---|---|---|---|---|\n",
    );
    for p in points {
        s += &format!(
            "| {} | {} | {} | {} | {} | {:+.3} | {:+.2} [{:+.2}, {:+.2}] |\n",
            p.setting,
            p.k,
            p.method,
            p.lambda.map_or("–".into(), |l| l.to_string()),
            p.seeds,
            p.probe_excess,
            p.gain,
            p.gain - p.half_width,
            p.gain + p.half_width
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{Evaluation, Metrics};

    fn r(m: Method, k: &str, seed: u64, rmse: f64) -> RunResult {
        // two horizon days: tomorrow's scores, then the day after's (RMSE 1.5x)
        let days = vec![
            LeadMetrics { lead: 1, rmse, mae: rmse / 2.0, r2: 0.5, n: 10 },
            LeadMetrics { lead: 2, rmse: rmse * 1.5, mae: rmse, r2: 0.25, n: 10 },
        ];
        let t = Metrics { rmse, mae: rmse / 2.0, rmse_horizon: rmse, r2: 0.5, n: 10, days };
        RunResult {
            method: m,
            sources: vec![],
            k: k.into(),
            seed,
            lambda: m.adversary().ne(&crate::model::Adversary::None).then_some(1.0),
            eval: Evaluation { target: t, ..Default::default() },
            final_domain_loss: None,
            seconds: 0.0,
            source_weights: None,
        }
    }

    #[test]
    fn the_horizon_table_gives_each_day_s_means_and_ratio_to_persistence_s_same_day() {
        let rs = [
            r(Method::Persistence, "-", 0, 10.0),
            r(Method::MultiClass, "all", 1, 8.0),
            r(Method::MultiClass, "all", 2, 10.0),
            r(Method::NoClassifier, "all", 1, 9.0),
        ];
        let t = horizon_table(&rs);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "| sources | method | seeds | day 1 RMSE | day 1 MAE | day 1 R² | day 1 vs persistence | day 2 RMSE | day 2 MAE | day 2 R² | day 2 vs persistence |"
        );
        assert_eq!(lines[2], "| - | persistence | 1 | 10.00 | 5.00 | 0.50 | 1.00 | 15.00 | 10.00 | 0.25 | 1.00 |");
        // multiclass: day 1 RMSE (8 + 10) / 2 = 9, day 2 (12 + 15) / 2 = 13.5 against 15
        assert_eq!(lines[4], "| all | grl-multiclass | 2 | 9.00 | 4.50 | 0.50 | 0.90 | 13.50 | 9.00 | 0.25 | 0.90 |");
        assert_eq!(lines.len(), 5);
        // results kept before the scores were kept per day have no such table
        let mut old = r(Method::NoClassifier, "1", 1, 9.0);
        old.eval.target.days.clear();
        assert!(horizon_table(&[old]).is_empty());
    }

    #[test]
    fn the_table_gives_means_spreads_and_the_ratio_to_persistence() {
        let rs = [
            r(Method::Persistence, "-", 0, 10.0),
            r(Method::MultiClass, "all", 1, 8.0),
            r(Method::MultiClass, "all", 2, 10.0),
            r(Method::NoClassifier, "1", 1, 9.0),
        ];
        let t = table(&rs);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5, "{t}");
        assert!(lines[2].starts_with("| - | persistence | 1 | 10.00 |"), "{t}");
        assert!(lines[3].starts_with("| 1 | no-classifier"), "sources ascending: {t}");
        // mean 9, sample sd sqrt(2); ratio mean 0.9
        assert!(lines[4].contains("9.00 ± 1.41") && lines[4].contains("0.90 ± 0.14"), "{t}");
    }

    #[test]
    fn differences_are_paired_by_seed_with_a_t_interval() {
        let rs = [
            r(Method::NoClassifier, "all", 1, 10.0),
            r(Method::NoClassifier, "all", 2, 12.0),
            r(Method::NoClassifier, "all", 3, 14.0),
            // seed by seed 1, 0, 2 below: mean -1, sd 1, half-width 4.303 / sqrt(3)
            r(Method::MultiClass, "all", 1, 9.0),
            r(Method::MultiClass, "all", 2, 12.0),
            r(Method::MultiClass, "all", 3, 12.0),
            // fitted once: against no-classifier's mean, 12
            r(Method::RidgeAr, "all", 0, 11.5),
        ];
        let t = table(&rs);
        let row = |m: &str| t.lines().find(|l| l.contains(&format!("| {m} |"))).unwrap().to_string();
        let half = 4.303 / 3f64.sqrt();
        assert!(row("grl-multiclass").contains(&format!("-1.00 [{:+.2}, {:+.2}]", -1.0 - half, -1.0 + half)), "{t}");
        assert!(row("ridge-ar").contains("| -0.50 |"), "{t}");
        // unpaired, the spread of the methods (sd 2) would hide what pairing shows
        assert!(row("no-classifier").contains("12.00 ± 2.00"), "{t}");
    }

    #[test]
    fn lambda_is_chosen_on_the_validation_years() {
        let run = |l: f64, seed: u64, val: f64, test: f64| {
            let mut x = r(Method::MultiClass, "all", seed, test);
            x.lambda = Some(l);
            x.eval.target_val.rmse = val;
            x
        };
        // λ 0.1 is better on the validation years, λ 1 on the test years: 0.1 is shown
        let rs = [run(0.1, 1, 5.0, 9.0), run(0.1, 2, 5.2, 9.0), run(1.0, 1, 6.0, 8.0), run(1.0, 2, 6.0, 8.0)];
        let c = choose_lambda(&rs);
        assert_eq!(c.len(), 2);
        assert!(c.iter().all(|x| x.lambda == Some(0.1)));
        let t = table(&rs);
        assert!(t.contains("| all | grl-multiclass (λ 0.1) | 2 | 9.00 ± 0.00 |"), "{t}");
        let lt = lambda_table(&rs);
        assert!(lt.contains("| all | grl-multiclass | 0.1 | 2 | 5.10 ± 0.14 | 9.00 ± 0.00 | yes |"), "{lt}");
        assert!(lt.contains("| all | grl-multiclass | 1 | 2 | 6.00 ± 0.00 | 8.00 ± 0.00 |  |"), "{lt}");
    }

    #[test]
    fn gain_points_pair_the_adversary_with_the_plain_network() {
        let mut rs = vec![r(Method::NoClassifier, "2", 1, 10.0), r(Method::NoClassifier, "2", 2, 12.0)];
        for x in &mut rs {
            x.eval.probe = Some(crate::train::DomainScore { balanced_accuracy: 0.40, chance: 0.33, windows: 1 });
        }
        rs.push(r(Method::PerSource, "2", 1, 9.0));
        rs.push(r(Method::PerSource, "2", 2, 12.0));
        let json = serde_json::json!({
            "grid": {"target": "Niedersachsen", "target_days": 365, "unlabelled_days": 0, "irrelevant": false, "by_profile": true},
            "results": rs,
        })
        .to_string();
        let p = gain_points(&json).unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!((p[0].method.as_str(), p[0].k.as_str(), p[0].seeds), ("grl-per-source", "2", 2));
        assert!((p[0].gain - 0.5).abs() < 1e-12 && (p[0].probe_excess - 0.07).abs() < 1e-12, "{p:?}");
        assert_eq!(p[0].setting, "Niedersachsen, 365 labelled days, profile domains");
        // half-width: t(1) · sd(1, 0) / sqrt 2
        assert!((p[0].half_width - 12.706 * 0.5f64.sqrt() / 2f64.sqrt()).abs() < 1e-9, "{p:?}");
        assert!(gain_points("{}").unwrap_err().to_string().contains("airq experiment"));
        // a results.json from before `--lambdas` has no λ: its adversaries ran at 1
        let mut old: serde_json::Value = serde_json::from_str(&json).unwrap();
        for r in old["results"].as_array_mut().unwrap() {
            r.as_object_mut().unwrap().remove("lambda");
        }
        let p = gain_points(&old.to_string()).unwrap();
        assert_eq!((p.len(), p[0].lambda), (1, Some(1.0)));
    }

    #[test]
    fn the_weights_table_lists_each_source_heaviest_first() {
        let mut a = r(Method::Weighted, "2", 1, 9.0);
        a.sources = vec!["Hessen".into(), "Beijing".into()];
        a.source_weights = Some(vec![1.9, 0.1]);
        let mut b = a.clone();
        b.seed = 2;
        b.source_weights = Some(vec![1.7, 0.3]);
        let t = weights_table(&[a, b, r(Method::PerSource, "2", 1, 9.0)]);
        assert!(t.contains("| 2 | grl-weighted | 2 | Hessen 1.80 ± 0.14; Beijing 0.20 ± 0.14 |"), "{t}");
        assert!(weights_table(&[r(Method::PerSource, "2", 1, 9.0)]).is_empty());
    }
}

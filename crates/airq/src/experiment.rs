//! The experiment grid: every method × number of source states × seed on one target, all in
//! one run (the baselines beside the adversarial methods), each model trained in-process on a
//! world of one, scored on the target's, the sources' and a never-seen state's test years; and
//! the table of means and spreads.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::data::AirData;
use crate::pipeline::Split;
use crate::train::{evaluate, fit, Evaluation, FitConfig, Method, Prepared, Task};
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
            if self.unlabelled_days == 0 { "= target days".to_string() } else { self.unlabelled_days.max(self.target_days).to_string() },
            k.join(","),
            seeds.join(","),
            f.iterations,
            f.batch,
            f.lr,
            f.conv,
            f.hidden,
            methods.join(",")
        )
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
    /// Scores.
    pub eval: Evaluation,
    /// The training domain loss over the last tenth of the iterations (adversarial methods).
    pub final_domain_loss: Option<f64>,
    /// Wall time of training and scoring, seconds.
    pub seconds: f64,
}

fn k_label(k: Option<usize>) -> String {
    k.map_or_else(|| "all".into(), |k| k.to_string())
}

/// Runs the grid; `progress(done, total, last)` after each run.
pub fn run(data: Arc<AirData>, grid: &Grid, mut progress: impl FnMut(usize, usize, &RunResult)) -> Result<Vec<RunResult>> {
    if grid.seeds.is_empty() || grid.methods.is_empty() {
        return Err(Error::Config("the grid needs at least one seed and one method".into()));
    }
    let split = Split::by_years(data.days)?;
    let comm = Arc::new(ironweave::transport::inproc::communicators(1)?.remove(0));
    // (method, k, seed): persistence once, target-only once per seed, the others per k and seed
    let mut jobs: Vec<(Method, Option<usize>, u64)> = Vec::new();
    for &m in &grid.methods {
        match m {
            Method::Persistence => jobs.push((m, None, 0)),
            Method::TargetOnly => jobs.extend(grid.seeds.iter().map(|&s| (m, None, s))),
            _ => {
                for &k in &grid.sources {
                    jobs.extend(grid.seeds.iter().map(|&s| (m, k, s)));
                }
            }
        }
    }
    let total = jobs.len();
    let mut out = Vec::with_capacity(total);
    for (i, (m, k, seed)) in jobs.into_iter().enumerate() {
        let t0 = Instant::now();
        let mut task = Task::nearest(&data, &grid.target, k, grid.unseen.as_deref(), split.clone())?;
        task.target_days = grid.target_days;
        task.unlabelled_days = grid.unlabelled_days;
        let sources =
            if m.uses_sources() { task.sources.iter().map(|&s| data.states[s].name.clone()).collect() } else { Vec::new() };
        let prep = Prepared::new(data.clone(), task, m)?;
        let (eval, final_domain_loss) = if m == Method::Persistence {
            (evaluate(None, &prep)?, None)
        } else {
            let f = fit(&prep, &comm, &FitConfig { seed, ..grid.fit })?;
            let tail = &f.losses[f.losses.len() - (f.losses.len() / 10).max(1)..];
            let dom = (m.adversary() != crate::model::Adversary::None)
                .then(|| tail.iter().map(|l| f64::from(l.domain)).sum::<f64>() / tail.len() as f64);
            (evaluate(Some(&f.net), &prep)?, dom)
        };
        let r = RunResult {
            method: m,
            sources,
            k: if m.uses_sources() { k_label(k) } else { "-".into() },
            seed,
            eval,
            final_domain_loss,
            seconds: t0.elapsed().as_secs_f64(),
        };
        progress(i + 1, total, &r);
        out.push(r);
    }
    Ok(out)
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let sd = if v.len() > 1 { (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt() } else { 0.0 };
    (m, sd)
}

fn cell(v: &[f64]) -> String {
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

/// The markdown table: one row per (method, source count), means ± sample standard deviation
/// over seeds; `vs persistence` is the target RMSE's ratio to persistence's (below 1: better);
/// `domain probe` is the balanced accuracy (chance in brackets) of a linear probe telling the
/// domains apart from the features: the adversary's counter, measured alike for every network.
pub fn table(results: &[RunResult]) -> String {
    let pers = results.iter().find(|r| r.method == Method::Persistence).map(|r| r.eval.target.rmse);
    let mut s = String::from(
        "| sources | method | seeds | target RMSE | target MAE | target RMSE, days 1–3 | vs persistence | sources RMSE | unseen-state RMSE | domain probe (chance) |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
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
    for (k, m) in keys {
        let rs: Vec<&RunResult> = results.iter().filter(|r| r.k == k && r.method == m).collect();
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
        s += &format!(
            "| {k} | {} | {} | {} | {} | {} | {ratio} | {} | {} | {dom} |\n",
            m.name(),
            rs.len(),
            cell(&rmse),
            cell(&f(&|r| Some(r.eval.target.mae))),
            cell(&f(&|r| Some(r.eval.target.rmse_horizon))),
            cell(&f(&|r| r.eval.sources.map(|x| x.rmse))),
            cell(&f(&|r| r.eval.unseen.map(|x| x.rmse))),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{Evaluation, Metrics};

    fn r(m: Method, k: &str, seed: u64, rmse: f64) -> RunResult {
        let t = Metrics { rmse, mae: rmse / 2.0, rmse_horizon: rmse, n: 10 };
        RunResult {
            method: m,
            sources: vec![],
            k: k.into(),
            seed,
            eval: Evaluation { target: t, ..Default::default() },
            final_domain_loss: None,
            seconds: 0.0,
        }
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
}

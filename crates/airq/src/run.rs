//! One training run as a job of `ironweave launch`: every rank loads the data, trains its share
//! of each step data-parallel with a Capricorn checkpoint every iteration (the job survives
//! `kill -9` of a rank), and rank 0 scores the model and writes the report.

use std::path::PathBuf;
use std::sync::Arc;

use ironweave::ckpt::{engine::Strategy, EngineConfig};
use ironweave::elastic::{Config, Job};
use serde::Serialize;

use crate::data::AirData;
use crate::pipeline::Split;
use crate::report::{render, ReportData};
use crate::train::{evaluate, predict, ElasticRun, Evaluation, FitConfig, Losses, Method, Prepared, Task};
use crate::{Error, Result};

/// What to train.
#[derive(Debug, Clone, Serialize)]
pub struct RunConfig {
    /// `air.rda` (`None`: where Debian installs it).
    pub data: Option<PathBuf>,
    /// Only the last this many days of the series (a small slice for tests), split 2/3, 1/6,
    /// 1/6; `None`: the whole series, split by years.
    pub days: Option<usize>,
    /// Target state.
    pub target: String,
    /// Source states: the nearest this many (`None`: all).
    pub sources: Option<usize>,
    /// The state never seen in training.
    pub unseen: Option<String>,
    /// Method (not persistence).
    pub method: Method,
    /// Training settings.
    pub fit: FitConfig,
    /// Labelled target days.
    pub target_days: usize,
    /// Target days the domain classifier sees unlabelled (0: the labelled ones, see
    /// [`Task::unlabelled_days`]).
    pub unlabelled_days: usize,
    /// Where rank 0 writes `metrics.json`, `report.json` and `report.html`.
    pub out: PathBuf,
}

/// What a rank ends with.
#[derive(Debug, Clone, Serialize)]
pub struct RunOutcome {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// Recoveries the job went through.
    pub recoveries: u64,
    /// SHA-256 over every rank's final state (hex), the same on every rank.
    pub final_state: String,
    /// Rank 0: the scores of the model and of persistence.
    pub scores: Option<(Evaluation, Evaluation)>,
    /// Rank 0: the report written.
    pub report: Option<PathBuf>,
}

/// Loads the data and lays out the task of `cfg`.
pub fn prepare(cfg: &RunConfig, method: Method) -> Result<Prepared> {
    let mut data = AirData::load(cfg.data.as_deref())?;
    let split = match cfg.days {
        Some(n) => {
            data = data.last_days(n)?;
            Split::proportional(n)
        }
        None => Split::by_years(data.days)?,
    };
    let mut task = Task::nearest(&data, &cfg.target, cfg.sources, cfg.unseen.as_deref(), split)?;
    task.target_days = cfg.target_days;
    task.unlabelled_days = cfg.unlabelled_days;
    Prepared::new(Arc::new(data), task, method)
}

/// Runs rank `job.rank()` of the job to the end; `print` gets progress lines.
pub fn run(cfg: &RunConfig, print: fn(&str)) -> Result<RunOutcome> {
    if !cfg.method.trained() {
        return Err(Error::Config(format!("{} is not trained: choose a network method", cfg.method.name())));
    }
    let engine = EngineConfig { strategy: Strategy::Capricorn, ..Default::default() };
    let job = Job::from_env(Config::new(cfg.fit.iterations, engine)).map_err(|e| {
        Error::Config(format!("{e}: `airq train` is a rank of a job; start it with `ironweave launch -n 4 -- airq train ...`"))
    })?;
    let (rank, world) = (job.rank(), job.world_size());
    print(&format!("rank {rank} pid {} generation {}", std::process::id(), job.generation()));
    let prep = Arc::new(prepare(cfg, cfg.method)?);
    let mut w = ElasticRun::new(prep.clone(), cfg.fit, rank)?;
    w.print = print;
    let done = match job.run(&mut w) {
        Ok(d) => d,
        Err(e) => return Err(Error::Job { code: e.exit_code(), message: e.to_string() }),
    };
    let digest = w.state_digest().ok_or_else(|| Error::Config("the job ended without a trainer".into()))?;
    let final_state = done.job_state_sha256(&digest).map_err(|e| Error::Job { code: e.exit_code(), message: e.to_string() })?;
    let recoveries = done.recoveries();
    // the job ends before rank 0 scores: scoring needs no peer, and no rank waits on it
    done.shutdown().map_err(|e| Error::Job { code: e.exit_code(), message: e.to_string() })?;
    let (mut scores, mut report) = (None, None);
    if rank == 0 {
        let ev = evaluate(Some(&w.net), &prep)?;
        let pers = Prepared::new(prep.data.clone(), prep.task.clone(), Method::Persistence)?;
        let pe = evaluate(None, &pers)?;
        report = Some(write_report(cfg, &prep, &w, &ev, &pe, world, recoveries)?);
        scores = Some((ev, pe));
    }
    Ok(RunOutcome { rank, world, recoveries, final_state, scores, report })
}

fn write_report(
    cfg: &RunConfig,
    prep: &Prepared,
    w: &ElasticRun,
    ev: &Evaluation,
    pe: &Evaluation,
    world: usize,
    recoveries: u64,
) -> Result<PathBuf> {
    let io = |what: String| move |source| Error::Io { what, source };
    std::fs::create_dir_all(&cfg.out).map_err(io(format!("creating {}", cfg.out.display())))?;
    let d = &prep.data;
    let t = &prep.task;
    let tst = Task::stations_of(d, t.target);
    let ws = crate::pipeline::windows(d, &tst, t.split.test.clone(), &t.spec);
    let fc = predict(Some(&w.net), prep, &ws)?;
    let forecasts: Vec<(usize, usize, f32)> =
        ws.iter().zip(&fc).map(|(w, f)| (w.day as usize, usize::from(w.station), f[0])).collect();
    let names = |v: &[usize]| v.iter().map(|&s| d.states[s].name.as_str()).collect::<Vec<_>>().join(", ");
    let summary = vec![
        format!("method {}, target {}, sources {}", cfg.method.name(), d.states[t.target].name, names(&t.sources)),
        format!(
            "never seen in training: {}; {} iterations of {} labelled windows per rank on {world} ranks, {} recoveries",
            t.unseen.map_or("none".into(), |u| d.states[u].name.clone()),
            cfg.fit.iterations,
            cfg.fit.batch,
            recoveries
        ),
        format!(
            "days {} to {}; train to {}, validation to {}, test to {}",
            d.date(0),
            d.date(d.days - 1),
            d.date(t.split.train.end - 1),
            d.date(t.split.val.end - 1),
            d.date(t.split.test.end - 1)
        ),
    ];
    let losses: Vec<Losses> = w.losses();
    let title = format!("airq: {} forecasting PM10 in {}", cfg.method.name(), d.states[t.target].name);
    let rd = ReportData::new(prep, title, summary, &losses, ev, pe, &forecasts);
    let json = serde_json::to_string_pretty(&rd).map_err(|e| Error::Config(format!("report: {e}")))?;
    let page = cfg.out.join("report.html");
    std::fs::write(cfg.out.join("report.json"), json).map_err(io("writing report.json".into()))?;
    let metrics = serde_json::json!({ "config": cfg, "model": ev, "persistence": pe, "losses": losses });
    std::fs::write(cfg.out.join("metrics.json"), metrics.to_string()).map_err(io("writing metrics.json".into()))?;
    std::fs::write(&page, render(&rd)).map_err(io(format!("writing {}", page.display())))?;
    Ok(page)
}

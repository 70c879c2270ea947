//! The task (which states teach, which is the target, which is never seen), training on any
//! ironweave communicator ([`fit`], a world of one in-process for the experiments), the elastic
//! worker that `ironweave launch` runs on several ranks with a Capricorn checkpoint every
//! iteration ([`ElasticRun`]), and evaluation in µg/m³.
//!
//! **Batches.** Each iteration, each rank draws its own batch from (seed, iteration, rank):
//! three quarters source windows and one quarter windows of the target's few labelled days
//! (the target's little data is used whatever the number of sources); adversarial methods add
//! half as many unlabelled target windows (labels masked; by default of the same labelled
//! days, so every method sees the same data) for the domain classifier. Ranks average gradients, so 4 ranks train on 4× the batch.

use std::sync::Arc;

use candle_core::Tensor;
use candle_nn::VarMap;
use ironweave::candle::{Layout, Trainer, TrainerConfig};
use ironweave::ckpt::{DType, Snapshot, TensorSpec};
use ironweave::elastic::{BoxError, Generation, Iteration, Recovery, Step, StepContext, Worker};
use ironweave::Communicator;
use serde::Serialize;

use crate::data::AirData;
use crate::metrics::{ErrorSums, LeadMetrics};
use crate::model::{lambda_schedule, Adversary, Net, NetConfig};
use crate::pipeline::{windows, Batch, Norm, Split, Window, WindowSpec};
use crate::{Error, Result, Rng};

/// A forecasting method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Method {
    /// Tomorrow (and every later day of the horizon) = today. Not trained.
    Persistence,
    /// The day-of-year mean of what the networks learn from ([`crate::baselines::Climatology`]).
    Climatology,
    /// A ridge autoregression on 14 lags and the day of year, closed form, fitted on what the
    /// networks learn from ([`crate::baselines::RidgeAr`]).
    RidgeAr,
    /// The network without a domain classifier, trained on the target's labelled days only.
    TargetOnly,
    /// The network without a domain classifier, trained on the sources only (the reference for
    /// the sources' own RMSE).
    SourceOnly,
    /// The network without a domain classifier, trained on sources and the target's days.
    NoClassifier,
    /// The network without a domain classifier, pretrained on the sources alone for the first
    /// three quarters of the iterations, then fine-tuned on the target's labelled days alone
    /// at a tenth of the learning rate (the optimizer's moments carried on).
    FineTune,
    /// Strategy 1: reversal layer and one multi-class domain classifier.
    MultiClass,
    /// Strategy 2: reversal layer and one discriminator per source domain.
    PerSource,
    /// Strategy 2 with a learned weight per source in the regression loss, from its
    /// discriminator's running loss ([`Net::weigh_sources`]): a source easily told from the
    /// target is pushed towards zero. Beyond the paper.
    Weighted,
}

impl Method {
    /// Every method, baselines first.
    pub const ALL: [Method; 10] = [
        Method::Persistence,
        Method::Climatology,
        Method::RidgeAr,
        Method::TargetOnly,
        Method::SourceOnly,
        Method::FineTune,
        Method::NoClassifier,
        Method::MultiClass,
        Method::PerSource,
        Method::Weighted,
    ];

    /// Its name on the command line and in tables.
    pub fn name(self) -> &'static str {
        match self {
            Method::Persistence => "persistence",
            Method::Climatology => "climatology",
            Method::RidgeAr => "ridge-ar",
            Method::TargetOnly => "target-only",
            Method::SourceOnly => "source-only",
            Method::NoClassifier => "no-classifier",
            Method::FineTune => "fine-tune",
            Method::MultiClass => "grl-multiclass",
            Method::PerSource => "grl-per-source",
            Method::Weighted => "grl-weighted",
        }
    }

    /// Parses [`Method::name`].
    pub fn parse(s: &str) -> Result<Method> {
        Method::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| Error::Config(format!("unknown method `{s}`; one of {}", Method::ALL.map(Method::name).join(", "))))
    }

    /// The network's adversary (`None` for the baselines that are not networks too).
    pub fn adversary(self) -> Adversary {
        match self {
            Method::MultiClass => Adversary::MultiClass,
            Method::PerSource | Method::Weighted => Adversary::PerSource,
            _ => Adversary::None,
        }
    }

    /// Whether it learns from the source domains.
    pub fn uses_sources(self) -> bool {
        !matches!(self, Method::Persistence | Method::TargetOnly)
    }

    /// Whether it learns from the target's labelled days (persistence learns nothing, but its
    /// windows are normalised like the target-only network's).
    pub fn uses_target_labels(self) -> bool {
        self != Method::SourceOnly
    }

    /// Whether it is a network trained by [`fit`] (the others are fitted in closed form or
    /// not at all, once: they do not depend on the seed).
    pub fn trained(self) -> bool {
        !matches!(self, Method::Persistence | Method::Climatology | Method::RidgeAr)
    }
}

/// Which stations teach what.
#[derive(Debug, Clone, Serialize)]
pub struct Task {
    /// Target state (index into the data's states).
    pub target: usize,
    /// Source states.
    pub sources: Vec<usize>,
    /// A state never seen in training, evaluated as a second target (none: skipped).
    pub unseen: Option<usize>,
    /// The chronological split.
    pub split: Split,
    /// Window shape.
    pub spec: WindowSpec,
    /// The target's labelled days: the last this many days of the training period.
    pub target_days: usize,
    /// The target days whose windows the domain classifier sees unlabelled: the last this
    /// many of the training period (at least `target_days`; 0, the default: the labelled days,
    /// so every method sees the same target data).
    pub unlabelled_days: usize,
}

/// The target days whose windows a domain classifier sees: `unlabelled_days`, never fewer than
/// the labelled `target_days` (0 asks for the labelled days). One rule for the windows drawn
/// and for the settings line that reports them.
pub fn effective_unlabelled_days(target_days: usize, unlabelled_days: usize) -> usize {
    unlabelled_days.max(target_days)
}

impl Task {
    /// The default task on `data`: target `target`, its `k` nearest states (by station
    /// centroid) with stations as sources (`None`: all), `unseen` kept out of training.
    pub fn nearest(data: &AirData, target: &str, k: Option<usize>, unseen: Option<&str>, split: Split) -> Result<Task> {
        let t = data.state_index(target)?;
        let u = unseen.map(|u| data.state_index(u)).transpose()?;
        if u == Some(t) {
            return Err(Error::Config("the unseen state cannot be the target".into()));
        }
        let centre = |s: usize| {
            let st: Vec<_> = data.stations.iter().filter(|x| x.state == s).collect();
            let n = st.len().max(1) as f64;
            (st.iter().map(|x| x.lon).sum::<f64>() / n, st.iter().map(|x| x.lat).sum::<f64>() / n)
        };
        let (tx, ty) = centre(t);
        // the irrelevant source (Beijing) is never a nearest state: it is added on purpose
        let far = data.beijing();
        let mut cands: Vec<usize> =
            data.states_with_stations().into_iter().filter(|&s| s != t && Some(s) != u && Some(s) != far).collect();
        if cands.is_empty() {
            return Err(Error::Config("no source state with stations is left".into()));
        }
        let dist = |s: usize| {
            let (x, y) = centre(s);
            ((x - tx) * ty.to_radians().cos()).powi(2) + (y - ty).powi(2)
        };
        cands.sort_by(|&a, &b| dist(a).total_cmp(&dist(b)).then(a.cmp(&b)));
        let k = k.unwrap_or(cands.len());
        if k == 0 || k > cands.len() {
            return Err(Error::Config(format!("{k} source states asked for; {} are available", cands.len())));
        }
        cands.truncate(k);
        Ok(Task {
            target: t,
            sources: cands,
            unseen: u,
            split,
            spec: WindowSpec::default(),
            target_days: 365,
            unlabelled_days: 0,
        })
    }

    /// Stations of state `s`.
    pub fn stations_of(data: &AirData, s: usize) -> Vec<usize> {
        (0..data.stations.len()).filter(|&i| data.stations[i].state == s).collect()
    }
}

/// Training settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FitConfig {
    /// Optimizer steps.
    pub iterations: u64,
    /// Labelled windows per rank per step.
    pub batch: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// Seed of the initial weights and of every batch.
    pub seed: u64,
    /// Convolution channels.
    pub conv: usize,
    /// Recurrent units per direction.
    pub hidden: usize,
    /// The reversal layer's final weight: λ rises from 0 towards this ([`lambda_schedule`]
    /// scaled).
    pub lambda: f64,
}

impl Default for FitConfig {
    fn default() -> Self {
        FitConfig { iterations: 300, batch: 64, lr: 3e-3, seed: 1, conv: 16, hidden: 16, lambda: 1.0 }
    }
}

/// [`Method::FineTune`]'s learning rate in its fine-tuning phase, as a share of [`FitConfig::lr`].
pub const FINE_TUNE_LR: f64 = 0.1;

/// The last pretraining iteration of [`Method::FineTune`]: three quarters of the run on the
/// sources, the rest on the target.
pub fn fine_tune_from(fit: &FitConfig) -> u64 {
    fit.iterations * 3 / 4
}

/// A method on a task, with its windows drawn and its normalisation fitted.
#[derive(Debug)]
pub struct Prepared {
    /// The data.
    pub data: Arc<AirData>,
    /// The task.
    pub task: Task,
    /// The method.
    pub method: Method,
    /// Normalisation (fitted on the training period of the stations it learns from).
    pub norm: Norm,
    /// Labelled source windows with their source index.
    pub source: Vec<(Window, u32)>,
    /// The target's labelled windows (its last `target_days` training days).
    pub target_labelled: Vec<Window>,
    /// The target's training windows, labels unused (adversaries only).
    pub target_unlabelled: Vec<Window>,
}

impl Prepared {
    /// Draws the windows of `method` on `task`.
    pub fn new(data: Arc<AirData>, task: Task, method: Method) -> Result<Prepared> {
        let sp = &task.split;
        let tst = Task::stations_of(&data, task.target);
        if tst.is_empty() {
            return Err(Error::Config(format!("the target {} has no stations", data.states[task.target].name)));
        }
        // what it learns from of the target: its last `target_days` training days
        let lab_from = if method.uses_target_labels() {
            sp.train.end.saturating_sub(task.target_days).max(sp.train.start)
        } else {
            sp.train.end
        };
        let target_labelled = windows(&data, &tst, lab_from..sp.train.end, &task.spec);
        if target_labelled.is_empty() && matches!(method, Method::TargetOnly | Method::FineTune) {
            return Err(Error::Config(format!(
                "{} learns from the target's labelled days, and {} has none ({} labelled days): give --target-days above 0",
                method.name(),
                data.states[task.target].name,
                task.target_days
            )));
        }
        let mut source = Vec::new();
        let mut src_stations = Vec::new();
        if method.uses_sources() {
            for (i, &s) in task.sources.iter().enumerate() {
                let st = Task::stations_of(&data, s);
                src_stations.extend(&st);
                source.extend(windows(&data, &st, sp.train.clone(), &task.spec).into_iter().map(|w| (w, i as u32)));
            }
            if source.is_empty() {
                return Err(Error::Config("the source states have no training windows".into()));
            }
        }
        // Equal conditions: every method sees the same target days. The domain classifier's
        // unlabelled target windows are the target's last `unlabelled_days` training days —
        // by default the labelled ones (`Task::nearest`), so the adversary gets no target data
        // the plain network lacks; more is the unsupervised-adaptation setting, said in the
        // task.
        let unl_days = effective_unlabelled_days(task.target_days, task.unlabelled_days);
        let unl_from = sp.train.end.saturating_sub(unl_days).max(sp.train.start);
        let target_unlabelled = if method.adversary() == Adversary::None {
            Vec::new()
        } else {
            windows(&data, &tst, unl_from..sp.train.end, &task.spec)
        };
        if method.adversary() != Adversary::None && target_unlabelled.is_empty() {
            return Err(Error::Config(format!(
                "{} needs target windows for its domain classifier and {} has none in its last {} training days: with --target-days 0 give --unlabelled-days N (the unsupervised setting)",
                method.name(),
                data.states[task.target].name,
                unl_days
            )));
        }
        // normalised by what the method learns from: the target's labelled days, and the
        // sources' training period
        let norm = if method == Method::Persistence {
            // persistence normalises nothing; any finite norm does (with 0 labelled days the
            // labelled part is empty)
            Norm::fit_parts(&data, &[(tst.as_slice(), sp.train.clone())])?
        } else {
            Norm::fit_parts(&data, &[(tst.as_slice(), lab_from..sp.train.end), (src_stations.as_slice(), sp.train.clone())])?
        };
        Ok(Prepared { data, task, method, norm, source, target_labelled, target_unlabelled })
    }

    /// Every labelled window the method learns from: the sources' training windows and the
    /// target's labelled ones (what the closed-form baselines are fitted on).
    pub fn training_windows(&self) -> Vec<Window> {
        self.source.iter().map(|(w, _)| *w).chain(self.target_labelled.iter().copied()).collect()
    }

    /// The network's sizes for this method.
    pub fn net_config(&self, fit: &FitConfig) -> NetConfig {
        NetConfig {
            lookback: self.task.spec.lookback,
            horizon: self.task.spec.horizon,
            channels: crate::pipeline::CHANNELS,
            conv: fit.conv,
            hidden: fit.hidden,
            sources: if self.method.uses_sources() { self.task.sources.len() } else { 0 },
            adversary: self.method.adversary(),
        }
    }

    /// Rank `rank`'s batch of iteration `iter`. Each part has its own stream of (seed,
    /// iteration, rank, part), so every method draws the same source windows, the same target
    /// windows (target-only: more of the same stream) and the same unlabelled ones.
    pub fn batch(&self, fit: &FitConfig, iter: u64, rank: usize) -> Batch {
        let stream = |part: u64| Rng::new(&[fit.seed, iter, rank as u64, part]);
        let mut b = Batch::default();
        let (d, n, spec) = (&*self.data, &self.norm, &self.task.spec);
        let k = self.task.sources.len() as u32;
        // three quarters sources, a quarter the target's labelled days; all sources where the
        // method learns no target label (source-only, or 0 labelled days)
        let n_src = match (self.source.is_empty(), self.target_labelled.is_empty()) {
            (true, _) => 0,
            (false, true) => fit.batch,
            // pretrain on the sources, then fine-tune on the target
            (false, false) if self.method == Method::FineTune => {
                if iter <= fine_tune_from(fit) {
                    fit.batch
                } else {
                    0
                }
            }
            (false, false) => fit.batch * 3 / 4,
        };
        let mut rng = stream(1);
        for _ in 0..n_src {
            let (w, s) = self.source[rng.below(self.source.len())];
            b.push(d, n, spec, w, true, s);
        }
        let mut rng = stream(2);
        for _ in n_src..fit.batch {
            let w = self.target_labelled[rng.below(self.target_labelled.len())];
            b.push(d, n, spec, w, true, k);
        }
        if !self.target_unlabelled.is_empty() {
            let mut rng = stream(3);
            for _ in 0..fit.batch / 2 {
                let w = self.target_unlabelled[rng.below(self.target_unlabelled.len())];
                b.push(d, n, spec, w, false, k);
            }
        }
        b
    }
}

/// The losses of one step (averaged over ranks: total; this rank's: the parts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Losses {
    /// Regression + domain loss, averaged over ranks.
    pub total: f32,
    /// This rank's masked regression loss (normalised units).
    pub regression: f32,
    /// This rank's domain loss (0 without a classifier).
    pub domain: f32,
}

/// One step of `trainer` on `net` with rank `rank`'s batch of iteration `iter` (collective).
pub fn train_step(trainer: &mut Trainer, net: &Net, prep: &Prepared, fit: &FitConfig, iter: u64, rank: usize) -> Result<Losses> {
    net.set_lambda(fit.lambda * lambda_schedule(iter as f64 / fit.iterations.max(1) as f64));
    if prep.method == Method::FineTune {
        // fine-tuning at a tenth of the rate, the usual practice; set every step, so a run
        // restored in either phase has it right
        trainer.set_lr(if iter > fine_tune_from(fit) { fit.lr * FINE_TUNE_LR } else { fit.lr })?;
    }
    let batch = prep.batch(fit, iter, rank);
    let x = net.input(&batch)?;
    let parts = std::cell::Cell::new((0f32, 0f32));
    let s = trainer.step(net, &x, |out| {
        let (total, reg, dom) = net.loss(out, &batch)?;
        let d = match &dom {
            Some(d) => d.to_scalar::<f32>()?,
            None => 0.0,
        };
        parts.set((reg.to_scalar::<f32>()?, d));
        Ok(total)
    })?;
    let (regression, domain) = parts.get();
    Ok(Losses { total: s.loss, regression, domain })
}

pub(crate) fn trainer_config(fit: &FitConfig) -> TrainerConfig {
    let mut t = TrainerConfig::default();
    t.adam.lr = fit.lr;
    t
}

/// A trained network and its loss curve.
pub struct Fitted {
    /// The network.
    pub net: Net,
    /// Its variables.
    pub vars: VarMap,
    /// Losses per iteration.
    pub losses: Vec<Losses>,
}

impl std::fmt::Debug for Fitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fitted").field("net", &self.net).field("iterations", &self.losses.len()).finish_non_exhaustive()
    }
}

/// Trains `prep`'s method data-parallel over `comm` (a world of one is a plain run).
pub fn fit(prep: &Prepared, comm: &Arc<Communicator>, cfg: &FitConfig) -> Result<Fitted> {
    if !prep.method.trained() {
        return Err(Error::Config(format!("{} is not a trained network", prep.method.name())));
    }
    let vars = VarMap::new();
    let net = Net::new(&vars, prep.net_config(cfg), cfg.seed)?;
    if prep.method == Method::Weighted {
        net.weigh_sources()?;
    }
    let mut t = Trainer::new(&vars, comm, Layout::DataParallel, trainer_config(cfg))?;
    let mut losses = Vec::with_capacity(cfg.iterations as usize);
    for it in 1..=cfg.iterations {
        losses.push(train_step(&mut t, &net, prep, cfg, it, comm.rank())?);
    }
    Ok(Fitted { net, vars, losses })
}

/// Errors of a forecast, in µg/m³.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Metrics {
    /// Root mean squared error of tomorrow's forecast.
    pub rmse: f64,
    /// Mean absolute error of tomorrow's forecast.
    pub mae: f64,
    /// RMSE over every day of the horizon.
    pub rmse_horizon: f64,
    /// Coefficient of determination of tomorrow's forecast (1 - squared error / variance of
    /// the observations scored).
    #[serde(default)]
    pub r2: f64,
    /// Observed targets scored (tomorrow).
    pub n: usize,
    /// RMSE, MAE and R² of each horizon day (lead 1 = tomorrow).
    #[serde(default)]
    pub days: Vec<LeadMetrics>,
}

/// Rows of `per_chunk(input, features)` over `ws` in chunks of 1024 windows: every pass of a
/// trained network over many windows (forecasts, domain logits, the probe's features).
fn over_windows(
    net: &Net,
    prep: &Prepared,
    ws: &[Window],
    mut per_chunk: impl FnMut(&Tensor, &Tensor) -> Result<Vec<Vec<f32>>>,
) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(ws.len());
    for chunk in ws.chunks(1024) {
        let mut b = Batch::default();
        for &w in chunk {
            b.push(&prep.data, &prep.norm, &prep.task.spec, w, true, 0);
        }
        let x = net.input(&b)?;
        out.extend(per_chunk(&x, &net.features(&x)?)?);
    }
    Ok(out)
}

/// Forecasts (µg/m³, `[window][horizon]`) of `net` (persistence when `None`) on `ws`.
pub fn predict(net: Option<&Net>, prep: &Prepared, ws: &[Window]) -> Result<Vec<Vec<f32>>> {
    predict_with(net.map_or(Forecaster::Persistence, Forecaster::Net), prep, ws)
}

/// What makes a forecast: a trained network or one of the baselines.
#[derive(Debug, Clone, Copy)]
pub enum Forecaster<'a> {
    /// Tomorrow = today.
    Persistence,
    /// The day-of-year mean.
    Climatology(&'a crate::baselines::Climatology),
    /// The ridge autoregression.
    RidgeAr(&'a crate::baselines::RidgeAr),
    /// A trained network.
    Net(&'a Net),
}

/// The forecast of every horizon day of `ws` by `f`, µg/m³.
pub fn predict_with(f: Forecaster<'_>, prep: &Prepared, ws: &[Window]) -> Result<Vec<Vec<f32>>> {
    let (h, norm) = (prep.task.spec.horizon, prep.norm);
    match f {
        Forecaster::Persistence => {
            Ok(ws.iter().map(|w| vec![prep.data.series(usize::from(w.station))[w.day as usize]; h]).collect())
        }
        Forecaster::Climatology(c) => Ok(c.predict(&prep.data, ws, h)),
        Forecaster::RidgeAr(r) => Ok(r.predict(&prep.data, ws)),
        Forecaster::Net(net) => over_windows(net, prep, ws, |x, f| {
            let p: Vec<Vec<f32>> = net.forecast(x, f)?.to_vec2()?;
            Ok(p.into_iter().map(|r| r.into_iter().map(|v| v * norm.std + norm.mean).collect()).collect())
        }),
    }
}

/// Scores `preds` on `ws` against the observed values.
pub fn score(data: &AirData, ws: &[Window], preds: &[Vec<f32>]) -> Metrics {
    let horizon = preds.iter().map(Vec::len).max().unwrap_or(0);
    let mut days = vec![ErrorSums::default(); horizon];
    for (w, p) in ws.iter().zip(preds) {
        let x = data.series(usize::from(w.station));
        for (h, &ph) in p.iter().enumerate() {
            let obs = x[w.day as usize + 1 + h];
            if obs.is_finite() {
                days[h].add(ph, obs);
            }
        }
    }
    let mut all = ErrorSums::default();
    days.iter().for_each(|d| all.merge(d));
    let days: Vec<LeadMetrics> = days.iter().enumerate().map(|(h, d)| d.at(h + 1)).collect();
    let first = days.first().copied().unwrap_or_else(|| ErrorSums::default().at(1));
    Metrics { rmse: first.rmse, mae: first.mae, rmse_horizon: all.rmse(), r2: first.r2, n: first.n, days }
}

/// Where a model was scored.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Evaluation {
    /// The target's test period.
    pub target: Metrics,
    /// The source states' test period (empty for methods that do not use them).
    pub sources: Option<Metrics>,
    /// The never-seen state's test period.
    pub unseen: Option<Metrics>,
    /// The target's validation period.
    pub target_val: Metrics,
    /// The domain classifier on the test windows (adversarial methods).
    pub domain: Option<DomainScore>,
    /// A probe's view of the features: a fresh linear classifier fitted on the training
    /// windows' features to tell the domains apart, scored on the test windows — how much
    /// domain information the features carry, measured alike for every network.
    pub probe: Option<DomainScore>,
}

/// How well the domain classifier tells the domains apart on test windows — the adversary's
/// counter: near chance, the features no longer say where a window comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DomainScore {
    /// Balanced accuracy: multi-class, the mean recall over the domains with test windows;
    /// per-source, the mean over discriminators of (source recall + target recall) / 2.
    pub balanced_accuracy: f64,
    /// What guessing scores (1 / domains, or 0.5).
    pub chance: f64,
    /// Windows scored.
    pub windows: usize,
}

/// The domain classifier's [`DomainScore`] on the test windows of the sources and the target
/// (`None` without a classifier).
pub fn domain_score(net: &Net, prep: &Prepared) -> Result<Option<DomainScore>> {
    let (d, t) = (&*prep.data, &prep.task);
    if net.domain_outputs() == 0 {
        return Ok(None);
    }
    let k = t.sources.len();
    // label i: source i; label k: the target
    let mut groups: Vec<Vec<Window>> =
        t.sources.iter().map(|&s| windows(d, &Task::stations_of(d, s), t.split.test.clone(), &t.spec)).collect();
    groups.push(windows(d, &Task::stations_of(d, t.target), t.split.test.clone(), &t.spec));
    let logits = |ws: &[Window]| {
        over_windows(net, prep, ws, |_, f| Ok(net.domain_logits(f)?.map(|l| l.to_vec2::<f32>()).transpose()?.unwrap_or_default()))
    };
    let per_group: Vec<Vec<Vec<f32>>> = groups.iter().map(|g| logits(g)).collect::<Result<_>>()?;
    let windows = groups.iter().map(Vec::len).sum();
    let share = |v: &[Vec<f32>], hit: &dyn Fn(&[f32]) -> bool| v.iter().filter(|l| hit(l)).count() as f64 / v.len() as f64;
    let score = match net.config().adversary {
        Adversary::MultiClass => {
            let argmax = |l: &[f32]| l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i);
            let recalls: Vec<f64> =
                per_group.iter().enumerate().filter(|(_, v)| !v.is_empty()).map(|(c, v)| share(v, &|l| argmax(l) == c)).collect();
            DomainScore {
                balanced_accuracy: recalls.iter().sum::<f64>() / recalls.len().max(1) as f64,
                chance: 1.0 / recalls.len().max(1) as f64,
                windows,
            }
        }
        Adversary::PerSource => {
            let target = &per_group[k];
            let bal: Vec<f64> = (0..k)
                .filter(|&i| !per_group[i].is_empty() && !target.is_empty())
                .map(|i| (share(&per_group[i], &|l| l[i] > 0.0) + share(target, &|l| l[i] <= 0.0)) / 2.0)
                .collect();
            DomainScore { balanced_accuracy: bal.iter().sum::<f64>() / bal.len().max(1) as f64, chance: 0.5, windows }
        }
        Adversary::None => return Ok(None),
    };
    Ok(Some(score))
}

/// Scores `net` (persistence when `None`) on the test periods of the target, the sources and
/// the never-seen state.
pub fn evaluate(net: Option<&Net>, prep: &Prepared) -> Result<Evaluation> {
    evaluate_with(net.map_or(Forecaster::Persistence, Forecaster::Net), prep)
}

/// [`evaluate`] for any [`Forecaster`] (the domain scores only for a network).
pub fn evaluate_with(f: Forecaster<'_>, prep: &Prepared) -> Result<Evaluation> {
    let (d, t) = (&*prep.data, &prep.task);
    let net = match f {
        Forecaster::Net(n) => Some(n),
        _ => None,
    };
    let on = |states: &[usize], days: std::ops::Range<usize>| -> Result<Metrics> {
        let st: Vec<usize> = states.iter().flat_map(|&s| Task::stations_of(d, s)).collect();
        let ws = windows(d, &st, days, &t.spec);
        Ok(score(d, &ws, &predict_with(f, prep, &ws)?))
    };
    Ok(Evaluation {
        target: on(&[t.target], t.split.test.clone())?,
        sources: if t.sources.is_empty() { None } else { Some(on(&t.sources, t.split.test.clone())?) },
        unseen: t.unseen.map(|u| on(&[u], t.split.test.clone())).transpose()?,
        target_val: on(&[t.target], t.split.val.clone())?,
        domain: net.map(|n| domain_score(n, prep)).transpose()?.flatten(),
        probe: net.map(|n| domain_probe(n, prep)).transpose()?.flatten(),
    })
}

/// Features of `ws` under `net`, row-major `[ws.len(), 2·hidden]`.
fn features_of(net: &Net, prep: &Prepared, ws: &[Window]) -> Result<Vec<Vec<f32>>> {
    over_windows(net, prep, ws, |_, f| Ok(f.to_vec2::<f32>()?))
}

/// The domain probe of [`Evaluation::probe`]: multinomial logistic regression on the
/// standardised features of at most 1500 training windows per domain (the sources and the
/// target; drawn with a fixed seed), 300 full-batch gradient steps; balanced accuracy on every
/// test window of those domains. `None` without sources.
pub fn domain_probe(net: &Net, prep: &Prepared) -> Result<Option<DomainScore>> {
    let (d, t) = (&*prep.data, &prep.task);
    if t.sources.is_empty() {
        return Ok(None);
    }
    let mut states = t.sources.clone();
    states.push(t.target);
    let mut rng = Rng::new(&[0x9e0b, t.target as u64]);
    let (mut xs, mut ys, mut tests) = (Vec::new(), Vec::new(), Vec::new());
    for (c, &s) in states.iter().enumerate() {
        let st = Task::stations_of(d, s);
        let mut tr = windows(d, &st, t.split.train.clone(), &t.spec);
        for i in 0..tr.len().min(1500) {
            let j = i + rng.below(tr.len() - i);
            tr.swap(i, j);
        }
        tr.truncate(1500);
        xs.extend(features_of(net, prep, &tr)?);
        ys.extend(std::iter::repeat_n(c as u32, tr.len()));
        tests.push(features_of(net, prep, &windows(d, &st, t.split.test.clone(), &t.spec))?);
    }
    let classes = states.len();
    let present: Vec<usize> = (0..classes).filter(|&c| ys.contains(&(c as u32)) && !tests[c].is_empty()).collect();
    if present.len() < 2 || xs.is_empty() {
        return Ok(None);
    }
    let dim = xs[0].len();
    let n = xs.len() as f32;
    let mean: Vec<f32> = (0..dim).map(|j| xs.iter().map(|r| r[j]).sum::<f32>() / n).collect();
    let sd: Vec<f32> =
        (0..dim).map(|j| (xs.iter().map(|r| (r[j] - mean[j]).powi(2)).sum::<f32>() / n).sqrt().max(1e-6)).collect();
    let norm = |rows: &[Vec<f32>]| -> Vec<f32> { rows.iter().flat_map(|r| (0..dim).map(|j| (r[j] - mean[j]) / sd[j])).collect() };
    let dev = candle_core::Device::Cpu;
    let x = Tensor::from_vec(norm(&xs), (xs.len(), dim), &dev)?;
    let y = Tensor::from_vec(ys, xs.len(), &dev)?;
    let w = candle_core::Var::zeros((dim, classes), candle_core::DType::F32, &dev)?;
    let b = candle_core::Var::zeros(classes, candle_core::DType::F32, &dev)?;
    for _ in 0..300 {
        let logits = x.matmul(w.as_tensor())?.broadcast_add(b.as_tensor())?;
        let g = candle_nn::loss::cross_entropy(&logits, &y)?.backward()?;
        for v in [&w, &b] {
            if let Some(gv) = g.get(v.as_tensor()) {
                v.set(&(v.as_tensor() - (gv * 0.5)?)?)?;
            }
        }
    }
    let mut recalls = Vec::new();
    let mut scored = 0;
    for &c in &present {
        let xt = Tensor::from_vec(norm(&tests[c]), (tests[c].len(), dim), &dev)?;
        let pred: Vec<u32> = xt.matmul(w.as_tensor())?.broadcast_add(b.as_tensor())?.argmax(1)?.to_vec1()?;
        recalls.push(pred.iter().filter(|&&p| p as usize == c).count() as f64 / pred.len() as f64);
        scored += pred.len();
    }
    Ok(Some(DomainScore {
        balanced_accuracy: recalls.iter().sum::<f64>() / recalls.len() as f64,
        chance: 1.0 / recalls.len() as f64,
        windows: scored,
    }))
}

/// The elastic worker: [`train_step`] under `ironweave::elastic` (`ironweave launch`), the
/// trainer's whole state and the loss curve registered with the checkpoint engine, so a
/// killed rank's replacement restores from peers' memory and the job ends where an
/// uninterrupted one does.
pub struct ElasticRun {
    /// The method on its task.
    pub prep: Arc<Prepared>,
    /// Training settings.
    pub fit: FitConfig,
    /// This rank.
    pub rank: usize,
    /// The network.
    pub net: Net,
    vars: VarMap,
    trainer: Option<Trainer>,
    /// Loss curve, 3 f32 (total, regression, domain) per iteration, little-endian bytes:
    /// checkpointed with the model, so a recovered rank reports the whole curve.
    history: Vec<u8>,
    /// Where progress lines go (the binary prints them).
    pub print: fn(&str),
}

impl ElasticRun {
    /// A worker for rank `rank`.
    pub fn new(prep: Arc<Prepared>, fit: FitConfig, rank: usize) -> Result<ElasticRun> {
        if !prep.method.trained() {
            return Err(Error::Config(format!("{} is not a trained network", prep.method.name())));
        }
        if prep.method == Method::Weighted {
            // its running losses would have to be in the checkpoint for a restore to be exact
            return Err(Error::Config(
                "grl-weighted keeps running source weights that the checkpoint does not hold: train it with `airq experiment --methods grl-weighted`".into(),
            ));
        }
        let vars = VarMap::new();
        let net = Net::new(&vars, prep.net_config(&fit), fit.seed)?;
        let history = vec![0u8; fit.iterations as usize * 12];
        Ok(ElasticRun { prep, fit, rank, net, vars, trainer: None, history, print: |_| {} })
    }

    /// The loss curve so far (iterations not yet run are zero).
    pub fn losses(&self) -> Vec<Losses> {
        self.history
            .chunks_exact(12)
            .map(|c| {
                let f = |i: usize| f32::from_le_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]);
                Losses { total: f(0), regression: f(4), domain: f(8) }
            })
            .collect()
    }

    /// SHA-256 of the trainer's state (parameters, moments, step).
    pub fn state_digest(&self) -> Option<[u8; 32]> {
        self.trainer.as_ref().map(Trainer::state_digest)
    }

    fn trainer(&mut self) -> Result<&mut Trainer, BoxError> {
        self.trainer.as_mut().ok_or_else(|| "no generation joined".into())
    }
}

impl std::fmt::Debug for ElasticRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElasticRun")
            .field("method", &self.prep.method)
            .field("rank", &self.rank)
            .field("fit", &self.fit)
            .finish_non_exhaustive()
    }
}

const HISTORY: &str = "airq.loss_history";

impl Worker for ElasticRun {
    type Output = Losses;

    fn join(&mut self, g: &Generation<'_>) -> Result<(), BoxError> {
        Ok(Trainer::join(&mut self.trainer, &self.vars, g, Layout::DataParallel, trainer_config(&self.fit))?)
    }
    fn state_specs(&self) -> Vec<TensorSpec> {
        let mut v = self.trainer.as_ref().map(Trainer::state_specs).unwrap_or_default();
        v.push(TensorSpec::new(HISTORY, DType::F32, &[self.fit.iterations, 3]));
        v
    }
    fn state(&self) -> Vec<&[u8]> {
        let mut v = self.trainer.as_ref().map(Trainer::state).unwrap_or_default();
        v.push(&self.history);
        v
    }
    fn restore(&mut self, s: &Snapshot) -> Result<(), BoxError> {
        self.trainer()?.restore(s)?;
        let h = s.tensor(HISTORY).ok_or("the checkpoint lacks the loss history (written by another program?)")?;
        if h.len() != self.history.len() {
            return Err(format!("the checkpoint's loss history has {} bytes, this run {}", h.len(), self.history.len()).into());
        }
        self.history.copy_from_slice(h);
        Ok(())
    }
    fn restored_state(&self) -> Result<Vec<Vec<u8>>, BoxError> {
        // the model's variables (not the trainer's host copies), then the history
        let mut v = self.trainer.as_ref().ok_or("no generation joined")?.state_from_variables()?;
        v.push(self.history.clone());
        Ok(v)
    }
    fn start_over(&mut self) -> Result<(), BoxError> {
        self.history.fill(0);
        Ok(self.trainer()?.start_over()?)
    }
    fn step(&mut self, iter: u64, _cx: &StepContext<'_>) -> Result<Step<Losses>, BoxError> {
        let (net, prep, fit, rank) = (&self.net, &self.prep, &self.fit, self.rank);
        let t = self.trainer.as_mut().ok_or("no generation joined")?;
        let l = train_step(t, net, prep, fit, iter, rank)?;
        if let Some(c) = (iter as usize).checked_sub(1).and_then(|i| self.history.get_mut(i * 12..i * 12 + 12)) {
            for (k, v) in [l.total, l.regression, l.domain].into_iter().enumerate() {
                c[k * 4..k * 4 + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
        Ok(Step::new(l))
    }
    fn on_iteration(&mut self, it: &Iteration<'_, Losses>) -> Result<(), BoxError> {
        let every = (self.fit.iterations / 20).max(1);
        // rank 0 every 5% of the run; every rank every iteration with AIRQ_VERBOSE set
        let verbose = std::env::var_os("AIRQ_VERBOSE").is_some();
        if verbose || (self.rank == 0 && (it.iter % every == 0 || it.iter == self.fit.iterations)) {
            (self.print)(&format!(
                "rank {}: iteration {} loss {:.5} (regression {:.5}, domain {:.5}) committed {:?}",
                self.rank, it.iter, it.output.total, it.output.regression, it.output.domain, it.committed
            ));
        }
        Ok(())
    }
    fn on_recovery(&mut self, r: &Recovery, _comm: &Arc<Communicator>) -> Result<(), BoxError> {
        (self.print)(&format!("rank {}: restored iteration {} from {}", self.rank, r.iter, r.source.name()));
        Ok(())
    }
}

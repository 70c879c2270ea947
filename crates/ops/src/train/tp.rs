//! Tensor-parallel training (`ironweave train --tp N --schedule megatron|oases`; the Megatron
//! and Oases schedules of the same job, compared by `ironweave bench overlap`).
//! `tp-worker` (hidden) is the per-rank program; rank 0 gathers every rank's lanes of the last
//! iteration for trace.json and timeline.svg.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{bail, Context, Result};
use ironweave_overlap::trace::{chrome_trace, svg_lanes, to_records, SpanRec};
use ironweave_overlap::{Lane, Schedule};
use ironweave_train::tp::{TpSpec, TpTrainer};
use ironweave_transport::rendezvous::JobEnv;
use ironweave_transport::CommOptions;

use crate::progress::{Mode, Progress};
use crate::rundir::TpReport;
use crate::train::args::{load_config, ComputeArgs, TrainArgs};
use crate::train::busy::BusyMeter;

/// The per-rank options `train --tp` hands to `tp-worker`: written with
/// [`TpWorkerArgs::to_argv`], parsed back by each rank, which runs [`worker`].
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct TpWorkerArgs {
    #[arg(long)]
    pub config: PathBuf,
    /// Degree of every sub-layer (one value: all of them).
    #[arg(long, value_delimiter = ',', required = true)]
    pub degrees: Vec<usize>,
    #[arg(long)]
    pub schedule: String,
    #[arg(long)]
    pub sub_batches: usize,
    #[arg(long)]
    pub iters: Option<u64>,
    #[arg(long)]
    pub report_dir: PathBuf,
    #[arg(long)]
    pub global_batch: Option<usize>,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

impl TpWorkerArgs {
    /// The hidden subcommand that runs it.
    pub const SUBCOMMAND: &'static str = "tp-worker";

    /// The rank's command line: the subcommand, then these options as clap parses them.
    pub fn to_argv(&self) -> Vec<String> {
        let argv = crate::Argv::new(Self::SUBCOMMAND)
            .opt("config", self.config.display())
            .list("degrees", &self.degrees)
            .opt("schedule", &self.schedule)
            .opt("sub-batches", self.sub_batches)
            .some("iters", self.iters)
            .opt("report-dir", self.report_dir.display())
            .some("global-batch", self.global_batch);
        self.compute.write(argv).done()
    }
}

const SPANS_TAG: u32 = 0x5A17;

/// The per-rank body of a tensor-parallel `ironweave train`.
pub fn worker(a: &TpWorkerArgs) -> Result<()> {
    let env = JobEnv::from_env()?;
    if let Some(choice) = ironweave_transport::threads::apply_to_process(env.local_world_size)? {
        if env.rank == 0 {
            eprintln!("ironweave train: {choice}");
        }
    }
    let (cfg, corpus) = load_config(&a.config)?;
    let iters = a.iters.unwrap_or(cfg.train.iters);
    let schedule: Schedule = a.schedule.parse()?;
    let backend = ironweave::Backend::from_env()?;
    let comm =
        Arc::new(ironweave::connect(backend, &env, CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() })?);
    let spec = TpSpec { degrees: a.degrees.clone(), schedule, sub_batches: a.sub_batches, global_batch: a.global_batch };
    let mut tr = TpTrainer::new(cfg.clone(), corpus, (comm.size() > 1).then_some(comm.as_ref()), spec)?;
    let (rank, n) = (comm.rank(), comm.size());
    let emulated = a.compute.load(&cfg, n, iters)?;
    let mut busy = BusyMeter::default();
    let dp = tr.dp();
    let degrees = a.degrees.clone();
    let tp_max = tr.degrees().iter().copied().max().unwrap_or(1);
    let group_names = tr.group_names();
    let tp_groups: Vec<usize> = (0..group_names.len()).filter(|&g| tr.is_tp_group(g)).collect();
    let prog = tr.program().clone();
    let k = prog.sub_batches;
    let mut rep = TpReport {
        config: cfg.name.clone(),
        schedule: schedule.name().into(),
        tp: tp_max,
        degrees: degrees.clone(),
        dp,
        sub_batches: k,
        ranks: n,
        threads_per_rank: std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
        iterations: iters,
        tokens_per_iter: (tr.global_batch() * cfg.model.seq) as u64,
        stage_compute_s: vec![vec![0.0; k]; prog.stages.len()],
        stage_comm_s: vec![vec![0.0; k]; prog.stages.len()],
        tail_comm_s: vec![0.0; prog.tails.len()],
        ..Default::default()
    };
    let progress = (rank == 0).then(|| Progress::new("iter", 0, iters, Mode::detect()));
    let mut last_spans = Vec::new();
    let mut steady = 0usize;
    for it in 1..=iters {
        let t0 = Instant::now();
        let s = match &emulated {
            Some(emu) => tr.step_emulated(emu)?,
            None => tr.step()?,
        };
        let dt = t0.elapsed().as_secs_f64();
        let device_busy = busy.iteration(emulated.as_ref(), it, dt, rank, Some(s.stats.compute_s));
        let st = &s.stats;
        rep.iter_time_s.push(dt);
        rep.loss.push(s.loss);
        rep.compute_s.push(st.compute_s);
        // tensor-parallel traffic: the sub-layers' all-reduces and the reshards
        let tp_comm: f64 = tp_groups.iter().map(|&g| st.comm_s[g]).sum();
        rep.tp_comm_s.push(tp_comm);
        rep.tp_hidden_s.push(tp_groups.iter().map(|&g| st.hidden_s[g]).sum());
        rep.wait_s.push(st.wait_s);
        rep.dp_comm_s.push(st.comm_s.iter().sum::<f64>() - tp_comm);
        rep.outside_s.push(s.outside_s);
        if it > 2 || iters <= 2 {
            // per-stage means over the steady iterations, the durations `predict` replays
            steady += 1;
            for sp in &st.spans {
                let d = (sp.end - sp.start).as_secs_f64();
                let (name, sub) = sp.name.rsplit_once('/').map_or((sp.name.as_str(), 0), |(a, b)| (a, b.parse().unwrap_or(0)));
                match sp.lane {
                    Lane::Compute => {
                        if let Some(i) = prog.stages.iter().position(|x| x.name == name) {
                            rep.stage_compute_s[i][sub] += d;
                        }
                    }
                    Lane::Comm(_) => {
                        if let Some(i) = prog.stages.iter().position(|x| x.name == name) {
                            rep.stage_comm_s[i][sub] += d;
                        } else if let Some(t) = prog.tails.iter().position(|x| x.name == sp.name) {
                            rep.tail_comm_s[t] += d;
                        }
                    }
                }
            }
        }
        if it == iters {
            last_spans = to_records(&st.spans);
        }
        if let Some(p) = &progress {
            p.step(
                it,
                &format!(
                    "{}  {:>6.0} tokens/s  tp comm {:>6.1} ms ({:.0}% hidden)",
                    crate::train::busy::iteration_cell(device_busy, dt, s.loss),
                    rep.tokens_per_iter as f64 / dt,
                    tp_comm * 1e3,
                    if tp_comm > 0.0 { tp_groups.iter().map(|&g| st.hidden_s[g]).sum::<f64>() / tp_comm * 100.0 } else { 0.0 }
                ),
            );
        }
    }
    if let Some(p) = &progress {
        p.finish();
    }
    let norm = steady.max(1) as f64;
    for v in rep.stage_compute_s.iter_mut().chain(rep.stage_comm_s.iter_mut()) {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    rep.tail_comm_s.iter_mut().for_each(|x| *x /= norm);
    rep.compute.mode = a.compute.describe(emulated.as_ref());
    (rep.compute.device_busy_share, rep.compute.cpu_busy_share) = busy.finish(&comm, emulated.is_some())?;
    rep.compute.host_compute_s = busy.finish_host(&comm, emulated.is_some())?;
    // every rank's digest and lanes to rank 0
    rep.final_state_sha256 = ironweave::elastic::job_state_sha256(&comm, &tr.state_digest())?;
    let bytes = serde_json::to_vec(&last_spans)?;
    if rank != 0 {
        comm.send_bytes(0, SPANS_TAG, &bytes)?;
        return Ok(());
    }
    let mut lanes: Vec<(usize, Vec<SpanRec>)> = vec![(0, last_spans)];
    for r in 1..n {
        let b = comm.recv_bytes(r, SPANS_TAG)?;
        lanes.push((r, serde_json::from_slice(&b).with_context(|| format!("rank {r}'s spans"))?));
    }
    let dir = &a.report_dir;
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("report.json"), serde_json::to_vec_pretty(&rep)?)?;
    let groups: Vec<&str> = group_names.iter().map(String::as_str).collect();
    std::fs::write(dir.join("trace.json"), serde_json::to_vec(&chrome_trace(&lanes, &groups))?)?;
    let title = format!(
        "{} degrees {} (head dp={dp}) {} k={k}: every rank's lanes in iteration {iters}",
        cfg.name,
        degrees_str(&degrees),
        schedule.name()
    );
    std::fs::write(dir.join("timeline.svg"), svg_lanes(&lanes, &groups, &title))?;
    Ok(())
}

/// `ironweave train --tp N`: launches the ranks; returns the exit status.
pub fn run(a: &TrainArgs) -> Result<i32> {
    let chosen = ironweave::Backend::pick(&a.backend)?;
    chosen.usable().with_context(|| format!("--backend {chosen} cannot run here (`ironweave doctor` says more)"))?;
    let (cfg, _) = load_config(&a.config)?;
    let plan = a.tp_plan.as_deref().map(|p| PlanLayout::load(p, a.ranks)).transpose()?;
    if plan.is_some() && (a.tp.is_some() || a.schedule.is_some() || a.sub_batches.is_some() || a.batch.is_some()) {
        bail!("--tp-plan sets the degree, schedule, sub-batches and batch: drop --tp, --schedule, --sub-batches and --batch");
    }
    let degrees = plan.as_ref().map_or_else(|| vec![a.tp.unwrap_or(1)], |p| p.degrees.clone());
    let schedule: Schedule = match &plan {
        Some(p) => p.schedule,
        None => a.schedule.as_deref().unwrap_or("oases").parse()?,
    };
    let k = plan.as_ref().map_or(a.sub_batches.unwrap_or(if schedule == Schedule::Oases { 2 } else { 1 }), |p| p.sub_batches);
    if let Some(p) = &plan {
        eprintln!("ironweave train: executing {}", p.describe());
    }
    if let Some(&tp) = degrees.iter().find(|&&d| d == 0 || a.ranks % d != 0) {
        bail!("--tp {tp} must divide --ranks {}", a.ranks);
    }
    // --batch is per group of the first sub-layer's degree
    let global_batch = plan.as_ref().map(|p| p.global_batch).or(a.batch.map(|b| b * a.ranks / degrees[0]));
    if a.fail.is_some() {
        bail!("--fail is not supported with --tp: tensor-parallel runs do not checkpoint yet");
    }
    // emulated compute: the device profile is read and the state must fit, before any rank
    // starts (each rank builds the whole model once before it keeps its shards; no checkpoint)
    a.compute.load_fitting(&a.config, &cfg, a.ranks, a.iters.unwrap_or(cfg.train.iters), 1, None)?;
    std::fs::create_dir_all(&a.report_dir).with_context(|| format!("creating {}", a.report_dir.display()))?;
    let _ = std::fs::remove_file(a.report_dir.join("report.json"));
    let args = TpWorkerArgs {
        config: a.config.clone(),
        degrees: degrees.clone(),
        schedule: schedule.name().into(),
        sub_batches: k,
        iters: a.iters,
        report_dir: a.report_dir.clone(),
        global_batch,
        compute: a.compute.clone(),
    }
    .to_argv();
    let topology = match &a.topology {
        Some(p) => Some((crate::cluster::load_up(p)?, a.ranks_per_host.max(1))),
        None => None,
    };
    eprintln!(
        "ironweave train: {} on {} ranks over {chosen}, tensor-parallel degree {} (data parallel across groups), schedule {schedule} with {k} sub-batch{}, compute {} (no checkpoints), report in {}",
        cfg.name,
        a.ranks,
        degrees_str(&degrees),
        if k == 1 { "" } else { "es" },
        a.compute.compute,
        a.report_dir.display()
    );
    let code = crate::launch::workers(a.ranks, args, chosen.name(), a.quiet, topology, 0, a.threads_per_rank)?;
    if code != 0 {
        return Ok(code);
    }
    let rep: TpReport = serde_json::from_slice(&std::fs::read(a.report_dir.join("report.json")).context("reading report.json")?)?;
    println!(
        "done: {} iterations, degree {} with head dp {} ({} k={}), {}, {:.0} tokens/s (median iteration {:.1} ms), tensor-parallel communication {:.1} ms per iteration, {:.0}% of it hidden behind compute",
        rep.iterations,
        degrees_str(&rep.degrees),
        rep.dp,
        rep.schedule,
        rep.sub_batches,
        crate::train::busy::outcome(&rep.compute, rep.loss.first().copied(), rep.loss.last().copied()),
        rep.tokens_per_iter as f64 / rep.median_iter_s().max(1e-12),
        rep.median_iter_s() * 1e3,
        rep.comm_s() * 1e3,
        rep.hidden_fraction().unwrap_or(0.0) * 100.0
    );
    println!(
        "lanes: {} and trace.json beside it; final state {}",
        a.report_dir.join("timeline.svg").display(),
        &rep.final_state_sha256[..16]
    );
    match crate::report::write(&a.report_dir, None) {
        Ok(html) => println!("report: {}", html.display()),
        Err(e) => eprintln!("ironweave train: could not write the HTML report: {e:#}"),
    }
    Ok(0)
}

/// Sub-layer degrees as one number when uniform, else the list.
pub fn degrees_str(d: &[usize]) -> String {
    match d {
        [] => "?".into(),
        [x] => x.to_string(),
        v if v.iter().all(|&x| x == v[0]) => v[0].to_string(),
        v => format!("[{}]", v.iter().map(usize::to_string).collect::<Vec<_>>().join(",")),
    }
}

/// What the runtime takes from a TMP plan (`ironweave plan tp --json`).
#[derive(Debug, Clone)]
pub struct PlanLayout {
    /// Each transformer sub-layer's degree (`L0.attn, L0.mlp, ...`), as planned.
    pub degrees: Vec<usize>,
    /// Sub-batches (the most any sub-layer asks for).
    pub sub_batches: usize,
    /// Oases when sub-batches overlap, Megatron otherwise.
    pub schedule: Schedule,
    /// Sequences per iteration over the job.
    pub global_batch: usize,
    /// Per sub-layer (name, degree, sub-batches), as planned.
    pub sublayers: Vec<(String, u32, u32)>,
    /// The planner's predicted iteration time.
    pub predicted_iter_s: f64,
}

impl PlanLayout {
    /// Reads a plan for a job of `ranks` ranks and checks the runtime can execute it.
    pub fn load(path: &Path, ranks: usize) -> Result<PlanLayout> {
        let bytes = std::fs::read(path).with_context(|| format!("reading plan {}", path.display()))?;
        let plan = ironweave_plan::tp::TpPlan::from_json(&bytes).with_context(|| format!("plan {}", path.display()))?;
        Self::from_plan(&plan, ranks).with_context(|| format!("plan {}", path.display()))
    }

    /// The layout of `plan` on `ranks` ranks: the degree of every attention and MLP sub-layer
    /// (the embeddings run at the first one's, the head at the last one's).
    pub fn from_plan(plan: &ironweave_plan::tp::TpPlan, ranks: usize) -> Result<PlanLayout> {
        if plan.devices as usize != ranks {
            bail!("the plan is for {} devices; run it with --ranks {}", plan.devices, plan.devices);
        }
        if plan.global_batch == 0 {
            bail!("the plan does not say its global batch (written by an older `ironweave plan tp`): plan again");
        }
        let sublayers: Vec<(String, u32, u32)> = plan.sublayers.iter().map(|s| (s.name.clone(), s.tp, s.sub_batches)).collect();
        let mut degrees = Vec::new();
        for (i, (name, t, _)) in sublayers.iter().filter(|s| s.0 != "head").enumerate() {
            let want = format!("L{}.{}", i / 2, if i % 2 == 0 { "attn" } else { "mlp" });
            if *name != want {
                bail!("sub-layer {i} of the plan is {name}, expected {want}: the runtime runs dense models (attention and MLP per layer)");
            }
            degrees.push(*t as usize);
        }
        if degrees.is_empty() {
            bail!("the plan has no sub-layers");
        }
        let k = sublayers.iter().map(|s| s.2).max().unwrap_or(1) as usize;
        Ok(PlanLayout {
            degrees,
            sub_batches: k,
            schedule: if k > 1 { Schedule::Oases } else { Schedule::Megatron },
            global_batch: plan.global_batch as usize,
            sublayers,
            predicted_iter_s: plan.predicted_iter_s,
        })
    }

    /// One line for the log.
    pub fn describe(&self) -> String {
        let ks: Vec<u32> = self.sublayers.iter().map(|s| s.2).collect();
        let mixed = if ks.iter().any(|&k| k as usize != self.sub_batches) {
            format!(" (the plan varies sub-batches per sub-layer, {ks:?}; every sub-layer runs {})", self.sub_batches)
        } else {
            String::new()
        };
        format!(
            "the plan: tensor-parallel degree {} with {} sub-batch{} ({}), {} sequences per iteration, predicted {:.1} ms per iteration{mixed}",
            degrees_str(&self.degrees),
            self.sub_batches,
            if self.sub_batches == 1 { "" } else { "es" },
            self.schedule,
            self.global_batch,
            self.predicted_iter_s * 1e3
        )
    }
}

//! Sharded data-parallel training (`ironweave train --sdp full|hybrid|hsdp|replicated`):
//! `sdp-worker` (hidden) is the per-rank program over `ironweave_train::sdp::SdpTrainer`.
//! `--sdp-plan plan.json` (from `ironweave plan sdp --json`) gives hsdp its per-layer
//! fractions. The all-rank part runs on one link and the cross-host all-reduce on another
//! (`--sdp-links full=a,inter=b`; default: the first and the last link of the job).

use std::sync::Arc;

use ironweave::ckpt::engine::Strategy as CkptStrategy;
use ironweave::ckpt::{Snapshot, TensorSpec};
use ironweave::elastic::{self, BoxError, Generation, Iteration, Recovery, Step, StepContext, Worker};
use ironweave::Communicator;
use ironweave_overlap::trace::{chrome_trace, svg_lanes, to_records, SpanRec};
use ironweave_sdp::{Groups, Strategy};
use ironweave_train::data::Corpus;
use ironweave_train::sdp::{SdpStep, SdpTrainer};
use ironweave_train::TrainConfig;

use crate::error::{bail, Context, Result};
use crate::rundir::SdpReport;
use crate::train::args::{load_config, ComputeArgs, ElasticRankArgs, TrainArgs};
use crate::train::busy::BusyMeter;
use crate::train::elastic::RankLog;
use ironweave_train::emulated::Emulated;

/// The per-rank options `train --sdp` hands to `sdp-worker`: written with
/// [`SdpWorkerArgs::to_argv`], parsed back by each rank, which runs [`worker`].
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct SdpWorkerArgs {
    #[command(flatten)]
    pub run: ElasticRankArgs,
    #[arg(long)]
    pub strategy: String,
    /// Share of each transformer layer sharded over all ranks (hsdp).
    #[arg(long, value_delimiter = ',')]
    pub fractions: Vec<f64>,
    #[arg(long, default_value_t = 1)]
    pub ranks_per_host: usize,
    /// Link names (or empty: the first / the last link).
    #[arg(long, default_value = "")]
    pub full_link: String,
    #[arg(long, default_value = "")]
    pub inter_link: String,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

impl SdpWorkerArgs {
    /// The hidden subcommand that runs it.
    pub const SUBCOMMAND: &'static str = "sdp-worker";

    /// The rank's command line: the subcommand, then these options as clap parses them.
    pub fn to_argv(&self) -> Vec<String> {
        let argv = self
            .run
            .write(crate::Argv::new(Self::SUBCOMMAND))
            .opt("strategy", &self.strategy)
            .list("fractions", &self.fractions)
            .opt("ranks-per-host", self.ranks_per_host)
            .opt("full-link", &self.full_link)
            .opt("inter-link", &self.inter_link);
        self.compute.write(argv).done()
    }
}

pub const LANES: [&str; 3] = ["all-rank", "host", "cross-host"];

fn link_index(comm: &ironweave_transport::Communicator, name: &str, default: usize) -> Result<usize> {
    if name.is_empty() {
        return Ok(default);
    }
    if name.contains('+') {
        // every link at once (the all-rank part only: `full=a+b`)
        let infos = comm.links();
        if infos.len() < 2 {
            bail!("{name:?}: striping needs a job with two or more links; this one has one");
        }
        for n in name.split('+') {
            link_index(comm, n, default)?;
        }
        if name.split('+').count() != infos.len() {
            bail!("{name:?}: the all-rank part stripes over every link of the job ({} links)", infos.len());
        }
        return Ok(Groups::STRIPED);
    }
    let infos = comm.links();
    infos.iter().position(|l| l.name == name || l.name.split_once(':').map(|(_, n)| n) == Some(name)).with_context(|| {
        format!("no link named {name:?}; this job has {:?}", infos.iter().map(|l| l.name.clone()).collect::<Vec<_>>())
    })
}

const SPANS_TAG: u32 = 0x5D95;

/// A rank of a sharded run as an elastic worker: a fresh trainer per generation (its groups
/// are new) holding the seed's initial shards, then the restored ones — the shards are
/// registered with the checkpoint engine like any rank's state.
struct SdpWorker<'a> {
    a: &'a SdpWorkerArgs,
    cfg: TrainConfig,
    corpus: Corpus,
    strategy: Strategy,
    rank: usize,
    iters: u64,
    fail: Option<(Vec<usize>, u64)>,
    links: (String, String),
    tr: Option<SdpTrainer>,
    log: RankLog,
    step: [u8; 8],
    seed: [u8; 8],
    /// This rank's lanes of the last iteration, for the timeline.
    last_spans: Vec<SpanRec>,
    /// `--compute emulated`: the device the steps wait on.
    emulated: Option<Emulated>,
    busy: BusyMeter,
}

impl SdpWorker<'_> {
    fn trainer(&mut self) -> Result<&mut SdpTrainer, BoxError> {
        self.tr.as_mut().ok_or_else(|| "the trainer joins no generation yet".into())
    }
}

impl Worker for SdpWorker<'_> {
    type Output = SdpStep;

    fn join(&mut self, g: &Generation<'_>) -> Result<(), BoxError> {
        let comm = g.comm;
        let last = comm.links().len().saturating_sub(1);
        let (fl, il) = (link_index(comm, &self.a.full_link, 0)?, link_index(comm, &self.a.inter_link, last)?);
        if il == Groups::STRIPED {
            return Err(format!("--sdp-links inter={}: the cross-host part takes one link", self.a.inter_link).into());
        }
        let names = comm.links();
        let full_name = if fl == Groups::STRIPED { self.a.full_link.clone() } else { names[fl].name.clone() };
        self.links = (full_name, names[il].name.clone());
        let groups = Groups::new(comm, self.a.ranks_per_host, fl, il)?;
        let mut tr = SdpTrainer::new(self.cfg.clone(), self.corpus.clone(), comm, groups, self.strategy, &self.a.fractions)?;
        if let Some((ranks, fi)) = &self.fail {
            let armed = g.number == 0 && ranks.contains(&self.rank);
            tr.set_backward_hook(crate::train::elastic::kill_hook(armed, self.rank, *fi, self.cfg.model.layers / 2));
        }
        self.step = (tr.iter() as i64).to_le_bytes();
        self.tr = Some(tr);
        Ok(())
    }

    fn state_specs(&self) -> Vec<TensorSpec> {
        self.tr.as_ref().map(SdpTrainer::state_specs).unwrap_or_default()
    }

    fn state(&self) -> Vec<&[u8]> {
        let Some(tr) = &self.tr else { return Vec::new() };
        let (mut v, _, _) = tr.state_bufs();
        v.push(&self.step);
        v.push(&self.seed);
        v
    }

    fn restore(&mut self, s: &Snapshot) -> Result<(), BoxError> {
        let tr = self.trainer()?;
        tr.load_state(|name| s.tensor(name).map(<[u8]>::to_vec))?;
        let it = tr.iter();
        self.step = (it as i64).to_le_bytes();
        Ok(())
    }

    fn start_over(&mut self) -> Result<(), BoxError> {
        // the generation's fresh trainer holds the seed's initial shards
        Ok(())
    }

    fn step(&mut self, it: u64, _cx: &StepContext<'_>) -> Result<Step<SdpStep>, BoxError> {
        let iters = self.iters;
        let tr = self.tr.as_mut().ok_or("the trainer joins no generation yet")?;
        let s = match &self.emulated {
            Some(emu) => tr.step_emulated(emu)?,
            None => tr.step_timed()?,
        };
        let done = tr.iter();
        self.step = (done as i64).to_le_bytes();
        if it == iters {
            // the compute lane shows compute; its waits are in the report (`wait_s`)
            let shown: Vec<_> =
                s.spans.iter().filter(|x| !(x.lane == ironweave_overlap::Lane::Compute && x.name == "wait")).cloned().collect();
            self.last_spans = to_records(&shown);
        }
        Ok(Step::new(s))
    }

    fn on_start(&mut self, first_iter: u64, _comm: &Arc<Communicator>) -> Result<(), BoxError> {
        self.log.start(first_iter);
        Ok(())
    }

    fn on_iteration(&mut self, it: &Iteration<'_, SdpStep>) -> Result<(), BoxError> {
        let (s, dt) = (it.output, it.elapsed.as_secs_f64());
        let busy = self.busy.iteration(self.emulated.as_ref(), it.iter, dt, self.rank, Some(s.compute_s()));
        if self.rank != 0 {
            return Ok(());
        }
        let lanes: Vec<f64> = (0..3).map(|l| s.lane_busy_s(l)).collect();
        let line = serde_json::json!({"iter": it.iter, "time": dt, "loss": s.loss, "committed": it.committed, "compute": s.compute_s(),
            "wait": s.wait_s(), "busy": s.comm_busy_s(), "lanes": lanes, "device_busy": busy});
        let text = format!(
            "{}  comm {:>6.1} ms busy, compute waited {:>6.1} ms  committed {}",
            crate::train::busy::iteration_cell(busy, dt, s.loss),
            s.comm_busy_s() * 1e3,
            s.wait_s() * 1e3,
            it.committed.map(|c| c.to_string()).unwrap_or_else(|| "-".into())
        );
        self.log.iteration(it.iter, &line, &text)?;
        Ok(())
    }

    fn on_recovery(&mut self, r: &Recovery, _comm: &Arc<Communicator>) -> Result<(), BoxError> {
        Ok(self.log.recovered(r)?)
    }

    fn on_stop(&mut self) {
        self.log.stop();
    }

    fn layout(&self) -> std::collections::BTreeMap<String, String> {
        let mut m = std::collections::BTreeMap::new();
        m.insert("kind".into(), format!("sharded data parallel `{}`", self.strategy.name()));
        m.insert("ranks_per_host".into(), self.a.ranks_per_host.to_string());
        m.insert("model".into(), self.cfg.name.clone());
        m
    }
}

/// The per-rank program of `train --sdp`, on the elastic runtime (a failed collective re-forms
/// the job; the shards come back from the checkpoint engine).
pub fn worker(a: &SdpWorkerArgs) -> Result<()> {
    let (cfg, corpus) = load_config(&a.run.config)?;
    let iters = a.run.iters.unwrap_or(cfg.train.iters);
    let strategy = Strategy::parse(&a.strategy)?;
    let choice = crate::train::args::parse_strategy(&a.run.ckpt)?;
    if choice.multilink {
        bail!("sharded runs checkpoint over the first link (their groups keep the others busy): use --ckpt capricorn");
    }
    let fail = a.run.fail.as_deref().map(crate::train::args::parse_fail).transpose()?;
    let dir = &a.run.report_dir;
    std::fs::create_dir_all(dir)?;
    let ecfg = choice.engine_config(dir, a.run.persist_every);
    let job = crate::train::elastic::join_job(iters, ecfg, elastic::CheckpointLinks::Training, a.run.resume_from.as_deref())?;
    let rank = job.rank();
    let emulated = a.compute.load(&cfg, job.world_size(), iters)?;
    let compute = a.compute.describe(emulated.as_ref());
    let mut w = SdpWorker {
        a,
        seed: (cfg.train.seed as i64).to_le_bytes(),
        cfg: cfg.clone(),
        corpus,
        strategy,
        rank,
        iters,
        fail,
        links: Default::default(),
        tr: None,
        log: RankLog::new(rank, iters, &a.run.report_dir),
        step: [0; 8],
        last_spans: Vec::new(),
        emulated,
        busy: BusyMeter::default(),
    };
    let done = crate::train::elastic::run_elastic(job, &mut w)?;
    let tr = w.tr.take().context("the job ran no generation")?;
    let comm = done.comm().clone();
    let mut rep = SdpReport {
        config: cfg.name.clone(),
        sdp: strategy.name().into(),
        ranks_per_host: a.ranks_per_host,
        iterations: iters,
        fractions: a.fractions.clone(),
        ckpt: a.run.ckpt.clone(),
        recoveries: done.recoveries(),
        last_committed_iter: done.last_committed(),
        links: w.links.clone(),
        ranks: comm.size(),
        state_bytes_per_rank: tr.state_bytes_per_rank(),
        ..Default::default()
    };
    rep.final_state_sha256 = done.job_state_sha256(&tr.state_digest())?;
    {
        let (mut bufs, step, seed) = tr.state_bufs();
        bufs.push(&step);
        bufs.push(&seed);
        rep.digests = crate::rundir::Digests::of(&done, &bufs)?;
    }
    // the communication threads' CPU of every rank (read while the links are still open)
    let mut cpu =
        [ironweave_transport::threads::comm_cpu_ns().unwrap_or(0) as f64, ironweave_transport::threads::process_cpu_ns() as f64];
    comm.all_reduce(&mut cpu, ironweave_transport::ReduceOp::Sum)?;
    rep.comm_cpu_ns = cpu[0] as u64;
    rep.process_cpu_ns = cpu[1] as u64;
    rep.compute.mode = compute;
    (rep.compute.device_busy_share, rep.compute.cpu_busy_share) = w.busy.finish(&comm, w.emulated.is_some())?;
    rep.compute.host_compute_s = w.busy.finish_host(&comm, w.emulated.is_some())?;
    let last_spans = std::mem::take(&mut w.last_spans);
    // every rank's lanes of the last iteration to rank 0 (empty if it ran before a restart)
    let bytes = serde_json::to_vec(&last_spans)?;
    if rank != 0 {
        comm.send_bytes(0, SPANS_TAG, &bytes)?;
    } else {
        let mut lanes: Vec<(usize, Vec<SpanRec>)> = vec![(0, last_spans)];
        for r in 1..comm.size() {
            let b = comm.recv_bytes(r, SPANS_TAG)?;
            lanes.push((r, serde_json::from_slice(&b).with_context(|| format!("rank {r}'s spans"))?));
        }
        // the whole run from the per-iteration lines (a re-run iteration's last line wins)
        let by_iter = crate::rundir::read_iterations(dir);
        for v in by_iter.values() {
            let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
            rep.iter_time_s.push(f("time"));
            rep.loss.push(v["loss"].as_f64().map_or(f32::NAN, |l| l as f32));
            rep.compute_s.push(f("compute"));
            rep.wait_s.push(f("wait"));
            rep.comm_busy_s.push(f("busy"));
            let l = |i: usize| v["lanes"][i].as_f64().unwrap_or(0.0);
            rep.lane_busy_s.push([l(0), l(1), l(2)]);
        }
        std::fs::write(dir.join("report.json"), serde_json::to_vec_pretty(&rep)?)?;
        let groups = [format!("{} ({})", LANES[0], rep.links.0), LANES[1].to_string(), format!("{} ({})", LANES[2], rep.links.1)];
        let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
        std::fs::write(dir.join("trace.json"), serde_json::to_vec(&chrome_trace(&lanes, &groups))?)?;
        let title = format!("{} sharded `{}`: every rank's lanes in iteration {iters}", cfg.name, strategy.name());
        std::fs::write(dir.join("timeline.svg"), svg_lanes(&lanes, &groups, &title))?;
    }
    comm.barrier()?;
    done.shutdown()?;
    Ok(())
}

/// Fractions of the all-rank part per layer from the plan file at `path`
/// (see [`ironweave_plan::sdp::part_fractions_from_json`]).
pub fn plan_fractions(path: &std::path::Path, layers: usize) -> Result<Vec<f64>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    ironweave_plan::sdp::part_fractions_from_json(&bytes, layers).with_context(|| format!("plan {}", path.display()))
}

/// `ironweave train --sdp ...`: launches the ranks, prints the summary.
pub fn run(a: &TrainArgs) -> Result<i32> {
    let strategy = Strategy::parse(a.sdp.as_deref().unwrap_or("hsdp"))?;
    let chosen = ironweave::Backend::pick(&a.backend)?;
    chosen.usable().with_context(|| format!("--backend {chosen} cannot run here (`ironweave doctor` says more)"))?;
    let (cfg, _) = load_config(&a.config)?;
    let choice = crate::train::args::parse_strategy(&a.ckpt)?;
    if let Some(f) = &a.fail {
        crate::train::args::parse_fail(f)?;
        if choice.strategy == CkptStrategy::None {
            bail!("--fail needs a checkpoint to recover from: drop --ckpt none (capricorn is the default)");
        }
    }
    let fractions = match (&a.sdp_plan, strategy) {
        (Some(p), Strategy::Hsdp) => plan_fractions(p, cfg.model.layers)?,
        (Some(_), _) => bail!("--sdp-plan gives hsdp its fractions: use it with --sdp hsdp"),
        (None, Strategy::Hsdp) => bail!("--sdp hsdp needs --sdp-plan plan.json (`ironweave plan sdp --json plan.json`)"),
        (None, _) => Vec::new(),
    };
    // emulated compute: the device profile is read and the state must fit, before any rank
    // starts (each rank builds the whole model once before it keeps its shards; the
    // checkpoint's buffers and replicas counted at the whole model's size, an upper bound)
    a.compute.load_fitting(
        &a.config,
        &cfg,
        a.ranks,
        a.iters.unwrap_or(cfg.train.iters),
        1,
        (choice.strategy != CkptStrategy::None).then_some(a.replicas),
    )?;
    // on one machine without a topology, --ranks-per-host still groups the ranks into
    // (logical) hosts; by default they all form one
    let rph = if a.topology.is_some() || a.ranks_per_host > 1 { a.ranks_per_host.max(1) } else { a.ranks.max(1) };
    if a.ranks % rph != 0 {
        bail!("--ranks {} is not a multiple of --ranks-per-host {rph}", a.ranks);
    }
    let (full_link, inter_link) = match a.sdp_links.as_deref() {
        None => (String::new(), String::new()),
        Some(s) => {
            let (mut f, mut i) = (String::new(), String::new());
            for part in s.split(',') {
                match part.split_once('=') {
                    Some(("full", v)) => f = v.trim().to_string(),
                    Some(("inter", v)) => i = v.trim().to_string(),
                    _ => bail!("--sdp-links takes full=LINK,inter=LINK (got {s:?})"),
                }
            }
            (f, i)
        }
    };
    std::fs::create_dir_all(&a.report_dir).with_context(|| format!("creating {}", a.report_dir.display()))?;
    for f in ["report.json", "iterations.jsonl"] {
        let _ = std::fs::remove_file(a.report_dir.join(f));
    }
    if let Some(from) = &a.resume_from {
        crate::train::args::check_resume_from(from, &a.report_dir)?;
    }
    let _ = std::fs::remove_dir_all(a.report_dir.join("persist"));
    let args = SdpWorkerArgs {
        run: a.rank_args(),
        strategy: strategy.name().into(),
        fractions,
        ranks_per_host: rph,
        full_link,
        inter_link,
        compute: a.compute.clone(),
    }
    .to_argv();
    let topology = match &a.topology {
        Some(p) => Some((crate::cluster::load_up(p)?, rph)),
        None => None,
    };
    eprintln!(
        "ironweave train: {} on {} ranks over {chosen}, sharded data parallelism `{}`, compute {}, checkpoints `{}`, report in {}",
        cfg.name,
        a.ranks,
        strategy.name(),
        a.compute.compute,
        a.ckpt,
        a.report_dir.display()
    );
    let code = crate::launch::workers(
        a.ranks,
        args,
        chosen.name(),
        a.quiet,
        topology,
        a.max_restarts.unwrap_or(if a.fail.is_some() { 4 } else { 0 }),
        a.threads_per_rank,
    )?;
    if code != 0 {
        return Ok(code);
    }
    let rep: SdpReport =
        serde_json::from_slice(&std::fs::read(a.report_dir.join("report.json")).context("reading report.json")?)?;
    let steady = crate::rundir::median_after(&rep.iter_time_s, 2);
    if rep.recoveries > 0 {
        println!("recoveries: {}", rep.recoveries);
    }
    println!("final state sha256 {}", rep.final_state_sha256);
    println!(
        "done: {} iterations on {} ranks, sharded `{}` (all-rank part on {}, cross-host on {}), {}, median iteration {:.1} ms, {:.1} MB of state per rank",
        rep.iterations,
        rep.ranks,
        rep.sdp,
        rep.links.0,
        rep.links.1,
        crate::train::busy::outcome(&rep.compute, rep.loss.first().copied(), rep.loss.last().copied()),
        steady * 1e3,
        rep.state_bytes_per_rank as f64 / 1e6
    );
    Ok(0)
}

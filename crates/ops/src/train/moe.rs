//! `ironweave train`: launch the ranks of the MoE workload with per-iteration checkpoints,
//! optionally kill one mid-backward (`--fail rank=R,iter=I`) and recover; write a report.
//! `train-worker` (hidden) is the per-rank program. Rank 0 also records its expert load per
//! iteration as `expert_load.json`, the trace format `ironweave simulate ckpt --load-trace` reads.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ironweave::ckpt::engine::Strategy;
use ironweave::ckpt::{Engine, EngineConfig, Snapshot, TensorSpec};
use ironweave::elastic::{self, BoxError, Generation, Iteration, Recovery, Step, StepContext, Worker};
use ironweave::Communicator;
use ironweave_train::data::Corpus;
use ironweave_train::dist::Dist;
use ironweave_train::model::Params;
use ironweave_train::{StepReport, TrainConfig, Trainer};

use crate::error::{bail, Context, Result};
use crate::rundir::{process_footprint, Report};
use crate::train::args::{host_fail_to_ranks, load_config, parse_fail, parse_strategy, ComputeArgs, ElasticRankArgs, TrainArgs};
use crate::train::busy::BusyMeter;
use crate::train::elastic::RankLog;
use ironweave_train::emulated::Emulated;

/// The hidden `train-worker`'s options: `ironweave train` writes them with
/// [`WorkerArgs::to_argv`], each rank parses them back and runs [`worker`].
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub run: ElasticRankArgs,
    #[arg(long, default_value_t = 2)]
    pub replicas: u32,
    #[arg(long)]
    pub bucket_kb: Option<usize>,
    /// This rank's share of the emulated storage bandwidth, bytes/s.
    #[arg(long)]
    pub storage_bytes_per_s: Option<f64>,
    /// Append this rank's routing to `rank<R>.jsonl` here, one line per iteration.
    #[arg(long)]
    pub routing_dir: Option<PathBuf>,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

impl WorkerArgs {
    /// The hidden subcommand that runs it.
    pub const SUBCOMMAND: &'static str = "train-worker";

    /// The rank's command line: the subcommand, then these options as clap parses them.
    pub fn to_argv(&self) -> Vec<String> {
        let argv = self
            .run
            .write(crate::Argv::new(Self::SUBCOMMAND))
            .opt("replicas", self.replicas)
            .some("bucket-kb", self.bucket_kb)
            .some("storage-bytes-per-s", self.storage_bytes_per_s)
            .some("routing-dir", self.routing_dir.as_ref().map(|p| p.display()));
        self.compute.write(argv).done()
    }
}

/// The reference MoE trainer as an elastic worker: the runtime owns generations, restores and
/// re-formations; this says what the state is, how a step runs and what rank 0 records.
struct MoeWorker {
    cfg: TrainConfig,
    corpus: Corpus,
    rank: usize,
    fail: Option<(Vec<usize>, u64)>,
    /// Rebuilt at each generation (its communicator is new); parameters carry over.
    trainer: Option<Trainer>,
    /// The seed's initial state, to start over from when a failure comes before any commit.
    initial: Option<Params>,
    log: RankLog,
    step: [u8; 8],
    seed: [u8; 8],
    /// `--record-routing`: this rank's routing file, a line per iteration.
    routing: Option<std::fs::File>,
    /// `--compute emulated`: the device and the router the steps replay.
    emulated: Option<Emulated>,
    /// Device-busy and CPU-busy shares.
    busy: BusyMeter,
}

impl Worker for MoeWorker {
    type Output = StepReport;

    fn state_specs(&self) -> Vec<TensorSpec> {
        self.trainer.as_ref().map(Trainer::state_specs).unwrap_or_default()
    }

    fn join(&mut self, g: &Generation<'_>) -> Result<(), BoxError> {
        let dist = Dist { comm: g.comm.clone(), prof: None };
        let mut tr = Trainer::distributed(self.cfg.clone(), self.corpus.clone(), dist)?;
        match self.trainer.take() {
            Some(old) => tr.params = old.params,
            None if self.initial.is_none() => self.initial = Some(tr.params.clone()),
            None => {}
        }
        if let Some((ranks, fi)) = &self.fail {
            // only the job's first generation fails: a restarted rank runs to the end
            let armed = g.number == 0 && ranks.contains(&self.rank);
            tr.backward_hook = Some(crate::train::elastic::kill_hook(armed, self.rank, *fi, self.cfg.model.layers / 2));
        }
        self.step = (tr.params.step as i64).to_le_bytes();
        self.trainer = Some(tr);
        Ok(())
    }

    fn state(&self) -> Vec<&[u8]> {
        let Some(tr) = &self.trainer else { return Vec::new() };
        let (mut v, _, _) = tr.state_bytes();
        v.push(&self.step);
        v.push(&self.seed);
        v
    }

    fn restore(&mut self, s: &Snapshot) -> Result<(), BoxError> {
        let tr = self.trainer.as_mut().ok_or("the trainer joins no generation yet")?;
        tr.load_state(|name| s.tensor(name).map(<[u8]>::to_vec))?;
        self.step = (tr.params.step as i64).to_le_bytes();
        Ok(())
    }

    fn start_over(&mut self) -> Result<(), BoxError> {
        let initial = self.initial.clone().ok_or("the initial state was not kept")?;
        let tr = self.trainer.as_mut().ok_or("the trainer joins no generation yet")?;
        tr.params = initial;
        self.step = (tr.params.step as i64).to_le_bytes();
        Ok(())
    }

    fn step(&mut self, iter: u64, cx: &StepContext<'_>) -> Result<Step<StepReport>, BoxError> {
        let tr = self.trainer.as_mut().ok_or("the trainer joins no generation yet")?;
        // training communication goes into the engine's profiler: its idle windows
        tr.set_profiler(cx.profiler.clone());
        let s = match &self.emulated {
            Some(emu) => tr.step_emulated(emu, Some(cx.profiler))?,
            None => tr.step(Some(cx.profiler))?,
        };
        self.step = (tr.params.step as i64).to_le_bytes();
        if let Some(f) = &mut self.routing {
            // the router's choices before capacity; a repeated iteration's line replaces this
            // one. One write per line: a rank killed between two writes would leave half a line
            // that its restarted self appends to.
            let mut line = serde_json::to_string(&RoutingRow { iter, tokens: s.load.tokens.clone() })?;
            line.push('\n');
            f.write_all(line.as_bytes())?;
        }
        Ok(Step { expert_load: Some(s.load.clone()), output: s })
    }

    fn on_start(&mut self, first_iter: u64, _comm: &Arc<Communicator>) -> Result<(), BoxError> {
        self.log.start(first_iter);
        Ok(())
    }

    fn on_iteration(&mut self, it: &Iteration<'_, StepReport>) -> Result<(), BoxError> {
        let (s, ir, dt) = (it.output, it.ckpt, it.elapsed.as_secs_f64());
        let busy = self.busy.iteration(self.emulated.as_ref(), it.iter, dt, self.rank, None);
        if self.rank != 0 {
            return Ok(());
        }
        // the report is built from these lines, so a restarted rank 0 still reports the run
        let (rss, fds) = process_footprint();
        let line = serde_json::json!({"iter": it.iter, "time": dt, "loss": s.loss, "exposed": ir.exposed_s, "committed": it.committed,
            "rss": rss, "fds": fds,
            "profiled": ir.profiled, "accuracy": ir.partition_accuracy, "load": s.load.tokens,
            "dp_comm": s.sync.comm_s, "dp_hidden": s.sync.hidden_s, "buckets": s.sync.buckets, "device_busy": busy});
        let toks = (self.cfg.train.batch * self.cfg.model.seq * it.comm.size()) as f64;
        let text = format!(
            "{}  {:>6.0} tokens/s  ckpt exposed {:>6.2} ms  committed {}",
            crate::train::busy::iteration_cell(busy, dt, s.loss),
            toks / dt,
            ir.exposed_s * 1e3,
            it.committed.map(|c| c.to_string()).unwrap_or_else(|| "-".into())
        );
        self.log.iteration(it.iter, &line, &text)?;
        let _ = std::io::stdout().flush();
        Ok(())
    }

    fn on_recovery(&mut self, r: &Recovery, _comm: &Arc<Communicator>) -> Result<(), BoxError> {
        Ok(self.log.recovered(r)?)
    }

    fn on_stop(&mut self) {
        self.log.stop();
    }

    fn layout(&self) -> std::collections::BTreeMap<String, String> {
        self.trainer.as_ref().map(Trainer::layout).unwrap_or_default()
    }
}

/// The hidden `train-worker`: one rank of `ironweave train`, on the elastic runtime.
pub fn worker(a: &WorkerArgs) -> Result<()> {
    let (mut cfg, corpus) = load_config(&a.run.config)?;
    if let Some(k) = a.bucket_kb {
        cfg.train.bucket_kb = k;
    }
    let iters = a.run.iters.unwrap_or(cfg.train.iters);
    let choice = parse_strategy(&a.run.ckpt)?;
    let strategy = choice.strategy;
    let fail = a.run.fail.as_deref().map(parse_fail).transpose()?;
    std::fs::create_dir_all(&a.run.report_dir)?;
    let ecfg = EngineConfig {
        storage_bytes_per_s: a.storage_bytes_per_s,
        replicas: a.replicas,
        ..choice.engine_config(&a.run.report_dir, a.run.persist_every)
    };
    let links = if choice.multilink { elastic::CheckpointLinks::All } else { elastic::CheckpointLinks::Training };
    let job = crate::train::elastic::join_job(iters, ecfg.clone(), links, a.run.resume_from.as_deref())?;
    let rank = job.rank();
    let emulated = a.compute.load(&cfg, job.world_size(), iters)?;
    let compute = a.compute.describe(emulated.as_ref());
    let mut w = MoeWorker {
        seed: (cfg.train.seed as i64).to_le_bytes(),
        cfg: cfg.clone(),
        corpus,
        rank,
        log: RankLog::new(rank, iters, &a.run.report_dir),
        fail,
        trainer: None,
        initial: None,
        step: [0; 8],
        routing: match &a.routing_dir {
            Some(d) => {
                let p = d.join(format!("rank{rank}.jsonl"));
                let f = std::fs::OpenOptions::new().create(true).append(true).open(&p);
                Some(f.with_context(|| format!("opening {}", p.display()))?)
            }
            None => None,
        },
        emulated,
        busy: BusyMeter::default(),
    };
    let done = crate::train::elastic::run_elastic(job, &mut w)?;
    let tr = w.trainer.take().context("the job ran no generation")?;
    let e = done.engine();
    let comm = done.comm().clone();
    let mut rep = Report {
        config: cfg.name.clone(),
        strategy: a.run.ckpt.clone(),
        iterations: iters,
        recoveries: done.recoveries(),
        last_committed_iter: done.last_committed(),
        ..Default::default()
    };
    // what the engine moved, summed over the ranks (after the final commit's flush)
    {
        use std::sync::atomic::Ordering::Relaxed;
        let c = e.counters();
        let cpu = c.replica_send_cpu_ns.load(Relaxed) + c.replica_recv_cpu_ns.load(Relaxed);
        let wire = [c.wire_chunks.load(Relaxed), c.wire_chunks_in_window.load(Relaxed)];
        let passes = e.memory_passes();
        let mut v: Vec<i64> = [
            c.replica_bytes.load(Relaxed),
            c.replica_bytes_inter_host.load(Relaxed),
            c.storage_bytes.load(Relaxed),
            cpu,
            wire[0],
            wire[1],
            ironweave_transport::threads::process_cpu_ns(),
            ironweave_transport::threads::comm_cpu_ns().unwrap_or(0),
            c.snapshots_skipped.load(Relaxed),
            passes.snapshot_bytes,
            passes.send_pass_bytes,
            passes.received_bytes,
            passes.recv_pass_bytes,
        ]
        .into_iter()
        .chain(c.replica_bytes_per_link.iter().map(|x| x.load(Relaxed)))
        .map(|x| x as i64)
        .collect();
        comm.all_reduce(&mut v, ironweave_transport::ReduceOp::Sum)?;
        let v: Vec<u64> = v.into_iter().map(|x| x.max(0) as u64).collect();
        rep.ckpt_bytes_replicated = v[0];
        rep.ckpt_bytes_inter_host_sent = v[1];
        rep.ckpt_bytes_storage = v[2];
        rep.ckpt_engine_threads_cpu_ns = v[3];
        rep.wire_chunks = v[4];
        rep.wire_accuracy = (v[4] > 0).then(|| v[5] as f64 / v[4] as f64);
        rep.process_cpu_ns = v[6];
        rep.comm_cpu_ns = v[7];
        rep.ckpt_snapshots_skipped = v[8];
        rep.ckpt_memory = ironweave_ckpt::MemoryPasses {
            snapshot_bytes: v[9],
            send_pass_bytes: v[10],
            received_bytes: v[11],
            recv_pass_bytes: v[12],
        };
        rep.ckpt_bytes_per_link = v[13..].to_vec();
        rep.state_bytes_per_rank = e.registry().total;
        rep.storage_bytes_per_s_per_rank = a.storage_bytes_per_s;
        (rep.compute.device_busy_share, rep.compute.cpu_busy_share) = w.busy.finish(&comm, w.emulated.is_some())?;
    }
    rep.compute.mode = compute;
    rep.final_state_sha256 = done.job_state_sha256(&tr.state_digest())?;
    // the layout-free digest of the final state, and of the state a resumed job loaded
    {
        let (mut bufs, step, seed) = tr.state_bytes();
        bufs.push(&step);
        bufs.push(&seed);
        rep.digests = crate::rundir::Digests::of(&done, &bufs)?;
    }
    rep.restore_sources =
        done.restore_sources()?.into_iter().map(|s| s.map_or("", elastic::RestoreSource::name).to_string()).collect();
    // the placement every rank derived from the hosts they exchanged
    let keys = e.hosts().to_vec();
    let mut order: Vec<u64> = Vec::new();
    for k in &keys {
        if !order.contains(k) {
            order.push(*k);
        }
    }
    rep.hosts = keys.iter().map(|k| order.iter().position(|o| o == k).unwrap_or(0)).collect();
    if matches!(strategy, Strategy::Gemini | Strategy::Capricorn) {
        rep.replica_holders = ironweave_ckpt::placement_on_hosts(&keys, ecfg.replicas as usize);
    }
    rep.ranks = comm.size();
    rep.tokens_per_iter = (cfg.train.batch * cfg.model.seq * comm.size()) as u64;
    if rank == 0 {
        write_rank0_files(&mut rep, &cfg, &a.run.report_dir, iters, &tr, e)?;
    } else {
        // every other rank's profile beside rank 0's trace.json: an all-to-all lasts as long as
        // its slowest peer, which only the peers' own traces show
        let trace =
            ironweave_profile::export::chrome_trace(&e.profiler().history(), &[], u32::try_from(rank).unwrap_or(u32::MAX));
        std::fs::write(a.run.report_dir.join(format!("trace-rank{rank}.json")), serde_json::to_vec(&trace)?)?;
    }
    done.shutdown()?;
    Ok(())
}

/// Rank 0's files: `report.json` from the per-iteration lines (the last line of a re-run
/// iteration wins, so a restarted rank 0 still reports every iteration), `expert_load.json`,
/// `trace.json` and `timeline.svg` (the other ranks write `trace-rank<r>.json`).
fn write_rank0_files(rep: &mut Report, cfg: &TrainConfig, report_dir: &Path, iters: u64, tr: &Trainer, e: &Engine) -> Result<()> {
    let last = crate::rundir::read_iterations(report_dir);
    let n = iters as usize;
    rep.iter_time_s = vec![0.0; n];
    rep.loss = vec![0.0; n];
    rep.ckpt_exposed_s = vec![0.0; n];
    rep.dp_comm_s = vec![0.0; n];
    rep.dp_hidden_s = vec![0.0; n];
    rep.rss_bytes = vec![0; n];
    rep.open_fds = vec![0; n];
    rep.threads_per_rank = std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    rep.grad_buckets = tr.buckets().len();
    // rank 0's expert load per iteration, in `ironweave simulate ckpt --load-trace` format
    let mut loads: Vec<Vec<Vec<f64>>> = vec![Vec::new(); n];
    let (mut acc_sum, mut acc_n) = (0.0, 0u64);
    for (it, v) in &last {
        let k = (*it - 1) as usize;
        if k >= n {
            continue;
        }
        rep.iter_time_s[k] = v["time"].as_f64().unwrap_or(0.0);
        // no loss (emulated compute learns nothing): NaN, which report.json writes as null
        rep.loss[k] = v["loss"].as_f64().map_or(f32::NAN, |l| l as f32);
        rep.ckpt_exposed_s[k] = v["exposed"].as_f64().unwrap_or(0.0);
        rep.dp_comm_s[k] = v["dp_comm"].as_f64().unwrap_or(0.0);
        rep.dp_hidden_s[k] = v["dp_hidden"].as_f64().unwrap_or(0.0);
        rep.rss_bytes[k] = v["rss"].as_u64().unwrap_or(0);
        rep.open_fds[k] = v["fds"].as_u64().unwrap_or(0);
        rep.profiling_activations += u64::from(v["profiled"].as_bool().unwrap_or(false));
        if let Some(a) = v["accuracy"].as_f64() {
            acc_sum += a;
            acc_n += 1;
        }
        if let Some(l) = v["load"].as_array() {
            loads[k] = l
                .iter()
                .map(|x| x.as_array().map(|a| a.iter().filter_map(|y| y.as_f64()).collect()).unwrap_or_default())
                .collect();
        }
    }
    rep.partition_accuracy = (acc_n > 0).then(|| acc_sum / acc_n as f64);
    std::fs::write(report_dir.join("report.json"), serde_json::to_vec_pretty(&rep)?)?;
    let trace_loads: Vec<_> = loads.into_iter().filter(|l| !l.is_empty()).collect();
    let lt = serde_json::json!({ "experts": cfg.model.experts, "iterations": trace_loads });
    std::fs::write(report_dir.join("expert_load.json"), serde_json::to_vec(&lt)?)?;
    let hist = e.profiler().history();
    let trace = ironweave_profile::export::chrome_trace(&hist, &[], 0);
    std::fs::write(report_dir.join("trace.json"), serde_json::to_vec(&trace)?)?;
    // the last iteration that timed its layers (speculative activation turns layer timing
    // off in most iterations; an unprofiled one would draw an empty layers lane)
    if let Some(p) = hist.iter().rev().find(|p| !p.layers.is_empty()).or(hist.last()) {
        let w = ironweave_profile::idle_windows(p, 0, 50_000);
        let title = if p.layers.is_empty() {
            format!("rank 0, iteration {} (no iteration timed its layers)", p.iter)
        } else {
            format!("rank 0, iteration {} (the last one profiled layer by layer)", p.iter)
        };
        std::fs::write(report_dir.join("timeline.svg"), ironweave_profile::export::svg_timeline(p, &w, &title))?;
    }
    Ok(())
}

/// `ironweave train` of data and expert parallelism: launches the ranks, prints the summary;
/// returns the exit status. ([`crate::train::run`] picks this, `--tp` or `--sdp`.)
pub fn run(a: &TrainArgs) -> Result<i32> {
    let (config, ranks, strategy, backend) = (a.config.as_path(), a.ranks, a.ckpt.as_str(), a.backend.as_str());
    let (iters, report_dir) = (a.iters, a.report_dir.as_path());
    // --fail host=H: every rank of emulated host H (the launcher puts rank r on host
    // r / ranks-per-host), killed together
    let fail_ranks =
        a.fail.as_deref().map(|f| host_fail_to_ranks(f, a.topology.is_some(), a.ranks_per_host, ranks)).transpose()?;
    let fail = fail_ranks.as_deref();
    // a backend that is not compiled in or cannot run here is refused before any rank starts
    let chosen = ironweave::Backend::pick(backend)?;
    chosen.usable().with_context(|| format!("--backend {chosen} cannot run here (`ironweave doctor` says more)"))?;
    let (cfg, _) = load_config(config)?;
    let choice = parse_strategy(strategy)?;
    // the host's storage bandwidth, shared by its ranks
    let per_host = if a.topology.is_some() { a.ranks_per_host.max(1) } else { ranks.max(1) };
    let storage_per_rank = match &a.storage_rate {
        Some(r) => {
            // bytes per second
            let rate = ironweave_units::parse_rate(r).map_err(|e| crate::error::err!("--storage-rate: {e}"))?;
            if rate == 0 {
                bail!("--storage-rate must be above 0 (leave it out for the local disk's speed)");
            }
            Some(rate as f64 / per_host as f64)
        }
        None => None,
    };
    if a.replicas == 0 || a.replicas as usize > ranks {
        bail!(
            "--replicas {}: give 1 to {ranks} copies per rank's state (its own included; 2 puts one replica on a peer)",
            a.replicas
        );
    }
    if let Some(f) = fail {
        let (rs, i) = parse_fail(f)?;
        if let Some(r) = rs.iter().find(|&&r| r >= ranks) {
            bail!("--fail rank={r}: there are only {ranks} ranks");
        }
        if i > iters.unwrap_or(cfg.train.iters) {
            bail!("--fail iter={i} is past the last iteration");
        }
    }
    // emulated compute: the device profile and the routing trace are read and checked, and the
    // state must fit in this machine's memory, before any rank starts
    let emulated = a.compute.load_fitting(
        config,
        &cfg,
        ranks,
        iters.unwrap_or(cfg.train.iters),
        ranks,
        (choice.strategy != Strategy::None).then_some(a.replicas),
    )?;
    std::fs::create_dir_all(report_dir).with_context(|| format!("creating {}", report_dir.display()))?;
    if let Some(from) = &a.resume_from {
        crate::train::args::check_resume_from(from, report_dir)?;
    }
    let _ = std::fs::remove_dir_all(report_dir.join("persist"));
    let _ = std::fs::remove_file(report_dir.join("report.json"));
    let _ = std::fs::remove_file(report_dir.join("iterations.jsonl"));
    let routing_dir = a.record_routing.as_ref().map(|_| report_dir.join("routing"));
    if let Some(d) = &routing_dir {
        let _ = std::fs::remove_dir_all(d);
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let args = WorkerArgs {
        // the ranks' --fail: hosts turned into their ranks
        run: ElasticRankArgs { fail: fail.map(str::to_string), ..a.rank_args() },
        replicas: a.replicas,
        bucket_kb: a.bucket_kb,
        storage_bytes_per_s: storage_per_rank,
        routing_dir: routing_dir.clone(),
        compute: a.compute.clone(),
    }
    .to_argv();
    let topology = match &a.topology {
        Some(p) => Some((crate::cluster::Topology::load(p)?, a.ranks_per_host.max(1))),
        None => None,
    };
    eprintln!(
        "ironweave train: {} on {ranks} ranks over {chosen}, compute {}, checkpoint strategy {strategy}, report in {}",
        cfg.name,
        a.compute.describe(emulated.as_ref()),
        report_dir.display()
    );
    let code = crate::launch::workers(
        ranks,
        args,
        chosen.name(),
        a.quiet,
        topology,
        a.max_restarts.unwrap_or(if fail.is_some() { 4 } else { 0 }),
        a.threads_per_rank,
    )?;
    if code != 0 {
        return Ok(code);
    }
    let mut rep: Report = serde_json::from_slice(&std::fs::read(report_dir.join("report.json")).context("reading report.json")?)?;
    // where it ran, for replays (`ironweave simulate ckpt --from-report`)
    rep.topology = a.topology.clone();
    rep.ranks_per_host = per_host;
    std::fs::write(report_dir.join("report.json"), serde_json::to_vec_pretty(&rep)?)?;
    if let (Some(file), Some(dir)) = (&a.record_routing, &routing_dir) {
        write_routing_trace(&cfg, ranks, dir, file)?;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let committed = match rep.last_committed_iter {
        Some(i) => format!("iteration {i}"),
        None => "nothing".into(),
    };
    let hidden = match rep.comm_hidden_fraction() {
        Some(h) => format!(", {:.0}% of gradient communication hidden behind backward", h * 100.0),
        None => String::new(),
    };
    // the first loss this job computed (a resumed job starts past the checkpoint's)
    let learned = crate::train::busy::outcome(&rep.compute, rep.loss.get(rep.resumed_iters()).copied(), rep.loss.last().copied());
    println!(
        "done: {} iterations on {} rank{} x {} thread{}, {learned}, {:.0} tokens/s (mean iteration {:.1} ms after 2 warm-up){hidden}",
        rep.iterations,
        rep.ranks,
        if rep.ranks == 1 { "" } else { "s" },
        rep.threads_per_rank,
        if rep.threads_per_rank == 1 { "" } else { "s" },
        rep.tokens_per_s(),
        rep.mean_iter_s() * 1e3,
    );
    println!(
        "checkpoints ({strategy}): mean exposed {:.2} ms, partition accuracy {} (sent) / {} (on the wire, every holder), profiling activations {}, last committed {committed}, recoveries {}; final state {}",
        mean(&rep.ckpt_exposed_s) * 1e3,
        rep.partition_accuracy.map(|a| format!("{:.0}%", a * 100.0)).unwrap_or_else(|| "-".into()),
        rep.wire_accuracy.map(|a| format!("{:.0}%", a * 100.0)).unwrap_or_else(|| "-".into()),
        rep.profiling_activations,
        rep.recoveries,
        &rep.final_state_sha256[..16]
    );
    match crate::report::write(report_dir, None) {
        Ok(html) => println!("report: {} (and report.json, trace.json, timeline.svg beside it)", html.display()),
        Err(e) => eprintln!("ironweave train: could not write the HTML report: {e:#}"),
    }
    Ok(0)
}

/// One line of a rank's routing file.
#[derive(serde::Serialize, serde::Deserialize)]
struct RoutingRow {
    iter: u64,
    tokens: Vec<Vec<u64>>,
}

/// Gathers the ranks' routing files into one trace at `file`.
fn write_routing_trace(cfg: &TrainConfig, ranks: usize, dir: &Path, file: &Path) -> Result<()> {
    let mut rows = Vec::new();
    for r in 0..ranks {
        let p = dir.join(format!("rank{r}.jsonl"));
        let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        for (n, line) in text.lines().enumerate() {
            let row: RoutingRow =
                serde_json::from_str(line).with_context(|| format!("{} line {}: not a routing row", p.display(), n + 1))?;
            rows.push((row.iter, r, row.tokens));
        }
    }
    let shape = ironweave_train::routing::RoutingShape::of(cfg, ranks);
    let trace = ironweave_train::routing::RoutingTrace::assemble(shape, rows)?;
    if let Some(parent) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(file, serde_json::to_vec(&trace)?).with_context(|| format!("writing {}", file.display()))?;
    let s = &trace.shape;
    println!(
        "routing trace: {} ({} iterations x {} MoE layers x {} ranks x {} experts, top-{})",
        file.display(),
        trace.iterations.len(),
        s.moe_layers,
        s.ranks,
        s.experts,
        s.top_k
    );
    for (m, l) in trace.stats().iter().enumerate() {
        println!(
            "  MoE layer {m}: busiest expert {:.2}x the mean (worst iteration {:.2}x); load drift {:.3} between consecutive iterations{}",
            l.imbalance_mean,
            l.imbalance_max,
            l.drift_1,
            l.drift_10.map(|d| format!(", {d:.3} between iterations 10 apart")).unwrap_or_default()
        );
    }
    Ok(())
}

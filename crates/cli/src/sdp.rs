//! Sharded data-parallel training (`ironweave train --sdp full|hybrid|hsdp|replicated`):
//! `sdp-worker` (hidden) is the per-rank program over `ironweave_train::sdp::SdpTrainer`.
//! `--sdp-plan plan.json` (from `ironweave plan sdp --json`) gives hsdp its per-layer
//! fractions. The all-rank part runs on one link and the cross-host all-reduce on another
//! (`--sdp-links full=a,inter=b`; default: the first and the last link of the job).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ironweave_ckpt::engine::Strategy as CkptStrategy;
use ironweave_ckpt::{Engine, EngineConfig, Registry};
use ironweave_overlap::trace::{chrome_trace, svg_lanes, to_records, SpanRec};
use ironweave_shard::{Groups, Strategy};
use ironweave_train::sdp::SdpTrainer;
use ironweave_transport::rendezvous::JobEnv;
use ironweave_transport::CommOptions;
use serde::{Deserialize, Serialize};

use crate::progress::{Mode, Progress};
use crate::train::{load_config, mark_recovery, TrainArgs};

/// The per-rank options `train` hands to `sdp-worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct SdpWorkerArgs {
    #[arg(long)]
    pub config: PathBuf,
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
    #[arg(long)]
    pub iters: Option<u64>,
    #[arg(long)]
    pub report_dir: PathBuf,
    /// Checkpoint strategy of the shards (as `train --ckpt`).
    #[arg(long, default_value = "none")]
    pub ckpt: String,
    #[arg(long)]
    pub fail: Option<String>,
    #[arg(long, default_value_t = 10)]
    pub persist_every: u64,
}

/// What a sharded run's `report.json` holds (rank 0's view).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SdpReport {
    pub config: String,
    /// The sharding strategy (`replicated`, `full`, `hybrid`, `hsdp`).
    pub sdp: String,
    pub ranks: usize,
    pub ranks_per_host: usize,
    pub iterations: u64,
    pub iter_time_s: Vec<f64>,
    pub loss: Vec<f32>,
    /// Parameters, gradients and both Adam moments each rank holds between iterations.
    pub state_bytes_per_rank: u64,
    /// The links the two parts' groups used: (all-rank part, cross-host all-reduce).
    pub links: (String, String),
    pub fractions: Vec<f64>,
    /// Rank 0's compute per iteration (forward, backward, optimizer), seconds.
    #[serde(default)]
    pub compute_s: Vec<f64>,
    /// Seconds rank 0's compute waited for collectives, per iteration.
    #[serde(default)]
    pub wait_s: Vec<f64>,
    /// Seconds per iteration during which at least one of rank 0's collectives was on the wire.
    #[serde(default)]
    pub comm_busy_s: Vec<f64>,
    /// Seconds per iteration each of rank 0's lanes was busy: [all-rank group, host group,
    /// cross-host group].
    #[serde(default)]
    pub lane_busy_s: Vec<[f64; 3]>,
    /// The checkpoint strategy of the shards.
    #[serde(default)]
    pub ckpt: String,
    /// Recoveries (re-formations after a failure).
    #[serde(default)]
    pub recoveries: u64,
    /// The last iteration committed by the checkpoint engine.
    #[serde(default)]
    pub last_committed_iter: Option<u64>,
    /// SHA-256 over every rank's state digest (its shards and step), in rank order.
    #[serde(default)]
    pub final_state_sha256: String,
}

/// Lanes of the trace: compute, then one per group (each on its own link).
pub const LANES: [&str; 3] = ["all-rank", "host", "cross-host"];

fn link_index(comm: &ironweave_transport::Communicator, name: &str, default: usize) -> Result<usize> {
    if name.is_empty() {
        return Ok(default);
    }
    let infos = comm.links();
    infos.iter().position(|l| l.name == name || l.name.split_once(':').map(|(_, n)| n) == Some(name)).with_context(|| {
        format!("no link named {name:?}; this job has {:?}", infos.iter().map(|l| l.name.clone()).collect::<Vec<_>>())
    })
}

const SPANS_TAG: u32 = 0x5D95;

/// The per-rank program: a generation loop like `train`'s worker (a failed collective re-forms
/// the job; the shards come back from the checkpoint engine, registered like any rank's state).
pub fn worker(a: &SdpWorkerArgs) -> Result<()> {
    let base = JobEnv::from_env()?;
    if let Some(choice) = ironweave_transport::threads::apply_to_process(base.local_world_size)? {
        if base.rank == 0 {
            eprintln!("ironweave train: {choice}");
        }
    }
    let (cfg, corpus) = load_config(&a.config)?;
    let iters = a.iters.unwrap_or(cfg.train.iters);
    let strategy = Strategy::parse(&a.strategy)?;
    let choice = crate::train::parse_strategy(&a.ckpt)?;
    if choice.multilink {
        bail!("sharded runs checkpoint over the first link (their groups keep the others busy): use --ckpt capricorn");
    }
    let fail = a.fail.as_deref().map(crate::train::parse_fail).transpose()?;
    let backend = ironweave::Backend::from_env()?;
    let mut gen: u16 = std::env::var("IRONWEAVE_GENERATION").ok().and_then(|g| g.parse().ok()).unwrap_or(0);
    let start_gen = gen;
    let rank = base.rank;
    let dir = &a.report_dir;
    std::fs::create_dir_all(dir)?;
    let ecfg = EngineConfig {
        strategy: choice.strategy,
        chunk_bytes: 256 << 10,
        persist_dir: (choice.strategy != CkptStrategy::None).then(|| dir.join("persist")),
        persist_every: if matches!(choice.strategy, CkptStrategy::Gemini | CkptStrategy::Capricorn) {
            a.persist_every
        } else {
            0
        },
        timeout: Duration::from_secs(60),
        host: ironweave_transport::rendezvous::host_name(),
        drift_threshold: if choice.always_profile { 0.0 } else { EngineConfig::default().drift_threshold },
        ..EngineConfig::default()
    };
    let mut engine: Option<Engine> = None;
    let mut need_restore = gen > 0;
    let mut rep = SdpReport {
        config: cfg.name.clone(),
        sdp: strategy.name().into(),
        ranks_per_host: a.ranks_per_host,
        iterations: iters,
        fractions: a.fractions.clone(),
        ckpt: a.ckpt.clone(),
        ..Default::default()
    };
    let (tr, comm, last_spans) = loop {
        if gen > start_gen + 8 {
            bail!("gave up after 8 re-formations");
        }
        let mut env = base.clone();
        env.master.set_port(base.master.port() + gen);
        env.job_id = format!("{}-g{gen}", base.job_id);
        let comm = Arc::new(ironweave::connect(
            backend,
            &env,
            CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() },
        )?);
        let last = comm.links().len().saturating_sub(1);
        let (fl, il) = (link_index(&comm, &a.full_link, 0)?, link_index(&comm, &a.inter_link, last)?);
        let names = comm.links();
        rep.links = (names[fl].name.clone(), names[il].name.clone());
        let groups = Groups::new(&comm, a.ranks_per_host, fl, il)?;
        // a fresh trainer per generation (its groups are new): the seed's initial shards, then
        // the restored ones
        let mut tr = SdpTrainer::new(cfg.clone(), corpus.clone(), &comm, groups, strategy, &a.fractions)?;
        match engine.as_mut() {
            Some(e) => e.rebind(comm.clone())?,
            None => engine = Some(Engine::new(comm.clone(), Registry::new(&tr.state_specs())?, ecfg.clone())?),
        }
        let e = engine.as_mut().expect("set");
        if let Some((frs, fi)) = fail.clone() {
            let mid = cfg.model.layers / 2;
            let armed = gen == 0 && frs.contains(&rank);
            tr.set_backward_hook(Box::new(move |it, layer| {
                if armed && it == fi && layer == mid {
                    eprintln!("rank {rank}: --fail: killing myself with SIGKILL in the backward of iteration {fi}, layer {mid}");
                    // SAFETY: kill(2) on our own pid with a valid signal number.
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                }
            }));
        }
        let r = (|| -> Result<Vec<SpanRec>> {
            let mut start = 1;
            if need_restore {
                match e.restore_latest() {
                    Ok(r) => {
                        tr.load_state(|name| r.snapshot.tensor(name).map(<[u8]>::to_vec))?;
                        rep.recoveries += 1;
                        if rank == 0 {
                            println!("recovered: every rank restored iteration {} (rank 0 from {:?})", r.iter, r.source);
                            mark_recovery(dir, r.iter)?;
                        }
                        start = r.iter + 1;
                    }
                    Err(err @ ironweave_ckpt::CkptError::NothingToRestore { .. }) => {
                        let mut c = [e.committed().map_or(-1, |i| i as i64)];
                        e.comm().all_reduce(&mut c, ironweave_transport::ReduceOp::Max)?;
                        if c[0] >= 0 {
                            return Err(anyhow::Error::new(err)
                                .context(format!("iteration {} was committed and every copy of it is gone", c[0])));
                        }
                        // nothing committed, nothing lost: the fresh trainer holds the initial state
                        e.start_over();
                        rep.recoveries += 1;
                        if rank == 0 {
                            println!("recovered: nothing was committed yet; every rank starts over from the initial state");
                            mark_recovery(dir, 0)?;
                        }
                    }
                    Err(other) => return Err(other.into()),
                }
            }
            let progress = (rank == 0).then(|| Progress::new("iter", start - 1, iters, Mode::detect()));
            let mut spans = Vec::new();
            for it in start..=iters {
                let t0 = Instant::now();
                e.begin_iteration(it, None);
                let s = tr.step_timed()?;
                e.end_iteration();
                let (mut bufs, step, seed) = tr.state_bufs();
                bufs.push(&step);
                bufs.push(&seed);
                e.checkpoint(it, &bufs)?;
                let committed = e.commit(false)?;
                let dt = t0.elapsed().as_secs_f64();
                if rank == 0 {
                    let lanes: Vec<f64> = (0..3).map(|l| s.lane_busy_s(l)).collect();
                    let line = serde_json::json!({"iter": it, "time": dt, "loss": s.loss, "committed": committed, "compute": s.compute_s(),
                        "wait": s.wait_s(), "busy": s.comm_busy_s(), "lanes": lanes});
                    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("iterations.jsonl"))?;
                    writeln!(f, "{line}")?;
                }
                if let Some(p) = &progress {
                    p.step(
                        it,
                        &format!(
                            "loss {:.4}  comm {:>6.1} ms busy, compute waited {:>6.1} ms  committed {}",
                            s.loss,
                            s.comm_busy_s() * 1e3,
                            s.wait_s() * 1e3,
                            committed.map(|c| c.to_string()).unwrap_or_else(|| "-".into())
                        ),
                    );
                }
                if it == iters {
                    // the compute lane shows compute; its waits are in the report (`wait_s`)
                    let shown: Vec<_> = s
                        .spans
                        .iter()
                        .filter(|x| !(x.lane == ironweave_overlap::Lane::Compute && x.name == "wait"))
                        .cloned()
                        .collect();
                    spans = to_records(&shown);
                }
            }
            if let Some(p) = &progress {
                p.finish();
            }
            Ok(spans)
        })();
        match r {
            Ok(spans) => break (tr, comm, spans),
            Err(err) if crate::train::is_unrecoverable(&err) => {
                // no re-formation brings lost copies back: end the job, saying what was lost
                if rank == 0 {
                    eprintln!("rank 0: cannot recover: {err:#}");
                }
                std::process::exit(crate::launch::EXIT_UNRECOVERABLE);
            }
            Err(err) => {
                eprintln!("rank {rank}: generation {gen} failed: {err:#}; re-forming the job");
                gen += 1;
                need_restore = true;
            }
        }
    };
    let e = engine.as_mut().expect("ran");
    rep.last_committed_iter = e.commit(true)?;
    rep.ranks = comm.size();
    rep.state_bytes_per_rank = tr.state_bytes_per_rank();
    rep.final_state_sha256 = crate::train::job_state_sha256(&comm, &tr.state_digest())?;
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
        let text = std::fs::read_to_string(dir.join("iterations.jsonl")).unwrap_or_default();
        let mut by_iter: std::collections::BTreeMap<u64, serde_json::Value> = Default::default();
        for l in text.lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(l) {
                if let Some(it) = v["iter"].as_u64() {
                    by_iter.insert(it, v);
                }
            }
        }
        for v in by_iter.values() {
            let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
            rep.iter_time_s.push(f("time"));
            rep.loss.push(f("loss") as f32);
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
    engine.take().expect("ran").shutdown()?;
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
    let choice = crate::train::parse_strategy(&a.ckpt)?;
    if let Some(f) = &a.fail {
        crate::train::parse_fail(f)?;
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
    let _ = std::fs::remove_dir_all(a.report_dir.join("persist"));
    let exe = std::env::current_exe().context("locating the ironweave binary")?;
    let mut args = vec![
        "sdp-worker".to_string(),
        "--config".into(),
        a.config.display().to_string(),
        "--strategy".into(),
        strategy.name().into(),
        "--ranks-per-host".into(),
        rph.to_string(),
        "--full-link".into(),
        full_link,
        "--inter-link".into(),
        inter_link,
        "--report-dir".into(),
        a.report_dir.display().to_string(),
        "--ckpt".into(),
        a.ckpt.clone(),
        "--persist-every".into(),
        a.persist_every.to_string(),
    ];
    if let Some(f) = &a.fail {
        args.extend(["--fail".into(), f.clone()]);
    }
    if !fractions.is_empty() {
        args.extend(["--fractions".into(), fractions.iter().map(|f| format!("{f}")).collect::<Vec<_>>().join(",")]);
    }
    if let Some(i) = a.iters {
        args.extend(["--iters".into(), i.to_string()]);
    }
    let topology = match &a.topology {
        Some(p) => Some((crate::cluster::load_up(p)?, rph)),
        None => None,
    };
    eprintln!(
        "ironweave train: {} on {} ranks over {chosen}, sharded data parallelism `{}`, checkpoints `{}`, report in {}",
        cfg.name,
        a.ranks,
        strategy.name(),
        a.ckpt,
        a.report_dir.display()
    );
    let spec = crate::launch::LaunchSpec {
        ranks: a.ranks,
        program: exe.to_string_lossy().into_owned(),
        args,
        prefix: false,
        env: [("IRONWEAVE_BACKEND", chosen.name())]
            .into_iter()
            .chain(a.quiet.then_some((crate::progress::QUIET_VAR, "1")))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        timeout: None,
        topology,
        max_restarts: a.max_restarts.unwrap_or(if a.fail.is_some() { 4 } else { 0 }),
        threads_per_rank: a.threads_per_rank,
    };
    crate::launch::install_signal_handlers();
    let code = crate::launch::run(&spec)?.exit_code();
    if code != 0 {
        return Ok(code);
    }
    let rep: SdpReport =
        serde_json::from_slice(&std::fs::read(a.report_dir.join("report.json")).context("reading report.json")?)?;
    let steady = crate::ckpt_bench::median_after(&rep.iter_time_s, 2);
    if rep.recoveries > 0 {
        println!("recoveries: {}", rep.recoveries);
    }
    println!("final state sha256 {}", rep.final_state_sha256);
    println!(
        "done: {} iterations on {} ranks, sharded `{}` (all-rank part on {}, cross-host on {}), loss {:.4} -> {:.4}, median iteration {:.1} ms, {:.1} MB of state per rank",
        rep.iterations,
        rep.ranks,
        rep.sdp,
        rep.links.0,
        rep.links.1,
        rep.loss.first().copied().unwrap_or(f32::NAN),
        rep.loss.last().copied().unwrap_or(f32::NAN),
        steady * 1e3,
        rep.state_bytes_per_rank as f64 / 1e6
    );
    Ok(0)
}

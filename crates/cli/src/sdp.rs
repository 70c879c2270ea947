//! Sharded data-parallel training (`ironweave train --sdp full|hybrid|hsdp|replicated`):
//! `sdp-worker` (hidden) is the per-rank program over `ironweave_train::sdp::SdpTrainer`.
//! `--sdp-plan plan.json` (from `ironweave plan sdp --json`) gives hsdp its per-layer
//! fractions. The all-rank part runs on one link and the cross-host all-reduce on another
//! (`--sdp-links full=a,inter=b`; default: the first and the last link of the job).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ironweave_shard::{Groups, Strategy};
use ironweave_train::sdp::SdpTrainer;
use ironweave_transport::rendezvous::JobEnv;
use ironweave_transport::CommOptions;
use serde::{Deserialize, Serialize};

use crate::progress::{Mode, Progress};
use crate::train::{load_config, TrainArgs};

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
}

fn link_index(comm: &ironweave_transport::Communicator, name: &str, default: usize) -> Result<usize> {
    if name.is_empty() {
        return Ok(default);
    }
    let infos = comm.links();
    infos.iter().position(|l| l.name == name || l.name.split_once(':').map(|(_, n)| n) == Some(name)).with_context(|| {
        format!("no link named {name:?}; this job has {:?}", infos.iter().map(|l| l.name.clone()).collect::<Vec<_>>())
    })
}

/// The per-rank program.
pub fn worker(a: &SdpWorkerArgs) -> Result<()> {
    let env = JobEnv::from_env()?;
    if let Some(choice) = ironweave_transport::threads::apply_to_process(env.local_world_size)? {
        if env.rank == 0 {
            eprintln!("ironweave train: {choice}");
        }
    }
    let (cfg, corpus) = load_config(&a.config)?;
    let iters = a.iters.unwrap_or(cfg.train.iters);
    let strategy = Strategy::parse(&a.strategy)?;
    let backend = ironweave::Backend::from_env()?;
    let comm =
        Arc::new(ironweave::connect(backend, &env, CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() })?);
    let last = comm.links().len().saturating_sub(1);
    let (fl, il) = (link_index(&comm, &a.full_link, 0)?, link_index(&comm, &a.inter_link, last)?);
    let names = comm.links();
    let groups = Groups::new(&comm, a.ranks_per_host, fl, il)?;
    let mut tr = SdpTrainer::new(cfg.clone(), corpus, &comm, groups, strategy, &a.fractions)?;
    let rank = comm.rank();
    let mut rep = SdpReport {
        config: cfg.name.clone(),
        sdp: strategy.name().into(),
        ranks: comm.size(),
        ranks_per_host: a.ranks_per_host,
        iterations: iters,
        state_bytes_per_rank: tr.state_bytes_per_rank(),
        links: (names[fl].name.clone(), names[il].name.clone()),
        fractions: a.fractions.clone(),
        ..Default::default()
    };
    let progress = (rank == 0).then(|| Progress::new("iter", 0, iters, Mode::detect()));
    for it in 1..=iters {
        let t0 = Instant::now();
        let loss = tr.step()?;
        rep.iter_time_s.push(t0.elapsed().as_secs_f64());
        rep.loss.push(loss);
        if let Some(p) = &progress {
            p.step(it, &format!("loss {loss:.4}"));
        }
    }
    if let Some(p) = &progress {
        p.finish();
    }
    if rank == 0 {
        std::fs::create_dir_all(&a.report_dir)?;
        std::fs::write(a.report_dir.join("report.json"), serde_json::to_vec_pretty(&rep)?)?;
    }
    comm.barrier()?;
    Ok(())
}

/// Fractions of the all-rank part per transformer layer from `ironweave plan sdp --json`
/// (`plan.layers[i].node_fraction` is the within-host share of layer `Li`).
pub fn plan_fractions(path: &std::path::Path, layers: usize) -> Result<Vec<f64>> {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path).with_context(|| format!("reading {}", path.display()))?)
            .with_context(|| format!("parsing {}", path.display()))?;
    let ls = v["plan"]["layers"].as_array().context("not an SDP plan (`ironweave plan sdp --json`): no plan.layers")?;
    let mut out = Vec::new();
    for i in 0..layers {
        let l = ls.iter().find(|l| l["name"] == format!("L{i}")).with_context(|| {
            format!("the plan has no layer L{i}: it was made for another model (the config has {layers} layers)")
        })?;
        let node = l["node_fraction"].as_f64().context("a plan layer without node_fraction")?;
        out.push((1.0 - node).clamp(0.0, 1.0));
    }
    Ok(out)
}

/// `ironweave train --sdp ...`: launches the ranks, prints the summary.
pub fn run(a: &TrainArgs) -> Result<i32> {
    let strategy = Strategy::parse(a.sdp.as_deref().unwrap_or("hsdp"))?;
    let chosen = ironweave::Backend::pick(&a.backend)?;
    chosen.usable().with_context(|| format!("--backend {chosen} cannot run here (`ironweave doctor` says more)"))?;
    let (cfg, _) = load_config(&a.config)?;
    if a.fail.is_some() {
        bail!("--fail is not supported with --sdp yet: sharded runs do not checkpoint yet");
    }
    let fractions = match (&a.sdp_plan, strategy) {
        (Some(p), Strategy::Hsdp) => plan_fractions(p, cfg.model.layers)?,
        (Some(_), _) => bail!("--sdp-plan gives hsdp its fractions: use it with --sdp hsdp"),
        (None, Strategy::Hsdp) => bail!("--sdp hsdp needs --sdp-plan plan.json (`ironweave plan sdp --json plan.json`)"),
        (None, _) => Vec::new(),
    };
    let rph = if a.topology.is_some() { a.ranks_per_host.max(1) } else { a.ranks.max(1) };
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
    let _ = std::fs::remove_file(a.report_dir.join("report.json"));
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
    ];
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
        "ironweave train: {} on {} ranks over {chosen}, sharded data parallelism `{}`, report in {}",
        cfg.name,
        a.ranks,
        strategy.name(),
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
        max_restarts: 0,
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

//! Tensor-parallel training (`ironweave train --tp N --schedule megatron|oases`) and
//! `ironweave bench overlap`: the Megatron and Oases schedules on the same job, side by side.
//! `tp-worker` (hidden) is the per-rank program; rank 0 gathers every rank's lanes of the last
//! iteration for trace.json and timeline.svg.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ironweave_overlap::schedule::{predict, CommRef};
use ironweave_overlap::trace::{chrome_trace, svg_lanes, to_records, SpanRec};
use ironweave_overlap::{steps, Lane, Schedule};
use ironweave_train::tp::{TpSpec, TpTrainer};
use ironweave_transport::rendezvous::JobEnv;
use ironweave_transport::CommOptions;
use serde::{Deserialize, Serialize};

use crate::progress::{Mode, Progress};
use crate::train::{load_config, TrainArgs};

/// The per-rank options `train` hands to `tp-worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct TpWorkerArgs {
    #[arg(long)]
    pub config: PathBuf,
    #[arg(long)]
    pub tp: usize,
    #[arg(long)]
    pub schedule: String,
    #[arg(long)]
    pub sub_batches: usize,
    #[arg(long)]
    pub iters: Option<u64>,
    #[arg(long)]
    pub report_dir: PathBuf,
}

/// What a tensor-parallel run's `report.json` holds (rank 0's view).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TpReport {
    pub config: String,
    pub schedule: String,
    pub tp: usize,
    pub dp: usize,
    pub sub_batches: usize,
    pub ranks: usize,
    pub threads_per_rank: usize,
    pub iterations: u64,
    pub iter_time_s: Vec<f64>,
    pub loss: Vec<f32>,
    /// Seconds of compute on rank 0's compute lane, per iteration.
    pub compute_s: Vec<f64>,
    /// Seconds rank 0's tensor-parallel collectives were on the wire, per iteration.
    pub tp_comm_s: Vec<f64>,
    /// Of those, seconds during which rank 0 computed.
    pub tp_hidden_s: Vec<f64>,
    /// Seconds rank 0's compute lane waited for collectives.
    pub wait_s: Vec<f64>,
    /// Data-parallel gradient averaging on the wire, per iteration.
    pub dp_comm_s: Vec<f64>,
    /// Mean compute seconds of each stage and sub-batch over the steady iterations.
    pub stage_compute_s: Vec<Vec<f64>>,
    /// Mean seconds on the wire of each stage's collective and sub-batch (0: none).
    pub stage_comm_s: Vec<Vec<f64>>,
    /// Mean seconds on the wire of each tail (data-parallel gradients).
    pub tail_comm_s: Vec<f64>,
    /// SHA-256 over every rank's state digest, in rank order.
    pub final_state_sha256: String,
    pub tokens_per_iter: u64,
}

impl TpReport {
    fn steady(v: &[f64]) -> f64 {
        crate::train::Report::steady(v, 2)
    }
    /// Median iteration time after two warm-up iterations.
    pub fn median_iter_s(&self) -> f64 {
        median(if self.iter_time_s.len() > 2 { &self.iter_time_s[2..] } else { &self.iter_time_s })
    }
    /// Tensor-parallel communication per iteration (steady mean).
    pub fn comm_s(&self) -> f64 {
        Self::steady(&self.tp_comm_s)
    }
    /// Share of it during which compute ran.
    pub fn hidden_fraction(&self) -> Option<f64> {
        let c = self.comm_s();
        (c > 0.0).then(|| Self::steady(&self.tp_hidden_s) / c)
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
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
    let spec = TpSpec { tp: a.tp, schedule, sub_batches: a.sub_batches };
    let mut tr = TpTrainer::new(cfg.clone(), corpus, (comm.size() > 1).then_some(comm.as_ref()), spec)?;
    let (rank, n) = (comm.rank(), comm.size());
    let (_, _, dp) = tr.coords();
    let prog = tr.program().clone();
    let k = prog.sub_batches;
    let mut rep = TpReport {
        config: cfg.name.clone(),
        schedule: schedule.name().into(),
        tp: a.tp,
        dp,
        sub_batches: k,
        ranks: n,
        threads_per_rank: std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
        iterations: iters,
        tokens_per_iter: (cfg.train.batch * cfg.model.seq * dp) as u64,
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
        let s = tr.step()?;
        let dt = t0.elapsed().as_secs_f64();
        let st = &s.stats;
        rep.iter_time_s.push(dt);
        rep.loss.push(s.loss);
        rep.compute_s.push(st.compute_s);
        rep.tp_comm_s.push(st.comm_s[0]);
        rep.tp_hidden_s.push(st.hidden_s[0]);
        rep.wait_s.push(st.wait_s);
        rep.dp_comm_s.push(st.comm_s[1]);
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
                    "loss {:.4}  {:>6.0} tokens/s  tp comm {:>6.1} ms ({:.0}% hidden)",
                    s.loss,
                    rep.tokens_per_iter as f64 / dt,
                    st.comm_s[0] * 1e3,
                    st.hidden_fraction(0).unwrap_or(0.0) * 100.0
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
    // every rank's digest and lanes to rank 0
    let mine = tr.state_digest();
    let mut all = vec![0u8; 32 * n];
    if n > 1 {
        comm.all_gather(&mine, &mut all)?;
    } else {
        all.copy_from_slice(&mine);
    }
    use sha2::Digest;
    rep.final_state_sha256 = sha2::Sha256::digest(&all).iter().map(|b| format!("{b:02x}")).collect();
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
    let groups = ["tensor-parallel", "data-parallel"];
    std::fs::write(dir.join("trace.json"), serde_json::to_vec(&chrome_trace(&lanes, &groups))?)?;
    let title =
        format!("{} tp={} dp={} {} k={}: every rank's lanes in iteration {iters}", cfg.name, a.tp, dp, schedule.name(), k);
    std::fs::write(dir.join("timeline.svg"), svg_lanes(&lanes, &groups, &title))?;
    Ok(())
}

/// `ironweave train --tp N`: launches the ranks; returns the exit status.
pub fn run(a: &TrainArgs) -> Result<i32> {
    let chosen = ironweave::Backend::pick(&a.backend)?;
    chosen.usable().with_context(|| format!("--backend {chosen} cannot run here (`ironweave doctor` says more)"))?;
    let (cfg, _) = load_config(&a.config)?;
    let tp = a.tp.unwrap_or(1);
    let schedule: Schedule = a.schedule.as_deref().unwrap_or("oases").parse()?;
    let k = a.sub_batches.unwrap_or(if schedule == Schedule::Oases { 2 } else { 1 });
    if tp == 0 || a.ranks % tp != 0 {
        bail!("--tp {tp} must divide --ranks {}", a.ranks);
    }
    if a.fail.is_some() {
        bail!("--fail is not supported with --tp: tensor-parallel runs do not checkpoint yet");
    }
    std::fs::create_dir_all(&a.report_dir).with_context(|| format!("creating {}", a.report_dir.display()))?;
    let _ = std::fs::remove_file(a.report_dir.join("report.json"));
    let exe = std::env::current_exe().context("locating the ironweave binary")?;
    let mut args = vec![
        "tp-worker".to_string(),
        "--config".into(),
        a.config.display().to_string(),
        "--tp".into(),
        tp.to_string(),
        "--schedule".into(),
        schedule.name().into(),
        "--sub-batches".into(),
        k.to_string(),
        "--report-dir".into(),
        a.report_dir.display().to_string(),
    ];
    if let Some(i) = a.iters {
        args.extend(["--iters".into(), i.to_string()]);
    }
    let topology = match &a.topology {
        Some(p) => {
            let t = crate::cluster::Topology::load(p)?;
            if !crate::cluster::status(&t)? {
                bail!("cluster {:?} is not up: run `ironweave cluster up --topology {}`", t.name, p.display());
            }
            Some((t, a.ranks_per_host.max(1)))
        }
        None => None,
    };
    eprintln!(
        "ironweave train: {} on {} ranks over {chosen}, tensor parallel {tp} x data parallel {}, schedule {schedule} with {k} sub-batch{} (no checkpoints), report in {}",
        cfg.name,
        a.ranks,
        a.ranks / tp,
        if k == 1 { "" } else { "es" },
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
    match crate::launch::run(&spec)? {
        crate::launch::Outcome::Success => {}
        crate::launch::Outcome::RankFailed { code } => return Ok(code.max(1)),
        crate::launch::Outcome::Interrupted { signal } => return Ok(128 + signal),
        crate::launch::Outcome::TimedOut => return Ok(124),
    }
    let rep: TpReport = serde_json::from_slice(&std::fs::read(a.report_dir.join("report.json")).context("reading report.json")?)?;
    println!(
        "done: {} iterations, tp {} x dp {} ({} k={}), loss {:.4} -> {:.4}, {:.0} tokens/s (median iteration {:.1} ms), tensor-parallel communication {:.1} ms per iteration, {:.0}% of it hidden behind compute",
        rep.iterations,
        rep.tp,
        rep.dp,
        rep.schedule,
        rep.sub_batches,
        rep.loss.first().copied().unwrap_or(f32::NAN),
        rep.loss.last().copied().unwrap_or(f32::NAN),
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

/// `ironweave bench overlap`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct OverlapArgs {
    /// Dense GPT configuration.
    #[arg(long, default_value = "configs/gpt-tp.toml")]
    pub config: PathBuf,
    /// Emulated cluster (the tensor-parallel group spans its hosts).
    #[arg(long, default_value = "topologies/2host-tp.toml")]
    pub topology: PathBuf,
    /// Ranks per emulated host.
    #[arg(long, default_value_t = 1)]
    pub ranks_per_host: usize,
    /// Tensor-parallel degree (default: every rank).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Sub-batches of the Oases rows.
    #[arg(long, default_value_t = 2)]
    pub sub_batches: usize,
    /// Iterations per row (the first two are warm-up).
    #[arg(long, default_value_t = 8)]
    pub iters: u64,
    /// Link rate of the rows where communication is small (tc syntax).
    #[arg(long, default_value = "10gbit")]
    pub fast_rate: String,
    /// Where the runs go.
    #[arg(long, default_value = "target/bench/overlap")]
    pub out: PathBuf,
    /// Also write the rows here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `ironweave bench overlap`: Megatron and Oases on the emulated bed, then both again on a fast
/// link; each row with its measured hidden share and the overlap model's prediction.
pub fn bench(a: &OverlapArgs) -> Result<()> {
    if a.iters < 3 {
        bail!("--iters must be at least 3 (two warm-up iterations are not counted)");
    }
    let topo = crate::cluster::Topology::load(&a.topology)?;
    let ranks = topo.hosts * a.ranks_per_host.max(1);
    let tp = a.tp.unwrap_or(ranks);
    // the same hosts with every link at --fast-rate
    let mut fast = topo.clone();
    fast.name = format!("{}f", &topo.name[..topo.name.len().min(7)]);
    for l in &mut fast.links {
        l.rate = a.fast_rate.clone();
    }
    std::fs::create_dir_all(&a.out)?;
    let fast_path = a.out.join("fast-topology.toml");
    std::fs::write(&fast_path, toml_of(&fast))?;
    let rows_spec: Vec<(String, &Path, Schedule, usize)> = vec![
        ("megatron".into(), a.topology.as_path(), Schedule::Megatron, 1),
        ("oases".into(), a.topology.as_path(), Schedule::Oases, a.sub_batches),
        (format!("megatron @{}", a.fast_rate), fast_path.as_path(), Schedule::Megatron, 1),
        (format!("oases @{}", a.fast_rate), fast_path.as_path(), Schedule::Oases, a.sub_batches),
    ];
    let progress = Progress::new("bench overlap: row", 0, rows_spec.len() as u64, Mode::detect());
    let mut reps: Vec<(String, TpReport)> = Vec::new();
    // each bed is brought up for its rows (both use the same subnets) and taken down again
    // unless it was up before
    let mut up: Option<(crate::cluster::Topology, bool)> = None;
    let settle = |up: &mut Option<(crate::cluster::Topology, bool)>| -> Result<()> {
        if let Some((t, ours)) = up.take() {
            if ours {
                crate::cluster::down(&t)?;
            }
        }
        Ok(())
    };
    for (i, (name, topo, sched, k)) in rows_spec.iter().enumerate() {
        let t = crate::cluster::Topology::load(topo)?;
        if up.as_ref().is_none_or(|(u, _)| u.name != t.name) {
            settle(&mut up)?;
            let was_up = crate::cluster::status(&t)?;
            if !was_up {
                crate::cluster::up(&t).with_context(|| format!("bringing up the emulated cluster of {}", topo.display()))?;
            }
            up = Some((t, !was_up));
        }
        let dir = a.out.join(format!("row{i}"));
        let args = TrainArgs {
            ranks,
            topology: Some(topo.to_path_buf()),
            ranks_per_host: a.ranks_per_host,
            iters: Some(a.iters),
            report_dir: dir.clone(),
            quiet: true,
            tp: Some(tp),
            schedule: Some(sched.name().into()),
            sub_batches: Some(*k),
            ..TrainArgs::new(&a.config)
        };
        let code = run(&args)?;
        if code != 0 {
            settle(&mut up)?;
            bail!("the {name} run failed (status {code}); see its output above");
        }
        let rep: TpReport = serde_json::from_slice(&std::fs::read(dir.join("report.json"))?)?;
        progress.step(i as u64 + 1, &format!("{name}: median iteration {:.1} ms", rep.median_iter_s() * 1e3));
        reps.push((name.clone(), rep));
    }
    progress.finish();
    settle(&mut up)?;
    let (cfg, corpus) = load_config(&a.config)?;
    let mut rows = Vec::new();
    let mut md = String::from(
        "| schedule | link | median iteration | TP comm / iter | comm hidden | compute / iter | predicted | predicted / measured | speedup vs megatron |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (i, (name, r)) in reps.iter().enumerate() {
        // the Megatron row of the same link measured each collective without overlap: its
        // per-stage wire times, with this row's own compute, replayed through this row's steps
        let base = &reps[i - i % 2].1;
        let sched: Schedule = r.schedule.parse()?;
        let spec = TpSpec { tp: r.tp, schedule: sched, sub_batches: r.sub_batches };
        let prog = TpTrainer::new(cfg.clone(), corpus.clone(), None, TpSpec { tp: 1, ..spec })?.program().clone();
        let st = steps(&prog, sched)?;
        let comm_of = |c: CommRef| match c {
            // the whole batch's collective of a stage, split evenly over this row's sub-batches
            CommRef::Stage { stage, .. } => base.stage_comm_s[stage].iter().sum::<f64>() / r.sub_batches as f64,
            CommRef::Tail(t) => base.tail_comm_s.get(t).copied().unwrap_or(0.0),
        };
        let predicted = predict(&prog, &st, |s, j| r.stage_compute_s[s][j], comm_of);
        let m = r.median_iter_s();
        let speedup = base.median_iter_s() / m;
        let link = if i < 2 { topo.links[0].rate.clone() } else { a.fast_rate.clone() };
        md.push_str(&format!(
            "| {} k={} | {link} | {:.1} ms | {:.1} ms | {:.0}% | {:.1} ms | {:.1} ms | {:.2} | {:.2}x |\n",
            r.schedule,
            r.sub_batches,
            m * 1e3,
            r.comm_s() * 1e3,
            r.hidden_fraction().unwrap_or(0.0) * 100.0,
            TpReport::steady(&r.compute_s) * 1e3,
            predicted * 1e3,
            predicted / m,
            speedup
        ));
        rows.push(serde_json::json!({
            "schedule": name, "link_rate": link, "tp": r.tp, "dp": r.dp, "sub_batches": r.sub_batches,
            "iter_time_s": m, "comm_s": r.comm_s(), "comm_hidden_fraction": r.hidden_fraction().unwrap_or(0.0),
            "compute_s": TpReport::steady(&r.compute_s), "wait_s": TpReport::steady(&r.wait_s),
            "predicted_iter_time_s": predicted, "speedup_vs_megatron": speedup,
            "loss_first": r.loss.first(), "loss_last": r.loss.last(), "report": format!("{}/row{i}", a.out.display()),
        }));
    }
    print!("{md}");
    std::fs::write(a.out.join("overlap.md"), &md)?;
    let json = serde_json::to_vec_pretty(&serde_json::json!({ "rows": rows }))?;
    std::fs::write(a.out.join("overlap.json"), &json)?;
    if let Some(j) = &a.json {
        std::fs::write(j, &json)?;
    }
    eprintln!("wrote {} and {}", a.out.join("overlap.md").display(), a.out.join("overlap.json").display());
    Ok(())
}

fn toml_of(t: &crate::cluster::Topology) -> String {
    let mut s = format!("name = \"{}\"\nhosts = {}\n", t.name, t.hosts);
    for l in &t.links {
        s.push_str(&format!("\n[[links]]\nname = \"{}\"\nrate = \"{}\"\n", l.name, l.rate));
        if let Some(n) = &l.subnet {
            s.push_str(&format!("subnet = \"{n}\"\n"));
        }
    }
    s
}

//! Tensor-parallel training (`ironweave train --tp N --schedule megatron|oases`) and
//! `ironweave bench overlap`: the Megatron and Oases schedules on the same job, side by side.
//! `tp-worker` (hidden) is the per-rank program; rank 0 gathers every rank's lanes of the last
//! iteration for trace.json and timeline.svg.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{bail, Context, Result};
use ironweave_overlap::schedule::{predict, CommRef};
use ironweave_overlap::trace::{chrome_trace, svg_lanes, to_records, SpanRec};
use ironweave_overlap::{steps, Lane, Schedule};
use ironweave_train::tp::{TpSpec, TpTrainer};
use ironweave_transport::rendezvous::JobEnv;
use ironweave_transport::CommOptions;

use crate::progress::{Mode, Progress};
use crate::run::{load_config, tc_rate_bytes, TpReport, TrainArgs};

/// The per-rank options `train` hands to `tp-worker`.
#[derive(Debug, Clone, clap::Args)]
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
        let s = tr.step()?;
        let dt = t0.elapsed().as_secs_f64();
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
                    "loss {:.4}  {:>6.0} tokens/s  tp comm {:>6.1} ms ({:.0}% hidden)",
                    s.loss,
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
    std::fs::create_dir_all(&a.report_dir).with_context(|| format!("creating {}", a.report_dir.display()))?;
    let _ = std::fs::remove_file(a.report_dir.join("report.json"));
    let mut args = vec![
        "tp-worker".to_string(),
        "--config".into(),
        a.config.display().to_string(),
        "--degrees".into(),
        degrees.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
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
    if let Some(b) = global_batch {
        args.extend(["--global-batch".into(), b.to_string()]);
    }
    let topology = match &a.topology {
        Some(p) => Some((crate::cluster::load_up(p)?, a.ranks_per_host.max(1))),
        None => None,
    };
    eprintln!(
        "ironweave train: {} on {} ranks over {chosen}, tensor-parallel degree {} (data parallel across groups), schedule {schedule} with {k} sub-batch{} (no checkpoints), report in {}",
        cfg.name,
        a.ranks,
        degrees_str(&degrees),
        if k == 1 { "" } else { "es" },
        a.report_dir.display()
    );
    let code = crate::launch::workers(a.ranks, args, chosen.name(), a.quiet, topology, 0, a.threads_per_rank)?;
    if code != 0 {
        return Ok(code);
    }
    let rep: TpReport = serde_json::from_slice(&std::fs::read(a.report_dir.join("report.json")).context("reading report.json")?)?;
    println!(
        "done: {} iterations, degree {} with head dp {} ({} k={}), loss {:.4} -> {:.4}, {:.0} tokens/s (median iteration {:.1} ms), tensor-parallel communication {:.1} ms per iteration, {:.0}% of it hidden behind compute",
        rep.iterations,
        degrees_str(&rep.degrees),
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
    /// Tensor-parallel degree of the uniform rows (default: every rank).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Sub-batches of the Oases rows.
    #[arg(long, default_value_t = 2)]
    pub sub_batches: usize,
    /// Iterations per row (the first two are warm-up).
    #[arg(long, default_value_t = 8)]
    pub iters: u64,
    /// Link rates of further beds (same hosts, every link at this rate; tc syntax),
    /// comma-separated: the last one should leave little to hide.
    #[arg(long, value_delimiter = ',', default_value = "400mbit,10gbit")]
    pub also_rates: Vec<String>,
    /// The workload as the planner sees it (the plan row).
    #[arg(long, default_value = "configs/models/gpt-tp-cpu.toml")]
    pub model: PathBuf,
    /// The emulated cluster as the planner sees it; its first inter-node link takes each
    /// bed's rate.
    #[arg(long, default_value = "configs/clusters/emulated-2host.toml")]
    pub cluster: PathBuf,
    /// Where the runs go.
    #[arg(long, default_value = "target/bench/overlap")]
    pub out: PathBuf,
    /// Also write the rows here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One bench row: what ran and how it went.
struct Row {
    name: String,
    link: String,
    report: TpReport,
    /// The planner's prediction for this layout on this bed (its cost model with compute
    /// measured by the bed's Megatron row).
    planner_s: Option<f64>,
}

/// `ironweave bench overlap`: on each bed (the topology's rate, then `--also-rates`) the
/// Megatron and Oases schedules at the uniform degree, and on the first bed the planner's plan
/// (planned with compute measured by that bed's Megatron row); each row with its measured
/// hidden share and two predictions: the planner's cost model, and the executed steps replayed
/// on the row's measured compute and the Megatron row's wire times.
pub fn bench(a: &OverlapArgs) -> Result<()> {
    if a.iters < 3 {
        bail!("--iters must be at least 3 (two warm-up iterations are not counted)");
    }
    let topo = crate::cluster::Topology::load(&a.topology)?;
    let ranks = topo.hosts * a.ranks_per_host.max(1);
    let tp = a.tp.unwrap_or(ranks);
    let (cfg, _) = load_config(&a.config)?;
    let model = {
        let mut m = crate::plan::load_model(&a.model, None)?;
        // the plan splits the same global batch the uniform rows train on
        m.global_batch = (cfg.train.batch * ranks / tp) as u32;
        m.validate()?;
        m
    };
    std::fs::create_dir_all(&a.out)?;
    let mut beds = vec![(topo.links[0].rate.clone(), a.topology.clone())];
    for (i, rate) in a.also_rates.iter().enumerate() {
        tc_rate_bytes(rate)?;
        let mut t = topo.clone();
        t.name = format!("{}{}", &topo.name[..topo.name.len().min(6)], i);
        for l in &mut t.links {
            l.rate = rate.clone();
        }
        let p = a.out.join(format!("bed{i}-topology.toml"));
        std::fs::write(&p, toml_of(&t))?;
        beds.push((rate.clone(), p));
    }
    let total = 2 * beds.len() as u64 + 1;
    let progress = Progress::new("bench overlap: row", 0, total, Mode::detect());
    let mut rows: Vec<Row> = Vec::new();
    let done = std::cell::Cell::new(0u64);
    for (b, (rate, topo_path)) in beds.iter().enumerate() {
        let t = crate::cluster::Topology::load(topo_path)?;
        // each bed is up for its rows only (they share subnets); one that was up before stays
        let was_up = crate::cluster::status(&t)?;
        if !was_up {
            crate::cluster::up(&t).with_context(|| format!("bringing up the emulated cluster of {}", topo_path.display()))?;
        }
        let r = (|| -> Result<()> {
            let run_row = |name: String, sched: Schedule, tpd: usize, k: usize, plan: Option<&Path>| -> Result<TpReport> {
                let n = done.get() + 1;
                done.set(n);
                let dir = a.out.join(format!("row{n}"));
                let args = TrainArgs {
                    ranks,
                    topology: Some(topo_path.clone()),
                    ranks_per_host: a.ranks_per_host,
                    iters: Some(a.iters),
                    report_dir: dir.clone(),
                    quiet: true,
                    tp: plan.is_none().then_some(tpd),
                    schedule: plan.is_none().then(|| sched.name().to_string()),
                    sub_batches: plan.is_none().then_some(k),
                    tp_plan: plan.map(Path::to_path_buf),
                    ..TrainArgs::new(&a.config)
                };
                let code = run(&args)?;
                if code != 0 {
                    bail!("the {name} run failed (status {code}); see its output above");
                }
                let rep: TpReport = serde_json::from_slice(&std::fs::read(dir.join("report.json"))?)?;
                progress.step(n, &format!("{name}: median iteration {:.1} ms", rep.median_iter_s() * 1e3));
                Ok(rep)
            };
            let meg = run_row(format!("megatron @{rate}"), Schedule::Megatron, tp, 1, None)?;
            // the planner, calibrated with this bed's measured compute and its link rate
            let profile = crate::plan::profile_from_run(&meg, &model)?;
            let mut cluster = crate::plan::load_cluster(&a.cluster)?;
            cluster.nodes = topo.hosts as u32;
            cluster.devices_per_node = a.ranks_per_host.max(1) as u32;
            let bw = tc_rate_bytes(rate)?;
            let Some(l) = cluster.links.iter_mut().find(|l| l.scope == ironweave_plan::Scope::InterNode) else {
                bail!("{} has no inter-node link to give the bed's rate", a.cluster.display());
            };
            l.bandwidth_gbyte_s = bw / 1e9;
            // the same figures as a probe file, for `ironweave simulate tp --probe` on this bed
            let probe = serde_json::json!([{ "name": l.name, "latency_s": l.latency_us * 1e-6,
                "bandwidth_bytes_per_s": bw, "declared_bytes_per_s": bw, "streamed_bytes": 0 }]);
            std::fs::write(a.out.join(format!("bed{b}-probe.json")), serde_json::to_vec_pretty(&probe)?)?;
            cluster.validate()?;
            let mut cm = ironweave_plan::CostModel::new(&cluster);
            cm.profile = Some(&profile);
            let mut ks = vec![1u32, a.sub_batches as u32];
            ks.dedup();
            let opts = ironweave_plan::tp::TpOptions { sub_batches: ks, ..Default::default() };
            let problem = ironweave_plan::tp::build(&model, &cluster, &cm, &opts)?;
            let (sol, by) = problem.chain.solve(opts.solver, opts.time_limit_s, opts.mip_rel_gap)?;
            let plan = problem.plan(&model, &cluster, &sol, by, &opts)?;
            let uniform = |t: usize, k: usize| problem.uniform(t as u32, k as u32).map(|u| u.iter_s);
            rows.push(Row { name: "megatron".into(), link: rate.clone(), planner_s: uniform(tp, 1), report: meg });
            let oases = run_row(format!("oases @{rate}"), Schedule::Oases, tp, a.sub_batches, None)?;
            rows.push(Row { name: "oases".into(), link: rate.clone(), planner_s: uniform(tp, a.sub_batches), report: oases });
            if b == 0 {
                let plan_path = a.out.join("plan.json");
                crate::plan::write_json(&plan_path, &serde_json::json!({ "plan": plan }))?;
                match PlanLayout::from_plan(&plan, ranks) {
                    Ok(layout) => {
                        eprintln!("bench overlap: executing {}", layout.describe());
                        let rep = run_row(format!("plan @{rate}"), layout.schedule, tp, layout.sub_batches, Some(&plan_path))?;
                        rows.push(Row {
                            name: "plan".into(),
                            link: rate.clone(),
                            planner_s: Some(plan.predicted_iter_s),
                            report: rep,
                        });
                    }
                    Err(e) => eprintln!("bench overlap: the planner's plan is not executed: {e:#}"),
                }
            }
            Ok(())
        })();
        if !was_up {
            crate::cluster::down(&t)?;
        }
        r?;
    }
    progress.finish();
    let mut out_rows = Vec::new();
    let mut md = String::from(
        "| schedule | link | TP degree x head DP | median iteration | TP comm / iter | comm hidden | compute / iter | predicted (planner) | planner / measured | replayed steps / measured | speedup vs megatron |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (i, row) in rows.iter().enumerate() {
        let r = &row.report;
        // the Megatron row of the same bed measured each collective without overlap
        let base = rows[..=i].iter().rev().find(|x| x.name == "megatron" && x.link == row.link).map_or(r, |x| &x.report);
        let sched: Schedule = r.schedule.parse()?;
        let degrees = if r.degrees.is_empty() { vec![r.tp] } else { r.degrees.clone() };
        let spec = TpSpec {
            degrees,
            schedule: sched,
            sub_batches: r.sub_batches,
            global_batch: Some(r.tokens_per_iter as usize / cfg.model.seq),
        };
        let prog = TpTrainer::program_for(&cfg, &spec, r.ranks)?;
        let st = steps(&prog, sched)?;
        let same_shape = base.degrees == r.degrees && base.stage_comm_s.len() == prog.stages.len();
        let comm_of = |c: CommRef| match c {
            // the whole batch's collective of a stage, split evenly over this row's sub-batches
            CommRef::Stage { stage, .. } if same_shape => base.stage_comm_s[stage].iter().sum::<f64>() / r.sub_batches as f64,
            CommRef::Stage { stage, .. } => r.stage_comm_s[stage].iter().sum::<f64>() / r.sub_batches as f64,
            CommRef::Tail(t) => r.tail_comm_s.get(t).copied().unwrap_or(0.0),
        };
        // both predictions cover the scheduled work; the optimizer step and the loss average
        // outside it are added as measured (the planner does not model an optimizer)
        let outside = TpReport::steady(&r.outside_s);
        let replayed = predict(&prog, &st, |s, j| r.stage_compute_s[s][j], comm_of) + outside;
        let m = r.median_iter_s();
        let speedup = base.median_iter_s() / m;
        let planner = row.planner_s.map(|p| p + outside);
        let predicted = planner.unwrap_or(replayed);
        md.push_str(&format!(
            "| {} {} k={} | {} | {} x {} | {:.1} ms | {:.1} ms | {:.0}% | {:.1} ms | {} | {} | {:.2} | {:.2}x |\n",
            row.name,
            if row.name == "plan" { format!("({})", r.schedule) } else { String::new() },
            r.sub_batches,
            row.link,
            degrees_str(&r.degrees),
            r.dp,
            m * 1e3,
            r.comm_s() * 1e3,
            r.hidden_fraction().unwrap_or(0.0) * 100.0,
            TpReport::steady(&r.compute_s) * 1e3,
            planner.map_or("-".into(), |p| format!("{:.1} ms", p * 1e3)),
            planner.map_or("-".into(), |p| format!("{:.2}", p / m)),
            replayed / m,
            speedup
        ));
        out_rows.push(serde_json::json!({
            "schedule": row.name, "executed_schedule": r.schedule, "link_rate": row.link, "tp": r.tp, "degrees": r.degrees, "dp": r.dp,
            "sub_batches": r.sub_batches, "iter_time_s": m, "comm_s": r.comm_s(),
            "comm_hidden_fraction": r.hidden_fraction().unwrap_or(0.0),
            "compute_s": TpReport::steady(&r.compute_s), "wait_s": TpReport::steady(&r.wait_s),
            "dp_comm_s": TpReport::steady(&r.dp_comm_s), "outside_s": outside,
            "predicted_iter_time_s": predicted, "predicted_by": if planner.is_some() { "planner" } else { "replayed steps" },
            "replayed_iter_time_s": replayed, "speedup_vs_megatron": speedup,
            "loss_first": r.loss.first(), "loss_last": r.loss.last(),
        }));
    }
    print!("{md}");
    std::fs::write(a.out.join("overlap.md"), &md)?;
    let json = serde_json::to_vec_pretty(&serde_json::json!({ "rows": out_rows }))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tc_rates_are_bytes_per_second() {
        assert_eq!(tc_rate_bytes("200mbit").unwrap(), 25e6);
        assert_eq!(tc_rate_bytes("10gbit").unwrap(), 1.25e9);
        assert_eq!(tc_rate_bytes("125mbps").unwrap(), 125e6);
        assert!(tc_rate_bytes("fast").unwrap_err().to_string().contains("no number"));
        assert!(tc_rate_bytes("3furlongs").unwrap_err().to_string().contains("unknown unit"));
    }
}

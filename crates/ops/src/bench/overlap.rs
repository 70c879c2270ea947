//! `ironweave bench overlap`: tensor parallelism on the emulated cluster, Megatron's schedule
//! against Oases' (sub-batches overlapping collectives with compute) on the same job, side by
//! side, on a slow and a fast link, with the planner's plan; each row with its hidden share and
//! the overlap model's prediction.

use std::path::{Path, PathBuf};

use ironweave_overlap::schedule::{predict, CommRef};
use ironweave_overlap::{steps, Schedule};
use ironweave_train::tp::{TpSpec, TpTrainer};

use crate::error::{bail, Context, Result};
use crate::progress::{Mode, Progress};
use crate::rundir::TpReport;
use crate::train::args::{load_config, ComputeArgs, TrainArgs};
use crate::train::tp::run;
use crate::train::tp::{degrees_str, PlanLayout};

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
    /// How every row computes (cpu, or emulated accelerators: docs/EMULATION.md).
    #[command(flatten)]
    pub compute: ComputeArgs,
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
        ironweave_units::parse_rate(rate)? as f64;
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
                    compute: a.compute.clone(),
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
            let bw = ironweave_units::parse_rate(rate)? as f64;
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
    let mut md = format!(
        "compute: {}\n\n| schedule | link | TP degree x head DP | median iteration | TP comm / iter | comm hidden | compute / iter | predicted (planner) | planner / measured | replayed steps / measured | speedup vs megatron | machine CPU busy | device busy (mean of ranks) |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        rows.first().map_or("cpu", |r| r.report.compute.mode_or_cpu())
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
            "| {} {} k={} | {} | {} x {} | {:.1} ms | {:.1} ms | {:.0}% | {:.1} ms | {} | {} | {:.2} | {:.2}x | {} | {} |\n",
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
            speedup,
            r.compute.cpu_cell(),
            r.compute.device_cell()
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
            "compute": r.compute.mode_or_cpu(), "cpu_busy_share": r.compute.cpu_busy_share,
            "device_busy_share": r.compute.device_busy_share,
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

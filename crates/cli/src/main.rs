//! `ironweave`: the command line. `launch` starts ranks, `bench` measures, `selftest` holds
//! the small rank programs the fault tests run.

mod backend;
mod bench;
mod launch;
mod selftest;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "ironweave", version, about = "Distributed training transport: launch ranks, benchmark collectives")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Start N local ranks of PROGRAM with the job in their environment.
    Launch {
        /// Number of ranks.
        #[arg(short = 'n', long = "ranks")]
        ranks: usize,
        /// Backend the ranks should use (exported as IRONWEAVE_BACKEND).
        #[arg(long, default_value = "tcp")]
        backend: String,
        /// Stop the job after this many seconds.
        #[arg(long)]
        timeout: Option<f64>,
        /// Do not prefix output lines with the rank.
        #[arg(long)]
        no_prefix: bool,
        /// The program and its arguments.
        #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
    /// Per-rank body of `bench collectives` (started by it).
    #[command(hide = true)]
    BenchWorker {
        #[arg(long)]
        backend: String,
        #[arg(long, value_delimiter = ',')]
        ops: Vec<String>,
        #[arg(long, value_delimiter = ',')]
        sizes: Vec<String>,
        #[arg(long)]
        dtype: String,
        #[arg(long)]
        min_time: f64,
        #[arg(long)]
        out: Option<String>,
    },
    /// Small rank programs used by the fault tests (ok, loop, mismatch).
    #[command(hide = true)]
    Selftest {
        scenario: String,
        #[arg(long, default_value = "tcp")]
        backend: String,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
    /// Collectives over local processes, nccl-tests style, each row verified.
    Collectives {
        /// Number of ranks (processes).
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// Backend: tcp (default), ucx, verbs, nccl.
        #[arg(long, default_value = "tcp")]
        backend: String,
        /// Comma-separated: allreduce, allgather, reducescatter, alltoall, broadcast.
        #[arg(long, value_delimiter = ',', default_value = "allreduce,allgather,reducescatter,alltoall")]
        ops: Vec<String>,
        /// Comma-separated sizes in bytes with K/M/G suffixes (total buffer, as nccl-tests).
        #[arg(long, value_delimiter = ',', default_value = "4K,1M,16M")]
        sizes: Vec<String>,
        /// Element type.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Seconds each timed loop should last (at least 3 iterations).
        #[arg(long, default_value_t = 0.3)]
        min_time: f64,
        /// Write the rows as JSON here.
        #[arg(long)]
        json: Option<String>,
    },
}

fn main() {
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ironweave: error: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run(cli: Cli) -> Result<i32> {
    match cli.cmd {
        Cmd::Launch { ranks, backend, timeout, no_prefix, command } => {
            backend::check(&backend)?;
            launch::install_signal_handlers();
            let spec = launch::LaunchSpec {
                ranks,
                program: command[0].clone(),
                args: command[1..].to_vec(),
                prefix: !no_prefix,
                env: vec![("IRONWEAVE_BACKEND".into(), backend)],
                timeout: timeout.map(Duration::from_secs_f64),
            };
            Ok(match launch::run(&spec)? {
                launch::Outcome::Success => 0,
                launch::Outcome::RankFailed { code, .. } => code.max(1),
                launch::Outcome::Interrupted { signal } => 128 + signal,
                launch::Outcome::TimedOut => 124,
            })
        }
        Cmd::Bench { what: BenchCmd::Collectives { ranks, backend, ops, sizes, dtype, min_time, json } } => {
            backend::check(&backend)?;
            bench::check_args(&ops, &sizes, &dtype)?;
            launch::install_signal_handlers();
            let exe = std::env::current_exe().context("locating the ironweave binary")?;
            let out = std::env::temp_dir().join(format!("ironweave-bench-{}.json", std::process::id()));
            let _ = std::fs::remove_file(&out);
            eprintln!(
                "ironweave bench collectives: {ranks} ranks over {backend}, {} ops x {} sizes, dtype {dtype}",
                ops.len(),
                sizes.len()
            );
            let spec = launch::LaunchSpec {
                ranks,
                program: exe.to_string_lossy().into_owned(),
                args: vec![
                    "bench-worker".into(),
                    "--backend".into(),
                    backend.clone(),
                    "--ops".into(),
                    ops.join(","),
                    "--sizes".into(),
                    sizes.join(","),
                    "--dtype".into(),
                    dtype.clone(),
                    "--min-time".into(),
                    min_time.to_string(),
                    "--out".into(),
                    out.to_string_lossy().into_owned(),
                ],
                prefix: true,
                env: vec![],
                timeout: None,
            };
            match launch::run(&spec)? {
                launch::Outcome::Success => {}
                other => bail!("the benchmark ranks did not finish: {other:?}"),
            }
            let mut rows: Vec<bench::Row> =
                serde_json::from_slice(&std::fs::read(&out).with_context(|| format!("reading {}", out.display()))?)?;
            let _ = std::fs::remove_file(&out);
            for r in rows.iter_mut() {
                r.memcpy_gbps = bench::memcpy_gbps(r.bytes);
            }
            println!("{}", bench::table(&rows));
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_vec_pretty(&rows)?).with_context(|| format!("writing {path}"))?;
                eprintln!("wrote {path}");
            }
            let bad: Vec<String> =
                rows.iter().filter(|r| !r.verified).map(|r| format!("{} {}", r.op, bench::human(r.bytes))).collect();
            if !bad.is_empty() {
                eprintln!("ironweave: {} rows failed verification: {}", bad.len(), bad.join(", "));
                return Ok(2);
            }
            Ok(0)
        }
        Cmd::BenchWorker { backend, ops, sizes, dtype, min_time, out } => {
            bench::worker(&backend, &ops, &sizes, &dtype, min_time, out.as_deref())?;
            Ok(0)
        }
        Cmd::Selftest { scenario, backend } => {
            selftest::run(&scenario, &backend)?;
            Ok(0)
        }
    }
}

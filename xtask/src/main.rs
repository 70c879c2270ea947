//! `cargo xtask`: ironweave's benchmark and CI helper.
//!
//! `cargo xtask bench collectives [--ranks 2,4] [--sizes 1M,16M,64M] [--ops ...] [--min-time S] [--repeat K]`
//! runs, in one invocation, ironweave's TCP backend, OpenMPI forced onto TCP
//! (`--mca btl tcp,self`), OpenMPI's default shared-memory path, and a single-process memcpy
//! of the same size; writes `target/bench/collectives.json` and prints a Markdown table for
//! docs/BENCHMARKS.md. As root it sets the system's default TCP congestion control to `reno`
//! for the run (restored after), the algorithm ironweave sets on its own connections within
//! one host, so that OpenMPI's TCP side is not paced by BBR while ours is not.
//!
//! `cargo xtask bench transport [--repeat 3] [--min-time S]` runs, interleaved in one
//! invocation, ironweave's UCX backend on its shared-memory and TCP links beside
//! `ucx_perftest` restricted to the same UCX transports (4 MiB `tag_bw`, 8-byte `tag_lat`; the
//! same with `ucp_am_*`, the API we use, as reference columns), and
//! 2-rank collectives over ironweave-ucx beside OpenMPI's default (shared memory) path;
//! `target/bench/transport.json` and a table.
//!
//! `cargo xtask bindings ucx` regenerates the checked-in UCX bindings
//! (`backends/ucx-sys/src/bindings.rs`) from the installed headers (libucx-dev, libclang-dev).
//!
//! `cargo xtask bench snapshot [--bytes 1G] [--repeat 3]` snapshots a state of mixed buffers
//! with ironweave-ckpt beside memcpy (1 and all threads), torch.save and torchsnapshot (a venv
//! under `target/bench-venv`, made on first use: torch from PyPI is large), and writes the
//! persistent tier beside a sequential write; `target/bench/snapshot.json` and a table.

mod tidy;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use serde_json::{json, Value};

/// `cargo xtask`: benchmarks beside their peers, and bindings generation.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "ironweave's benchmark and CI helper")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Benchmarks: ironweave beside its peers in one invocation; JSON under target/bench.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Regenerate checked-in FFI bindings.
    #[command(subcommand)]
    Bindings(BindingsCmd),
    /// The architecture invariants a reading of the source checks (module cycles, upward
    /// imports, what the binary may do); the same checks run in `cargo test -p xtask`.
    Tidy,
}

#[derive(Debug, Subcommand)]
enum BindingsCmd {
    /// backends/ucx-sys/src/bindings.rs from the installed headers (libucx-dev, libclang-dev).
    Ucx,
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
    /// Collectives over ironweave TCP vs OpenMPI (TCP and shared memory) vs memcpy.
    Collectives {
        #[arg(long, value_delimiter = ',', default_value = "2,4")]
        ranks: Vec<usize>,
        #[arg(long, default_value = "1M,16M,64M")]
        sizes: String,
        #[arg(long, default_value = "allreduce,allgather,reducescatter,alltoall")]
        ops: String,
        #[arg(long, default_value = "0.5")]
        min_time: String,
        #[arg(long, default_value_t = 3)]
        repeat: usize,
    },
    /// Two emulated links at once vs each alone, with iperf3 and the probe as references.
    Links {
        #[arg(long, default_value = "topologies/2host-2link.toml")]
        topology: String,
        #[arg(long, default_value = "16M,64M")]
        sizes: String,
        #[arg(long, default_value = "1")]
        min_time: String,
        #[arg(long, default_value_t = 3)]
        repeat: usize,
    },
    /// ironweave-ucx links vs ucx_perftest; 2-rank collectives vs OpenMPI's default path.
    Transport {
        #[arg(long, default_value_t = 3)]
        repeat: usize,
        #[arg(long, default_value = "0.5")]
        min_time: String,
    },
    /// Snapshot and persistent tier vs memcpy, torch.save and torchsnapshot.
    Snapshot {
        #[arg(long, default_value = "1G")]
        bytes: String,
        #[arg(long, default_value_t = 3)]
        repeat: usize,
    },
    /// ironweave-train vs PyTorch eager: same model, batch and threads, one process each.
    Train {
        #[arg(long, default_value = "configs/moe-small.toml")]
        config: String,
        #[arg(long, default_value_t = 10)]
        iters: u64,
        /// Compute threads of both (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Tidy => {
            let problems = tidy::check(&root());
            for p in &problems {
                println!("{p}");
            }
            if !problems.is_empty() {
                bail!("{} problems (docs/ARCHITECTURE.md, \"Architecture invariants\")", problems.len());
            }
            println!("tidy: no module cycle, no upward import, the binary parses and dispatches, deterministic cores pure, no forbidden dependency");
            Ok(())
        }
        Cmd::Bindings(BindingsCmd::Ucx) => {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let out = root().join("backends/ucx-sys/src/bindings.rs");
            run(Command::new(cargo)
                .args([
                    "run",
                    "-q",
                    "-p",
                    "ironweave-ucx-sys",
                    "--features",
                    "generate",
                    "--bin",
                    "ironweave-ucx-sys-generate",
                    "--",
                ])
                .arg(&out)
                .current_dir(root()))?;
            eprintln!("xtask: wrote {}", out.display());
            Ok(())
        }
        Cmd::Bench(BenchCmd::Collectives { ranks, sizes, ops, min_time, repeat }) => {
            bench_collectives(&ranks, &sizes, &ops, &min_time, repeat)
        }
        Cmd::Bench(BenchCmd::Links { topology, sizes, min_time, repeat }) => bench_links(&topology, &sizes, &min_time, repeat),
        Cmd::Bench(BenchCmd::Transport { repeat, min_time }) => bench_transport(repeat, &min_time),
        Cmd::Bench(BenchCmd::Snapshot { bytes, repeat }) => bench_snapshot(&bytes, repeat),
        Cmd::Bench(BenchCmd::Train { config, iters, threads }) => bench_train(&config, iters, threads),
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
}

fn parse_size(s: &str) -> Result<u64> {
    Ok(ironweave_units::parse_size(s)?)
}

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({}):\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `target/bench`, where every benchmark writes its JSON and tables (created).
fn bench_dir() -> Result<PathBuf> {
    let d = target_dir().join("bench");
    std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    Ok(d)
}

/// Builds the `ironweave` binary (release, default features: tcp and ucx); returns its path.
fn build_ironweave() -> Result<PathBuf> {
    eprintln!("xtask: building ironweave (release)");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(cargo).args(["build", "--release", "-p", "ironweave-cli"]).current_dir(root()))?;
    Ok(target_dir().join("release").join("ironweave"))
}

/// Builds the OpenMPI side of the collectives benchmarks into `out_dir`; returns its path.
fn build_mpi_peer(out_dir: &Path) -> Result<PathBuf> {
    eprintln!("xtask: building the OpenMPI peer with mpicc");
    let mpi_bin = out_dir.join("mpi_collectives");
    run(Command::new("mpicc").args(["-O2", "-o"]).arg(&mpi_bin).arg(root().join("xtask/peers/mpi_collectives.c")))
        .context("mpicc failed: install OpenMPI (apt-get install openmpi-bin libopenmpi-dev)")?;
    Ok(mpi_bin)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target"))
}

const CC_PATH: &str = "/proc/sys/net/ipv4/tcp_congestion_control";

/// The system's default TCP congestion control set to `reno` for one benchmark and put back
/// when dropped. ironweave sets `reno` on its own connections within one host
/// (`TcpConfig::local_congestion`); OpenMPI has no such setting and takes the system default,
/// so without this its TCP side would run under BBR's pacing and ours not.
struct RenoForTheRun {
    restore: Option<String>,
    /// What OpenMPI's sockets ran with, for the table.
    note: String,
}

impl RenoForTheRun {
    fn set() -> Self {
        match std::fs::read_to_string(CC_PATH).map(|s| s.trim().to_string()) {
            Ok(was) if was == "reno" => RenoForTheRun { restore: None, note: "reno (the system default)".into() },
            Ok(was) => {
                match std::fs::write(CC_PATH, "reno") {
                    Ok(()) => RenoForTheRun {
                        note: format!("reno, set for the run (the system default, {was}, is restored after)"),
                        restore: Some(was),
                    },
                    Err(e) => {
                        eprintln!("xtask: warning: could not set {CC_PATH} to reno ({e}; needs root): OpenMPI's TCP side runs under {was}");
                        RenoForTheRun { restore: None, note: format!("{was}, the system default (setting reno needs root)") }
                    }
                }
            }
            Err(e) => RenoForTheRun { restore: None, note: format!("the system default ({CC_PATH}: {e})") },
        }
    }
}

impl Drop for RenoForTheRun {
    fn drop(&mut self) {
        if let Some(was) = self.restore.take() {
            if let Err(e) = std::fs::write(CC_PATH, &was) {
                eprintln!("xtask: warning: could not restore {CC_PATH} to {was}: {e}");
            }
        }
    }
}

fn bench_collectives(ranks: &[usize], sizes: &str, ops: &str, min_time: &str, repeat: usize) -> Result<()> {
    let out_dir = bench_dir()?;
    let cc = RenoForTheRun::set();

    let iw = build_ironweave()?;

    let mpi_bin = build_mpi_peer(&out_dir)?;
    let size_bytes: Vec<String> = sizes.split(',').map(|s| parse_size(s).map(|b| b.to_string())).collect::<Result<_>>()?;

    // Rounds interleave the four sides so that drift on a shared machine hits them alike;
    // each table row is the median of its rounds. ironweave runs twice: forced onto its TCP
    // sockets (IRONWEAVE_SHM=0, like for like with OpenMPI on TCP) and as a user gets it by
    // default on one host (the shared-memory path), beside OpenMPI's default (vader).
    let mut rows: Vec<Value> = Vec::new();
    for round in 0..repeat {
        for &n in ranks {
            for (peer, shm) in [("ironweave-tcp", "0"), ("ironweave-shm", "1")] {
                eprintln!("xtask: round {}/{repeat}: {peer}, {n} ranks", round + 1);
                let json_path = out_dir.join(format!("{peer}-{n}.json"));
                run(Command::new(&iw)
                    .env("IRONWEAVE_SHM", shm)
                    .args(["bench", "collectives", "--ranks", &n.to_string(), "--backend", "tcp", "--ops", ops, "--sizes", sizes])
                    .args(["--min-time", min_time, "--json"])
                    .arg(&json_path))?;
                let iw_rows: Vec<Value> = serde_json::from_slice(&std::fs::read(&json_path)?)?;
                for r in iw_rows {
                    rows.push(json!({
                        "peer": peer, "op": r["op"], "bytes": r["bytes"], "ranks": r["ranks"], "iters": r["iters"],
                        "time_us": r["time_us"], "verified": r["verified"], "memcpy_gbps": r["memcpy_gbps"], "round": round,
                        "path": r["path"],
                    }));
                }
            }
            for (label, mca) in
                [("ompi-tcp", vec!["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]), ("ompi-default", vec![])]
            {
                eprintln!("xtask: round {}/{repeat}: OpenMPI ({label}), {n} ranks", round + 1);
                let mut c = Command::new("mpirun");
                c.args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string()])
                    .args(&mca)
                    .arg(&mpi_bin)
                    .args([label, min_time]);
                c.args(ops.split(',')).arg("--").args(&size_bytes);
                for line in run(&mut c)?.lines().filter(|l| l.starts_with('{')) {
                    let mut v: Value = serde_json::from_str(line)?;
                    v["round"] = json!(round);
                    rows.push(v);
                }
            }
        }
    }
    for r in rows.iter_mut() {
        let n = r["ranks"].as_f64().unwrap_or(1.0);
        let f = r["op"].as_str().and_then(|o| o.parse::<ironweave_units::Coll>().ok()).map_or(1.0, |c| c.bus_factor(n as u32));
        let b = r["bytes"].as_f64().unwrap_or(0.0) / (r["time_us"].as_f64().unwrap_or(f64::INFINITY) * 1e-6) / 1e9 * f;
        r["busbw_gbps"] = json!(b);
    }
    std::fs::write(out_dir.join("collectives.json"), serde_json::to_vec_pretty(&rows)?)?;

    let matching = |peer: &str, op: &str, bytes: u64, n: usize| -> Vec<&Value> {
        rows.iter()
            .filter(|r| {
                r["peer"] == peer && r["op"] == op && r["bytes"].as_u64() == Some(bytes) && r["ranks"].as_u64() == Some(n as u64)
            })
            .collect()
    };
    let median = |peer: &str, op: &str, bytes: u64, n: usize, key: &str| -> f64 {
        let mut v: Vec<f64> =
            matching(peer, op, bytes, n).iter().filter_map(|r| r[key].as_f64()).filter(|x| x.is_finite()).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let verified = |peer: &str, op: &str, bytes: u64, n: usize| {
        let m = matching(peer, op, bytes, n);
        !m.is_empty() && m.iter().all(|r| r["verified"] == json!(true))
    };
    let sides = ["ironweave-tcp", "ompi-tcp", "ironweave-shm", "ompi-default"];
    let mut table = format!(
        "Median of {repeat} interleaved rounds, busbw in GB/s (nccl-tests definition); rows of at most 4 KiB \
         are latency rows: time per call in us, and the ratio is OpenMPI's time / ours (above 1: we are faster). \
         TCP congestion control of OpenMPI's sockets: {}; ironweave's connections within one host use reno \
         on their own.\n\n",
        cc.note
    );
    table.push_str("| op | size | ranks | ironweave tcp | OpenMPI tcp | vs OpenMPI tcp | ironweave default (shm path) | OpenMPI default (vader) | vs OpenMPI default | memcpy | shm path taken | all verified |\n");
    table.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n");
    for &n in ranks {
        let firsts = rows
            .iter()
            .filter(|r| r["peer"] == "ironweave-tcp" && r["ranks"].as_u64() == Some(n as u64) && r["round"] == json!(0));
        for r in firsts {
            let (op, bytes) = (r["op"].as_str().unwrap_or(""), r["bytes"].as_u64().unwrap_or(0));
            if bytes == 0 {
                // A size below one element per rank rounds to nothing for the gathers: no row.
                continue;
            }
            let latency = bytes <= 4096;
            let key = if latency { "time_us" } else { "busbw_gbps" };
            let [it, ot, is, od] = sides.map(|p| median(p, op, bytes, n, key));
            let ratio = |ours: f64, theirs: f64| if latency { theirs / ours } else { ours / theirs };
            let mc = median("ironweave-tcp", op, bytes, n, "memcpy_gbps");
            let ok = sides.iter().all(|p| verified(p, op, bytes, n));
            // The counter that proves the mechanism: the rank reports which path it took.
            let shm_taken = matching("ironweave-shm", op, bytes, n).iter().all(|r| r["path"] == json!("shm"))
                && matching("ironweave-tcp", op, bytes, n).iter().all(|r| r["path"] == json!("link"));
            let unit = if latency { " us" } else { "" };
            table.push_str(&format!(
                "| {op} | {} | {n} | {it:.3}{unit} | {ot:.3}{unit} | {:.2}x | {is:.3}{unit} | {od:.3}{unit} | {:.2}x | {mc:.2} | {} | {} |\n",
                human(bytes),
                ratio(it, ot),
                ratio(is, od),
                if shm_taken { "yes" } else { "NO" },
                if ok { "yes" } else { "NO" }
            ));
        }
    }
    println!("{table}");
    std::fs::write(out_dir.join("collectives.md"), &table)?;
    eprintln!("xtask: wrote {} and collectives.md", out_dir.join("collectives.json").display());
    Ok(())
}

/// `cargo xtask bench links [--topology FILE] [--sizes 16M,64M] [--min-time S] [--repeat N]`
/// (root): on the emulated cluster, all-gather and reduce-scatter between two hosts over link A
/// alone, link B alone, both split by their rates (static) and both balanced dynamically, in
/// `repeat` interleaved rounds, with iperf3 on each link and the probe as references.
fn bench_links(topo: &str, sizes: &str, min_time: &str, repeat: usize) -> Result<()> {
    let out_dir = bench_dir()?;
    let iw = build_ironweave()?;
    let topo_path = root().join(topo);
    let topo_arg = topo_path.to_string_lossy().into_owned();
    let text = std::fs::read_to_string(&topo_path).with_context(|| format!("reading {topo}"))?;
    // The two links of the file, by name and rate (the CLI validates the whole file).
    let links: Vec<(String, String)> = text
        .split("[[links]]")
        .skip(1)
        .map(|sec| {
            let get = |k: &str| {
                sec.lines()
                    .find_map(|l| {
                        l.trim()
                            .strip_prefix(k)
                            .and_then(|r| r.trim().strip_prefix('='))
                            .map(|v| v.trim().trim_matches('"').to_string())
                    })
                    .unwrap_or_default()
            };
            (get("name"), get("rate"))
        })
        .collect();
    let name = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("name").and_then(|r| r.trim().strip_prefix('=')))
        .map(|v| v.trim().trim_matches('"').to_string());
    let name = name.context("topology without a name")?;
    if links.len() != 2 {
        bail!("bench links wants a topology with exactly two links");
    }
    let _ = Command::new(&iw).args(["cluster", "down", "--topology", &topo_arg]).output();
    run(Command::new(&iw).args(["cluster", "up", "--topology", &topo_arg]))?;
    let result = (|| -> Result<String> {
        let ns = |h: usize| format!("iw-{name}-h{h}");
        // iperf3 per link, one direction, host 0 -> host 1: the ceiling of one direction.
        let mut iperf = Vec::new();
        for (l, _) in links.iter().enumerate() {
            let (src, dst) = (format!("10.231.{}.1", l + 1), format!("10.231.{}.2", l + 1));
            run(Command::new("ip").args(["netns", "exec", &ns(1), "iperf3", "-s", "-1", "-D", "-B", &dst, "-p", "5299"]))?;
            std::thread::sleep(std::time::Duration::from_millis(300));
            let out = run(Command::new("ip").args([
                "netns",
                "exec",
                &ns(0),
                "iperf3",
                "-J",
                "-t",
                "3",
                "-p",
                "5299",
                "-c",
                &dst,
                "-B",
                &src,
            ]))?;
            let v: Value = serde_json::from_str(&out)?;
            iperf.push(v["end"]["sum_received"]["bits_per_second"].as_f64().unwrap_or(f64::NAN) / 8.0 / 1e9);
        }
        eprintln!("xtask: probe");
        let probe_path = out_dir.join("probe.json");
        run(Command::new(&iw).args(["cluster", "probe", "--topology", &topo_arg, "--json"]).arg(&probe_path))?;
        let probes: Vec<Value> = serde_json::from_slice(&std::fs::read(&probe_path)?)?;
        // Interleaved rounds: every side once per round, so drift hits all sides alike.
        let sides = [links[0].0.as_str(), links[1].0.as_str(), "all-static", "all"];
        let mut samples: Vec<Vec<Vec<Value>>> = vec![Vec::new(); sides.len()];
        for round in 0..repeat.max(1) {
            for (i, sel) in sides.iter().enumerate() {
                eprintln!("xtask: round {}/{}: ironweave over {sel}", round + 1, repeat.max(1));
                let path = out_dir.join(format!("links-{sel}-{round}.json"));
                run(Command::new(&iw)
                    .args(["bench", "collectives", "--topology", &topo_arg, "--ranks-per-host", "1", "--link", sel])
                    .args(["--ops", "allgather,reducescatter", "--sizes", sizes, "--min-time", min_time, "--json"])
                    .arg(&path))?;
                samples[i].push(serde_json::from_slice(&std::fs::read(&path)?)?);
            }
        }
        // The same two splits while link A also carries a competing TCP flow (iperf3, host 0 ->
        // host 1): the link is slower than its declared rate, which a fixed split cannot know.
        let contended = ["all-static", "all"];
        let mut busy: Vec<Vec<Vec<Value>>> = vec![Vec::new(); contended.len()];
        let (a_src, a_dst) = ("10.231.1.1", "10.231.1.2");
        run(Command::new("ip").args(["netns", "exec", &ns(1), "iperf3", "-s", "-D", "-B", a_dst, "-p", "5298"]))?;
        std::thread::sleep(std::time::Duration::from_millis(300));
        let mut flow = Command::new("ip")
            .args(["netns", "exec", &ns(0), "iperf3", "-c", a_dst, "-B", a_src, "-p", "5298", "-t", "3600"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting the competing iperf3 flow")?;
        std::thread::sleep(std::time::Duration::from_secs(1));
        let contended_runs = (|| -> Result<()> {
            for round in 0..repeat.max(1) {
                for (i, sel) in contended.iter().enumerate() {
                    eprintln!(
                        "xtask: round {}/{}: ironweave over {sel}, link {} shared with iperf3",
                        round + 1,
                        repeat.max(1),
                        links[0].0
                    );
                    let path = out_dir.join(format!("links-busy-{sel}-{round}.json"));
                    run(Command::new(&iw)
                        .args(["bench", "collectives", "--topology", &topo_arg, "--ranks-per-host", "1", "--link", sel])
                        .args(["--ops", "allgather,reducescatter", "--sizes", sizes, "--min-time", min_time, "--json"])
                        .arg(&path))?;
                    busy[i].push(serde_json::from_slice(&std::fs::read(&path)?)?);
                }
            }
            Ok(())
        })();
        let _ = flow.kill();
        let _ = flow.wait();
        let _ = Command::new("ip").args(["netns", "exec", &ns(1), "pkill", "-f", "iperf3 -s -D -B 10.231.1.2"]).status();
        contended_runs?;
        std::fs::write(
            out_dir.join("links.json"),
            serde_json::to_vec_pretty(
                &json!({ "sides": sides, "rounds": samples, "contended_sides": contended, "contended_rounds": busy }),
            )?,
        )?;
        let med = |mut v: Vec<f64>| -> f64 {
            v.retain(|x| x.is_finite());
            v.sort_by(|a, b| a.total_cmp(b));
            v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
        };
        // side i, row k: the median over rounds of a field, and whether every round verified
        let stat = |i: usize, k: usize, f: &dyn Fn(&Value) -> Option<f64>| {
            med(samples[i].iter().filter_map(|r| r.get(k).and_then(f)).collect())
        };
        let verified =
            |k: usize| samples.iter().all(|side| side.iter().all(|r| r.get(k).is_some_and(|x| x["verified"] == json!(true))));
        // Declared rates as the links themselves report them (parsed once, by the CLI).
        let declared = |i: usize| probes.get(i).and_then(|p| p["declared_bytes_per_s"].as_f64()).unwrap_or(f64::NAN) / 1e9;
        let (ra, rb) = (declared(0), declared(1));
        let mut t = format!(
            "Link rates: {} = {} ({ra:.4} GB/s), {} = {} ({rb:.4} GB/s); iperf3 one direction: {:.4} and {:.4} GB/s. \
             busbw in GB/s, median of {} interleaved rounds; share = the part of rank 0's bytes that went over {}.\n\n",
            links[0].0,
            links[0].1,
            links[1].0,
            links[1].1,
            iperf[0],
            iperf[1],
            repeat.max(1),
            links[1].0
        );
        t.push_str(&format!(
            "| op | size | {a} alone | {b} alone | both, static split | both, dynamic | dynamic / (rate {A} + rate {B}) | dynamic / (iperf {A} + iperf {B}) | dynamic / faster single | dynamic / static | {b} share static, dynamic | verified |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n",
            a = links[0].0,
            b = links[1].0,
            A = links[0].0.to_uppercase(),
            B = links[1].0.to_uppercase()
        ));
        let first = samples[0].first().cloned().unwrap_or_default();
        for (k, r) in first.iter().enumerate() {
            let bw = |i: usize| stat(i, k, &|row| row["busbw_gbps"].as_f64());
            let share = |i: usize| stat(i, k, &|row| row["link_share"].get(1).and_then(Value::as_f64));
            let (a, b, fixed, both) = (bw(0), bw(1), bw(2), bw(3));
            t.push_str(&format!(
                "| {} | {} | {a:.4} | {b:.4} | {fixed:.4} | {both:.4} | {:.2}x | {:.2}x | {:.2}x | {:.2}x | {:.1}%, {:.1}% | {} |\n",
                r["op"].as_str().unwrap_or(""),
                human(r["bytes"].as_u64().unwrap_or(0)),
                both / (ra + rb),
                both / (iperf[0] + iperf[1]),
                both / a.max(b),
                both / fixed,
                share(2) * 100.0,
                share(3) * 100.0,
                if verified(k) { "yes" } else { "NO" }
            ));
        }
        t.push_str(&format!(
            "\nWith link {a} shared by a competing TCP flow (iperf3 host 0 -> host 1, running through every call), \
             median of {} interleaved rounds:\n\n| op | size | both, static split | both, dynamic | dynamic / static | {b} share static, dynamic | verified |\n|---|---:|---:|---:|---:|---|---|\n",
            repeat.max(1),
            a = links[0].0,
            b = links[1].0
        ));
        let bstat = |i: usize, k: usize, f: &dyn Fn(&Value) -> Option<f64>| {
            med(busy[i].iter().filter_map(|r| r.get(k).and_then(f)).collect())
        };
        for (k, r) in first.iter().enumerate() {
            let bw = |i: usize| bstat(i, k, &|row| row["busbw_gbps"].as_f64());
            let share = |i: usize| bstat(i, k, &|row| row["link_share"].get(1).and_then(Value::as_f64));
            let ok = busy.iter().all(|side| side.iter().all(|r| r.get(k).is_some_and(|x| x["verified"] == json!(true))));
            t.push_str(&format!(
                "| {} | {} | {:.4} | {:.4} | {:.2}x | {:.1}%, {:.1}% | {} |\n",
                r["op"].as_str().unwrap_or(""),
                human(r["bytes"].as_u64().unwrap_or(0)),
                bw(0),
                bw(1),
                bw(1) / bw(0),
                share(0) * 100.0,
                share(1) * 100.0,
                if ok { "yes" } else { "NO" }
            ));
        }
        t.push_str("\nProbe (host 0 -> host 1):\n\n| link | declared (Mbit/s) | measured (Mbit/s) | measured / declared | latency (us) |\n|---|---:|---:|---:|---:|\n");
        for p in &probes {
            let d = p["declared_bytes_per_s"].as_f64().unwrap_or(f64::NAN) * 8.0 / 1e6;
            let m = p["bandwidth_bytes_per_s"].as_f64().unwrap_or(f64::NAN) * 8.0 / 1e6;
            t.push_str(&format!(
                "| {} | {d:.0} | {m:.0} | {:.3} | {:.1} |\n",
                p["name"].as_str().unwrap_or(""),
                m / d,
                p["latency_s"].as_f64().unwrap_or(0.0) * 1e6
            ));
        }
        Ok(t)
    })();
    let down = run(Command::new(&iw).args(["cluster", "down", "--topology", &topo_arg]));
    let table = result?;
    down?;
    println!("{table}");
    std::fs::write(out_dir.join("links.md"), &table)?;
    Ok(())
}

fn human(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64)
    } else if b >= 1 << 10 {
        format!("{:.0} KiB", b as f64 / 1024.0)
    } else {
        format!("{b} B")
    }
}

/// Runs `ucx_perftest` as a server and a client on loopback with `UCX_TLS=tls`; returns the
/// client's `Final:` figures (one-way latency in us, bandwidth in bytes/s).
fn perftest(tls: &str, test: &str, size: u64, iters: u64, port: u16) -> Result<(f64, f64)> {
    let mut server = Command::new("ucx_perftest")
        .env("UCX_TLS", tls)
        .args(["-p", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting ucx_perftest: install ucx-utils")?;
    let mut last_err = None;
    let mut result = None;
    for _ in 0..50 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let out = Command::new("ucx_perftest")
            .env("UCX_TLS", tls)
            .args(["127.0.0.1", "-p", &port.to_string(), "-t", test, "-s", &size.to_string(), "-n", &iters.to_string()])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if let Some(line) = text.lines().find(|l| l.trim_start().starts_with("Final:")) {
            let f: Vec<f64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
            // Final: iterations, latency p50/avg/overall (us), bandwidth avg/overall (MB/s = 2^20 B/s), ...
            if f.len() >= 6 {
                result = Some((f[3], f[5] * (1u64 << 20) as f64));
                break;
            }
        }
        last_err = Some(format!("{}{}", text, String::from_utf8_lossy(&out.stderr)));
    }
    let _ = server.kill();
    let _ = server.wait();
    result.with_context(|| format!("ucx_perftest {test} with UCX_TLS={tls} gave no result: {}", last_err.unwrap_or_default()))
}

fn bench_transport(repeat: usize, min_time: &str) -> Result<()> {
    let coll_ops = "allreduce,allgather,reducescatter,alltoall";
    let coll_sizes = "1M,16M";
    let out_dir = bench_dir()?;
    let iw = build_ironweave()?;
    let mpi_bin = build_mpi_peer(&out_dir)?;
    let size_bytes: Vec<String> = coll_sizes.split(',').map(|s| parse_size(s).map(|b| b.to_string())).collect::<Result<_>>()?;
    let links = [("shm", "posix,sysv,cma,self"), ("tcp", "tcp")];
    let mut rows: Vec<Value> = Vec::new();
    let port = 13337 + (std::process::id() % 1000) as u16;
    for round in 0..repeat {
        for (link, tls) in links {
            eprintln!("xtask: round {}/{repeat}: ironweave-ucx on {link}", round + 1);
            let path = out_dir.join(format!("transport-{link}.json"));
            run(Command::new(&iw)
                .args(["bench", "collectives", "--ranks", "2", "--backend", "ucx", "--link", link])
                .args(["--ops", "stream,pingpong", "--sizes", "4M,8", "--min-time", min_time, "--json"])
                .arg(&path))?;
            let got: Vec<Value> = serde_json::from_slice(&std::fs::read(&path)?)?;
            for r in got {
                rows.push(json!({"peer": format!("ironweave-ucx:{link}"), "op": r["op"], "bytes": r["bytes"],
                    "time_us": r["time_us"], "bw": r["algbw_gbps"].as_f64().unwrap_or(0.0) * 1e9, "verified": r["verified"], "round": round}));
            }
            eprintln!("xtask: round {}/{repeat}: ucx_perftest with UCX_TLS={tls}", round + 1);
            let (_, bw) = perftest(tls, "tag_bw", 4 << 20, 1000, port)?;
            rows.push(json!({"peer": format!("ucx_perftest:{link}"), "op": "stream", "bytes": 4u64 << 20, "bw": bw, "verified": true, "round": round}));
            let (lat, _) = perftest(tls, "tag_lat", 8, 100_000, port + 1)?;
            rows.push(json!({"peer": format!("ucx_perftest:{link}"), "op": "pingpong", "bytes": 8, "time_us": lat, "verified": true, "round": round}));
            // The same API as ours (UCP active messages): what UCX itself gets without tag
            // matching, a reference column beside the target's tag_* figures.
            let (_, bw) = perftest(tls, "ucp_am_bw", 4 << 20, 1000, port + 2)?;
            rows.push(json!({"peer": format!("ucx_perftest_am:{link}"), "op": "stream", "bytes": 4u64 << 20, "bw": bw, "verified": true, "round": round}));
            let (lat, _) = perftest(tls, "ucp_am_lat", 8, 100_000, port + 3)?;
            rows.push(json!({"peer": format!("ucx_perftest_am:{link}"), "op": "pingpong", "bytes": 8, "time_us": lat, "verified": true, "round": round}));
        }
        eprintln!("xtask: round {}/{repeat}: collectives, ironweave-ucx (shm link) and OpenMPI default", round + 1);
        let path = out_dir.join("transport-coll.json");
        // UCX's own shared-memory transports, not the transport's segment (which `bench
        // collectives` measures as ironweave's default path on one host).
        run(Command::new(&iw)
            .env("IRONWEAVE_SHM", "0")
            .args(["bench", "collectives", "--ranks", "2", "--backend", "ucx", "--ops", coll_ops, "--sizes", coll_sizes])
            .args(["--min-time", min_time, "--json"])
            .arg(&path))?;
        let got: Vec<Value> = serde_json::from_slice(&std::fs::read(&path)?)?;
        for r in got {
            rows.push(json!({"peer": "ironweave-ucx", "op": r["op"], "bytes": r["bytes"], "busbw": r["busbw_gbps"],
                "verified": r["verified"], "round": round}));
        }
        let mut c = Command::new("mpirun");
        c.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"]).arg(&mpi_bin).args(["ompi-default", min_time]);
        c.args(coll_ops.split(',')).arg("--").args(&size_bytes);
        for line in run(&mut c)?.lines().filter(|l| l.starts_with('{')) {
            let v: Value = serde_json::from_str(line)?;
            let bytes = v["bytes"].as_f64().unwrap_or(0.0);
            let f = if v["op"] == "allreduce" { 1.0 } else { 0.5 };
            let busbw = bytes / (v["time_us"].as_f64().unwrap_or(f64::INFINITY) * 1e-6) / 1e9 * f;
            rows.push(json!({"peer": "ompi-default", "op": v["op"], "bytes": v["bytes"], "busbw": busbw,
                "verified": v["verified"], "round": round}));
        }
    }
    std::fs::write(out_dir.join("transport.json"), serde_json::to_vec_pretty(&rows)?)?;
    let median = |peer: &str, op: &str, bytes: u64, key: &str| -> f64 {
        let mut v: Vec<f64> = rows
            .iter()
            .filter(|r| r["peer"] == peer && r["op"] == op && r["bytes"].as_u64() == Some(bytes))
            .filter_map(|r| r[key].as_f64())
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let all_ok = |peer: &str| rows.iter().filter(|r| r["peer"] == peer).all(|r| r["verified"] == json!(true));
    let mut t = format!("Median of {repeat} interleaved rounds; bandwidth in GB/s (10^9 B/s), latency one way in us.\n\n");
    t.push_str("| link | ironweave-ucx 4 MiB bw | ucx_perftest tag_bw | ratio | ucp_am_bw (same API) | ironweave-ucx 8 B latency | ucx_perftest tag_lat | ratio (perftest / ours) | ucp_am_lat (same API) | verified |\n");
    t.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for (link, _) in links {
        let (ours, peer, am) =
            (format!("ironweave-ucx:{link}"), format!("ucx_perftest:{link}"), format!("ucx_perftest_am:{link}"));
        let (bw, pbw, abw) = (
            median(&ours, "stream", 4 << 20, "bw"),
            median(&peer, "stream", 4 << 20, "bw"),
            median(&am, "stream", 4 << 20, "bw"),
        );
        let (lat, plat, alat) = (
            median(&ours, "pingpong", 8, "time_us"),
            median(&peer, "pingpong", 8, "time_us"),
            median(&am, "pingpong", 8, "time_us"),
        );
        t.push_str(&format!(
            "| {link} | {:.3} | {:.3} | {:.2}x | {:.3} | {lat:.2} | {plat:.2} | {:.2}x | {alat:.2} | {} |\n",
            bw / 1e9,
            pbw / 1e9,
            bw / pbw,
            abw / 1e9,
            plat / lat,
            if all_ok(&ours) { "yes" } else { "NO" }
        ));
    }
    t.push_str("\n| op | size | ranks | ironweave-ucx (shm link) busbw | OpenMPI default (shm) busbw | ratio | verified |\n|---|---:|---:|---:|---:|---:|---|\n");
    for op in coll_ops.split(',') {
        for s in coll_sizes.split(',') {
            let b = parse_size(s)?;
            let (ours, peer) = (median("ironweave-ucx", op, b, "busbw"), median("ompi-default", op, b, "busbw"));
            t.push_str(&format!(
                "| {op} | {} | 2 | {ours:.3} | {peer:.3} | {:.2}x | {} |\n",
                human(b),
                ours / peer,
                if all_ok("ironweave-ucx") && all_ok("ompi-default") { "yes" } else { "NO" }
            ));
        }
    }
    println!("{t}");
    std::fs::write(out_dir.join("transport.md"), &t)?;
    eprintln!("xtask: wrote {}", out_dir.join("transport.json").display());
    Ok(())
}

/// The Python of `target/bench-venv` (torch, torchsnapshot, numpy), made on first use.
fn torch_venv() -> Result<PathBuf> {
    let venv = target_dir().join("bench-venv");
    let py = venv.join("bin/python");
    if !py.exists() {
        eprintln!("making {} with torch and torchsnapshot (large download) ...", venv.display());
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        run(Command::new(venv.join("bin/pip")).args(["install", "-q", "torch", "torchsnapshot", "numpy"]))?;
    }
    Ok(py)
}

/// ironweave-train beside PyTorch eager on the same model and batch, one process each, the same
/// compute threads, the same warm-up rule (mean iteration after two warm-up iterations).
fn bench_train(config: &str, iters: u64, threads: Option<usize>) -> Result<()> {
    if iters < 3 {
        bail!("--iters must be at least 3 (two warm-up iterations are not averaged)");
    }
    let iters = iters.to_string();
    let threads = threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).to_string();
    let out_dir = bench_dir()?;
    let iw = build_ironweave()?;
    let report = out_dir.join("train-ironweave");
    eprintln!("ironweave train, 1 rank, {threads} threads ...");
    run(Command::new(&iw)
        .args(["train", "--config", config, "--ranks", "1", "--ckpt", "none", "--iters", &iters, "--threads-per-rank", &threads])
        .arg("--report-dir")
        .arg(&report)
        .current_dir(root()))?;
    let ours: Value = serde_json::from_slice(&std::fs::read(report.join("report.json"))?)?;
    let times: Vec<f64> =
        ours["iter_time_s"].as_array().map(|a| a.iter().filter_map(Value::as_f64).collect()).unwrap_or_default();
    if times.len() < 3 {
        bail!("the ironweave run reported {} iterations; --iters must be at least 3", times.len());
    }
    let ours_iter = times[2..].iter().sum::<f64>() / (times.len() - 2) as f64;
    let ours_tps = ours["tokens_per_iter"].as_f64().unwrap_or(f64::NAN) / ours_iter;
    let py = torch_venv()?;
    eprintln!("PyTorch eager, 1 process, {threads} threads ...");
    let peer_out = run(Command::new(&py)
        .arg(root().join("xtask/peers/torch_train.py"))
        .args(["--config", config, "--iters", &iters, "--threads", &threads, "--profile"])
        .current_dir(root()))?;
    let peer: Value = serde_json::from_str(peer_out.trim()).context("torch peer output")?;
    let torch_tps = peer["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
    println!("| {config}, 1 process, {threads} threads | mean iteration | tokens/s | vs PyTorch eager |");
    println!("|---|---:|---:|---:|");
    println!(
        "| ironweave-train (candle, layer-wise recompute) | {:.1} ms | {ours_tps:.0} | {:.2}x |",
        ours_iter * 1e3,
        ours_tps / torch_tps
    );
    println!(
        "| PyTorch {} eager | {:.1} ms | {torch_tps:.0} | 1.00x |",
        peer["torch"].as_str().unwrap_or("?"),
        peer["iter_time_s"].as_f64().unwrap_or(f64::NAN) * 1e3
    );
    if let Some(ops) = peer["top_ops"].as_array() {
        let list: Vec<String> = ops
            .iter()
            .take(5)
            .map(|o| format!("{} {:.0}%", o["op"].as_str().unwrap_or("?"), o["share"].as_f64().unwrap_or(0.0) * 100.0))
            .collect();
        println!(
            "
PyTorch's heaviest operators (self CPU time): {}",
            list.join(", ")
        );
    }
    let all = json!({ "config": config, "threads": threads, "ironweave": { "iter_time_s": ours_iter, "tokens_per_s": ours_tps },
        "torch": peer, "ratio": ours_tps / torch_tps });
    std::fs::write(out_dir.join("train.json"), serde_json::to_vec_pretty(&all)?)?;
    eprintln!("wrote {}", out_dir.join("train.json").display());
    Ok(())
}

fn bench_snapshot(bytes: &str, repeat: usize) -> Result<()> {
    let bytes = parse_size(bytes)?;
    let repeat = repeat.to_string();
    let out_dir = bench_dir()?;
    let iw = build_ironweave()?;
    let ours_json = out_dir.join("snapshot-ironweave.json");
    eprintln!("ironweave snapshot of {bytes} bytes ...");
    let table = run(Command::new(&iw).args([
        "bench",
        "snapshot",
        "--bytes",
        &bytes.to_string(),
        "--repeat",
        &repeat,
        "--dir",
        &out_dir.join("snapshot").display().to_string(),
        "--json",
        &ours_json.display().to_string(),
    ]))?;
    eprint!("{table}");
    let ours: Value = serde_json::from_slice(&std::fs::read(&ours_json)?)?;
    let py = torch_venv()?;
    eprintln!("torch.save and torchsnapshot on the same layout ...");
    let peer_out = run(Command::new(&py)
        .arg(root().join("xtask/peers/torch_snapshot.py"))
        .arg(bytes.to_string())
        .arg(&repeat)
        .arg(out_dir.join("snapshot-torch")))?;
    let peer: Value = serde_json::from_str(peer_out.trim()).context("torch peer output")?;
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let snap = f(&ours, "snapshot_s");
    let rows = [
        ("memcpy into warm buffers, 1 thread", f(&ours, "memcpy_s")),
        ("memcpy into warm buffers, all threads (ceiling)", f(&ours, "memcpy_parallel_s")),
        ("**ironweave-ckpt snapshot**", snap),
        ("torch: copy_ into warm tensors", f(&peer, "torch_copy_warm_s")),
        ("torch.save (+fsync)", f(&peer, "torch_save_s")),
        ("torchsnapshot Snapshot.take", f(&peer, "torchsnapshot_take_s")),
        ("ironweave persistent tier (safetensors+fsync)", f(&ours, "persist_s")),
        ("sequential write + fsync (dd-style)", f(&ours, "sequential_write_s")),
    ];
    let gib = bytes as f64 / (1u64 << 30) as f64;
    println!("| {gib:.2} GiB state, {} buffers | seconds | GB/s | ironweave snapshot speedup |", ours["buffers"]);
    println!("|---|---:|---:|---:|");
    for (name, s) in rows {
        println!("| {name} | {s:.3} | {:.2} | {:.2}x |", bytes as f64 / s / 1e9, s / snap);
    }
    println!(
        "\nsnapshot vs ceiling: {:.2}x; persistent write vs sequential write: {:.2}x (torch {})",
        f(&ours, "memcpy_parallel_s") / snap,
        f(&ours, "sequential_write_s") / f(&ours, "persist_s"),
        peer["torch"].as_str().unwrap_or("?")
    );
    let all = json!({ "ironweave": ours, "torch": peer });
    std::fs::write(out_dir.join("snapshot.json"), serde_json::to_vec_pretty(&all)?)?;
    eprintln!("wrote {}", out_dir.join("snapshot.json").display());
    Ok(())
}

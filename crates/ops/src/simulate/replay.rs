//! `ironweave simulate ckpt --from-report DIR`: replay a measured checkpoint run in the
//! simulator (`ironweave_sim::replay`) and put each strategy's predicted iteration time beside
//! the measured one.
//!
//! Inputs, all measured: the `none` run's profile (rank 0's `trace.json`: its iterations'
//! training communications and the compute between them), the bytes the inter-host links
//! carried during it (the bench's link counters), the link rates of the topology the run used,
//! the state's size, the storage's bandwidth; and two probes run here on this machine: the
//! time of one snapshot of that size (the engine's own copy-and-checksum) and the CPU one byte
//! costs to move through a socket into a replica buffer.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::error::{bail, err, Context, Result};
use ironweave_sim::ckpt::Strategy;
use ironweave_sim::engine::Sharing;
use ironweave_sim::replay::{replay_with, Bed, Predicted, Step};
use serde_json::Value;

/// (a training communication?, seconds, rank 0's bytes).
pub type TraceStep = (bool, f64, f64);

/// One iteration of a trace: (start µs, seconds, steps).
pub type TraceIteration = (f64, f64, Vec<TraceStep>);

/// One measured iteration from a `trace.json`: steps in time order and rank 0's bytes per
/// training communication (merged where they overlap).
pub fn steps_from_trace(trace: &Value) -> Result<(Vec<TraceStep>, f64)> {
    let (its, k) = trace_iterations(trace)?;
    let (_, dur, steps) = its.into_iter().nth(k).expect("index of a listed iteration");
    Ok((steps, dur))
}

/// Every iteration of a `trace.json` in time order, and the index of the one to replay: the
/// iteration of median length among the steady ones (the trace keeps the last few; the first
/// of them is left out when there are more than 3).
pub fn trace_iterations(trace: &Value) -> Result<(Vec<TraceIteration>, usize)> {
    let ev = trace.get("traceEvents").and_then(Value::as_array).or_else(|| trace.as_array()).context("no trace events")?;
    let f = |e: &Value, k: &str| e.get(k).and_then(Value::as_f64);
    let mut iters: Vec<(f64, f64)> = ev
        .iter()
        .filter(|e| e.get("cat").and_then(Value::as_str) == Some("iteration"))
        .filter_map(|e| Some((f(e, "ts")?, f(e, "dur")?)))
        .collect();
    if iters.is_empty() {
        bail!("the trace has no iterations");
    }
    iters.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut steady: Vec<usize> = (first_steady(iters.len())..iters.len()).collect();
    steady.sort_by(|&a, &b| iters[a].1.total_cmp(&iters[b].1));
    let median = steady[steady.len() / 2];
    let comms: Vec<(f64, f64, f64)> = ev
        .iter()
        .filter(|e| e.get("cat").and_then(Value::as_str) == Some("training"))
        .filter_map(|e| {
            let (s, d) = (f(e, "ts")?, f(e, "dur")?);
            let bytes: f64 = e.get("name")?.as_str()?.split_whitespace().nth(1)?.parse().ok()?;
            Some((s, s + d, bytes))
        })
        .collect();
    let out = iters.iter().map(|&(ts, dur)| (ts, dur * 1e-6, iteration_steps(&comms, ts, dur))).collect();
    Ok((out, median))
}

/// Index of the first steady iteration of the `n` a trace keeps: the first is left out when
/// there are more than 3.
fn first_steady(n: usize) -> usize {
    usize::from(n > 3)
}

/// The steps of the iteration `[ts, ts + dur)` (µs) given every training communication as
/// (start, end, bytes).
fn iteration_steps(all: &[(f64, f64, f64)], ts: f64, dur: f64) -> Vec<TraceStep> {
    let mut comms: Vec<(f64, f64, f64)> =
        all.iter().filter(|c| c.0 >= ts && c.0 < ts + dur).map(|&(s, e, b)| (s, e.min(ts + dur), b)).collect();
    comms.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Vec<(f64, f64, f64)> = Vec::new();
    for c in comms {
        match merged.last_mut() {
            Some(m) if c.0 <= m.1 => {
                m.1 = m.1.max(c.1);
                m.2 += c.2;
            }
            _ => merged.push(c),
        }
    }
    // (is a communication, seconds, rank 0's bytes)
    let mut out = Vec::new();
    let mut t = ts;
    for (a, b, bytes) in merged {
        if a > t {
            out.push((false, (a - t) * 1e-6, 0.0));
        }
        out.push((true, (b - a) * 1e-6, bytes));
        t = b;
    }
    if ts + dur > t {
        out.push((false, (ts + dur - t) * 1e-6, 0.0));
    }
    out
}

/// Training-thread seconds of one snapshot of `bytes` (the engine's copy and checksums, all
/// copy threads), best of three.
fn snapshot_probe(bytes: u64) -> Result<f64> {
    use ironweave_ckpt::{DType, Registry, SnapshotBuffers, TensorSpec};
    let reg = std::sync::Arc::new(Registry::new(&[TensorSpec::new("state", DType::U8, &[bytes])])?);
    let src = vec![7u8; bytes as usize];
    let mut snaps = SnapshotBuffers::new(0, 256 << 10);
    let mut best = f64::INFINITY;
    for it in 1..=4u64 {
        let t = Instant::now();
        snaps.take(it, it - 1, &reg, &[&src])?;
        if it > 1 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    Ok(best)
}

/// `socket-probe`'s options: `--listen ADDR` (receive one connection into a replica buffer and
/// checksum it) or `--connect ADDR --bytes N` (send N bytes in 256 KiB messages).
#[derive(Debug, Clone, clap::Args)]
pub struct ProbeArgs {
    #[arg(long)]
    pub listen: Option<std::net::SocketAddr>,
    #[arg(long)]
    pub connect: Option<std::net::SocketAddr>,
    #[arg(long, default_value_t = 0)]
    pub bytes: u64,
}

const PROBE_MSG: usize = 256 << 10;

/// One end of the probe (what the replication path does with a checkpoint byte: the sender
/// writes messages, the receiver copies them into a replica buffer and checksums it).
pub fn probe_end(a: &ProbeArgs) -> Result<()> {
    if let Some(addr) = a.listen {
        let l = std::net::TcpListener::bind(addr).with_context(|| format!("socket probe: binding {addr}"))?;
        let (mut s, _) = l.accept()?;
        let mut replica: Vec<u8> = Vec::new();
        let mut buf = vec![0u8; PROBE_MSG];
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            replica.extend_from_slice(&buf[..n]);
        }
        std::hint::black_box(xxhash_rust::xxh3::xxh3_64(&replica));
        return Ok(());
    }
    let Some(addr) = a.connect else { bail!("socket-probe: give --listen ADDR or --connect ADDR") };
    // the listener may still be starting in its namespace
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    let mut s = loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => return Err(e).with_context(|| format!("socket probe: connecting to {addr}")),
        }
    };
    let msg = vec![3u8; PROBE_MSG];
    let mut left = a.bytes as usize;
    while left > 0 {
        let n = left.min(PROBE_MSG);
        s.write_all(&msg[..n])?;
        left -= n;
    }
    Ok(())
}

/// CPU seconds per byte moved from host 0 to host 1 of the emulated cluster (both ends'
/// processes, the kernel's work in their contexts included: veth, bridge, shaper), less the
/// same probe moving nothing. None when the cluster is not up.
fn emulated_socket_cpu(t: &crate::cluster::Topology) -> Result<Option<f64>> {
    if !crate::cluster::status(t)? {
        return Ok(None);
    }
    let exe = std::env::current_exe()?;
    let run = |bytes: u64, port: u16| -> Result<f64> {
        let addr = format!("{}:{port}", t.addr(1, 0));
        let c0 = children_cpu_s();
        let mut sink = std::process::Command::new("ip")
            .args(["netns", "exec", &t.host_ns(1)])
            .arg(&exe)
            .args(["socket-probe", "--listen", &addr])
            .spawn()
            .context("starting the probe's receiver")?;
        let src = std::process::Command::new("ip")
            .args(["netns", "exec", &t.host_ns(0)])
            .arg(&exe)
            .args(["socket-probe", "--connect", &addr, "--bytes", &bytes.to_string()])
            .status()
            .context("running the probe's sender")?;
        let rx = sink.wait()?;
        if !src.success() || !rx.success() {
            bail!("the socket probe across the emulated link failed ({src}, {rx})");
        }
        Ok(children_cpu_s() - c0)
    };
    const BYTES: u64 = 128 << 20;
    let idle = run(0, 47_311)?;
    let busy = run(BYTES, 47_312)?;
    Ok(Some(((busy - idle) / BYTES as f64).max(0.0)))
}

/// CPU seconds (user + system, this process) per byte sent through a loopback TCP socket in
/// 256 KiB messages and copied into a replica buffer that is then checksummed: what moving a
/// checkpoint byte from one rank's memory to another's costs the machine.
fn socket_cpu_probe() -> Result<f64> {
    const TOTAL: usize = 128 << 20;
    const MSG: usize = 256 << 10;
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("socket probe: bind")?;
    let addr = l.local_addr()?;
    let rx = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut s, _) = l.accept()?;
        let mut replica = vec![0u8; TOTAL];
        let mut buf = vec![0u8; MSG];
        let mut at = 0;
        while at < TOTAL {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            replica[at..at + n].copy_from_slice(&buf[..n]);
            at += n;
        }
        Ok(xxhash_rust::xxh3::xxh3_64(&replica))
    });
    let cpu0 = cpu_s();
    // segments of an Ethernet MTU, as on the emulated links (loopback's 64 KiB segments would
    // hide the per-packet cost)
    let mut s = connect_with_mss(addr, 1448).context("socket probe: connect")?;
    let msg = vec![3u8; MSG];
    for _ in 0..TOTAL / MSG {
        s.write_all(&msg)?;
    }
    drop(s);
    rx.join().map_err(|_| err!("socket probe: the receiver panicked"))??;
    Ok((cpu_s() - cpu0) / TOTAL as f64)
}

/// A TCP connection to `addr` whose segments carry at most `mss` bytes.
fn connect_with_mss(addr: std::net::SocketAddr, mss: i32) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    let std::net::SocketAddr::V4(v4) = addr else {
        return Err(std::io::Error::other("the probe listens on IPv4 loopback"));
    };
    // SAFETY: socket(2) with constant arguments; the descriptor is checked before use.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a socket we own; from here the TcpStream closes it.
    let stream = unsafe { std::net::TcpStream::from_raw_fd(fd) };
    // SAFETY: setsockopt on our socket with a pointer to an i32 and its size.
    let rc = unsafe {
        libc::setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_MAXSEG, (&mss as *const i32).cast(), std::mem::size_of::<i32>() as u32)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(v4.ip().octets()) },
        sin_zero: [0; 8],
    };
    // SAFETY: connect(2) on our socket with a valid sockaddr_in and its size.
    let rc =
        unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_in).cast(), std::mem::size_of::<libc::sockaddr_in>() as u32) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(stream)
}

/// CPU seconds (user + system) of `who`: `RUSAGE_SELF` or `RUSAGE_CHILDREN` (waited-for children).
fn cpu_s_of(who: libc::c_int) -> f64 {
    // SAFETY: getrusage fills the struct we own; `who` is one of the two valid targets.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(who, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn cpu_s() -> f64 {
    cpu_s_of(libc::RUSAGE_SELF)
}

fn children_cpu_s() -> f64 {
    cpu_s_of(libc::RUSAGE_CHILDREN)
}

/// What the replay needs from a measured directory.
struct Measured {
    /// (strategy, measured median iteration seconds).
    rows: Vec<(String, f64)>,
    /// Directory of the run whose profile is replayed.
    profile_dir: PathBuf,
    topology: PathBuf,
    ranks_per_host: usize,
    state_bytes_per_rank: f64,
    storage_per_host: Option<f64>,
    /// Inter-host link bytes per iteration per host of the profiled run, if counted.
    link_bytes_per_iter_per_host: Option<f64>,
    /// The run's compute mode (`cpu`, or `emulated ...`: the math waited on an emulated device,
    /// so moving checkpoint bytes took no time from it).
    compute: String,
}

fn read_json(p: &Path) -> Result<Value> {
    serde_json::from_slice(&std::fs::read(p).with_context(|| format!("reading {}", p.display()))?)
        .with_context(|| format!("parsing {}", p.display()))
}

fn measured(dir: &Path) -> Result<Measured> {
    if dir.join("ckpt.json").exists() {
        let v = read_json(&dir.join("ckpt.json"))?;
        let rows = v["rows"].as_array().context("ckpt.json has no rows (written by an older ironweave? rerun bench ckpt)")?;
        let topology =
            v["topology"].as_str().context("the bench ran without --topology: a replay needs the emulated cluster's links")?;
        let none =
            rows.iter().find(|r| r["strategy"] == "none").context("the bench has no `none` run to take the profile from")?;
        let hosts = crate::cluster::Topology::load(Path::new(topology))?.hosts as f64;
        let iters = none["iterations"].as_f64().unwrap_or(1.0).max(1.0);
        let link: f64 = none["link_bytes"].as_object().map(|m| m.values().filter_map(Value::as_f64).sum()).unwrap_or(0.0);
        Ok(Measured {
            rows: rows.iter().filter_map(|r| Some((r["strategy"].as_str()?.to_string(), r["iter_time_s"].as_f64()?))).collect(),
            profile_dir: [dir.join("none"), dir.join("none-r1")]
                .into_iter()
                .find(|d| d.exists())
                .unwrap_or_else(|| dir.join("none")),
            topology: PathBuf::from(topology),
            ranks_per_host: v["ranks_per_host"].as_u64().unwrap_or(1) as usize,
            state_bytes_per_rank: none["state_bytes_per_rank"].as_f64().unwrap_or(0.0),
            storage_per_host: rows.iter().find_map(|r| r["storage_bytes_per_s_per_host"].as_f64()),
            link_bytes_per_iter_per_host: (link > 0.0).then(|| link / hosts / iters),
            compute: none["compute"].as_str().unwrap_or("cpu").to_string(),
        })
    } else if dir.join("report.json").exists() {
        let r: crate::rundir::Report = serde_json::from_value(read_json(&dir.join("report.json"))?)?;
        let topology =
            r.topology.clone().context("the run was not on the emulated cluster (no --topology): a replay needs its links")?;
        let t = crate::rundir::median_after(&r.iter_time_s, 2);
        Ok(Measured {
            rows: vec![(r.strategy.clone(), t)],
            profile_dir: dir.to_path_buf(),
            topology,
            ranks_per_host: r.ranks_per_host.max(1),
            state_bytes_per_rank: r.state_bytes_per_rank as f64,
            storage_per_host: r.storage_bytes_per_s_per_rank.map(|x| x * r.ranks_per_host.max(1) as f64),
            link_bytes_per_iter_per_host: None,
            compute: r.compute.mode.clone(),
        })
    } else {
        bail!(
            "{} holds neither ckpt.json (`ironweave bench ckpt --out`) nor report.json (`ironweave train --report-dir`)",
            dir.display()
        )
    }
}

/// Seconds per iteration rank 0's training communications lasted in a strategy's run of a
/// bench directory (the median over its steady iterations), if its trace is there.
fn measured_comm_s(dir: &Path, strategy: &str) -> Option<f64> {
    let mut per: Vec<f64> =
        steady_iterations(dir, strategy)?.iter().map(|(_, _, st)| st.iter().filter(|s| s.0).map(|s| s.1).sum()).collect();
    per.sort_by(f64::total_cmp);
    per.get(per.len() / 2).copied()
}

/// Rank 0's bytes that bound the classes of training communications: below 64 KB a call's
/// bytes take under a millisecond on these links (its time is latency and waiting for peers),
/// from 1 MB on they take several.
const CLASS_BOUNDS: [f64; 2] = [65_536.0, 1_048_576.0];
/// The classes' names, for tables.
const CLASS_NAMES: [&str; 3] = ["< 64 KB", "64 KB - 1 MB", ">= 1 MB"];

fn class_of(rank0_bytes: f64) -> usize {
    CLASS_BOUNDS.iter().filter(|&&b| rank0_bytes >= b).count()
}

/// Seconds per iteration of training communication in each class of [`CLASS_NAMES`], mean over
/// the iterations given (a trace's merged steps).
fn comm_by_class(its: &[TraceIteration]) -> [f64; 3] {
    let mut out = [0.0; 3];
    for (_, _, st) in its {
        for &(_, s, b) in st.iter().filter(|s| s.0) {
            out[class_of(b)] += s / its.len().max(1) as f64;
        }
    }
    out
}

/// [`comm_by_class`] of rank 0's steady iterations in a strategy's run of a bench directory.
fn measured_comm_by_class(dir: &Path, strategy: &str) -> Option<[f64; 3]> {
    Some(comm_by_class(&steady_iterations(dir, strategy)?))
}

/// Rank 0's steady iterations in a strategy's run of a bench directory (its first round's
/// trace), if the trace is there.
fn steady_iterations(dir: &Path, strategy: &str) -> Option<Vec<TraceIteration>> {
    let run = [dir.join(strategy), dir.join(format!("{strategy}-r1"))].into_iter().find(|d| d.join("trace.json").exists())?;
    let (mut its, _) = trace_iterations(&read_json(&run.join("trace.json")).ok()?).ok()?;
    Some(its.split_off(first_steady(its.len())))
}

/// `SHARE,WAIT` of `--link-sharing`: training's share of the link in (0, 1] and the queue wait
/// in seconds (0 or more).
pub fn parse_sharing(v: &str) -> Result<Sharing> {
    let bad = || {
        err!(
            "--link-sharing {v:?}: give SHARE,WAIT — training's share of the link in (0, 1] and the wait in seconds, e.g. 0.33,0.002"
        )
    };
    let (w, q) = v.split_once(',').ok_or_else(bad)?;
    let (w, q): (f64, f64) = (w.trim().parse().map_err(|_| bad())?, q.trim().parse().map_err(|_| bad())?);
    if !(w > 0.0 && w <= 1.0 && q.is_finite() && q >= 0.0) {
        return Err(bad());
    }
    Ok(Sharing { training_share: w, queue_wait_s: q })
}

/// Runs the replay; prints predicted vs measured; writes JSON. `sharing`: the link model
/// (`None`: one first-come-first-served queue).
pub fn run(dir: &Path, json: Option<&Path>, sharing: Option<Sharing>) -> Result<()> {
    let m = measured(dir)?;
    if m.state_bytes_per_rank <= 0.0 {
        bail!("the run's report has no state size (state_bytes_per_rank): rerun it with this ironweave");
    }
    let topo = crate::cluster::Topology::load(&m.topology)?;
    let rate = |i: usize| -> Result<f64> {
        Ok(topo.links.get(i).map(|l| ironweave_units::parse_rate(&l.rate)).transpose()?.unwrap_or(0) as f64)
    };
    let (its, median) = trace_iterations(&read_json(&m.profile_dir.join("trace.json"))?)?;
    let steps = its[median].2.clone();
    // the iteration before it, in time: what Capricorn's profile saw (none when it is the first)
    let before = median.checked_sub(1).map(|k| its[k].2.clone()).unwrap_or_default();
    eprintln!("replaying the profile of {}", m.profile_dir.display());
    // rank 0's bytes per communication, scaled to what the host's link carried
    let rank0: f64 = steps.iter().map(|s| s.2).sum();
    let hosts = topo.hosts as f64;
    let per_host = m.link_bytes_per_iter_per_host.unwrap_or(rank0 * m.ranks_per_host as f64 * (hosts - 1.0) / hosts);
    let scale = if rank0 > 0.0 { per_host / rank0 } else { 0.0 };
    let to_bed = |v: &[TraceStep]| -> Vec<Step> {
        v.iter().map(|&(comm, s, b)| if comm { Step::Comm { bytes: b * scale, seconds: s } } else { Step::Compute(s) }).collect()
    };
    let raw = to_bed(&steps);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as u32;
    let ranks = topo.hosts * m.ranks_per_host;
    eprintln!("probing this machine: one snapshot of {:.1} MB, and the CPU of a socket byte ...", m.state_bytes_per_rank / 1e6);
    // every rank snapshots at the same moment on the shared cores
    let snapshot_s = snapshot_probe(m.state_bytes_per_rank as u64)? * (ranks as f64 / cores as f64).max(1.0);
    // the CPU a checkpoint byte costs: across the emulated link when its cluster is up (the
    // path the run took), else over loopback (which misses the veth, bridge and shaper work)
    let (cpu, path) = match emulated_socket_cpu(&topo)? {
        Some(c) => (c, "across the emulated link"),
        None => {
            eprintln!(
                "simulate ckpt: the emulated cluster of {} is down: probing over loopback, which misses the veth/bridge/shaper work (bring it up for the run's path)",
                m.topology.display()
            );
            (socket_cpu_probe()?, "over loopback")
        }
    };
    // on an emulated device the checkpoint's socket CPU runs beside the math, not in its place
    // (the run's machine CPU busy share says whether the cores had room)
    let emulated = m.compute.starts_with("emulated");
    let bed = Bed {
        steps: raw,
        // the shaper paces frames; the replay moves payload
        link_bytes_per_s: rate(0)? * crate::cluster::TCP_PAYLOAD_SHARE,
        hosts: topo.hosts as u32,
        ranks_per_host: m.ranks_per_host as u32,
        state_bytes_per_rank: m.state_bytes_per_rank,
        storage_bytes_per_s_per_host: m.storage_per_host.unwrap_or(f64::INFINITY).min(1e15),
        snapshot_s,
        cpu_s_per_byte: if emulated { 0.0 } else { cpu },
        cores,
        queue_s: crate::cluster::SHAPER_QUEUE_S,
        profiled: to_bed(&before),
        sharing,
    };
    // the profiled iteration is one sample; its compute is scaled so the replayed `none`
    // iteration takes the measured (pooled) median: `none` is the calibration row
    let calib = match m.rows.iter().find(|r| r.0 == "none") {
        Some(&(_, t)) => match ironweave_sim::replay::calibrate(&bed, t) {
            Ok(k) => k,
            Err(e) => {
                eprintln!("simulate ckpt: {e}; replaying the profile's compute as measured");
                1.0
            }
        },
        None => 1.0,
    };
    let bed = ironweave_sim::replay::scaled(&bed, calib);
    let strategies = Strategy::ALL;
    let fill = ironweave_ckpt::EngineConfig::default().window_fill;
    // every capricorn-sparse[K] row measured is replayed with its K
    let sparse: Vec<u64> = m
        .rows
        .iter()
        .filter_map(|r| crate::train::args::parse_strategy(&r.0).ok().filter(|c| c.spread > 1).map(|c| c.spread))
        .collect();
    let second = if topo.links.len() > 1 { rate(1)? * crate::cluster::TCP_PAYLOAD_SHARE } else { 0.0 };
    let pred: Vec<Predicted> = replay_with(&bed, &strategies, fill, second, &sparse)?;
    println!(
        "Replay of {} on {} ({} hosts x {} ranks, link {:.0} MB/s per host, {:.1} MB of state per rank, storage {}), probes: snapshot {:.1} ms, {:.2} ns of CPU per checkpoint byte {path}",
        dir.display(),
        m.topology.display(),
        topo.hosts,
        m.ranks_per_host,
        bed.link_bytes_per_s / 1e6,
        m.state_bytes_per_rank / 1e6,
        m.storage_per_host.map(|s| format!("{:.1} MB/s per host", s / 1e6)).unwrap_or_else(|| "unpaced".into()),
        snapshot_s * 1e3,
        cpu * 1e9
    );
    println!("(none is the calibration row: the profile's compute is scaled by {calib:.3} to its measured median)");
    match sharing {
        None => println!("(the host's egress: one first-come-first-served queue)"),
        Some(sh) => println!(
            "(the host's egress: training and checkpoint bytes interleave, training at {:.0}% of the link while both are on it, after a {:.1} ms wait behind checkpoint bytes: --link-sharing)",
            sh.training_share * 100.0,
            sh.queue_wait_s * 1e3
        ),
    }
    if emulated {
        println!("(compute {}: the checkpoint's CPU is not charged to the device's compute)", m.compute);
    }
    println!(
        "| strategy | predicted | measured | error | predicted accuracy | training comm per iteration, predicted | measured (rank 0) |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    let mut out = Vec::new();
    for p in &pred {
        let meas = m.rows.iter().find(|r| r.0 == p.strategy).map(|r| r.1);
        let err = meas.map(|x| p.iter_time_s / x - 1.0);
        let comm = measured_comm_s(dir, &p.strategy);
        let ms = |x: Option<f64>| x.map(|x| format!("{:.1} ms", x * 1e3)).unwrap_or_else(|| "-".into());
        println!(
            "| {} | {:.1} ms | {} | {} | {} | {:.1} ms | {} |",
            p.strategy,
            p.iter_time_s * 1e3,
            ms(meas),
            err.map(|e| format!("{:+.1}%", e * 100.0)).unwrap_or_else(|| "-".into()),
            p.partition_accuracy.map(|a| format!("{:.0}%", a * 100.0)).unwrap_or_else(|| "-".into()),
            p.training_comm_s * 1e3,
            ms(comm),
        );
        out.push(serde_json::json!({
            "strategy": p.strategy,
            "predicted_iter_time_s": p.iter_time_s,
            "measured_iter_time_s": meas,
            "error": err,
            "predicted_partition_accuracy": p.partition_accuracy,
            "predicted_training_comm_s": p.training_comm_s,
            "measured_training_comm_s": comm,
        }));
    }
    // where a strategy's added training communication time goes, by call size: the replayed
    // iteration is one (the median) and the measured ones are all of rank 0's steady ones, so
    // each side is compared with its own `none`
    let comm_steps: Vec<f64> = steps.iter().filter(|s| s.0).map(|s| s.2).collect();
    let by_class = |p: &Predicted| {
        let mut c = [0.0; 3];
        for (&b, &t) in comm_steps.iter().zip(&p.training_comm_per_step_s) {
            c[class_of(b)] += t;
        }
        c
    };
    let base = pred.iter().find(|p| p.strategy == "none").map(by_class).zip(measured_comm_by_class(dir, "none"));
    if let Some((pred_none, meas_none)) = base {
        let calls: Vec<usize> = (0..3).map(|c| comm_steps.iter().filter(|&&b| class_of(b) == c).count()).collect();
        println!(
            "\nTraining communication per iteration added over none, by rank 0's bytes per call (predicted / measured; measured: the mean over rank 0's steady iterations; calls of the replayed iteration: {} / {} / {}):",
            calls[0], calls[1], calls[2]
        );
        println!("| strategy | {} | {} | {} |\n|---|---:|---:|---:|", CLASS_NAMES[0], CLASS_NAMES[1], CLASS_NAMES[2]);
        for (p, row) in pred.iter().zip(out.iter_mut()) {
            let Some(meas) = measured_comm_by_class(dir, &p.strategy).filter(|_| p.strategy != "none") else { continue };
            let predicted = by_class(p);
            let added = |a: [f64; 3], b: [f64; 3]| [a[0] - b[0], a[1] - b[1], a[2] - b[2]];
            let (pa, ma) = (added(predicted, pred_none), added(meas, meas_none));
            let cell = |c: usize| format!("{:+.0} / {:+.0} ms", pa[c] * 1e3, ma[c] * 1e3);
            println!("| {} | {} | {} | {} |", p.strategy, cell(0), cell(1), cell(2));
            row["training_comm_added_by_call_size"] = serde_json::json!({
                "classes": CLASS_NAMES,
                "predicted_s": pa,
                "measured_s": ma,
            });
        }
    }
    if let Some(p) = json {
        let v = serde_json::json!({ "from": dir.display().to_string(), "bed": bed, "rows": out });
        std::fs::write(p, serde_json::to_vec_pretty(&v)?).with_context(|| format!("writing {}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_becomes_compute_and_merged_communications() {
        let t = serde_json::json!({"traceEvents": [
            {"cat": "iteration", "name": "iteration 1", "ts": 0.0, "dur": 1000.0},
            {"cat": "iteration", "name": "iteration 2", "ts": 1000.0, "dur": 1000.0},
            {"cat": "training", "name": "training 100 B", "ts": 1100.0, "dur": 100.0},
            {"cat": "training", "name": "training 50 B", "ts": 1150.0, "dur": 100.0},
            {"cat": "training", "name": "training 10 B", "ts": 1500.0, "dur": 100.0},
        ]});
        let (s, dur) = steps_from_trace(&t).unwrap();
        assert!((dur - 1e-3).abs() < 1e-12);
        let kinds: Vec<(bool, i64, f64)> = s.iter().map(|x| (x.0, (x.1 * 1e6).round() as i64, x.2)).collect();
        assert_eq!(kinds, vec![(false, 100, 0.0), (true, 150, 150.0), (false, 250, 0.0), (true, 100, 10.0), (false, 400, 0.0)]);
        assert!(steps_from_trace(&serde_json::json!({"traceEvents": []})).is_err());
        // by class: the merged 150-byte and the 10-byte call are both latency-bound
        let (its, _) = trace_iterations(&t).unwrap();
        let c = comm_by_class(&its[1..]);
        assert!((c[0] - 250e-6).abs() < 1e-12 && c[1] == 0.0 && c[2] == 0.0, "{c:?}");
        assert_eq!([class_of(65_535.0), class_of(65_536.0), class_of(2e6)], [0, 1, 2]);
    }

    #[test]
    fn link_sharing_is_parsed_and_bad_values_say_what_to_give() {
        assert_eq!(parse_sharing("0.33,0.002").unwrap(), Sharing { training_share: 0.33, queue_wait_s: 0.002 });
        for bad in ["0.33", "0,0.002", "1.5,0", "0.5,-1", "x,0", "0.5,nan"] {
            let e = parse_sharing(bad).unwrap_err().to_string();
            assert!(e.contains("SHARE,WAIT"), "{bad}: {e}");
        }
    }
}

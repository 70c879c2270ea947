//! `ironweave chaos`: a repeatable reliability campaign. One clean training run, then N runs
//! with one fault each, drawn from a seeded generator: kill -9 of a random rank in the middle of
//! a random iteration's backward, a rank killed together with its replica holder, and kills at
//! the checkpoint engine's named fault points (`ironweave_ckpt::fault`: mid replica transfer,
//! commit, restore, mid persistent-tier write), plus the persistent tier on a full filesystem (a
//! small tmpfs). On the emulated cluster (`--topology`) it also kills whole hosts and sets an
//! inter-host link down for a few seconds (`ip link set ... down`, then `up`, inside a host's
//! namespace): a job must ride out a short outage without an error or a recovery.
//! Every run is a real `ironweave train` (its own launcher and ranks) under a
//! deadline; a run past it is killed and counted as a hang. Per run: whether the job finished,
//! whether its final state equals the clean run's (SHA-256 over every rank's state), committed
//! iterations lost (the restored iteration against the last one committed before the fault),
//! the time the fault cost, and the error when it did not finish.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::progress::{Mode, Progress};

/// `ironweave chaos`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ChaosArgs {
    /// Training configuration.
    #[arg(long, default_value = "configs/moe-tiny.toml")]
    pub config: PathBuf,
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Checkpoint strategy (an in-memory one: capricorn or gemini).
    #[arg(long, default_value = "capricorn")]
    pub ckpt: String,
    /// Iterations per run (default: the config's).
    #[arg(long)]
    pub iters: Option<u64>,
    /// Faulty runs after the clean one.
    #[arg(long, default_value_t = 8)]
    pub runs: usize,
    /// Seed of the fault generator (the same seed draws the same faults).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Persistent tier every N iterations (the last resort when a rank and its holder die).
    #[arg(long, default_value_t = 4)]
    pub persist_every: u64,
    /// Copies of each rank's state in memory, its own included (`train --replicas`): 3 keeps a
    /// copy when a rank dies together with one of its holders.
    #[arg(long, default_value_t = 2)]
    pub replicas: u32,
    /// Run every job on this emulated cluster (root; brought up, and down afterwards, when it
    /// is not up): adds whole-host kills and link outages to the faults drawn from.
    #[arg(long)]
    pub topology: Option<PathBuf>,
    /// Ranks per emulated host (with --topology).
    #[arg(long, default_value_t = 2)]
    pub ranks_per_host: usize,
    /// How long a `link-down` fault keeps the link down, seconds (well below the transport's
    /// deadline: the job must ride it out).
    #[arg(long, default_value_t = 3.0)]
    pub link_down_s: f64,
    /// The deadline (`IRONWEAVE_TIMEOUT_S`) of a `link-down-long` run, whose link stays down
    /// 2.5 times as long: every rank must fail with a typed error and the job recover.
    #[arg(long, default_value_t = 4.0)]
    pub long_outage_deadline_s: f64,
    /// Only these fault kinds (default: every kind the bed allows).
    #[arg(long, value_delimiter = ',')]
    pub faults: Vec<String>,
    /// Where each run's report and output go.
    #[arg(long, default_value = "target/chaos")]
    pub out: PathBuf,
    /// Also write the runs here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The kinds of fault a campaign draws from on one host.
pub const KINDS: [&str; 7] = ["kill", "kill-with-holder", "replica", "commit", "persist", "restore", "full-disk"];
/// The kinds only the emulated cluster (`--topology`) has.
pub const CLUSTER_KINDS: [&str; 3] = ["host", "link-down", "link-down-long"];

/// One faulty run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    /// The kind drawn (one of [`KINDS`] or [`CLUSTER_KINDS`]).
    pub kind: String,
    /// What was done, e.g. `kill rank=2 iter=7 (backward)`.
    pub fault: String,
    pub finished: bool,
    /// The final state equals the clean run's.
    pub final_state_matches: bool,
    /// Committed iterations the recovery did not get back (0 when nothing committed was lost).
    pub lost_committed_iterations: u64,
    /// The run's time over the clean run's: what the fault cost, restarts and recovery included.
    pub recovery_s: f64,
    /// Killed at the deadline.
    pub hang: bool,
    /// The last error line when the run did not finish.
    pub error: Option<String>,
    /// Recoveries the job reported.
    pub recoveries: u64,
    /// The iteration restored (0: started over from the initial state), if any.
    pub restored_iter: Option<u64>,
    /// Iterations trained again after the first recovery: the last one rank 0 logged before
    /// it minus the one restored (`capricorn-sparse` restores an older snapshot and replays).
    #[serde(default)]
    pub replayed_iterations: u64,
    /// Wall time of the run.
    pub wall_s: f64,
    /// The fault happened (a rank was killed, or the persistent tier refused a write).
    pub fault_fired: bool,
    /// The job went back to its initial state although an iteration had been committed
    /// before the fault: work lost without a word (a deterministic job still ends in the
    /// clean state, so only this counter shows it). The campaign requires none.
    #[serde(default)]
    pub retrained_from_scratch: bool,
}

use ironweave_units::SplitMix64 as Rng;

/// One drawn fault: its description and how to inject it.
#[derive(Debug, Clone)]
struct Fault {
    text: String,
    fail: Option<String>,
    env: Option<String>,
    /// Mount a tmpfs of this many KiB on the persistent tier.
    full_disk_kib: Option<u64>,
    /// Set a link down for a while.
    link_down: Option<LinkDown>,
    /// `IRONWEAVE_TIMEOUT_S` of the run.
    deadline_s: Option<f64>,
}

/// A link outage: interface `dev` of namespace `ns` down for `secs` once rank 0 has finished
/// iteration `after_iter`.
#[derive(Debug, Clone)]
struct LinkDown {
    ns: String,
    dev: String,
    after_iter: u64,
    secs: f64,
}

/// What a campaign draws from: the ranks, their hosts and the bed.
struct Bed<'a> {
    ranks: usize,
    iters: u64,
    persist_every: u64,
    /// Ranks holding a replica of each rank (the engine's placement).
    holders: Vec<Vec<usize>>,
    /// The emulated cluster.
    topology: Option<&'a crate::cluster::Topology>,
    link_down_s: f64,
    long_outage_deadline_s: f64,
    /// Iterations one snapshot spans (`capricorn-sparse[K]`: K; else 1): snapshots are taken
    /// at iterations 1, 1 + K, 1 + 2K, ... until a recovery.
    spread: u64,
}

impl Bed<'_> {
    /// The snapshot iteration whose replication, commit or persistent write covers `iter`:
    /// the newest snapshot at or before it, or for a persistent write (`at_or_after`) the
    /// first snapshot at or after it.
    fn snapshot_of(&self, iter: u64, at_or_after: bool) -> u64 {
        let k = self.spread.max(1);
        let m = iter.saturating_sub(1);
        1 + k * if at_or_after { m.div_ceil(k) } else { m / k }
    }
}

fn draw(kind: &str, rng: &mut Rng, bed: &Bed<'_>) -> Fault {
    let (ranks, iters, persist_every) = (bed.ranks, bed.iters, bed.persist_every);
    let rank = rng.below(ranks as u64) as usize;
    // iterations 2..=iters-1: a kill at the very start or end is still a kill, but these show
    // recovery from the middle of training; a persistent write happens every persist_every
    let iter = if kind == "persist" {
        persist_every * (1 + rng.below(((iters - 1) / persist_every.max(1)).max(1)))
    } else {
        2 + rng.below(iters.saturating_sub(2).max(1))
    };
    // the engine's points fire at snapshot iterations (every one unless capricorn-sparse)
    let iter = match kind {
        "persist" => bed.snapshot_of(iter, true),
        "replica" | "commit" => bed.snapshot_of(iter, false),
        _ => iter,
    };
    let none = Fault { text: String::new(), fail: None, env: None, full_disk_kib: None, link_down: None, deadline_s: None };
    match kind {
        "kill" => Fault {
            text: format!("kill -9 rank {rank} in iteration {iter}'s backward"),
            fail: Some(format!("rank={rank},iter={iter}")),
            ..none
        },
        "kill-with-holder" => {
            let hs = &bed.holders[rank];
            let h = hs.get(rng.below(hs.len() as u64) as usize).copied().unwrap_or((rank + 1) % ranks);
            Fault {
                text: format!("kill -9 rank {rank} and its replica holder {h} in iteration {iter}'s backward"),
                fail: Some(format!("rank={rank}+{h},iter={iter}")),
                ..none
            }
        }
        "host" => {
            let hosts = bed.topology.map_or(1, |t| t.hosts);
            let h = rng.below(hosts as u64);
            Fault {
                text: format!("kill -9 every rank of host {h} in iteration {iter}'s backward"),
                fail: Some(format!("host={h},iter={iter}")),
                ..none
            }
        }
        "link-down" | "link-down-long" => {
            let t = bed.topology.expect("link faults are drawn only with a topology");
            let h = rng.below(t.hosts as u64) as usize;
            // the job's first link: it carries the training's and the checkpoints' traffic
            // (an outage of a link nothing uses would prove nothing)
            let l = &t.links[0];
            let long = kind == "link-down-long";
            let secs = if long { 2.5 * bed.long_outage_deadline_s } else { bed.link_down_s };
            Fault {
                text: if long {
                    format!(
                        "link {} of host {h} down for {secs:.1} s after iteration {iter}, deadline {:.1} s",
                        l.name, bed.long_outage_deadline_s
                    )
                } else {
                    format!("link {} of host {h} down for {secs:.1} s after iteration {iter}", l.name)
                },
                link_down: Some(LinkDown { ns: t.host_ns(h), dev: l.name.clone(), after_iter: iter, secs }),
                deadline_s: long.then_some(bed.long_outage_deadline_s),
                ..none
            }
        }
        "restore" => {
            // a first kill makes every rank restore; another rank dies inside that restore
            let other = (rank + 1 + rng.below(ranks as u64 - 1) as usize) % ranks;
            Fault {
                text: format!("kill -9 rank {rank} in iteration {iter}, then rank {other} inside the restore"),
                fail: Some(format!("rank={rank},iter={iter}")),
                env: Some(format!("restore:{other}:1")),
                ..none
            }
        }
        "full-disk" => {
            Fault { text: "persistent tier on a full filesystem (64 KiB tmpfs)".into(), full_disk_kib: Some(64), ..none }
        }
        point => Fault {
            text: format!("kill -9 rank {rank} at fault point `{point}` of iteration {iter}"),
            env: Some(format!("{point}:{rank}:{iter}")),
            ..none
        },
    }
}

/// What a finished (or killed) run left.
struct Outcome {
    code: Option<i32>,
    hang: bool,
    wall_s: f64,
    stdout: String,
    stderr: String,
    /// Seconds a link fault kept its link down.
    link_was_down: Option<f64>,
}

fn run_train(a: &ChaosArgs, dir: &Path, fault: Option<&Fault>, deadline: Duration) -> Result<Outcome> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // a previous campaign's lines would set a link fault off before this run has begun
    for f in ["iterations.jsonl", "report.json"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let exe = std::env::current_exe().context("locating the ironweave binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(["train", "--config"])
        .arg(&a.config)
        .args(["--ranks", &a.ranks.to_string(), "--ckpt", &a.ckpt, "--quiet", "--max-restarts", "4"])
        .args(["--persist-every", &a.persist_every.to_string(), "--replicas", &a.replicas.to_string(), "--report-dir"])
        .arg(dir)
        .env_remove(ironweave_ckpt::fault::VAR)
        .env_remove("IRONWEAVE_TIMEOUT_S")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(i) = a.iters {
        cmd.args(["--iters", &i.to_string()]);
    }
    if let Some(t) = &a.topology {
        cmd.arg("--topology").arg(t).args(["--ranks-per-host", &a.ranks_per_host.to_string()]);
    }
    let mut mounted = None;
    if let Some(f) = fault {
        if let Some(x) = &f.fail {
            cmd.args(["--fail", x]);
        }
        if let Some(e) = &f.env {
            cmd.env(ironweave_ckpt::fault::VAR, e);
        }
        if let Some(d) = f.deadline_s {
            cmd.env("IRONWEAVE_TIMEOUT_S", format!("{d}"));
        }
        if let Some(kib) = f.full_disk_kib {
            let p = dir.join("persist");
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p)?;
            let st = Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "chaos-full"])
                .arg(&p)
                .status()
                .context("running mount")?;
            if !st.success() {
                bail!("mounting a {kib} KiB tmpfs on {} failed (the full-disk fault needs root)", p.display());
            }
            mounted = Some(p);
        }
    }
    let t0 = Instant::now();
    let mut child = cmd.spawn().context("starting ironweave train")?;
    // drain the pipes on threads so a chatty run never blocks on a full pipe
    let read = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = read(child.stdout.take().map(|x| Box::new(x) as Box<dyn Read + Send>));
    let err = read(child.stderr.take().map(|x| Box::new(x) as Box<dyn Read + Send>));
    let mut hang = false;
    let mut outage = Outage::default();
    let link = fault.and_then(|f| f.link_down.as_ref());
    let code = loop {
        if let Some(st) = child.try_wait()? {
            break st.code();
        }
        if let Some(l) = link {
            outage.step(l, dir)?;
        }
        if t0.elapsed() > deadline {
            hang = true;
            // SIGTERM first: the launcher takes its ranks down with it
            // SAFETY: kill(2) on a child we spawned and have not reaped.
            unsafe {
                libc::kill(child.id() as i32, libc::SIGTERM);
            }
            let t1 = Instant::now();
            while child.try_wait()?.is_none() && t1.elapsed() < Duration::from_secs(15) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // a link is never left down, whatever became of the run
    if let Some(l) = link {
        outage.end(l)?;
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let (stdout, stderr) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    std::fs::write(dir.join("stdout.txt"), &stdout)?;
    std::fs::write(dir.join("stderr.txt"), &stderr)?;
    if let Some(p) = mounted {
        let _ = Command::new("umount").arg(&p).status();
    }
    Ok(Outcome { code, hang, wall_s, stdout, stderr, link_was_down: outage.down_for })
}

/// A link outage in progress: down once rank 0 has logged the iteration, up `secs` later.
#[derive(Default)]
struct Outage {
    since: Option<Instant>,
    /// How long the link was down (set when it came back).
    down_for: Option<f64>,
}

fn ip_link(l: &LinkDown, state: &str) -> Result<()> {
    let st =
        Command::new("ip").args(["-n", &l.ns, "link", "set", "dev", &l.dev, state]).status().context("running ip (iproute2)")?;
    if !st.success() {
        bail!("`ip -n {} link set dev {} {state}` failed (the link fault needs root and the cluster up)", l.ns, l.dev);
    }
    Ok(())
}

impl Outage {
    fn step(&mut self, l: &LinkDown, dir: &Path) -> Result<()> {
        match self.since {
            None if self.down_for.is_none() && iterations_logged(dir) >= l.after_iter => {
                ip_link(l, "down")?;
                self.since = Some(Instant::now());
            }
            Some(t) if t.elapsed().as_secs_f64() >= l.secs => self.end(l)?,
            _ => {}
        }
        Ok(())
    }

    fn end(&mut self, l: &LinkDown) -> Result<()> {
        if let Some(t) = self.since.take() {
            ip_link(l, "up")?;
            self.down_for = Some(t.elapsed().as_secs_f64());
        }
        Ok(())
    }
}

/// Iterations rank 0 has finished so far (its per-iteration lines).
fn iterations_logged(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join("iterations.jsonl"))
        .map_or(0, |t| t.lines().filter(|l| l.contains("\"iter\"")).count() as u64)
}

/// The report's final state digest and recovery count.
fn report_of(dir: &Path) -> Option<(String, u64)> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("report.json")).ok()?).ok()?;
    Some((v["final_state_sha256"].as_str()?.to_string(), v["recoveries"].as_u64().unwrap_or(0)))
}

/// The last iteration committed before the first recovery, from rank 0's per-iteration lines
/// (the job marks each recovery there; a restarted rank 0 appends to the same file).
fn committed_before_fault(dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("iterations.jsonl")).ok()?;
    let mut best: Option<u64> = None;
    for l in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else { continue };
        if v.get("recovered").is_some() {
            break;
        }
        if let Some(c) = v["committed"].as_u64() {
            best = Some(best.map_or(c, |b| b.max(c)));
        }
    }
    best
}

/// The last iteration rank 0 logged before the first recovery.
fn logged_before_fault(dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("iterations.jsonl")).ok()?;
    let mut last = None;
    for l in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else { continue };
        if v.get("recovered").is_some() {
            break;
        }
        last = v["iter"].as_u64().or(last);
    }
    last
}

/// The iteration every rank restored (0: started over), from the run's output.
fn restored_iter(stdout: &str) -> Option<u64> {
    for l in stdout.lines() {
        if let Some(rest) = l.strip_prefix("recovered: every rank restored iteration ") {
            return rest.split_whitespace().next().and_then(|x| x.parse().ok());
        }
        if l.starts_with("recovered: nothing was committed yet") {
            return Some(0);
        }
    }
    None
}

/// `ironweave chaos`: the campaign with its table; fails (1) on a hang, a wrong final state or
/// a run retrained from scratch after a commit (runs that could not be survived are in the
/// table with their error).
pub fn command(a: &ChaosArgs) -> Result<i32> {
    crate::launch::install_signal_handlers();
    let rs = run(a)?;
    Ok(if rs.iter().any(|r| r.hang || r.retrained_from_scratch || (r.finished && !r.final_state_matches)) { 1 } else { 0 })
}

/// Runs the campaign; returns the faulty runs' results.
pub fn run(a: &ChaosArgs) -> Result<Vec<RunResult>> {
    let known: Vec<&str> = KINDS.iter().chain(if a.topology.is_some() { &CLUSTER_KINDS[..] } else { &[] }).copied().collect();
    let kinds: Vec<String> = if a.faults.is_empty() { known.iter().map(|s| s.to_string()).collect() } else { a.faults.clone() };
    if let Some(k) = kinds.iter().find(|k| !known.contains(&k.as_str())) {
        if CLUSTER_KINDS.contains(&k.as_str()) {
            bail!("fault kind {k:?} needs the emulated cluster: add --topology (e.g. topologies/2host-2link.toml)");
        }
        bail!("unknown fault kind {k:?} (known: {})", known.join(", "));
    }
    for (flag, v) in [("--link-down-s", a.link_down_s), ("--long-outage-deadline-s", a.long_outage_deadline_s)] {
        if v <= 0.0 || !v.is_finite() {
            bail!("{flag} {v}: give a positive number of seconds");
        }
    }
    if a.replicas < 2 || a.replicas as usize > a.ranks {
        bail!("--replicas {}: the campaign needs 2 to {} copies (a rank's own and at least one on a peer)", a.replicas, a.ranks);
    }
    let topo = a.topology.as_deref().map(crate::cluster::Topology::load).transpose()?;
    if let Some(t) = &topo {
        if a.ranks != t.hosts * a.ranks_per_host {
            bail!("--ranks {} does not fill {} hosts x --ranks-per-host {}", a.ranks, t.hosts, a.ranks_per_host);
        }
    }
    match &topo {
        Some(t) => crate::cluster::with_up(t, "chaos", || campaign(a, &kinds, Some(t))),
        None => campaign(a, &kinds, None),
    }
}

fn campaign(a: &ChaosArgs, kinds: &[String], topo: Option<&crate::cluster::Topology>) -> Result<Vec<RunResult>> {
    if a.ranks < 2 {
        bail!("--ranks {}: a campaign needs at least 2 ranks (a replica lives on another rank)", a.ranks);
    }
    let choice = crate::train::args::parse_strategy(&a.ckpt)?;
    if !choice.strategy.in_memory() {
        bail!("--ckpt {}: the campaign kills ranks and expects in-memory recovery; use capricorn or gemini", a.ckpt);
    }
    let (cfg, _) = crate::train::args::load_config(&a.config)?;
    let iters = a.iters.unwrap_or(cfg.train.iters);
    if iters < 4 {
        bail!("--iters {iters}: a campaign needs at least 4 iterations");
    }
    if kinds.iter().any(|k| k == "persist") && (a.persist_every == 0 || a.persist_every >= iters) {
        bail!("the `persist` fault needs a persistent write before the last iteration: --persist-every below --iters");
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let progress = Progress::new("chaos: run", 0, a.runs as u64 + 1, Mode::detect());
    // the clean run: the reference state and time (generous deadline: nothing to compare yet)
    let clean_dir = a.out.join("clean");
    let clean = run_train(a, &clean_dir, None, Duration::from_secs(1800))?;
    if clean.code != Some(0) {
        bail!("the clean run failed: {}", clean.stderr.lines().last().unwrap_or(""));
    }
    let (clean_sha, _) = report_of(&clean_dir).context("the clean run left no report")?;
    progress.step(1, &format!("clean run: {:.1} s", clean.wall_s));
    // a run may take its recovery and restarts on top: 3x the clean run plus 3 minutes
    let deadline = Duration::from_secs_f64(clean.wall_s * 3.0 + 180.0);
    // replica holders: the engine's placement (ranks on host r / ranks-per-host, or one host)
    let hosts: Vec<usize> = (0..a.ranks).map(|r| if topo.is_some() { r / a.ranks_per_host.max(1) } else { 0 }).collect();
    let bed = Bed {
        ranks: a.ranks,
        iters,
        persist_every: a.persist_every,
        holders: ironweave_ckpt::placement_on_hosts(&hosts, a.replicas as usize),
        topology: topo,
        link_down_s: a.link_down_s,
        long_outage_deadline_s: a.long_outage_deadline_s,
        spread: choice.spread,
    };
    let mut rng = Rng(a.seed);
    let mut results = Vec::with_capacity(a.runs);
    for k in 0..a.runs {
        let kind = &kinds[rng.below(kinds.len() as u64) as usize];
        let fault = draw(kind, &mut rng, &bed);
        let dir = a.out.join(format!("run{:03}", k + 1));
        let o = run_train(a, &dir, Some(&fault), deadline)?;
        let finished = o.code == Some(0) && !o.hang;
        let rep = report_of(&dir).filter(|_| finished);
        let restored = restored_iter(&o.stdout);
        let before = committed_before_fault(&dir);
        let replayed = match (logged_before_fault(&dir), restored) {
            (Some(l), Some(r)) => l.saturating_sub(r),
            _ => 0,
        };
        let lost = match (before, restored) {
            (Some(b), Some(r)) if r < b => b - r,
            _ => 0,
        };
        let error = (!finished).then(|| {
            if o.hang {
                format!("no end within {:.0} s", deadline.as_secs_f64())
            } else {
                // the job's own verdict when it gave up, else its last word
                let lines: Vec<&str> = o.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
                lines
                    .iter()
                    .find(|l| l.contains("cannot recover:"))
                    .or(lines.last())
                    .copied()
                    .unwrap_or("exited without a message")
                    .to_string()
            }
        });
        let r = RunResult {
            kind: kind.clone(),
            fault: fault.text.clone(),
            finished,
            final_state_matches: rep.as_ref().is_some_and(|(s, _)| *s == clean_sha),
            lost_committed_iterations: lost,
            recovery_s: (o.wall_s - clean.wall_s).max(0.0),
            hang: o.hang,
            error,
            recoveries: rep.as_ref().map_or(0, |(_, n)| *n),
            restored_iter: restored,
            replayed_iterations: replayed,
            wall_s: o.wall_s,
            fault_fired: o.stderr.contains("with SIGKILL")
                || o.stderr.contains("persistent tier failed")
                || o.link_was_down.is_some(),
            retrained_from_scratch: restored == Some(0) && before.is_some(),
        };
        progress.step(
            k as u64 + 2,
            &format!(
                "{}: {}",
                r.fault,
                if r.finished && r.final_state_matches { "recovered, same final state" } else { "FAILED" }
            ),
        );
        results.push(r);
    }
    progress.finish();
    print_summary(a, clean.wall_s, &results);
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&serde_json::json!({ "clean_s": clean.wall_s, "runs": results }))?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(results)
}

fn print_summary(a: &ChaosArgs, clean_s: f64, rs: &[RunResult]) {
    println!("| # | fault | fired | finished | final state = clean | committed iterations lost | restored | recovery (s) | hang | error |");
    println!("|---:|---|---|---|---|---:|---:|---:|---|---|");
    for (i, r) in rs.iter().enumerate() {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} |",
            i + 1,
            r.fault,
            if r.fault_fired { "yes" } else { "no" },
            if r.finished { "yes" } else { "no" },
            if r.final_state_matches { "yes" } else { "no" },
            r.lost_committed_iterations,
            r.restored_iter.map_or("-".into(), |x| x.to_string()),
            r.recovery_s,
            if r.hang { "yes" } else { "no" },
            r.error.as_deref().unwrap_or("")
        );
    }
    // by kind: the table docs/RELIABILITY.md carries
    println!("\n| fault kind | runs | fired | finished | final state = clean | committed iterations lost | retrained from scratch | iterations replayed (mean) | recovered without a restart | hangs | median cost (s) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut kinds: Vec<&str> = rs.iter().map(|r| r.kind.as_str()).collect();
    kinds.sort();
    kinds.dedup();
    for k in kinds {
        let of: Vec<&RunResult> = rs.iter().filter(|r| r.kind == k).collect();
        let count = |f: &dyn Fn(&RunResult) -> bool| of.iter().filter(|r| f(r)).count();
        let mut cost: Vec<f64> = of.iter().filter(|r| r.finished).map(|r| r.recovery_s).collect();
        cost.sort_by(f64::total_cmp);
        println!(
            "| {k} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {:.1} |",
            of.len(),
            count(&|r| r.fault_fired),
            count(&|r| r.finished),
            count(&|r| r.finished && r.final_state_matches),
            of.iter().map(|r| r.lost_committed_iterations).sum::<u64>(),
            count(&|r| r.retrained_from_scratch),
            of.iter().map(|r| r.replayed_iterations).sum::<u64>() as f64 / of.len().max(1) as f64,
            count(&|r| r.finished && r.recoveries == 0),
            count(&|r| r.hang),
            cost.get(cost.len() / 2).copied().unwrap_or(0.0)
        );
    }
    let n = rs.len();
    let ok = rs.iter().filter(|r| r.finished && r.final_state_matches).count();
    let hangs = rs.iter().filter(|r| r.hang).count();
    let mismatched = rs.iter().filter(|r| r.finished && !r.final_state_matches).count();
    let lost: u64 = rs.iter().map(|r| r.lost_committed_iterations).sum();
    let scratch = rs.iter().filter(|r| r.retrained_from_scratch).count();
    let mut rec: Vec<f64> = rs.iter().filter(|r| r.finished).map(|r| r.recovery_s).collect();
    rec.sort_by(f64::total_cmp);
    let median = rec.get(rec.len() / 2).copied().unwrap_or(0.0);
    println!(
        "\n{} of {n} faulty runs ({} on {} ranks, seed {}) finished with the clean run's final state; {hangs} hangs, {mismatched} finished with another state, {lost} committed iterations lost, {scratch} retrained from scratch; median cost of a fault {median:.1} s over the clean run's {clean_s:.1} s",
        ok,
        a.config.display(),
        a.ranks,
        a.seed
    );
}

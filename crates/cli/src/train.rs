//! `ironweave train`: launch the ranks of the MoE workload with per-iteration checkpoints,
//! optionally kill one mid-backward (`--fail rank=R,iter=I`) and recover; write a report.
//! `train-worker` (hidden) is the per-rank program. Rank 0 also records its expert load per
//! iteration as `expert_load.json`, the trace format `ironweave simulate ckpt --load-trace` reads.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ironweave_ckpt::engine::Strategy;
use ironweave_ckpt::{Engine, EngineConfig, Registry};
use ironweave_profile::ExpertLoad;
use ironweave_train::data::Corpus;
use ironweave_train::dist::Dist;
use ironweave_train::{TrainConfig, Trainer};
use ironweave_transport::rendezvous::JobEnv;
use ironweave_transport::CommOptions;
use serde::{Deserialize, Serialize};

use crate::progress::{Mode, Progress};

/// `--fail host=H,iter=I` as the `rank=...` form naming every rank of emulated host `H`; other
/// forms unchanged.
pub fn host_fail_to_ranks(s: &str, emulated: bool, ranks_per_host: usize, ranks: usize) -> Result<String> {
    let Some(host) = s.split(',').find_map(|p| p.trim().strip_prefix("host=")) else { return Ok(s.to_string()) };
    if !emulated {
        bail!("--fail host=H needs --topology (the emulated cluster's hosts); on one machine use rank=R1+R2");
    }
    let h: usize = host.trim().parse().with_context(|| format!("--fail: host {host:?}"))?;
    let k = ranks_per_host.max(1);
    if (h + 1) * k > ranks {
        bail!("--fail host={h}: there are only {} hosts of {k} ranks", ranks / k);
    }
    let list: Vec<String> = (h * k..(h + 1) * k).map(|r| r.to_string()).collect();
    let rest: Vec<&str> = s.split(',').filter(|p| !p.trim().starts_with("host=")).collect();
    Ok(std::iter::once(format!("rank={}", list.join("+")))
        .chain(rest.into_iter().map(String::from))
        .collect::<Vec<_>>()
        .join(","))
}

/// `--fail rank=R,iter=I` (several ranks: `rank=R1+R2,iter=I`, killed together).
pub fn parse_fail(s: &str) -> Result<(Vec<usize>, u64)> {
    let mut ranks = Vec::new();
    let mut iter = None;
    for part in s.split(',') {
        match part.split_once('=') {
            Some(("rank", v)) => {
                for r in v.split('+') {
                    ranks.push(r.trim().parse().with_context(|| format!("--fail: rank {r:?}"))?);
                }
            }
            Some(("iter", v)) => iter = Some(v.trim().parse().with_context(|| format!("--fail: iter {v:?}"))?),
            _ => bail!("--fail takes rank=R,iter=I (got {s:?})"),
        }
    }
    match iter {
        Some(i) if i >= 1 && !ranks.is_empty() => Ok((ranks, i)),
        _ => bail!("--fail takes rank=R,iter=I (or rank=R1+R2,iter=I) with I >= 1 (got {s:?})"),
    }
}

/// `ironweave train`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// Training configuration (configs/moe-tiny.toml, configs/moe-small.toml).
    #[arg(long)]
    pub config: PathBuf,
    /// Number of ranks (processes).
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Checkpoint strategy: none, blocking, async, gemini, capricorn.
    #[arg(long, default_value = "capricorn")]
    pub ckpt: String,
    /// Backend.
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Run on the emulated cluster of this topology file.
    #[arg(long)]
    pub topology: Option<PathBuf>,
    /// Ranks per emulated host (with --topology).
    #[arg(long, default_value_t = 1)]
    pub ranks_per_host: usize,
    /// Iterations (default: the config's).
    #[arg(long)]
    pub iters: Option<u64>,
    /// Where report.json, trace.json (Perfetto) and timeline.svg go.
    #[arg(long, default_value = "target/train-report")]
    pub report_dir: PathBuf,
    /// Kill rank R with SIGKILL in the middle of iteration I's backward pass: rank=R,iter=I
    /// (several: rank=R1+R2,iter=I; a whole emulated host with --topology: host=H,iter=I).
    #[arg(long)]
    pub fail: Option<String>,
    /// Restart a rank that dies, up to N times in all (default: 4 with --fail, else 0).
    #[arg(long)]
    pub max_restarts: Option<usize>,
    /// In-memory strategies: also write the persistent tier every N iterations (0: never).
    #[arg(long, default_value_t = 10)]
    pub persist_every: u64,
    /// Copies of each rank's state kept in memory, its own included (2: one replica on a peer;
    /// 3 survives a rank dying with one of its holders, for twice the replica traffic).
    #[arg(long, default_value_t = 2)]
    pub replicas: u32,
    /// Compute threads per rank (default: RAYON_NUM_THREADS / OMP_NUM_THREADS if set, else
    /// cores / ranks on a host).
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// Dense gradients are averaged in buckets of this many KiB during the backward pass
    /// (0: one bucket after the whole backward; default: the config's `bucket_kb`, 512).
    #[arg(long)]
    pub bucket_kb: Option<usize>,
    /// No progress bar or per-iteration lines (the summary is still printed).
    #[arg(long)]
    pub quiet: bool,
    /// Tensor parallelism: groups of this many consecutive ranks split every layer
    /// (Megatron-LM's layout; data parallel across groups). Dense configs only
    /// (configs/gpt-tp.toml); no checkpoints.
    #[arg(long)]
    pub tp: Option<usize>,
    /// Tensor-parallel schedule: megatron (each collective waited where its result is needed)
    /// or oases (sub-batches interleaved so collectives overlap compute). Implies --tp 1 alone.
    #[arg(long)]
    pub schedule: Option<String>,
    /// Sub-batches per rank's batch (default: 2 for oases, 1 for megatron).
    #[arg(long)]
    pub sub_batches: Option<usize>,
    /// Execute the planner's plan (`ironweave plan tmp ... --json plan.json`): its
    /// tensor-parallel degree, sub-batches and batch per group.
    #[arg(long)]
    pub tp_plan: Option<PathBuf>,
    /// Sequences per data-parallel replica per iteration (default: the config's `batch`).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Sharded data parallelism of a dense config (configs/gpt-sdp.toml): replicated, full
    /// (FULL_SHARD), hybrid (HYBRID_SHARD) or hsdp (with --sdp-plan). No checkpoints yet.
    #[arg(long)]
    pub sdp: Option<String>,
    /// hsdp's per-layer split from `ironweave plan sdp --json plan.json`.
    #[arg(long)]
    pub sdp_plan: Option<PathBuf>,
    /// Links of the all-rank part and of the cross-host all-reduce: full=LINK,inter=LINK
    /// (default: the job's first and last link).
    #[arg(long)]
    pub sdp_links: Option<String>,
    /// Bandwidth of the persistent tier per host, as `tc` writes rates (`200mbit`, `1gbit`):
    /// emulated remote storage, enforced by a token bucket in each rank's writer (the host's
    /// ranks share it equally). Default: the local disk, unpaced.
    #[arg(long)]
    pub storage_rate: Option<String>,
}

impl TrainArgs {
    /// Options for `config` with every other option at its default.
    pub fn new(config: &Path) -> Self {
        TrainArgs {
            config: config.to_path_buf(),
            ranks: 4,
            ckpt: "capricorn".into(),
            backend: "tcp".into(),
            topology: None,
            ranks_per_host: 1,
            iters: None,
            report_dir: PathBuf::from("target/train-report"),
            fail: None,
            max_restarts: None,
            persist_every: 10,
            replicas: 2,
            threads_per_rank: None,
            bucket_kb: None,
            quiet: false,
            tp: None,
            schedule: None,
            sub_batches: None,
            tp_plan: None,
            batch: None,
            storage_rate: None,
            sdp: None,
            sdp_plan: None,
            sdp_links: None,
        }
    }
}

/// What `report.json` holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub config: String,
    pub strategy: String,
    pub ranks: usize,
    pub iterations: u64,
    pub iter_time_s: Vec<f64>,
    pub loss: Vec<f32>,
    pub ckpt_exposed_s: Vec<f64>,
    pub partition_accuracy: Option<f64>,
    pub profiling_activations: u64,
    pub last_committed_iter: Option<u64>,
    pub recoveries: u64,
    pub final_state_sha256: String,
    pub tokens_per_iter: u64,
    /// Compute threads of each rank (RAYON_NUM_THREADS as the ranks saw it).
    #[serde(default)]
    pub threads_per_rank: usize,
    /// Gradient buckets per iteration (0 when alone).
    #[serde(default)]
    pub grad_buckets: usize,
    /// Rank 0's data-parallel gradient averaging per iteration: seconds on the wire, and the
    /// part of it during which its backward pass computed.
    #[serde(default)]
    pub dp_comm_s: Vec<f64>,
    #[serde(default)]
    pub dp_hidden_s: Vec<f64>,
    /// Where each rank's state came from in the last recovery: "own memory", "peer",
    /// "persistent", "initial state" (nothing was committed: started over), "" when it never
    /// restored.
    #[serde(default)]
    pub restore_sources: Vec<String>,
    /// The ranks holding a replica of each rank's snapshots.
    #[serde(default)]
    pub replica_holders: Vec<Vec<usize>>,
    /// Each rank's host (index in order of first appearance).
    #[serde(default)]
    pub hosts: Vec<usize>,
    /// Parameters and optimizer state each rank holds between iterations (what one
    /// checkpoint of a rank carries), bytes.
    #[serde(default)]
    pub state_bytes_per_rank: u64,
    /// Replica bytes the ranks sent to their holders over the run (every holder counted).
    #[serde(default)]
    pub ckpt_bytes_replicated: u64,
    /// Of which to holders on another host, as the senders counted them (the links' own
    /// counters are in `bench ckpt`'s rows).
    #[serde(default)]
    pub ckpt_bytes_inter_host_sent: u64,
    /// Replica bytes per link the engine used (the training link first).
    #[serde(default)]
    pub ckpt_bytes_per_link: Vec<u64>,
    /// Bytes written to the persistent tier over the run, all ranks.
    #[serde(default)]
    pub ckpt_bytes_storage: u64,
    /// Each rank's share of the emulated storage bandwidth, bytes/s (None: the local disk).
    #[serde(default)]
    pub storage_bytes_per_s_per_rank: Option<f64>,
    /// The emulated cluster's topology file the run used (None: one machine).
    #[serde(default)]
    pub topology: Option<PathBuf>,
    /// Ranks per host.
    #[serde(default)]
    pub ranks_per_host: usize,
    /// Rank 0's resident memory after each iteration, bytes (`/proc/self/statm`; 0 where
    /// unreadable): a leak shows as growth over a long run.
    #[serde(default)]
    pub rss_bytes: Vec<u64>,
    /// Rank 0's open file descriptors after each iteration.
    #[serde(default)]
    pub open_fds: Vec<u64>,
}

impl Report {
    /// Mean of `v` after the first `skip` (warm-up) entries, or of all when too short.
    pub fn steady(v: &[f64], skip: usize) -> f64 {
        let v = if v.len() > skip { &v[skip..] } else { v };
        v.iter().sum::<f64>() / v.len().max(1) as f64
    }

    /// Mean iteration time after two warm-up iterations.
    pub fn mean_iter_s(&self) -> f64 {
        Self::steady(&self.iter_time_s, 2)
    }

    /// Tokens per second over the steady iterations.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens_per_iter as f64 / self.mean_iter_s().max(1e-12)
    }

    /// Share of data-parallel communication time during which backward computed (None when
    /// nothing was communicated).
    pub fn comm_hidden_fraction(&self) -> Option<f64> {
        let c = Self::steady(&self.dp_comm_s, 2);
        (c > 0.0).then(|| Self::steady(&self.dp_hidden_s, 2) / c)
    }
}

/// This process's resident memory (bytes) and open file descriptors, from /proc (zeros where
/// it cannot be read).
pub fn process_footprint() -> (u64, u64) {
    // statm's second field: resident pages
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|t| t.split_whitespace().nth(1).and_then(|x| x.parse::<u64>().ok()))
        // SAFETY: sysconf with a valid name has no preconditions.
        .map_or(0, |pages| pages * (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64));
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    (rss, fds)
}

/// How often a rank tries to re-form one generation of the job before it gives up (each try
/// waits up to the job's deadline).
pub const REFORM_ATTEMPTS: u32 = 8;

/// A failure no re-formation can mend: a committed iteration whose every copy is gone.
pub fn is_unrecoverable(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        matches!(e.downcast_ref::<ironweave_ckpt::CkptError>(), Some(ironweave_ckpt::CkptError::NothingToRestore { .. }))
    })
}

/// Appends a recovery marker to rank 0's per-iteration lines: where the job went back to (0:
/// the initial state). `ironweave chaos` reads what was committed before it.
pub fn mark_recovery(dir: &Path, restored: u64) -> Result<()> {
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("iterations.jsonl"))?;
    writeln!(f, "{}", serde_json::json!({ "recovered": restored }))?;
    Ok(())
}

/// `final_state_sha256` of a job: SHA-256 of every rank's state digest, in rank order
/// (collective: every rank calls it with its own digest).
pub fn job_state_sha256(comm: &ironweave_transport::Communicator, mine: &[u8; 32]) -> Result<String> {
    let mut all = vec![0u8; 32 * comm.size()];
    comm.all_gather(mine, &mut all)?;
    use sha2::Digest;
    Ok(sha2::Sha256::digest(&all).iter().map(|b| format!("{b:02x}")).collect())
}

pub fn load_config(path: &Path) -> Result<(TrainConfig, Corpus)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let cfg = TrainConfig::from_toml_str(&text)?;
    let data = {
        let p = PathBuf::from(&cfg.data.path);
        if p.is_absolute() || p.exists() {
            p
        } else {
            // relative to the repository root (the config's grandparent or parent)
            path.parent().and_then(|d| [d.join("..").join(&p), d.join(&p)].into_iter().find(|c| c.exists())).unwrap_or(p)
        }
    };
    let corpus = Corpus::load(&data, cfg.model.seq)?;
    Ok((cfg, corpus))
}

/// The hidden `train-worker`'s options (set by `ironweave train`).
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    #[arg(long)]
    pub config: PathBuf,
    #[arg(long)]
    pub ckpt: String,
    #[arg(long)]
    pub iters: Option<u64>,
    #[arg(long)]
    pub report_dir: PathBuf,
    #[arg(long)]
    pub fail: Option<String>,
    #[arg(long, default_value_t = 10)]
    pub persist_every: u64,
    #[arg(long, default_value_t = 2)]
    pub replicas: u32,
    #[arg(long)]
    pub bucket_kb: Option<usize>,
    /// This rank's share of the emulated storage bandwidth, bytes/s.
    #[arg(long)]
    pub storage_bytes_per_s: Option<f64>,
}

/// A checkpoint strategy as the CLI names it: the engine's five, `capricorn-multilink`
/// (Capricorn whose chunks may take every link of the job) and `capricorn-always` (Capricorn
/// profiling every iteration: the reference speculative activation is measured against).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CkptChoice {
    pub strategy: Strategy,
    pub multilink: bool,
    pub always_profile: bool,
}

/// Names beyond the engine's five.
pub const VARIANTS: [&str; 2] = ["capricorn-multilink", "capricorn-always"];

pub fn parse_strategy(s: &str) -> Result<CkptChoice> {
    let plain = |strategy| CkptChoice { strategy, multilink: false, always_profile: false };
    Ok(match s {
        "capricorn-multilink" => CkptChoice { multilink: true, ..plain(Strategy::Capricorn) },
        "capricorn-always" => CkptChoice { always_profile: true, ..plain(Strategy::Capricorn) },
        _ => plain(Strategy::parse(s).map_err(|e| anyhow::anyhow!("{e} (or {})", VARIANTS.join(", ")))?),
    })
}

pub fn worker(a: &WorkerArgs) -> Result<()> {
    let (config, iters, report_dir, persist_every, bucket_kb) =
        (a.config.as_path(), a.iters, a.report_dir.as_path(), a.persist_every, a.bucket_kb);
    let fail = a.fail.as_deref();
    // before any compute pool exists: ranks from torchrun/srun/mpirun get cores / local ranks
    let base = JobEnv::from_env()?;
    if let Some(choice) = ironweave_transport::threads::apply_to_process(base.local_world_size)? {
        if base.rank == 0 {
            eprintln!("ironweave train: {choice}");
        }
    }
    let (mut cfg, corpus) = load_config(config)?;
    if let Some(k) = bucket_kb {
        cfg.train.bucket_kb = k;
    }
    let iters = iters.unwrap_or(cfg.train.iters);
    let choice = parse_strategy(&a.ckpt)?;
    let (strategy, multilink) = (choice.strategy, choice.multilink);
    let fail = fail.map(parse_fail).transpose()?;
    // the launcher exports the backend `ironweave train --backend` named
    let backend = ironweave::Backend::from_env()?;
    let mut gen: u16 = std::env::var("IRONWEAVE_GENERATION").ok().and_then(|g| g.parse().ok()).unwrap_or(0);
    let start_gen = gen;
    let rank = base.rank;
    std::fs::create_dir_all(report_dir)?;
    // every wait's deadline: IRONWEAVE_TIMEOUT_S when set (`ironweave chaos` sets a short one
    // to show what an outage longer than it does), else a minute
    let deadline = match std::env::var_os("IRONWEAVE_TIMEOUT_S") {
        Some(_) => CommOptions::from_env()?.timeout,
        None => Duration::from_secs(60),
    };
    let ecfg = EngineConfig {
        strategy,
        chunk_bytes: 256 << 10,
        persist_dir: Some(report_dir.join("persist")),
        persist_every: if matches!(strategy, Strategy::Gemini | Strategy::Capricorn) { persist_every } else { 0 },
        timeout: deadline,
        // replicas go to other hosts (the emulated cluster's, or real ones by hostname)
        host: ironweave_transport::rendezvous::host_name(),
        storage_bytes_per_s: a.storage_bytes_per_s,
        replicas: a.replicas,
        // always-on profiling: a threshold of 0 profiles every iteration
        drift_threshold: if choice.always_profile { 0.0 } else { EngineConfig::default().drift_threshold },
        ..EngineConfig::default()
    };
    let ecfg = if strategy == Strategy::None { EngineConfig { persist_dir: None, ..ecfg } } else { ecfg };
    let mut trainer: Option<Trainer> = None;
    let mut engine: Option<Engine> = None;
    let mut rep = Report { config: cfg.name.clone(), strategy: a.ckpt.clone(), iterations: iters, ..Default::default() };
    let mut need_restore = gen > 0;
    let mut initial: Option<ironweave_train::model::Params> = None;
    // where this rank's state came from in its last recovery (0: none, 1: own memory, 2: a
    // peer's replica, 3: the persistent tier)
    let mut last_source = 0u8;
    loop {
        if gen > start_gen + 8 {
            bail!("gave up after 8 re-formations");
        }
        let mut env = base.clone();
        env.master.set_port(base.master.port() + gen);
        env.job_id = format!("{}-g{gen}", base.job_id);
        let opts = CommOptions { timeout: deadline, ..CommOptions::default() };
        // a re-formation by a surviving process whose peers cannot be reached yet (a link
        // still down, a peer still restarting) tries the same generation again instead of
        // exiting: its memory holds the checkpoints the job restores from. A process's first
        // formation does not retry: if it fails, the launcher restarts it as a later
        // generation, as before.
        let mut attempt = 0;
        let comm = loop {
            match ironweave::connect(backend, &env, opts.clone()) {
                Ok(c) => break Arc::new(c),
                Err(err) if gen > start_gen && attempt < REFORM_ATTEMPTS && err.is_transient() => {
                    attempt += 1;
                    eprintln!(
                        "rank {rank}: re-forming generation {gen} failed: {err}; trying again ({attempt} of {REFORM_ATTEMPTS})"
                    );
                }
                Err(err) => return Err(err.into()),
            }
        };
        let ecfg = if multilink {
            // every further link of the job may carry chunks (training stays on the first)
            let n = comm.links().len() as u32;
            if n < 2 {
                bail!("capricorn-multilink needs a job with several links (--topology with two or more); this one has {n}");
            }
            EngineConfig { extra_links: (1..n).collect(), ..ecfg.clone() }
        } else {
            ecfg.clone()
        };
        let dist = Dist { comm: comm.clone(), prof: None };
        // a fresh trainer per generation (its communicator is new); parameters come back from
        // the restore, or from the seed at generation 0
        let mut tr = Trainer::distributed(cfg.clone(), corpus.clone(), dist)?;
        match trainer.take() {
            Some(old) => tr.params = old.params,
            // this process's first trainer: the seed's initial state, kept to start over from
            // when a failure comes before anything was committed
            None => initial = Some(tr.params.clone()),
        }
        match engine.as_mut() {
            Some(e) => e.rebind(comm.clone())?,
            None => engine = Some(Engine::new(comm.clone(), Registry::new(&tr.state_specs())?, ecfg.clone())?),
        }
        let e = engine.as_mut().expect("set");
        tr.set_profiler(e.profiler().clone());
        if let Some((frs, fi)) = fail.clone() {
            let mid = cfg.model.layers / 2;
            let armed = gen == 0 && frs.contains(&rank);
            let fr = rank;
            tr.backward_hook = Some(Box::new(move |it, layer| {
                if armed && it == fi && layer == mid {
                    eprintln!("rank {fr}: --fail: killing myself with SIGKILL in the backward of iteration {fi}, layer {mid}");
                    // SAFETY: kill(2) on our own pid with a valid signal number.
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                }
            }));
        }
        let r = (|| -> Result<()> {
            let mut start = 1;
            if need_restore {
                // the newest iteration any rank saw committed before the failure (a restarted
                // rank remembers nothing; -1: none): collective, as the restore's choice is
                let mut c = [e.committed().map_or(-1, |i| i as i64)];
                e.comm().all_reduce(&mut c, ironweave_transport::ReduceOp::Max)?;
                let committed_before = c[0];
                match e.restore_latest() {
                    Ok(r) => {
                        last_source = match r.source {
                            ironweave_ckpt::Source::Local => 1,
                            ironweave_ckpt::Source::Peer(_) => 2,
                            ironweave_ckpt::Source::Persistent => 3,
                        };
                        tr.load_state(|name| r.snapshot.tensor(name).map(<[u8]>::to_vec))?;
                        rep.recoveries += 1;
                        // an older iteration than one committed before: some rank's copies of
                        // the newer ones are all gone (a rank died with its holders); said, not
                        // hidden, though training redoes them to the same state
                        if rank == 0 {
                            if committed_before > r.iter as i64 {
                                eprintln!(
                                    "warning: iteration {committed_before} was committed but a rank's every copy of it is gone (a rank died with its replica holders; --replicas 3 keeps one more); restored iteration {}, {} committed iteration(s) to redo",
                                    r.iter,
                                    committed_before - r.iter as i64
                                );
                            }
                            // said even with --quiet: a recovery is news
                            println!("recovered: every rank restored iteration {} (rank 0 from {:?})", r.iter, r.source);
                            mark_recovery(report_dir, r.iter)?;
                        }
                        start = r.iter + 1;
                    }
                    Err(err @ ironweave_ckpt::CkptError::NothingToRestore { .. }) => {
                        // every rank got the same answer (the choice is collective): was
                        // anything ever committed?
                        if committed_before >= 0 {
                            return Err(anyhow::Error::new(err)
                                .context(format!("iteration {committed_before} was committed and every copy of it is gone")));
                        }
                        // nothing was committed, so nothing is lost: every rank starts over
                        // from the seed's initial state (training is deterministic)
                        tr.params = initial.clone().context("the initial state was not kept")?;
                        e.start_over();
                        last_source = 4;
                        rep.recoveries += 1;
                        if rank == 0 {
                            println!("recovered: nothing was committed yet; every rank starts over from the initial state");
                            mark_recovery(report_dir, 0)?;
                        }
                    }
                    Err(other) => return Err(other.into()),
                }
            }
            let progress = (rank == 0).then(|| Progress::new("iter", start - 1, iters, Mode::detect()));
            let mut last_load: Option<ExpertLoad> = None;
            for it in start..=iters {
                let t0 = Instant::now();
                e.begin_iteration(it, last_load.as_ref());
                let s = tr.step(Some(e.profiler()))?;
                let ir = e.end_iteration();
                let (bufs, step, seed) = tr.state_bytes();
                let mut all = bufs;
                all.push(&step);
                all.push(&seed);
                e.checkpoint(it, &all)?;
                let committed = e.commit(false)?;
                let dt = t0.elapsed().as_secs_f64();
                if rank == 0 {
                    // the report is built from these lines, so a restarted rank 0 still reports
                    // the whole run
                    let (rss, fds) = process_footprint();
                    let line = serde_json::json!({"iter": it, "time": dt, "loss": s.loss, "exposed": ir.exposed_s, "committed": committed,
                        "rss": rss, "fds": fds,
                        "profiled": ir.profiled, "accuracy": ir.partition_accuracy, "load": s.load.tokens,
                        "dp_comm": s.sync.comm_s, "dp_hidden": s.sync.hidden_s, "buckets": s.sync.buckets});
                    let mut f =
                        std::fs::OpenOptions::new().create(true).append(true).open(report_dir.join("iterations.jsonl"))?;
                    writeln!(f, "{line}")?;
                }
                last_load = Some(s.load);
                if let Some(p) = &progress {
                    let toks = (cfg.train.batch * cfg.model.seq * comm.size()) as f64;
                    p.step(
                        it,
                        &format!(
                            "loss {:.4}  {:>6.0} tokens/s  ckpt exposed {:>6.2} ms  committed {}",
                            s.loss,
                            toks / dt,
                            ir.exposed_s * 1e3,
                            committed.map(|c| c.to_string()).unwrap_or_else(|| "-".into())
                        ),
                    );
                    let _ = std::io::stdout().flush();
                }
            }
            if let Some(p) = &progress {
                p.finish();
            }
            Ok(())
        })();
        trainer = Some(tr);
        match r {
            Ok(()) => break,
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
    }
    let e = engine.as_mut().expect("ran");
    rep.last_committed_iter = e.commit(true)?;
    let tr = trainer.expect("ran");
    let comm = e.comm().clone();
    // what the engine moved, summed over the ranks (after the final commit's flush)
    {
        use std::sync::atomic::Ordering::Relaxed;
        let c = e.counters();
        let mut v: Vec<i64> =
            [c.replica_bytes.load(Relaxed), c.replica_bytes_inter_host.load(Relaxed), c.storage_bytes.load(Relaxed)]
                .into_iter()
                .chain(c.replica_bytes_per_link.iter().map(|x| x.load(Relaxed)))
                .map(|x| x as i64)
                .collect();
        comm.all_reduce(&mut v, ironweave_transport::ReduceOp::Sum)?;
        let v: Vec<u64> = v.into_iter().map(|x| x.max(0) as u64).collect();
        rep.ckpt_bytes_replicated = v[0];
        rep.ckpt_bytes_inter_host_sent = v[1];
        rep.ckpt_bytes_storage = v[2];
        rep.ckpt_bytes_per_link = v[3..].to_vec();
        rep.state_bytes_per_rank = e.registry().total;
        rep.storage_bytes_per_s_per_rank = a.storage_bytes_per_s;
    }
    rep.final_state_sha256 = job_state_sha256(&comm, &tr.state_digest())?;
    let mut sources = vec![0u8; comm.size()];
    comm.all_gather(&[last_source], &mut sources)?;
    rep.restore_sources = sources
        .iter()
        .map(|s| match s {
            1 => "own memory",
            2 => "peer",
            3 => "persistent",
            4 => "initial state",
            _ => "",
        })
        .map(String::from)
        .collect();
    // the placement every rank derived from the hosts they exchanged
    let keys = e.hosts().to_vec();
    let mut order: Vec<u64> = Vec::new();
    for k in &keys {
        if !order.contains(k) {
            order.push(*k);
        }
    }
    rep.hosts = keys.iter().map(|k| order.iter().position(|o| o == k).unwrap_or(0)).collect();
    if matches!(strategy, Strategy::Gemini | Strategy::Capricorn) {
        rep.replica_holders = ironweave_ckpt::placement_on_hosts(&keys, ecfg.replicas as usize);
    }
    rep.ranks = comm.size();
    rep.tokens_per_iter = (cfg.train.batch * cfg.model.seq * comm.size()) as u64;
    if rank == 0 {
        // the whole run from the per-iteration lines (the last line of a re-run iteration wins),
        // so a restarted rank 0 still reports every iteration
        let text = std::fs::read_to_string(report_dir.join("iterations.jsonl")).unwrap_or_default();
        let mut last: std::collections::BTreeMap<u64, serde_json::Value> = std::collections::BTreeMap::new();
        for l in text.lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(l) {
                if let Some(it) = v["iter"].as_u64() {
                    last.insert(it, v);
                }
            }
        }
        let n = iters as usize;
        rep.iter_time_s = vec![0.0; n];
        rep.loss = vec![0.0; n];
        rep.ckpt_exposed_s = vec![0.0; n];
        rep.dp_comm_s = vec![0.0; n];
        rep.dp_hidden_s = vec![0.0; n];
        rep.rss_bytes = vec![0; n];
        rep.open_fds = vec![0; n];
        rep.threads_per_rank = std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        rep.grad_buckets = tr.buckets().len();
        // rank 0's expert load per iteration, in `ironweave simulate ckpt --load-trace` format
        let mut loads: Vec<Vec<Vec<f64>>> = vec![Vec::new(); n];
        let (mut acc_sum, mut acc_n) = (0.0, 0u64);
        for (it, v) in &last {
            let k = (*it - 1) as usize;
            if k >= n {
                continue;
            }
            rep.iter_time_s[k] = v["time"].as_f64().unwrap_or(0.0);
            rep.loss[k] = v["loss"].as_f64().unwrap_or(0.0) as f32;
            rep.ckpt_exposed_s[k] = v["exposed"].as_f64().unwrap_or(0.0);
            rep.dp_comm_s[k] = v["dp_comm"].as_f64().unwrap_or(0.0);
            rep.dp_hidden_s[k] = v["dp_hidden"].as_f64().unwrap_or(0.0);
            rep.rss_bytes[k] = v["rss"].as_u64().unwrap_or(0);
            rep.open_fds[k] = v["fds"].as_u64().unwrap_or(0);
            rep.profiling_activations += u64::from(v["profiled"].as_bool().unwrap_or(false));
            if let Some(a) = v["accuracy"].as_f64() {
                acc_sum += a;
                acc_n += 1;
            }
            if let Some(l) = v["load"].as_array() {
                loads[k] = l
                    .iter()
                    .map(|x| x.as_array().map(|a| a.iter().filter_map(|y| y.as_f64()).collect()).unwrap_or_default())
                    .collect();
            }
        }
        rep.partition_accuracy = (acc_n > 0).then(|| acc_sum / acc_n as f64);
        std::fs::write(report_dir.join("report.json"), serde_json::to_vec_pretty(&rep)?)?;
        let trace_loads: Vec<_> = loads.into_iter().filter(|l| !l.is_empty()).collect();
        let lt = serde_json::json!({ "experts": cfg.model.experts, "iterations": trace_loads });
        std::fs::write(report_dir.join("expert_load.json"), serde_json::to_vec(&lt)?)?;
        let hist = e.profiler().history();
        let trace = ironweave_profile::export::chrome_trace(&hist, &[], 0);
        std::fs::write(report_dir.join("trace.json"), serde_json::to_vec(&trace)?)?;
        // the last iteration that timed its layers (speculative activation turns layer timing
        // off in most iterations; an unprofiled one would draw an empty layers lane)
        if let Some(p) = hist.iter().rev().find(|p| !p.layers.is_empty()).or(hist.last()) {
            let w = ironweave_profile::idle_windows(p, 0, 50_000);
            let title = if p.layers.is_empty() {
                format!("rank 0, iteration {} (no iteration timed its layers)", p.iter)
            } else {
                format!("rank 0, iteration {} (the last one profiled layer by layer)", p.iter)
            };
            std::fs::write(report_dir.join("timeline.svg"), ironweave_profile::export::svg_timeline(p, &w, &title))?;
        }
    }
    engine.take().expect("ran").shutdown()?;
    Ok(())
}

/// `ironweave train`: launches the ranks, prints the summary; returns the exit status.
pub fn run(a: &TrainArgs) -> Result<i32> {
    if a.sdp.is_some() || a.sdp_plan.is_some() {
        if a.tp.is_some() || a.tp_plan.is_some() {
            bail!("--sdp and --tp do not combine yet: choose one");
        }
        return crate::sdp::run(a);
    }
    if a.tp.is_some() || a.schedule.is_some() || a.sub_batches.is_some() || a.tp_plan.is_some() {
        return crate::overlap::run(a);
    }
    let (config, ranks, strategy, backend) = (a.config.as_path(), a.ranks, a.ckpt.as_str(), a.backend.as_str());
    let (iters, report_dir, persist_every) = (a.iters, a.report_dir.as_path(), a.persist_every);
    // --fail host=H: every rank of emulated host H (the launcher puts rank r on host
    // r / ranks-per-host), killed together
    let fail_ranks =
        a.fail.as_deref().map(|f| host_fail_to_ranks(f, a.topology.is_some(), a.ranks_per_host, ranks)).transpose()?;
    let fail = fail_ranks.as_deref();
    // a backend that is not compiled in or cannot run here is refused before any rank starts
    let chosen = ironweave::Backend::pick(backend)?;
    chosen.usable().with_context(|| format!("--backend {chosen} cannot run here (`ironweave doctor` says more)"))?;
    let (cfg, _) = load_config(config)?;
    parse_strategy(strategy)?;
    // the host's storage bandwidth, shared by its ranks
    let per_host = if a.topology.is_some() { a.ranks_per_host.max(1) } else { ranks.max(1) };
    let storage_per_rank = match &a.storage_rate {
        Some(r) => {
            // bytes per second
            let rate = ironweave_tcp::parse_rate(r).map_err(|e| anyhow::anyhow!("--storage-rate: {e}"))?;
            if rate == 0 {
                bail!("--storage-rate must be above 0 (leave it out for the local disk's speed)");
            }
            Some(rate as f64 / per_host as f64)
        }
        None => None,
    };
    if a.replicas == 0 || a.replicas as usize > ranks {
        bail!(
            "--replicas {}: give 1 to {ranks} copies per rank's state (its own included; 2 puts one replica on a peer)",
            a.replicas
        );
    }
    if let Some(f) = fail {
        let (rs, i) = parse_fail(f)?;
        if let Some(r) = rs.iter().find(|&&r| r >= ranks) {
            bail!("--fail rank={r}: there are only {ranks} ranks");
        }
        if i > iters.unwrap_or(cfg.train.iters) {
            bail!("--fail iter={i} is past the last iteration");
        }
    }
    std::fs::create_dir_all(report_dir).with_context(|| format!("creating {}", report_dir.display()))?;
    let _ = std::fs::remove_dir_all(report_dir.join("persist"));
    let _ = std::fs::remove_file(report_dir.join("report.json"));
    let _ = std::fs::remove_file(report_dir.join("iterations.jsonl"));
    let exe = std::env::current_exe().context("locating the ironweave binary")?;
    let mut args = vec![
        "train-worker".to_string(),
        "--config".into(),
        config.display().to_string(),
        "--ckpt".into(),
        strategy.into(),
        "--report-dir".into(),
        report_dir.display().to_string(),
        "--persist-every".into(),
        persist_every.to_string(),
        "--replicas".into(),
        a.replicas.to_string(),
    ];
    if let Some(i) = iters {
        args.extend(["--iters".into(), i.to_string()]);
    }
    if let Some(f) = fail {
        args.extend(["--fail".into(), f.to_string()]);
    }
    if let Some(k) = a.bucket_kb {
        args.extend(["--bucket-kb".into(), k.to_string()]);
    }
    if let Some(r) = storage_per_rank {
        args.extend(["--storage-bytes-per-s".into(), format!("{r}")]);
    }
    let topology = match &a.topology {
        Some(p) => Some((crate::cluster::Topology::load(p)?, a.ranks_per_host.max(1))),
        None => None,
    };
    eprintln!(
        "ironweave train: {} on {ranks} ranks over {chosen}, checkpoint strategy {strategy}, report in {}",
        cfg.name,
        report_dir.display()
    );
    let spec = crate::launch::LaunchSpec {
        ranks,
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
        max_restarts: a.max_restarts.unwrap_or(if fail.is_some() { 4 } else { 0 }),
        threads_per_rank: a.threads_per_rank,
    };
    crate::launch::install_signal_handlers();
    let code = crate::launch::run(&spec)?.exit_code();
    if code != 0 {
        return Ok(code);
    }
    let mut rep: Report = serde_json::from_slice(&std::fs::read(report_dir.join("report.json")).context("reading report.json")?)?;
    // where it ran, for replays (`ironweave simulate ckpt --from-report`)
    rep.topology = a.topology.clone();
    rep.ranks_per_host = per_host;
    std::fs::write(report_dir.join("report.json"), serde_json::to_vec_pretty(&rep)?)?;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let committed = match rep.last_committed_iter {
        Some(i) => format!("iteration {i}"),
        None => "nothing".into(),
    };
    let hidden = match rep.comm_hidden_fraction() {
        Some(h) => format!(", {:.0}% of gradient communication hidden behind backward", h * 100.0),
        None => String::new(),
    };
    println!(
        "done: {} iterations on {} rank{} x {} thread{}, loss {:.4} -> {:.4}, {:.0} tokens/s (mean iteration {:.1} ms after 2 warm-up){hidden}",
        rep.iterations,
        rep.ranks,
        if rep.ranks == 1 { "" } else { "s" },
        rep.threads_per_rank,
        if rep.threads_per_rank == 1 { "" } else { "s" },
        rep.loss.first().copied().unwrap_or(f32::NAN),
        rep.loss.last().copied().unwrap_or(f32::NAN),
        rep.tokens_per_s(),
        rep.mean_iter_s() * 1e3,
    );
    println!(
        "checkpoints ({strategy}): mean exposed {:.2} ms, partition accuracy {}, profiling activations {}, last committed {committed}, recoveries {}; final state {}",
        mean(&rep.ckpt_exposed_s) * 1e3,
        rep.partition_accuracy.map(|a| format!("{:.0}%", a * 100.0)).unwrap_or_else(|| "-".into()),
        rep.profiling_activations,
        rep.recoveries,
        &rep.final_state_sha256[..16]
    );
    match crate::report::write(report_dir, None) {
        Ok(html) => println!("report: {} (and report.json, trace.json, timeline.svg beside it)", html.display()),
        Err(e) => eprintln!("ironweave train: could not write the HTML report: {e:#}"),
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_failure_names_every_rank_of_the_host() {
        assert_eq!(host_fail_to_ranks("host=1,iter=12", true, 2, 4).unwrap(), "rank=2+3,iter=12");
        assert_eq!(host_fail_to_ranks("iter=3,host=0", true, 3, 6).unwrap(), "rank=0+1+2,iter=3");
        assert_eq!(host_fail_to_ranks("rank=1,iter=2", false, 1, 4).unwrap(), "rank=1,iter=2");
        assert!(host_fail_to_ranks("host=1,iter=2", false, 2, 4).unwrap_err().to_string().contains("needs --topology"));
        assert!(host_fail_to_ranks("host=2,iter=2", true, 2, 4).unwrap_err().to_string().contains("only 2 hosts"));
        let (r, i) = parse_fail(&host_fail_to_ranks("host=1,iter=5", true, 2, 4).unwrap()).unwrap();
        assert_eq!((r, i), (vec![2, 3], 5));
    }
}

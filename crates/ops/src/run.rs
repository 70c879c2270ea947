//! What every training run shares: the options of `ironweave train` (data, tensor and sharded
//! parallel alike), what their `report.json` files hold, the `--fail` and `--ckpt` syntax, the
//! training configuration's loading, and the statistics the benches read reports with. The
//! bottom of the crate's module graph: it imports no other operation.

use std::io::Write;
use std::path::{Path, PathBuf};

use ironweave::ckpt::engine::Strategy;
use ironweave::ckpt::EngineConfig;
use ironweave_train::data::Corpus;
use ironweave_train::TrainConfig;
use serde::{Deserialize, Serialize};

use crate::error::{bail, err, Context, Result};

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
    /// Checkpoint strategy: none, blocking, async, gemini, capricorn; or `capricorn-sparseK`
    /// (a snapshot every K iterations, 1/K of it replicated per iteration; `capricorn-sparse`:
    /// K=4), capricorn-multilink, capricorn-always, async-sustained, gemini-fillF-chunkSIZE.
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
    /// Execute the planner's plan (`ironweave plan tp ... --json plan.json`): its
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
    /// (default: the job's first and last link); full=a+b stripes the all-rank part over
    /// every link.
    #[arg(long)]
    pub sdp_links: Option<String>,
    /// Bandwidth of the persistent tier per host, as `tc` writes rates (`200mbit`, `1gbit`):
    /// emulated remote storage, enforced by a token bucket in each rank's writer (the host's
    /// ranks share it equally). Default: the local disk, unpaced.
    #[arg(long)]
    pub storage_rate: Option<String>,
    /// Start from the newest complete checkpoint in this persistent tier (`<report dir>/persist`
    /// of another run), whatever world size or expert placement wrote it (MoE configs); the
    /// job continues after that iteration. `report.json` gains `restored_global_state_sha256`.
    #[arg(long)]
    pub resume_from: Option<PathBuf>,
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
            resume_from: None,
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
    /// Rank 0's chunk transfers as its sender threads timed them (`send` calls: bytes into
    /// the socket buffer), mean over the iterations.
    pub partition_accuracy: Option<f64>,
    /// Every rank as a holder: the share of the replica chunks it received whose time on the
    /// wire (the `len / rate` before the last byte arrived) fell inside an idle window of its
    /// own link, over the run (`ironweave_ckpt::partition::wire_accuracy`).
    #[serde(default)]
    pub wire_accuracy: Option<f64>,
    /// Replica chunks the holders received and judged, all ranks.
    #[serde(default)]
    pub wire_chunks: u64,
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
    /// The layout-free digests of the final state and of a resumed job's loaded state.
    #[serde(flatten)]
    pub digests: Digests,
    /// CPU the replica sender and receiver threads used over the run, all ranks, ns: divided by
    /// `ckpt_bytes_replicated`, what each checkpoint byte costs the cores that train.
    #[serde(default)]
    pub ckpt_cpu_ns: u64,
    /// CPU every thread of the ranks' processes used over the whole run, ns, all ranks: a run
    /// minus the `none` run of the same job is what checkpointing cost, on whichever thread
    /// (TCP readers that decode replica frames included).
    #[serde(default)]
    pub process_cpu_ns: u64,
    /// CPU the transport's own threads used (`ironweave_transport::threads::comm_cpu_ns`), ns,
    /// all ranks.
    #[serde(default)]
    pub comm_cpu_ns: u64,
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

    /// Iterations this job did not run: those of the checkpoint it resumed from.
    pub fn resumed_iters(&self) -> usize {
        self.digests.resumed_from_iter.unwrap_or(0) as usize
    }

    /// Mean iteration time after two warm-up iterations (of those this job ran).
    pub fn mean_iter_s(&self) -> f64 {
        Self::steady(&self.iter_time_s, self.resumed_iters() + 2)
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

/// Appends a recovery marker to rank 0's per-iteration lines: where the job went back to (0:
/// the initial state). `ironweave chaos` reads what was committed before it.
pub fn mark_recovery(dir: &Path, restored: u64) -> Result<()> {
    append_line(dir, &serde_json::json!({ "recovered": restored }))
}

/// Appends `line` to the run's `iterations.jsonl` under `dir`.
fn append_line(dir: &Path, line: &serde_json::Value) -> Result<()> {
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("iterations.jsonl"))?;
    writeln!(f, "{line}")?;
    Ok(())
}

/// Every iteration's line of the run under `dir`, the last line of a re-run iteration winning
/// (so a restarted rank 0 still reports the whole run); unreadable lines are skipped.
pub fn read_iterations(dir: &Path) -> std::collections::BTreeMap<u64, serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("iterations.jsonl")).unwrap_or_default();
    let mut by_iter = std::collections::BTreeMap::new();
    for l in text.lines() {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(l) {
            if let Some(it) = v["iter"].as_u64() {
                by_iter.insert(it, v);
            }
        }
    }
    by_iter
}

/// What a training run's rank 0 shows and records while it runs: its progress bar and its
/// per-iteration lines in `iterations.jsonl` (the report is built from them), and what it
/// says of a recovery. Every method is a no-op on the other ranks.
#[derive(Debug)]
pub struct RankLog {
    rank: usize,
    iters: u64,
    dir: PathBuf,
    progress: Option<crate::progress::Progress>,
}

impl RankLog {
    /// The log of `rank` of a run of `iters` iterations writing under `dir`.
    pub fn new(rank: usize, iters: u64, dir: &Path) -> Self {
        RankLog { rank, iters, dir: dir.to_path_buf(), progress: None }
    }

    /// A generation starts stepping at `first_iter`: rank 0's progress bar.
    pub fn start(&mut self, first_iter: u64) {
        if self.rank == 0 {
            self.progress =
                Some(crate::progress::Progress::new("iter", first_iter - 1, self.iters, crate::progress::Mode::detect()));
        }
    }

    /// Iteration `iter` ended: rank 0 records `line` and shows `text` beside its progress.
    pub fn iteration(&self, iter: u64, line: &serde_json::Value, text: &str) -> Result<()> {
        if self.rank != 0 {
            return Ok(());
        }
        append_line(&self.dir, line)?;
        if let Some(p) = &self.progress {
            p.step(iter, text);
        }
        Ok(())
    }

    /// A recovery: rank 0 says it ([`say_recovery`]).
    pub fn recovered(&self, r: &ironweave::elastic::Recovery) -> Result<()> {
        if self.rank == 0 {
            say_recovery(r, &self.dir)?;
        }
        Ok(())
    }

    /// The generation stopped (done or failed): the bar ends.
    pub fn stop(&mut self) {
        if let Some(p) = self.progress.take() {
            p.finish();
        }
    }
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

/// A checkpoint strategy as the CLI names it: the engine's five, `capricorn-multilink`
/// (Capricorn whose chunks may take every link of the job), `capricorn-always` (Capricorn
/// profiling every iteration: the reference speculative activation is measured against), and
/// Gemini with a fill of its spans and a chunk size of its own (`gemini-fill0.8`,
/// `gemini-chunk1M`, `gemini-fill0.9-chunk4M`: the baseline tuned, not a straw man).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CkptChoice {
    pub strategy: Strategy,
    pub multilink: bool,
    pub always_profile: bool,
    /// Gemini's share of each profiled span (None: the whole span).
    pub gemini_fill: Option<f64>,
    /// Gemini's chunk size, bytes (None: sized from the spans).
    pub gemini_chunk: Option<u64>,
    /// `async-sustained`: Async skipping the iterations whose checkpoint would wait for the
    /// previous write (the interval its storage sustains).
    pub async_skip: bool,
    /// `capricorn-sparse[K]`: one snapshot every K iterations, a 1/K part replicated per
    /// iteration (`EngineConfig::spread_iters`; 1: every iteration, whole).
    pub spread: u64,
}

/// Names beyond the engine's five.
pub const VARIANTS: [&str; 5] =
    ["capricorn-multilink", "capricorn-always", "capricorn-sparse[K]", "async-sustained", "gemini-fillF-chunkSIZE"];

/// Iterations `capricorn-sparse` spreads a snapshot over when no K is given.
pub const SPARSE_DEFAULT: u64 = 4;

pub fn parse_strategy(s: &str) -> Result<CkptChoice> {
    let plain = |strategy| CkptChoice {
        strategy,
        multilink: false,
        always_profile: false,
        gemini_fill: None,
        gemini_chunk: None,
        async_skip: false,
        spread: 1,
    };
    Ok(match s {
        "capricorn-multilink" => CkptChoice { multilink: true, ..plain(Strategy::Capricorn) },
        _ if s.starts_with("capricorn-sparse") => {
            let k = &s["capricorn-sparse".len()..];
            let spread = if k.is_empty() {
                SPARSE_DEFAULT
            } else {
                k.parse::<u64>().ok().filter(|&k| (2..=1000).contains(&k)).ok_or_else(|| {
                    err!("--ckpt {s}: the part count K of capricorn-sparseK must be a whole number from 2 to 1000 (capricorn-sparse: {SPARSE_DEFAULT})")
                })?
            };
            CkptChoice { spread, ..plain(Strategy::Capricorn) }
        }
        "capricorn-always" => CkptChoice { always_profile: true, ..plain(Strategy::Capricorn) },
        "async-sustained" => CkptChoice { async_skip: true, ..plain(Strategy::Async) },
        _ if s.starts_with("gemini-") => {
            let mut c = plain(Strategy::Gemini);
            for part in s["gemini-".len()..].split('-') {
                if let Some(f) = part.strip_prefix("fill") {
                    let f: f64 = f.parse().map_err(|_| err!("--ckpt {s}: fill {f:?} is not a number"))?;
                    if !(f > 0.0 && f <= 1.0) {
                        bail!("--ckpt {s}: the fill must be in (0, 1]");
                    }
                    c.gemini_fill = Some(f);
                } else if let Some(b) = part.strip_prefix("chunk") {
                    let b = ironweave_units::parse_size(b).map_err(|e| err!("--ckpt {s}: {e}"))?;
                    if b == 0 {
                        bail!("--ckpt {s}: the chunk must be at least 1 byte");
                    }
                    c.gemini_chunk = Some(b);
                } else {
                    bail!(
                        "--ckpt {s}: Gemini takes fillF and chunkSIZE (gemini-fill0.8, gemini-chunk1M, gemini-fill0.9-chunk4M)"
                    );
                }
            }
            c
        }
        _ => plain(Strategy::parse(s).map_err(|e| err!("{e} (or {})", VARIANTS.join(", ")))?),
    })
}

/// What a tensor-parallel run's `report.json` holds (rank 0's view).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TpReport {
    pub config: String,
    pub schedule: String,
    /// The largest tensor-parallel degree (every sub-layer's when uniform).
    pub tp: usize,
    /// Each sub-layer's degree (one value: uniform).
    #[serde(default)]
    pub degrees: Vec<usize>,
    /// Data-parallel degree of the head.
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
    /// Seconds of each iteration outside the scheduled work (loss average, optimizer step).
    #[serde(default)]
    pub outside_s: Vec<f64>,
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
    /// Mean of `v` after two warm-up iterations.
    pub fn steady(v: &[f64]) -> f64 {
        Report::steady(v, 2)
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

/// A `tc` rate (`200mbit`, `10gbit`, `125mbps`) in bytes per second.
pub fn tc_rate_bytes(rate: &str) -> Result<f64> {
    let r = rate.trim().to_ascii_lowercase();
    let split = r.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(r.len());
    let (num, unit) = r.split_at(split);
    let v: f64 = num.parse().with_context(|| format!("rate {rate:?}: no number"))?;
    let bits = match unit {
        "bit" | "" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        "bps" => 8.0,
        "kbps" => 8e3,
        "mbps" => 8e6,
        "gbps" => 8e9,
        _ => bail!("rate {rate:?}: unknown unit {unit:?} (bit, kbit, mbit, gbit, bps, kbps, mbps, gbps)"),
    };
    Ok(v * bits / 8.0)
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
    /// Rank 0's compute per iteration (forward, backward, optimizer), seconds.
    #[serde(default)]
    pub compute_s: Vec<f64>,
    /// Seconds rank 0's compute waited for collectives, per iteration.
    #[serde(default)]
    pub wait_s: Vec<f64>,
    /// Seconds per iteration during which at least one of rank 0's collectives was on the wire.
    #[serde(default)]
    pub comm_busy_s: Vec<f64>,
    /// Seconds per iteration each of rank 0's lanes was busy: [all-rank group, host group,
    /// cross-host group].
    #[serde(default)]
    pub lane_busy_s: Vec<[f64; 3]>,
    /// The checkpoint strategy of the shards.
    #[serde(default)]
    pub ckpt: String,
    /// Recoveries (re-formations after a failure).
    #[serde(default)]
    pub recoveries: u64,
    /// The last iteration committed by the checkpoint engine.
    #[serde(default)]
    pub last_committed_iter: Option<u64>,
    /// SHA-256 over every rank's state digest (its shards and step), in rank order.
    #[serde(default)]
    pub final_state_sha256: String,
    /// CPU the ranks' communication threads used over the run, all ranks, ns
    /// (`ironweave_transport::threads::comm_cpu_ns`: collective threads, TCP readers and
    /// senders, striped lanes): on this bed every byte's CPU is paid on the training cores.
    #[serde(default)]
    pub comm_cpu_ns: u64,
    /// CPU every thread of the ranks' processes used over the run, all ranks, ns (the
    /// communication threads' CPU is a part of it).
    #[serde(default)]
    pub process_cpu_ns: u64,
    /// As in [`Report`] (the final digest is None when shards split the global tensors:
    /// `ironweave ckpt inspect` assembles them from the persistent tier).
    #[serde(flatten)]
    pub digests: Digests,
}

/// `--resume-from FROM` of a run reporting to `report_dir`: refused when it is that run's own
/// persistent tier (which a new run clears) or holds no complete checkpoint; says which
/// iteration it will load.
pub fn check_resume_from(from: &Path, report_dir: &Path) -> Result<()> {
    let (f, p) = (std::fs::canonicalize(from), std::fs::canonicalize(report_dir.join("persist")));
    if let (Ok(f), Ok(p)) = (f, p) {
        if f.starts_with(&p) {
            bail!(
                "--resume-from {}: that is this run's own persistent tier, which a new run clears; copy it elsewhere or give another --report-dir",
                from.display()
            );
        }
    }
    let (it, _) = ironweave::ckpt::persist::newest_complete(from).map_err(|e| err!("--resume-from {}: {e}", from.display()))?;
    eprintln!("ironweave train: resuming from {} iteration {it}", from.display());
    Ok(())
}

/// The layout-free digests `report.json` carries (train and sdp runs alike).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Digests {
    /// The final global state's (`ironweave::elastic::global_state_sha256`): equal across
    /// world sizes and layouts for the same tensors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_state_sha256: Option<String>,
    /// With `--resume-from`: the iteration loaded, the world size that wrote it, and the
    /// layout-free digest of the state as loaded (equal to the writer's `global_state_sha256`
    /// at that iteration when the load is exact).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from_iter: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from_world: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored_global_state_sha256: Option<String>,
}

impl Digests {
    /// The digests of a finished job whose final state is `bufs` (in its registered order;
    /// collective).
    pub fn of(done: &ironweave::elastic::Finished, bufs: &[&[u8]]) -> Result<Self> {
        let (resumed_from_iter, resumed_from_world, restored_global_state_sha256) =
            done.resumed().map_or((None, None, None), |r| (Some(r.iter), Some(r.written_by), r.global_sha256.clone()));
        Ok(Digests {
            global_state_sha256: done.global_state_sha256(bufs)?,
            resumed_from_iter,
            resumed_from_world,
            restored_global_state_sha256,
        })
    }
}

/// Median of `v` after `skip` warm-up entries (of all when too short).
pub fn median_after(v: &[f64], skip: usize) -> f64 {
    let mut s: Vec<f64> = if v.len() > skip { v[skip..].to_vec() } else { v.to_vec() };
    if s.is_empty() {
        return 0.0;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

impl CkptChoice {
    /// The checkpoint engine's settings of a training run's rank: chunks of 256 KiB, the
    /// persistent tier under `dir/persist` every `persist_every` iterations for the in-memory
    /// strategies (none for `none`), replicas on other hosts, profiling every iteration for
    /// `capricorn-always`.
    pub fn engine_config(&self, dir: &Path, persist_every: u64) -> EngineConfig {
        EngineConfig {
            strategy: self.strategy,
            chunk_bytes: 256 << 10,
            persist_dir: (self.strategy != Strategy::None).then(|| dir.join("persist")),
            persist_every: if matches!(self.strategy, Strategy::Gemini | Strategy::Capricorn) { persist_every } else { 0 },
            // replicas go to other hosts (the emulated cluster's, or real ones by hostname)
            host: ironweave_transport::rendezvous::host_name(),
            // always-on profiling: a threshold of 0 profiles every iteration
            drift_threshold: if self.always_profile { 0.0 } else { EngineConfig::default().drift_threshold },
            gemini_fill: self.gemini_fill.unwrap_or(1.0),
            gemini_chunk_bytes: self.gemini_chunk.unwrap_or(0),
            async_skip_busy: self.async_skip,
            spread_iters: self.spread,
            ..EngineConfig::default()
        }
    }
}

/// This rank of an elastic job of `iters` iterations under `ecfg` (the launcher exports the
/// backend `ironweave train --backend` named); rank 0 says the compute threads chosen.
pub fn join_job(
    iters: u64,
    ecfg: EngineConfig,
    links: ironweave::elastic::CheckpointLinks,
    resume_from: Option<&Path>,
) -> Result<ironweave::elastic::Job> {
    let mut cfg = ironweave::elastic::Config::new(iters, ecfg);
    cfg.checkpoint_links = links;
    cfg.resume_from = resume_from.map(Path::to_path_buf);
    let job = ironweave::elastic::Job::from_env(cfg)?;
    if let (0, Some(t)) = (job.rank(), job.threads()) {
        eprintln!("ironweave train: {t}");
    }
    Ok(job)
}

/// The `--fail` hook of a rank: when `armed`, it kills this process with SIGKILL at the start
/// of layer `layer`'s backward in iteration `iter` (mid-backward: its peers are inside
/// collectives with it).
pub fn kill_hook(armed: bool, rank: usize, iter: u64, layer: usize) -> Box<dyn Fn(u64, usize) + Send> {
    Box::new(move |it, l| {
        if armed && it == iter && l == layer {
            eprintln!("rank {rank}: --fail: killing myself with SIGKILL in the backward of iteration {iter}, layer {layer}");
            // SAFETY: kill(2) on our own pid with a valid signal number.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    })
}

/// What rank 0 says of a recovery (on stdout even with `--quiet`: a recovery is news) and
/// the marker `ironweave chaos` reads in `iterations.jsonl`.
pub fn say_recovery(r: &ironweave::elastic::Recovery, dir: &Path) -> Result<()> {
    use ironweave::elastic::RestoreSource;
    if r.source == RestoreSource::InitialState {
        println!("recovered: nothing was committed yet; every rank starts over from the initial state");
        return mark_recovery(dir, 0);
    }
    // an older iteration than one committed before: some rank's copies of the newer ones are
    // all gone (a rank died with its holders); said, not hidden, though training redoes them
    // to the same state
    if r.lost_committed() > 0 {
        eprintln!(
            "warning: iteration {} was committed but a rank's every copy of it is gone (a rank died with its replica holders; --replicas 3 keeps one more); restored iteration {}, {} committed iteration(s) to redo",
            r.committed_before.unwrap_or(0),
            r.iter,
            r.lost_committed()
        );
    }
    println!("recovered: every rank restored iteration {} (rank 0 from {})", r.iter, r.source.name());
    mark_recovery(dir, r.iter)
}

/// Runs an elastic job; a committed iteration that cannot be restored ends this process with
/// [`ironweave::elastic::EXIT_UNRECOVERABLE`] (rank 0 says what was lost), which the launcher
/// does not restart.
pub fn run_elastic<W: ironweave::elastic::Worker>(
    job: ironweave::elastic::Job,
    w: &mut W,
) -> Result<ironweave::elastic::Finished> {
    let rank = job.rank();
    match job.run(w) {
        Ok(done) => Ok(done),
        Err(e @ ironweave::elastic::Error::Unrecoverable { .. }) => {
            if rank == 0 {
                eprintln!("rank 0: cannot recover: {e}");
            }
            std::process::exit(e.exit_code());
        }
        Err(e @ ironweave::elastic::Error::Resume { .. }) => {
            // every rank says it: the one whose part failed names the tensor and the file
            eprintln!("rank {rank}: {e}");
            std::process::exit(e.exit_code());
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemini_can_be_tuned_by_name() {
        let c = parse_strategy("gemini-fill0.8-chunk1M").unwrap();
        assert_eq!((c.strategy, c.gemini_fill, c.gemini_chunk), (Strategy::Gemini, Some(0.8), Some(1 << 20)));
        let e = c.engine_config(Path::new("/tmp"), 10);
        assert_eq!((e.gemini_fill, e.gemini_chunk_bytes), (0.8, 1 << 20));
        assert_eq!(parse_strategy("gemini").unwrap().engine_config(Path::new("/tmp"), 1).gemini_fill, 1.0);
        for bad in ["gemini-fill0", "gemini-fill1.5", "gemini-chunk0", "gemini-speed9", "gemini-fillx"] {
            assert!(parse_strategy(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sparse_capricorn_names_its_part_count() {
        let e = |s: &str| parse_strategy(s).unwrap().engine_config(Path::new("/tmp"), 10);
        assert_eq!((e("capricorn-sparse").strategy, e("capricorn-sparse").spread_iters), (Strategy::Capricorn, SPARSE_DEFAULT));
        assert_eq!(e("capricorn-sparse8").spread_iters, 8);
        assert_eq!(e("capricorn").spread_iters, 1);
        for bad in ["capricorn-sparse1", "capricorn-sparse0", "capricorn-sparsex", "capricorn-sparse-4"] {
            let m = parse_strategy(bad).unwrap_err().to_string();
            assert!(m.contains("2 to 1000"), "{bad}: {m}");
        }
    }

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

//! `ironweave train`'s options ([`TrainArgs`], shared by the data-, tensor- and sharded-parallel
//! runs), the `--fail` and `--ckpt` syntax, and the training configuration's loading.

use std::path::{Path, PathBuf};

use ironweave::ckpt::engine::Strategy;
use ironweave::ckpt::EngineConfig;
use ironweave_train::data::Corpus;
use ironweave_train::TrainConfig;

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

/// How a run computes (`--compute`): the real math on this machine's cores, or emulated
/// accelerators ([`ironweave_train::emulated`]; docs/EMULATION.md).
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct ComputeArgs {
    /// cpu: the real math (candle) on this machine's cores. emulated: every layer's forward
    /// and backward waits the time --device takes for it while everything else stays real
    /// (collectives with the model's byte counts, state of the model's size, checkpoints,
    /// recovery). MoE (--routing), sharded (--sdp) and tensor-parallel (--tp) runs.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "emulated"])]
    pub compute: String,
    /// Device profile of emulated compute: a file (configs/devices/h100.toml) or a name
    /// (h100: configs/devices/h100.toml).
    #[arg(long)]
    pub device: Option<PathBuf>,
    /// Routing trace emulated compute replays for MoE layers (`ironweave train
    /// --record-routing FILE` of a model with the same MoE layers, experts, top-k and ranks;
    /// its counts are scaled to this model's tokens per rank). Dense models take none.
    #[arg(long, value_name = "FILE")]
    pub routing: Option<PathBuf>,
    /// Time dilation of emulated compute: every device operation lasts D times its published
    /// duration (an emulated bed divides its link rates by the same D, keeping their ratio).
    #[arg(long, default_value_t = 1.0)]
    pub dilation: f64,
}

impl Default for ComputeArgs {
    fn default() -> Self {
        ComputeArgs { compute: "cpu".into(), device: None, routing: None, dilation: 1.0 }
    }
}

impl ComputeArgs {
    /// Whether the math is emulated; refuses emulated options without `--compute emulated`,
    /// and `--compute emulated` without a device or a routing trace.
    pub fn emulated(&self) -> Result<bool> {
        match self.compute.as_str() {
            "cpu" => {
                if self.device.is_some() || self.routing.is_some() || self.dilation != 1.0 {
                    bail!("--device, --routing and --dilation are emulated compute's: add --compute emulated");
                }
                Ok(false)
            }
            "emulated" => {
                if self.device.is_none() {
                    bail!("--compute emulated needs --device (configs/devices/*.toml, or a name: a100, h100, h200)");
                }
                Ok(true)
            }
            other => bail!("--compute {other}: cpu or emulated"),
        }
    }

    /// The device profile's file: `--device` as given when it is a file, else
    /// `configs/devices/NAME.toml`.
    pub fn device_file(&self) -> Result<PathBuf> {
        let d = self.device.as_deref().ok_or_else(|| err!("--compute emulated needs --device"))?;
        if d.is_file() {
            return Ok(d.to_path_buf());
        }
        let by_name = Path::new("configs/devices").join(d).with_extension("toml");
        if d.components().count() == 1 && by_name.is_file() {
            return Ok(by_name);
        }
        let known: Vec<String> = std::fs::read_dir("configs/devices")
            .map(|rd| {
                rd.filter_map(|e| e.ok()).filter_map(|e| e.path().file_stem().map(|s| s.to_string_lossy().into_owned())).collect()
            })
            .unwrap_or_default();
        bail!(
            "--device {}: no such file, and no device of that name in configs/devices (known: {})",
            d.display(),
            if known.is_empty() { "none found from this directory".to_string() } else { known.join(", ") }
        )
    }

    /// Reads and checks the device profile and the routing trace for `cfg` on `world` ranks
    /// over `iters` iterations (`None`: cpu compute). Every error names the file.
    pub fn load(&self, cfg: &TrainConfig, world: usize, iters: u64) -> Result<Option<ironweave_train::emulated::Emulated>> {
        if !self.emulated()? {
            return Ok(None);
        }
        let file = self.device_file()?;
        let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        let device = ironweave_plan::DeviceDesc::from_toml_str(&text).with_context(|| format!("{}", file.display()))?;
        let trace = match self.routing.as_deref() {
            Some(tf) => {
                let text = std::fs::read_to_string(tf).with_context(|| format!("reading the routing trace {}", tf.display()))?;
                Some(ironweave_train::routing::RoutingTrace::from_json_str(&text, &tf.display().to_string())?)
            }
            None => None,
        };
        let what =
            self.routing.as_ref().map_or_else(|| "--compute emulated".to_string(), |t| format!("--routing {}", t.display()));
        let emu = ironweave_train::emulated::Emulated::new(cfg, world, &device, self.dilation, trace, iters, None)
            .with_context(|| format!("{what} on {}", cfg.name))?;
        Ok(Some(emu))
    }

    /// These options on a rank's command line.
    pub(crate) fn write(&self, argv: crate::Argv) -> crate::Argv {
        argv.opt("compute", &self.compute)
            .some("device", self.device.as_ref().map(|p| p.display()))
            .some("routing", self.routing.as_ref().map(|p| p.display()))
            .opt("dilation", self.dilation)
    }

    /// What a report and a table say of the mode: `cpu`, or `emulated NAME, dilation D`.
    pub fn describe(&self, emu: Option<&ironweave_train::emulated::Emulated>) -> String {
        match emu {
            Some(e) => format!("emulated {} (dilation {})", e.device.name(), e.dilation()),
            None => "cpu".into(),
        }
    }
}

impl ComputeArgs {
    /// [`ComputeArgs::load`] for a run launched from `file`, then refuses, before any rank
    /// starts, a bed whose state would not fit in this machine's memory: each of `ranks` ranks
    /// holds the parameters and Adam moments of the model split `shards` ways (1: the whole
    /// model, as a sharded or tensor-parallel rank builds it before keeping its part);
    /// `replicas` is the checkpoint's replica count, `None` when the run does not checkpoint.
    pub fn load_fitting(
        &self,
        file: &Path,
        cfg: &TrainConfig,
        ranks: usize,
        iters: u64,
        shards: usize,
        replicas: Option<u32>,
    ) -> Result<Option<ironweave_train::emulated::Emulated>> {
        let emu = self.load(cfg, ranks, iters)?;
        if let Some(emu) = &emu {
            let state = ironweave_train::emulated::state_bytes_per_rank(&emu.model, shards);
            check_memory(file, &cfg.name, ranks, state, replicas)?;
        }
        Ok(emu)
    }
}

/// Refuses an emulated bed whose ranks' state would not fit in this machine's memory, before
/// any rank starts: `state` bytes of parameters and Adam moments per rank, with gradients (a
/// third of it) and, when the run checkpoints (`replicas` is `Some`), the checkpoint engine's
/// snapshot buffers and, for each of `replicas - 1` peers, the replicas it keeps of them (at
/// most: the committed iteration, a newer one and the one arriving).
fn check_memory(file: &Path, model: &str, ranks: usize, state: f64, replicas: Option<u32>) -> Result<()> {
    let held = match replicas {
        None => 0.0,
        Some(r) => {
            ironweave_ckpt::SNAPSHOT_BUFFERS as f64
                + (r.max(1) - 1) as f64 * (ironweave_ckpt::engine::replicate::KEPT_REPLICAS + 1) as f64
        }
    };
    let held_what = match replicas {
        None => "no checkpoint".to_string(),
        Some(r) => format!("up to {} snapshots and the replicas of {} peer(s)", ironweave_ckpt::SNAPSHOT_BUFFERS, r.max(1) - 1),
    };
    let need = ranks as f64 * state * (1.0 + 1.0 / 3.0 + held);
    let avail = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        t.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .map(|kib| kib * 1024.0)
    });
    if let Some(avail) = avail {
        if need > 0.9 * avail {
            bail!(
                "{}: model `{model}` on {ranks} ranks needs about {:.1} GiB of host memory for emulated compute ({:.0} MiB of parameters and Adam moments per rank, with gradients, {held_what}), more than 90% of the {:.1} GiB available: lower [model] layers, hidden or experts, or run fewer ranks",
                file.display(),
                need / (1u64 << 30) as f64,
                state / (1u64 << 20) as f64,
                avail / (1u64 << 30) as f64
            );
        }
    }
    Ok(())
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
    /// Record which experts the router sent every rank's tokens to, per iteration and MoE layer,
    /// into this JSON file (`ironweave_train::routing::RoutingTrace`): the routing emulated
    /// compute replays. MoE runs (not `--tp`, `--sdp`) only.
    #[arg(long, value_name = "FILE")]
    pub record_routing: Option<PathBuf>,
    /// No progress bar or per-iteration lines (the summary is still printed).
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub compute: ComputeArgs,
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
            record_routing: None,
            quiet: false,
            compute: ComputeArgs::default(),
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

/// What every rank of an elastic training run is told, whatever the run: flattened into
/// `train-worker`'s [`WorkerArgs`](super::moe::WorkerArgs) and `sdp-worker`'s
/// [`SdpWorkerArgs`](super::sdp::SdpWorkerArgs), which each write it first.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct ElasticRankArgs {
    #[arg(long)]
    pub config: PathBuf,
    /// Checkpoint strategy (as `train --ckpt`).
    #[arg(long, default_value = "none")]
    pub ckpt: String,
    #[arg(long)]
    pub iters: Option<u64>,
    #[arg(long)]
    pub report_dir: PathBuf,
    /// Fault injection (as `train --fail`).
    #[arg(long)]
    pub fail: Option<String>,
    #[arg(long, default_value_t = 10)]
    pub persist_every: u64,
    /// Start from the newest complete checkpoint in this persistent tier (any layout).
    #[arg(long)]
    pub resume_from: Option<PathBuf>,
}

impl TrainArgs {
    /// What each rank of an elastic run of these options is told (the runs change what they
    /// must: `train` writes its ranks' `--fail`).
    pub fn rank_args(&self) -> ElasticRankArgs {
        ElasticRankArgs {
            config: self.config.clone(),
            ckpt: self.ckpt.clone(),
            iters: self.iters,
            report_dir: self.report_dir.clone(),
            fail: self.fail.clone(),
            persist_every: self.persist_every,
            resume_from: self.resume_from.clone(),
        }
    }
}

impl ElasticRankArgs {
    /// These options on a rank's command line, as clap parses them back.
    pub(crate) fn write(&self, argv: crate::Argv) -> crate::Argv {
        argv.opt("config", self.config.display())
            .opt("ckpt", &self.ckpt)
            .some("iters", self.iters)
            .opt("report-dir", self.report_dir.display())
            .some("fail", self.fail.as_ref())
            .opt("persist-every", self.persist_every)
            .some("resume-from", self.resume_from.as_ref().map(|p| p.display()))
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

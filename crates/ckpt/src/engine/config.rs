//! How an engine is set up: the [`Strategy`] and the [`EngineConfig`].

use super::*;

/// How checkpoints are taken (one engine, five strategies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// No checkpoints.
    None,
    /// Stop after the optimizer step and write to storage (torch.save-like).
    Blocking,
    /// Snapshot to host, write to storage in the background, no traffic control (TorchSnapshot-like).
    Async,
    /// In-memory replication; fixed-size chunks at the time offsets of idle spans profiled once.
    Gemini,
    /// In-memory replication; chunks sized to the predicted windows of each iteration, released
    /// when the communication before the window ends; re-profiling only on expert-load drift.
    #[default]
    Capricorn,
}

impl Strategy {
    /// All five, in table order.
    pub const ALL: [Strategy; 5] = [Strategy::None, Strategy::Blocking, Strategy::Async, Strategy::Gemini, Strategy::Capricorn];

    /// Name as in configs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::Blocking => "blocking",
            Strategy::Async => "async",
            Strategy::Gemini => "gemini",
            Strategy::Capricorn => "capricorn",
        }
    }
    /// Parse a name.
    pub fn parse(s: &str) -> Result<Self> {
        Strategy::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| CkptError::Invalid(format!("unknown strategy `{s}` (none, blocking, async, gemini, capricorn)")))
    }
    /// Whether snapshots are replicated to peers' memory (Gemini, Capricorn).
    pub fn in_memory(self) -> bool {
        matches!(self, Strategy::Gemini | Strategy::Capricorn)
    }
}

/// Engine settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Strategy.
    pub strategy: Strategy,
    /// Copies of each snapshot in host memory, including the rank's own (Gemini's m).
    pub replicas: u32,
    /// Bytes per replication message.
    pub chunk_bytes: u64,
    /// Bytes per checksum (small enough that hashing reads what the copy just left in cache).
    pub checksum_bytes: u64,
    /// Snapshot copy threads (0: all cores).
    pub copy_threads: usize,
    /// Persistent tier directory (none: memory only). Required by `blocking` and `async`.
    pub persist_dir: Option<PathBuf>,
    /// In-memory strategies: also write to the persistent tier every this many iterations (0: never).
    pub persist_every: u64,
    /// Bound on every wait of the engine.
    pub timeout: Duration,
    /// Index of the link checkpoint traffic shares with training (whose windows are used).
    pub link: u32,
    /// Bandwidth of that link for checkpoint traffic, bytes/s (e.g. from `ironweave cluster
    /// probe`); `None`: estimated from the engine's own transfers, bounded by the link's declared
    /// rate shared by the ranks of the host (see [`Engine::slot_rate`]).
    pub link_bytes_per_s: Option<f64>,
    /// Capricorn fills this fraction of a predicted window.
    pub window_fill: f64,
    /// Capricorn re-profiles when the drift of the smoothed expert load (EWMA, see
    /// `ironweave_profile::SpeculativeActivation`) since the last profiled iteration exceeds this
    /// (0: every iteration, the always-on reference).
    pub drift_threshold: f64,
    /// Gemini's fixed chunk size, bytes (0: sized from the profiled spans and the state, so
    /// that whole chunks fill the spans best without overfilling any).
    pub gemini_chunk_bytes: u64,
    /// Async skips an iteration's checkpoint while the previous write is still running,
    /// instead of waiting for it: it checkpoints at the interval its storage sustains (the
    /// training never blocks on the disk; a failure loses more iterations).
    pub async_skip_busy: bool,
    /// Gemini fills this fraction of each profiled span (1: the whole span, the paper's rule;
    /// a lower fill leaves room for the spans' variation, as Capricorn's `window_fill` does).
    pub gemini_fill: f64,
    /// Gemini profiles this many iterations at the start (the spans of the last one are
    /// used), then never again.
    pub gemini_profile_iters: u64,
    /// Windows shorter than this are ignored, ns.
    pub min_window_ns: u64,
    /// Which host this rank runs on (any string equal on the ranks of one host and different
    /// between hosts: `ironweave_transport::rendezvous::host_name()`); replicas go to other
    /// hosts when there are several. Empty on every rank: one host.
    pub host: String,
    /// Further links (transport link indices) Capricorn may route chunks over besides `link`
    /// (each chunk takes the link whose predicted window opens first; beyond the paper).
    /// Ignored by the other strategies.
    pub extra_links: Vec<u32>,
    /// Bandwidth of the persistent tier for this rank, bytes/s, enforced by a token bucket in
    /// the writer (emulated remote storage: a host's share of a file system); `None`: as fast
    /// as the local disk goes.
    pub storage_bytes_per_s: Option<f64>,
    /// Capricorn replicates one snapshot over this many iterations, a `1/spread_iters` part
    /// per iteration, and takes the next snapshot when the last part has gone (1: a snapshot
    /// every iteration, whole). Fewer bytes per iteration; a recovery restores the newest
    /// complete snapshot and replays the iterations since (up to `2 * spread_iters - 1`),
    /// which is bit-identical because training is deterministic. Ignored by the other
    /// strategies.
    pub spread_iters: u64,
    /// The parallel layout this rank's state belongs to (`world`, `kind`, degrees: names of the
    /// trainer's choosing), written into every manifest of the persistent tier.
    pub layout: std::collections::BTreeMap<String, String>,
    /// The job this state belongs to, written into every manifest of the persistent tier:
    /// recovery takes only this job's files, so a new job that reuses a directory never
    /// restores an old job's iteration. None: the launcher's id from the environment
    /// (`ironweave_transport::rendezvous::job_id_from_env`: unique per `ironweave launch`,
    /// torchrun's `--rdzv-id`, the SLURM job), the same in a restarted process.
    pub job_id: Option<String>,
    /// Recovery may also take files another job wrote into `persist_dir`: set it to continue an
    /// earlier job from its persistent tier (off: those files are passed over and named in
    /// the `NothingToRestore` error).
    pub restore_other_jobs: bool,
    /// A directory in memory that outlives the process (tmpfs: `/dev/shm/...`), for launchers
    /// that restart every process of the job when one fails (torchrun). After each commit the
    /// rank copies its own snapshot of the committed iteration and the replicas it holds of it
    /// there (under `holder-RANK/`, in the persistent tier's format); a new engine of the same
    /// job and rank adopts them, so recovery finds them as if the process had lived on. The two
    /// newest committed iterations are kept (a rank may die before its newest copy is whole).
    /// None: memory only, lost with the process.
    pub keep_dir: Option<PathBuf>,
    /// The key every copy written to `keep_dir` (and the persistent tier) carries a MAC under,
    /// and every kept copy is checked against before it is adopted (the Python package and
    /// `ironweave::checkpointer` use a random key kept 0600 beside the copies). None: no MAC
    /// (the keep directory's owner and mode are all that vouch for what is read back).
    #[serde(skip)]
    pub mac_key: Option<persist::MacKey>,
}

impl EngineConfig {
    /// The job id the engine writes and adopts by: [`EngineConfig::job_id`], else the
    /// launcher's or one derived for this launch (collective: every rank builds its engine
    /// together), never an id another job shares.
    pub fn resolved_job_id(&self, comm: &Communicator) -> Result<String> {
        match &self.job_id {
            Some(j) => Ok(j.clone()),
            None => Ok(ironweave_transport::unique_job_id(comm, &ironweave_transport::rendezvous::job_id_from_env())?),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            strategy: Strategy::Capricorn,
            replicas: 2,
            chunk_bytes: 4 << 20,
            checksum_bytes: 256 << 10,
            copy_threads: 0,
            persist_dir: None,
            persist_every: 0,
            timeout: Duration::from_secs(300),
            link: 0,
            link_bytes_per_s: None,
            window_fill: 0.9,
            drift_threshold: 0.3,
            gemini_chunk_bytes: 0,
            gemini_fill: 1.0,
            async_skip_busy: false,
            gemini_profile_iters: 3,
            min_window_ns: 50_000,
            host: String::new(),
            extra_links: Vec::new(),
            storage_bytes_per_s: None,
            spread_iters: 1,
            layout: Default::default(),
            job_id: None,
            restore_other_jobs: false,
            keep_dir: None,
            mac_key: None,
        }
    }
}

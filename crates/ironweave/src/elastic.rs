//! In-job recovery: a training loop that survives a rank's death without losing what the
//! other ranks hold in memory.
//!
//! The user supplies a [`Worker`] (its state as named byte buffers, how to restore it, one
//! training step) and a [`Config`] (iterations, the checkpoint engine's settings); [`Job::run`]
//! owns everything else:
//!
//! - **generations**: the job's processes form generation `g` on the launcher's port `+ g`
//!   (`IRONWEAVE_GENERATION` tells a restarted process which one it joins). Under `ironweave
//!   launch` every process announces the generation it goes to on the job's board
//!   ([`ironweave_transport::board`]) and a rank waiting to form an older one gives it up for
//!   the newest: ranks that die moments apart never leave two generations waiting on each
//!   other, a second registration of a rank is its newer process replacing the older one, and
//!   a rank restarted after the job finished leaves at once ([`Error::JobFinished`]);
//! - **failure detection**: any error of a step, a checkpoint or a commit (a peer lost, a
//!   deadline passed) ends the generation on this rank; its peers see the same through their
//!   own typed transport errors;
//! - **re-formation**: the survivors form the next generation with the restarted ranks and
//!   keep their memory (the checkpoint engine is rebound to the new communicator, not rebuilt),
//!   retrying a formation whose peers cannot be reached yet (a link still down, a rank still
//!   restarting) up to [`Config::reform_attempts`] times;
//! - **the restore choice**: every rank restores the newest iteration every rank still has,
//!   from its own memory, the replica a peer holds of it, or the persistent tier (only files
//!   this job wrote: [`ironweave_ckpt::EngineConfig::job_id`]) ([`RestoreSource`]), and the
//!   worker's state after the restore is checked against what it restored; a job that never
//!   committed starts over from the initial state, or from its [`Config::resume_from`]
//!   checkpoint when it resumed;
//! - **the "cannot recover" outcome**: an iteration that was committed and whose every copy is
//!   gone ends the job with [`Error::Unrecoverable`] (exit status [`EXIT_UNRECOVERABLE`], which
//!   `ironweave launch` does not restart), instead of re-forming until a deadline;
//! - **deadlines**: every wait of the transport and the engine has [`Config::timeout`].
//!
//! It runs under `ironweave launch --max-restarts N`, torchrun, srun and mpirun alike: the
//! rank, world and rendezvous come from [`JobEnv::from_env`].
//!
//! ```
//! use ironweave::ckpt::{DType, EngineConfig, Snapshot, TensorSpec};
//! use ironweave::elastic::{BoxError, Config, Generation, Job, Step, StepContext, Worker};
//!
//! /// A model of one vector, trained data parallel.
//! struct Fit { w: Vec<f32>, step: [u8; 8] }
//!
//! impl Worker for Fit {
//!     type Output = f32;
//!     fn state_specs(&self) -> Vec<TensorSpec> {
//!         vec![TensorSpec::new("w", DType::F32, &[self.w.len() as u64]), TensorSpec::new("step", DType::I64, &[])]
//!     }
//!     fn join(&mut self, _g: &Generation<'_>) -> Result<(), BoxError> {
//!         Ok(()) // a model that keeps its communicator takes the new one here
//!     }
//!     fn state(&self) -> Vec<&[u8]> {
//!         vec![bytemuck::cast_slice(&self.w), &self.step]
//!     }
//!     fn restore(&mut self, s: &Snapshot) -> Result<(), BoxError> {
//!         let w = s.tensor("w").ok_or("no `w` in the checkpoint")?;
//!         self.w = w.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
//!         Ok(())
//!     }
//!     fn start_over(&mut self) -> Result<(), BoxError> {
//!         self.w.iter_mut().for_each(|x| *x = 0.0);
//!         Ok(())
//!     }
//!     fn step(&mut self, it: u64, cx: &StepContext<'_>) -> Result<Step<f32>, BoxError> {
//!         let mut g: Vec<f32> = self.w.iter().map(|w| w - 1.0).collect();
//!         cx.comm.all_reduce(&mut g, ironweave::ReduceOp::Avg)?;
//!         self.w.iter_mut().zip(&g).for_each(|(w, g)| *w -= 0.1 * g);
//!         self.step = (it as i64).to_le_bytes();
//!         Ok(Step::new(g.iter().map(|x| x * x).sum()))
//!     }
//! }
//!
//! # // a job of one rank, as `ironweave launch -n 1` would describe it
//! # let port = ironweave::transport::rendezvous::free_base_port(ironweave::transport::rendezvous::RENDEZVOUS_SPAN)?;
//! # for (k, v) in [("IRONWEAVE_RANK", "0"), ("IRONWEAVE_WORLD_SIZE", "1"), ("IRONWEAVE_MASTER_ADDR", "127.0.0.1")] {
//! #     std::env::set_var(k, v);
//! # }
//! # std::env::set_var("IRONWEAVE_MASTER_PORT", port.to_string());
//! let job = Job::from_env(Config::new(20, EngineConfig::default()))?;
//! let done = job.run(&mut Fit { w: vec![0.0; 1024], step: [0; 8] })?;
//! println!("restored {} times; last committed {:?}", done.recoveries(), done.last_committed());
//! done.shutdown()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use ironweave_ckpt::engine::IterationReport;
use ironweave_ckpt::{CkptError, Engine, EngineConfig, Registry, Snapshot, Source, TensorSpec};
use ironweave_profile::{ExpertLoad, MonotonicClock, Profiler};
use ironweave_transport::board::{Board, CommitRecord};
use ironweave_transport::rendezvous::JobEnv;
use ironweave_transport::threads::ThreadChoice;
use ironweave_transport::{CommOptions, Communicator, ReduceOp};

use crate::Backend;

/// The exit status of a rank that ends the job because a committed iteration cannot be
/// restored: `ironweave launch` does not restart it (a restart would find the same copies
/// missing).
pub const EXIT_UNRECOVERABLE: i32 = 75;

/// What a [`Worker`]'s methods may fail with: any error (`?` converts one).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The job could not be joined, or a generation could not be formed.
    #[error(transparent)]
    Transport(#[from] ironweave_transport::Error),
    /// The checkpoint engine could not be set up or shut down.
    #[error(transparent)]
    Ckpt(#[from] CkptError),
    /// An iteration was committed and every copy of it is gone (a rank died with every holder
    /// of its replicas before the persistent tier had it): no re-formation brings it back.
    #[error("iteration {committed} was committed and every copy of it is gone (more replicas, `EngineConfig::replicas`, or a more frequent persistent tier keep one): {source}")]
    Unrecoverable {
        /// The newest iteration any rank saw committed.
        committed: u64,
        /// What the restore found.
        source: CkptError,
    },
    /// The checkpoint [`Config::resume_from`] names could not be loaded onto this job's layout
    /// (on some rank: every rank ends with this, no generation starts).
    #[error("cannot resume from {}: {detail}", dir.display())]
    Resume {
        /// The directory.
        dir: std::path::PathBuf,
        /// What went wrong (this rank's error, or which rank failed).
        detail: String,
    },
    /// Generations kept failing.
    #[error("gave up after {reformations} re-formations; the last generation failed with: {last}")]
    GaveUp {
        /// Re-formations tried.
        reformations: u32,
        /// The last generation's failure.
        last: BoxError,
    },
    /// The worker refused its first generation (a configuration it cannot run).
    #[error(transparent)]
    Worker(BoxError),
    /// A rank's state does not match the registered layout (or rank 0's): a key missing or
    /// added, another dtype or shape.
    #[error("state mismatch on rank {rank}: `{key}` is {actual}, expected {expected}; every rank must hand over the state it registered (the same keys, dtypes and shapes)")]
    StateMismatch {
        /// The rank whose state differs.
        rank: usize,
        /// The first key that differs.
        key: String,
        /// What was expected.
        expected: String,
        /// What was found.
        actual: String,
    },
    /// A rank refused (an error in its state or its arguments, agreed on by every rank before
    /// anything was snapshot): every rank returns it.
    #[error("rank {rank} refused: {detail}")]
    Refused {
        /// The rank that refused.
        rank: usize,
        /// Its error.
        detail: String,
    },
    /// This process was started (or restarted) after every rank of the job passed its final
    /// barrier: there is nothing left to do (exit status 0).
    #[error("the job finished before this process could join it (every rank had passed the final barrier): nothing to do")]
    JobFinished,
}

impl Error {
    /// The exit status a rank should end with: [`EXIT_UNRECOVERABLE`] for
    /// [`Error::Unrecoverable`] and [`Error::Resume`], [`EXIT_BOARD`] for a job board that
    /// cannot be written, 0 for [`Error::JobFinished`], 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::JobFinished => 0,
            // a restart would meet the same copies (or the same files) again
            Error::Unrecoverable { .. } | Error::Resume { .. } => EXIT_UNRECOVERABLE,
            Error::Transport(ironweave_transport::Error::Board { .. }) => EXIT_BOARD,
            _ => 1,
        }
    }

    /// Whether no re-formation can help: the job ends on every rank.
    fn is_final(&self) -> bool {
        matches!(
            self,
            Error::Unrecoverable { .. } | Error::Resume { .. } | Error::Transport(ironweave_transport::Error::Board { .. })
        )
    }
}

/// The exit status of a rank that could not write the job's board or commit record (a full or
/// read-only file system): `ironweave launch` reports the board's path and free space and
/// does not restart the job (sysexits' `EX_IOERR`).
pub const EXIT_BOARD: i32 = 74;

/// Result of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which links carry checkpoint chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CheckpointLinks {
    /// The training link only (link 0).
    #[default]
    Training,
    /// Every link of the job: training stays on the first, chunks may take the others too
    /// (the job must have two or more).
    All,
}

/// How a [`Job`] runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The checkpoint engine's settings (strategy, replicas, persistent tier, ...).
    pub engine: EngineConfig,
    /// Iterations of the whole job (1-based; a restored job continues after the restored one).
    pub iterations: u64,
    /// Every wait's deadline (formation, collectives, the engine's messages).
    pub timeout: Duration,
    /// Generations a process may form after its first before it gives up.
    pub max_reformations: u32,
    /// Tries at forming one generation when its peers cannot be reached yet.
    pub reform_attempts: u32,
    /// Links that carry checkpoint chunks.
    pub checkpoint_links: CheckpointLinks,
    /// The backend (default: `IRONWEAVE_BACKEND`, else TCP).
    pub backend: Option<Backend>,
    /// Set the compute threads of this process from its share of the host's cores before any
    /// thread pool exists (see [`ironweave_transport::threads`]); on by default.
    pub set_threads: bool,
    /// Start the job's first generation from the newest complete checkpoint in this directory
    /// (a persistent tier: `<report dir>/persist`), whatever world size and layout wrote it —
    /// every tensor the worker registers must name its global slice
    /// ([`ironweave_ckpt::GlobalSlice`]). None: start from the worker's initial state.
    pub resume_from: Option<std::path::PathBuf>,
}

/// Default [`Config::max_reformations`].
pub const MAX_REFORMATIONS: u32 = 8;
/// Default [`Config::reform_attempts`].
pub const REFORM_ATTEMPTS: u32 = 8;

impl Config {
    /// `iterations` under `engine`, with every wait's deadline from `IRONWEAVE_TIMEOUT_S`
    /// (default 60 s; it replaces `engine.timeout` too) and the other settings at their
    /// defaults.
    pub fn new(iterations: u64, engine: EngineConfig) -> Config {
        // the transport's own reading of the variable (a malformed one is refused by
        // `Job::from_env`); unset, a minute rather than the transport's default
        let timeout = match std::env::var_os("IRONWEAVE_TIMEOUT_S") {
            Some(_) => CommOptions::from_env().map_or(Duration::from_secs(60), |o| o.timeout),
            None => Duration::from_secs(60),
        };
        Config {
            engine: EngineConfig { timeout, ..engine },
            iterations,
            timeout,
            max_reformations: MAX_REFORMATIONS,
            reform_attempts: REFORM_ATTEMPTS,
            checkpoint_links: CheckpointLinks::Training,
            backend: None,
            set_threads: true,
            resume_from: None,
        }
    }
}

/// One generation of the job, as a [`Worker`] joins it.
#[derive(Debug)]
pub struct Generation<'a> {
    /// The job's communicator of this generation (new in each).
    pub comm: &'a Arc<Communicator>,
    /// The generation's number (0: the job's first).
    pub number: u16,
    /// Whether this process formed no generation before (it starts from its initial state or
    /// was restarted by the launcher).
    pub fresh_process: bool,
}

/// What a step may use besides its own state.
#[derive(Debug)]
pub struct StepContext<'a> {
    /// The job's communicator.
    pub comm: &'a Arc<Communicator>,
    /// The checkpoint engine's profiler: time layers and record training communication in it
    /// so the engine can place its chunks in the link's idle windows (optional).
    pub profiler: &'a Arc<Profiler<MonotonicClock>>,
}

/// Where a rank's state came from in a recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RestoreSource {
    /// Its own snapshot in its memory (a survivor).
    OwnMemory,
    /// The replica a peer held of it (from that rank).
    Peer(usize),
    /// The persistent tier.
    Persistent,
    /// Nothing was committed yet: it started over from the initial state.
    InitialState,
    /// Nothing was committed since the job resumed ([`Config::resume_from`]): it loaded that
    /// checkpoint again.
    Resumed,
}

impl RestoreSource {
    /// Its name in reports: `own memory`, `peer`, `persistent`, `initial state`, `resumed
    /// checkpoint`.
    pub fn name(self) -> &'static str {
        match self {
            RestoreSource::OwnMemory => "own memory",
            RestoreSource::Peer(_) => "peer",
            RestoreSource::Persistent => "persistent",
            RestoreSource::InitialState => "initial state",
            RestoreSource::Resumed => "resumed checkpoint",
        }
    }

    fn code(s: Option<RestoreSource>) -> u8 {
        match s {
            None => 0,
            Some(RestoreSource::OwnMemory) => 1,
            Some(RestoreSource::Peer(_)) => 2,
            Some(RestoreSource::Persistent) => 3,
            Some(RestoreSource::InitialState) => 4,
            Some(RestoreSource::Resumed) => 5,
        }
    }

    fn from_code(c: u8) -> Option<RestoreSource> {
        match c {
            1 => Some(RestoreSource::OwnMemory),
            // the peer's rank does not travel in the one-byte summary
            2 => Some(RestoreSource::Peer(usize::MAX)),
            3 => Some(RestoreSource::Persistent),
            4 => Some(RestoreSource::InitialState),
            5 => Some(RestoreSource::Resumed),
            _ => None,
        }
    }
}

impl From<Source> for RestoreSource {
    fn from(s: Source) -> Self {
        match s {
            Source::Local => RestoreSource::OwnMemory,
            Source::Peer(r) => RestoreSource::Peer(r),
            Source::Persistent => RestoreSource::Persistent,
        }
    }
}

/// A recovery, as every rank saw it (the restore is collective).
#[derive(Debug, Clone)]
pub struct Recovery {
    /// The iteration restored (0: the initial state; the resumed iteration when it loaded the
    /// job's [`Config::resume_from`] again).
    pub iter: u64,
    /// Where this rank's state came from.
    pub source: RestoreSource,
    /// The newest iteration any rank saw committed before the failure (None: nothing).
    pub committed_before: Option<u64>,
    /// The generation that restored.
    pub generation: u16,
}

impl Recovery {
    /// Committed iterations that are redone: an older iteration than one committed before the
    /// failure was restored because a rank lost every copy of the newer ones.
    pub fn lost_committed(&self) -> u64 {
        self.committed_before.map_or(0, |c| c.saturating_sub(self.iter))
    }
}

/// What one step returns: the expert load it saw (MoE models: the engine re-profiles when it
/// drifts) and the worker's own output (loss, timings), handed to [`Worker::on_iteration`].
#[derive(Debug, Clone)]
pub struct Step<O> {
    /// Tokens routed to each expert of each MoE layer (None: a dense model).
    pub expert_load: Option<ExpertLoad>,
    /// The worker's output.
    pub output: O,
}

impl<O> Step<O> {
    /// A step of a dense model.
    pub fn new(output: O) -> Self {
        Step { expert_load: None, output }
    }
}

/// One finished iteration, as [`Worker::on_iteration`] sees it.
#[derive(Debug)]
pub struct Iteration<'a, O> {
    /// The iteration (1-based).
    pub iter: u64,
    /// What the step returned.
    pub output: &'a O,
    /// Wall time of step, checkpoint and commit.
    pub elapsed: Duration,
    /// The newest iteration committed on every replica, as this rank knows it.
    pub committed: Option<u64>,
    /// What the checkpoint engine did in the iteration (exposed time, chunks in windows, ...).
    pub ckpt: &'a IterationReport,
    /// The job's communicator.
    pub comm: &'a Arc<Communicator>,
}

/// A rank's training: its state as named buffers and one step at a time. [`Job::run`] calls
/// [`Worker::join`] at each generation, then restores (after a failure) and steps.
pub trait Worker {
    /// What a step returns besides the expert load (a loss, timings).
    type Output;

    /// Joins a generation: keep the communicator. Called before any restore of that
    /// generation. A restarted process joins a later generation while its peers rejoin with
    /// their state in memory: any collective here must be one that both run (a restarted
    /// process that broadcasts its initial state would wait for peers that do not).
    fn join(&mut self, generation: &Generation<'_>) -> Result<(), BoxError>;

    /// The layout of the state checkpointed every iteration (called once, after the first
    /// [`Worker::join`]; it must not change).
    fn state_specs(&self) -> Vec<TensorSpec>;

    /// The state as buffers, in [`Worker::state_specs`] order (copied into a snapshot at once).
    fn state(&self) -> Vec<&[u8]>;

    /// Loads the state from a restored snapshot (tensors by name, as registered).
    fn restore(&mut self, snapshot: &Snapshot) -> Result<(), BoxError>;

    /// The state as the model holds it, in [`Worker::state_specs`] order, for the check after
    /// a restore (the state must equal what was restored). Default: [`Worker::state`]. A worker
    /// whose `state` reads copies beside the model (the candle adapter's host copies) returns
    /// the model's own values here (`candle::Trainer::state_from_variables`), so a restore that
    /// never reached the model is refused instead of training on.
    fn restored_state(&self) -> Result<Vec<Vec<u8>>, BoxError> {
        Ok(self.state().into_iter().map(<[u8]>::to_vec).collect())
    }

    /// Goes back to the initial state (a failure before anything was committed: every rank
    /// starts over, so training must be deterministic from it).
    fn start_over(&mut self) -> Result<(), BoxError>;

    /// Runs iteration `iter` (the state afterwards is iteration `iter`'s).
    fn step(&mut self, iter: u64, cx: &StepContext<'_>) -> Result<Step<Self::Output>, BoxError>;

    /// Called when a generation starts stepping at `first_iter` (a progress bar starts here).
    fn on_start(&mut self, _first_iter: u64, _comm: &Arc<Communicator>) -> Result<(), BoxError> {
        Ok(())
    }

    /// Called after each iteration's checkpoint and commit.
    fn on_iteration(&mut self, _it: &Iteration<'_, Self::Output>) -> Result<(), BoxError> {
        Ok(())
    }

    /// Called on every rank after a restore, before the first step of the generation.
    fn on_recovery(&mut self, _r: &Recovery, _comm: &Arc<Communicator>) -> Result<(), BoxError> {
        Ok(())
    }

    /// Called when a generation ends, by failure or because the last iteration ran.
    fn on_stop(&mut self) {}

    /// The parallel layout of this rank's state (free-form names: `world`, `kind`, degrees),
    /// written into the persistent tier's manifests; called after [`Worker::join`].
    fn layout(&self) -> std::collections::BTreeMap<String, String> {
        Default::default()
    }
}

/// A job started from another job's checkpoint ([`Config::resume_from`]).
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The directory.
    pub dir: std::path::PathBuf,
    /// The iteration loaded; the job continues after it.
    pub iter: u64,
    /// The world size that wrote it.
    pub written_by: u32,
    /// The layout-free digest of the loaded global state ([`global_state_sha256`]; rank 0
    /// only, and only when every global tensor is whole on one rank).
    pub global_sha256: Option<String>,
}

/// A rank of an elastic job: joined from the environment, run with [`Job::run`].
#[derive(Debug)]
pub struct Job {
    cfg: Config,
    env: JobEnv,
    backend: Backend,
    start_gen: u16,
    threads: Option<ThreadChoice>,
}

impl Job {
    /// This rank of the job its launcher described (`ironweave launch`, torchrun, srun,
    /// mpirun): rank, world and rendezvous from the environment, the generation from
    /// `IRONWEAVE_GENERATION` (0 when unset: the job's first), the backend from
    /// `IRONWEAVE_BACKEND` unless `cfg.backend` names one. Sets the compute threads when
    /// `cfg.set_threads`; call it before any thread pool exists.
    pub fn from_env(cfg: Config) -> Result<Job> {
        let env = JobEnv::from_env()?;
        // a malformed IRONWEAVE_TIMEOUT_S is refused here, not silently replaced
        if std::env::var_os("IRONWEAVE_TIMEOUT_S").is_some() {
            CommOptions::from_env()?;
        }
        Job::new(cfg, env)
    }

    /// This rank of the job `env` describes (it joins generation `env.generation` first: 0, the
    /// job's first; above, a restarted process) — for a caller that has its own launcher or
    /// runs ranks as threads. [`Job::from_env`] reads `env` from the environment.
    pub fn new(cfg: Config, env: JobEnv) -> Result<Job> {
        let threads = if cfg.set_threads { ironweave_transport::threads::apply_to_process(env.local_world_size)? } else { None };
        let backend = match cfg.backend {
            Some(b) => b,
            None => Backend::from_env()?,
        };
        let start_gen = env.generation;
        Ok(Job { cfg, env, backend, start_gen, threads })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.env.rank
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    /// The generation this process joins first (above 0: the launcher restarted it).
    pub fn generation(&self) -> u16 {
        self.start_gen
    }

    /// The compute threads chosen for this process, if [`Job::from_env`] set them.
    pub fn threads(&self) -> Option<&ThreadChoice> {
        self.threads.as_ref()
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Forms generation `gen`, retrying while its peers cannot be reached yet (only a
    /// re-formation of the job retries — a restarted process's first one included: the job's
    /// very first formation that fails exits, and the launcher restarts it as a later
    /// generation).
    /// Under a launcher's job board a wait gives up as soon as a newer generation is announced
    /// there (`ironweave_transport::Error::Superseded`: the caller goes to it).
    fn form(&self, gen: u16, first: bool) -> Result<Arc<Communicator>> {
        let mut env = self.env.clone();
        // inside the span of ports the launcher found free, however often the job re-forms
        env.master.set_port(ironweave_transport::rendezvous::generation_port(self.env.master.port(), gen)?);
        env.job_id = format!("{}-g{gen}", self.env.job_id);
        env.generation = gen;
        let opts = CommOptions { timeout: self.cfg.timeout, ..CommOptions::default() };
        let mut attempt = 0;
        loop {
            if let Some(e) = env.superseded() {
                return Err(e.into());
            }
            match crate::connect(self.backend, &env, opts.clone()) {
                Ok(c) => return Ok(Arc::new(c)),
                Err(err @ ironweave_transport::Error::Superseded { .. }) => return Err(err.into()),
                Err(err) if (gen > 0 || !first) && attempt < self.cfg.reform_attempts && err.is_transient() => {
                    attempt += 1;
                    eprintln!(
                        "rank {}: re-forming generation {gen} failed: {err}; trying again ({attempt} of {})",
                        self.env.rank, self.cfg.reform_attempts
                    );
                }
                Err(err) => return Err(err.into()),
            }
        }
    }

    /// Runs `worker` to [`Config::iterations`], checkpointing every iteration and recovering
    /// from failures as the module documentation says. Returns when every rank has run the
    /// last iteration; [`Finished`] holds the engine for the final report.
    pub fn run<W: Worker>(self, worker: &mut W) -> Result<Finished> {
        let rank = self.env.rank;
        let board = self.env.board.clone();
        if board.as_ref().is_some_and(Board::finished) {
            // restarted after every rank passed the final barrier: nobody will come
            return Err(Error::JobFinished);
        }
        // A restarted process goes past every generation announced so far: its previous
        // incarnation may have registered in any of them before it died, and a generation with
        // that stale registration in it can never form (its members give it up when they see
        // this announcement). A process of the job's first start joins the newest one.
        let announced = board.as_ref().and_then(Board::generation);
        let mut gen = match (self.start_gen, announced) {
            (0, a) => a.unwrap_or(0),
            (g, a) => g.max(a.map_or(0, |a| a.saturating_add(1))),
        };
        announce(&board, gen)?;
        let mut engine: Option<Engine> = None;
        // the job's memory of its commits, outside its processes (set with the engine)
        let mut record: Option<CommitRecord> = None;
        let mut recorded: Option<u64> = None;
        // a restarted process (a later generation) restores; the job's first generation starts
        let mut need_restore = gen > 0;
        let mut recoveries = 0u64;
        let mut last_source: Option<RestoreSource> = None;
        let mut fresh = true;
        let mut failures = 0u32;
        let mut resumed: Option<Resumed> = None;
        loop {
            let comm = match self.form(gen, fresh) {
                Ok(c) => c,
                Err(Error::Transport(ironweave_transport::Error::Superseded { by: Some(newer), .. })) if newer > gen => {
                    // ranks failed or restarted while this one waited: every rank meets in the
                    // newest generation (never two generations waiting on each other)
                    eprintln!("rank {rank}: generation {gen} was given up for generation {newer}, announced on the job board");
                    gen = newer;
                    need_restore = true;
                    continue;
                }
                Err(Error::Transport(ironweave_transport::Error::Superseded { by: None, .. })) => return Err(Error::JobFinished),
                Err(e) => return Err(e),
            };
            let joined = worker.join(&Generation { comm: &comm, number: gen, fresh_process: fresh });
            let joined = match (fresh, joined) {
                // a worker that cannot take its first generation (a configuration it refuses)
                // would refuse every later one too
                (true, Err(err)) => return Err(Error::Worker(err)),
                (_, j) => j,
            };
            fresh = false;
            let r = match joined {
                Ok(()) => {
                    match engine.as_mut() {
                        Some(e) => e.rebind(comm.clone())?,
                        None => {
                            let mut ecfg = self.engine_config(&comm)?;
                            ecfg.layout = worker.layout();
                            // the job's id: a restarted process finds its own files in the
                            // persistent tier, never another job's
                            let id = match ecfg.job_id.clone() {
                                Some(id) => id,
                                None => self.job_identity(&comm, gen)?,
                            };
                            ecfg.job_id = Some(id.clone());
                            record = self.commit_record(&id)?;
                            engine = Some(Engine::new(comm.clone(), Registry::new(&worker.state_specs())?, ecfg)?);
                        }
                    }
                    let e = engine.as_mut().expect("set above");
                    (|| -> Result<(), BoxError> {
                        let mut start = 1;
                        if let (false, Some(dir), None) = (need_restore, &self.cfg.resume_from, &resumed) {
                            let r = resume(e, worker, dir)?;
                            start = r.iter + 1;
                            resumed = Some(r);
                        }
                        if need_restore {
                            let rec = restore(e, worker, gen, self.cfg.resume_from.as_deref(), &mut resumed, record.as_ref())?;
                            // the restored iteration is the committed one from here on
                            let ours = !matches!(rec.source, RestoreSource::InitialState | RestoreSource::Resumed);
                            record_commit(&record, &mut recorded, rank, ours.then_some(rec.iter))?;
                            recoveries += 1;
                            last_source = Some(rec.source);
                            start = rec.iter + 1;
                            worker.on_recovery(&rec, &comm)?;
                        }
                        self.iterate(e, worker, &comm, start, &mut |c| record_commit(&record, &mut recorded, rank, c))
                    })()
                }
                Err(err) => Err(err),
            };
            worker.on_stop();
            match r {
                Ok(()) => {
                    let mut e = engine.take().expect("ran");
                    let last_committed = e.commit(true)?;
                    record_commit(&record, &mut recorded, rank, last_committed)?;
                    return Ok(Finished {
                        engine: e,
                        comm,
                        recoveries,
                        last_source,
                        last_committed,
                        generation: gen,
                        resumed,
                        board,
                        record,
                        last_iteration: self.cfg.iterations,
                    });
                }
                Err(err) => {
                    let err = match err.downcast::<Error>() {
                        // no re-formation brings lost copies back (or mends the files, or the
                        // board): end the job
                        Ok(e) if e.is_final() => return Err(*e),
                        Ok(e) => e as BoxError,
                        Err(other) => match other.downcast::<ironweave_transport::Error>() {
                            Ok(t) if matches!(*t, ironweave_transport::Error::Board { .. }) => return Err(Error::Transport(*t)),
                            Ok(t) => t as BoxError,
                            Err(other) => other,
                        },
                    };
                    failures += 1;
                    if failures > self.cfg.max_reformations {
                        return Err(Error::GaveUp { reformations: self.cfg.max_reformations, last: err });
                    }
                    eprintln!("rank {rank}: generation {gen} failed: {}; re-forming the job", chain(&*err));
                    // the peers learn of it now, not at their next deadline (an error of this
                    // rank's own, unlike a death, leaves its connections open)
                    comm.abort(&format!("rank {rank} left generation {gen}: {}", chain(&*err)));
                    // the next generation, or a newer one a restarted process already went to
                    gen = (gen + 1).max(board.as_ref().and_then(Board::generation).unwrap_or(0));
                    announce(&board, gen)?;
                    need_restore = true;
                }
            }
        }
    }

    fn engine_config(&self, comm: &Communicator) -> Result<EngineConfig> {
        Ok(match self.cfg.checkpoint_links {
            CheckpointLinks::Training => self.cfg.engine.clone(),
            CheckpointLinks::All => {
                let n = comm.links().len() as u32;
                if n < 2 {
                    return Err(ironweave_transport::Error::InvalidArgument(format!(
                        "checkpoint chunks on every link need a job with several links (an emulated cluster with two or more); this one has {n}"
                    ))
                    .into());
                }
                EngineConfig { extra_links: (1..n).collect(), ..self.cfg.engine.clone() }
            }
        })
    }

    /// The job's id for its files and its commit record: the launcher's, or — when none named
    /// the job — the derived id with rank 0's launcher (its PID and start time) added, so two
    /// launches of the same program on the same endpoint are two jobs. Collective (rank 0's is
    /// broadcast) in the job's first generation; a process that joins a later one without a
    /// launcher's id cannot learn rank 0's and keeps the derived id (give such jobs an id).
    fn job_identity(&self, comm: &Communicator, gen: u16) -> Result<String> {
        let id = self.env.job_id.clone();
        if gen != 0 || self.start_gen != 0 {
            return Ok(id);
        }
        // a launcher's id comes back as it is, without a collective
        Ok(ironweave_transport::unique_job_id(comm, &id)?)
    }

    /// Where the job remembers its commits: the launcher's board, or under torchrun (which
    /// restarts every worker, so nothing lives in memory) a directory of the job's own under
    /// the temporary directory, cleared by a fresh launch's first process of each host.
    /// None elsewhere (srun, mpirun restart no process into a running job).
    fn commit_record(&self, job_id: &str) -> Result<Option<CommitRecord>> {
        if let Some(b) = &self.env.board {
            return Ok(Some(b.commits()));
        }
        let Some(restarts) = std::env::var_os("TORCHELASTIC_RESTART_COUNT") else { return Ok(None) };
        let safe: String = job_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).take(96).collect();
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        let rec = CommitRecord::at(std::env::temp_dir().join(format!("ironweave-commits-{uid}-{safe}")));
        if restarts == "0" && self.env.local_rank == 0 && self.start_gen == 0 {
            // a fresh launch under an id a finished job may have used (a reused --rdzv-id)
            rec.clear()?;
        }
        Ok(Some(rec))
    }

    /// The iterations of a generation from `start` (after its restore) until the last or the
    /// first error.
    fn iterate<W: Worker>(
        &self,
        e: &mut Engine,
        worker: &mut W,
        comm: &Arc<Communicator>,
        start: u64,
        record: &mut dyn FnMut(Option<u64>) -> Result<()>,
    ) -> Result<(), BoxError> {
        worker.on_start(start, comm)?;
        let mut last_load: Option<ExpertLoad> = None;
        for it in start..=self.cfg.iterations {
            let t0 = Instant::now();
            e.begin_iteration(it, last_load.as_ref());
            let s = worker.step(it, &StepContext { comm, profiler: e.profiler() })?;
            let ir = e.end_iteration();
            e.checkpoint(it, &worker.state())?;
            let committed = e.commit(false)?;
            record(committed)?;
            worker.on_iteration(&Iteration { iter: it, output: &s.output, elapsed: t0.elapsed(), committed, ckpt: &ir, comm })?;
            last_load = s.expert_load;
        }
        Ok(())
    }
}

/// Announces on the job's board (if any) that this process goes to generation `gen`. A board
/// that cannot be written is an error: without the announcement the others would wait for a
/// generation nobody forms, the waits the board exists to end.
fn announce(board: &Option<Board>, gen: u16) -> Result<()> {
    if let Some(b) = board {
        b.announce(gen)?;
    }
    Ok(())
}

/// Records `committed` in the job's commit record when it is newer than the last recorded.
fn record_commit(record: &Option<CommitRecord>, recorded: &mut Option<u64>, rank: usize, committed: Option<u64>) -> Result<()> {
    if let (Some(rec), Some(c)) = (record, committed) {
        if recorded.is_none_or(|r| c > r) {
            rec.record(rank, c)?;
            *recorded = Some(c);
        }
    }
    Ok(())
}

/// `err` and its sources, `: `-separated.
fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut s = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let m = e.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = e.source();
    }
    s
}

/// The first generation's start from another job's checkpoint: the newest complete iteration
/// under `dir`, loaded into this rank's registered layout.
fn resume<W: Worker>(e: &mut Engine, worker: &mut W, dir: &std::path::Path) -> Result<Resumed, BoxError> {
    // rank 0 chooses the iteration and every rank loads that one: ranks that each looked for
    // the newest themselves could load different iterations of a directory that changes
    // between their reads (a live job's persistent tier, a write still running)
    let chosen = match e.comm().rank() {
        0 => ironweave_ckpt::persist::newest_complete(dir),
        _ => Err(CkptError::Invalid(String::new())),
    };
    let mut pick = [chosen.as_ref().map_or(-1, |(i, _)| *i as i64)];
    e.comm().all_reduce(&mut pick, ReduceOp::Max)?;
    let loaded = (|| -> Result<(u64, Vec<String>, u32, Snapshot), BoxError> {
        let (iter, skipped) = match (u64::try_from(pick[0]), chosen) {
            (_, Ok(c)) => c,
            (Ok(i), Err(_)) => (i, Vec::new()),
            (Err(_), Err(err)) if e.comm().rank() == 0 => return Err(Box::new(err)),
            (Err(_), Err(_)) => return Err("rank 0 found no complete checkpoint there".into()),
        };
        let written_by = ironweave_ckpt::persist::read_manifest(dir, iter, 0)?.world;
        let snap = ironweave_ckpt::persist::load_global(dir, iter, e.registry())?;
        worker.restore(&snap)?;
        check_restored(worker, &snap)?;
        Ok((iter, skipped, written_by, snap))
    })();
    let me = e.comm().rank() as i64;
    let mut failed = [if loaded.is_err() { me } else { -1 }];
    e.comm().all_reduce(&mut failed, ReduceOp::Max)?;
    let (iter, skipped, written_by, _) = match (loaded, failed[0]) {
        (Err(err), _) => return Err(Box::new(Error::Resume { dir: dir.to_path_buf(), detail: chain(&*err) })),
        (Ok(_), r) if r >= 0 => {
            return Err(Box::new(Error::Resume { dir: dir.to_path_buf(), detail: format!("rank {r} could not load its part") }))
        }
        (Ok(x), _) => x,
    };
    // the digest of the worker's state after the restore, not of the bytes read: a restore
    // that dropped or mangled a tensor shows here (and was refused above)
    let global_sha256 = global_state_sha256(e.comm(), e.registry(), &worker.state())?;
    if e.comm().rank() == 0 {
        for s in &skipped {
            eprintln!("resume: passed over {s}");
        }
    }
    Ok(Resumed { dir: dir.to_path_buf(), iter, written_by, global_sha256 })
}

/// What a restarted process of a resumed job knows of the checkpoint the job started from
/// without loading it again: the iteration and the world that wrote it (the digest of the
/// loaded state is the first generation's, not this process's).
fn resumed_of(dir: &std::path::Path) -> Result<Resumed, BoxError> {
    let (iter, _) = ironweave_ckpt::persist::newest_complete(dir)?;
    let written_by = ironweave_ckpt::persist::read_manifest(dir, iter, 0)?.world;
    Ok(Resumed { dir: dir.to_path_buf(), iter, written_by, global_sha256: None })
}

/// The layout-free digest of the job's state (`ironweave_ckpt::layout::global_digest`): every
/// rank hashes the global tensors it owns whole, rank 0 gathers the hashes and returns the hex
/// digest (collective; None on the other ranks, and when some owned slice is only part of its
/// global tensor). `bufs`: the state in `registry` order.
pub fn global_state_sha256(comm: &Communicator, registry: &Registry, bufs: &[&[u8]]) -> Result<Option<String>> {
    use ironweave_ckpt::layout;
    let mut mine: Vec<u8> = Vec::new();
    let mut whole = true;
    for (t, b) in registry.tensors.iter().zip(bufs) {
        let Some(g) = t.global.as_ref().filter(|g| g.owner) else {
            whole &= t.global.is_some();
            continue;
        };
        if g.offsets.iter().any(|&o| o != 0) || g.shape != t.shape {
            whole = false;
            continue;
        }
        mine.extend_from_slice(&(g.tensor.len() as u32).to_le_bytes());
        mine.extend_from_slice(g.tensor.as_bytes());
        mine.extend_from_slice(&layout::tensor_sha256(b));
    }
    const TAG: u32 = 0x6710_0001;
    let mut ok = [i64::from(!whole)];
    comm.all_reduce(&mut ok, ironweave_transport::ReduceOp::Max)?;
    if comm.rank() != 0 {
        comm.send_bytes(0, TAG, &mine)?;
        return Ok(None);
    }
    let mut all = vec![mine];
    for r in 1..comm.size() {
        all.push(comm.recv_bytes(r, TAG)?);
    }
    if ok[0] != 0 {
        return Ok(None);
    }
    let mut per = std::collections::BTreeMap::new();
    for (r, b) in all.iter().enumerate() {
        let mut at = 0usize;
        while at < b.len() {
            let n = b.get(at..at + 4).map(|x| u32::from_le_bytes(x.try_into().expect("4 bytes")) as usize);
            let (Some(n), true) = (n, at + 4 + n.unwrap_or(0) + 32 <= b.len()) else {
                return Err(
                    ironweave_transport::Error::InvalidArgument(format!("rank {r}'s tensor digests are malformed")).into()
                );
            };
            let name = String::from_utf8_lossy(&b[at + 4..at + 4 + n]).into_owned();
            let d: [u8; 32] = b[at + 4 + n..at + 4 + n + 32].try_into().expect("32 bytes");
            if per.insert(name.clone(), d).is_some() {
                return Err(ironweave_transport::Error::InvalidArgument(format!("global tensor `{name}` is owned twice")).into());
            }
            at += 4 + n + 32;
        }
    }
    Ok(Some(layout::hex(&layout::global_digest(&per))))
}

/// Checks that the worker's state after a restore is the snapshot it restored, tensor by
/// tensor: a restore that left a tensor out (or loaded it wrongly) would train on from a state
/// nobody checkpointed.
fn check_restored<W: Worker>(worker: &W, snap: &Snapshot) -> Result<(), BoxError> {
    let state = worker.restored_state()?;
    let reg = &snap.registry;
    if state.len() != reg.tensors.len() {
        return Err(format!(
            "after the restore the worker's state has {} buffers, the checkpoint {} tensors",
            state.len(),
            reg.tensors.len()
        )
        .into());
    }
    let differ: Vec<&str> = reg
        .tensors
        .iter()
        .zip(&state)
        .filter(|(t, b)| snap.data.get(t.offset as usize..(t.offset + t.len) as usize) != Some(b.as_slice()))
        .map(|(t, _)| t.name.as_str())
        .collect();
    if !differ.is_empty() {
        return Err(format!(
            "after the restore the worker's state differs from the checkpoint it restored (iteration {}) in {}: `Worker::restore` must load every registered tensor",
            snap.iter,
            differ.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        )
        .into());
    }
    Ok(())
}

/// The collective restore of a generation after a failure. A job that resumed from
/// `resume_from` and committed nothing since loads that checkpoint again (it never starts over
/// from the initial state: that would train another model than the one asked for).
fn restore<W: Worker>(
    e: &mut Engine,
    worker: &mut W,
    generation: u16,
    resume_from: Option<&std::path::Path>,
    resumed: &mut Option<Resumed>,
    record: Option<&CommitRecord>,
) -> Result<Recovery, BoxError> {
    // the newest iteration any rank saw committed before the failure, in its memory or in the
    // job's record (which outlives every process: a job whose ranks all restarted still knows
    // it committed; -1: none): collective, as the restore's choice is
    let seen = e.committed().max(record.and_then(CommitRecord::newest));
    let mut c = [seen.map_or(-1, |i| i as i64)];
    e.comm().all_reduce(&mut c, ReduceOp::Max)?;
    let committed_before = u64::try_from(c[0]).ok();
    match e.restore_latest() {
        Ok(r) => {
            worker.restore(&r.snapshot)?;
            check_restored(worker, &r.snapshot)?;
            if resumed.is_none() {
                // a restarted process of a resumed job: what the job started from, for its report
                if let Some(dir) = resume_from {
                    *resumed = Some(resumed_of(dir)?);
                }
            }
            Ok(Recovery { iter: r.iter, source: r.source.into(), committed_before, generation })
        }
        Err(err @ CkptError::NothingToRestore { .. }) => {
            // every rank got the same answer (the choice is collective): was anything ever
            // committed? Only a record that shows nothing lets the job start over.
            if let Some(committed) = committed_before {
                return Err(Box::new(Error::Unrecoverable { committed, source: err }));
            }
            if let (0, CkptError::NothingToRestore { hint, .. }) = (e.comm().rank(), &err) {
                if hint.contains("another job") {
                    // refused, not adopted: said with both ids and the way to take it on purpose
                    eprintln!("ironweave: this job ({}) starts over; {hint}", e.job_id());
                }
            }
            e.start_over();
            if let Some(dir) = resume_from {
                // nothing committed since the job resumed: every rank loads that checkpoint again
                let r = resume(e, worker, dir)?;
                let iter = r.iter;
                *resumed = Some(r);
                return Ok(Recovery { iter, source: RestoreSource::Resumed, committed_before, generation });
            }
            // nothing was committed, so nothing is lost: every rank starts over from the
            // initial state (training is deterministic)
            worker.start_over()?;
            Ok(Recovery { iter: 0, source: RestoreSource::InitialState, committed_before, generation })
        }
        Err(other) => Err(Box::new(other)),
    }
}

/// A job that ran its last iteration on every rank: the engine (flushed: the last commit
/// waited for every replica) and what recovery did, for the final report.
#[derive(Debug)]
pub struct Finished {
    engine: Engine,
    comm: Arc<Communicator>,
    recoveries: u64,
    last_source: Option<RestoreSource>,
    last_committed: Option<u64>,
    generation: u16,
    resumed: Option<Resumed>,
    board: Option<Board>,
    record: Option<CommitRecord>,
    last_iteration: u64,
}

impl Finished {
    /// The communicator of the last generation.
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }

    /// The checkpoint engine (counters, placement, profiler history).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Recoveries this process took part in.
    pub fn recoveries(&self) -> u64 {
        self.recoveries
    }

    /// Where this rank's state came from in its last recovery (None: it never restored).
    pub fn restore_source(&self) -> Option<RestoreSource> {
        self.last_source
    }

    /// The newest iteration committed on every replica at the end.
    pub fn last_committed(&self) -> Option<u64> {
        self.last_committed
    }

    /// The generation that finished.
    pub fn generation(&self) -> u16 {
        self.generation
    }

    /// Every rank's [`Finished::restore_source`], in rank order (collective; a peer's rank is
    /// not carried: `Peer(usize::MAX)`).
    pub fn restore_sources(&self) -> Result<Vec<Option<RestoreSource>>> {
        let mut all = vec![0u8; self.comm.size()];
        self.comm.all_gather(&[RestoreSource::code(self.last_source)], &mut all)?;
        Ok(all.into_iter().map(RestoreSource::from_code).collect())
    }

    /// A digest of the whole job's state: SHA-256 of every rank's digest `mine` in rank order
    /// (collective), hex. Equal for two runs that end in the same state.
    pub fn job_state_sha256(&self, mine: &[u8; 32]) -> Result<String> {
        job_state_sha256(&self.comm, mine)
    }

    /// The checkpoint the job started from ([`Config::resume_from`]).
    pub fn resumed(&self) -> Option<&Resumed> {
        self.resumed.as_ref()
    }

    /// [`global_state_sha256`] of `bufs` (the worker's state in its registered order) on this
    /// job's communicator.
    pub fn global_state_sha256(&self, bufs: &[&[u8]]) -> Result<Option<String>> {
        global_state_sha256(&self.comm, self.engine.registry(), bufs)
    }

    /// Waits for the engine's background work (persistent writes) and stops its threads; once
    /// every rank passed its final barrier, says on the job's board that the job ended (a rank
    /// the launcher restarts after that leaves at once: [`Error::JobFinished`]).
    pub fn shutdown(self) -> Result<()> {
        // fault point `done`: between the job's last iteration (and whatever the program does
        // after `Job::run`) and the end every rank passes together
        ironweave_ckpt::fault::hit("done", self.comm.rank(), self.last_iteration);
        self.engine.shutdown()?;
        if let Some(b) = &self.board {
            b.finish()?;
        } else if let Some(rec) = &self.record {
            // the job ended: its record of commits has nothing left to tell
            let _ = rec.clear();
            let _ = std::fs::remove_dir(rec.dir());
        }
        Ok(())
    }
}

/// SHA-256 of every rank's 32-byte digest in rank order, hex (collective: every rank calls it
/// with its own digest).
pub fn job_state_sha256(comm: &Communicator, mine: &[u8; 32]) -> Result<String> {
    use sha2::Digest;
    let mut all = vec![0u8; 32 * comm.size()];
    comm.all_gather(mine, &mut all)?;
    Ok(sha2::Sha256::digest(&all).iter().map(|b| format!("{b:02x}")).collect())
}

//! A checkpointer for a training loop ironweave does not drive: PyTorch through the
//! `ironweave` Python package (crate `ironweave-py`), or any program that owns its loop and
//! hands over its state as bytes after each optimizer step.
//!
//! Why a separate piece from [`crate::elastic`]: there the runtime runs the loop and re-forms
//! the job around a failed rank; here the framework's launcher (torchrun) restarts every
//! process, and the checkpointer only snapshots, replicates to peers' host memory, commits and
//! restores. With [`EngineConfig::keep_dir`] on a tmpfs the copies outlive the processes, so a
//! restarted job restores from memory — its own or, for a host that was lost, a peer's.
//!
//! The checkpointer joins the job's launcher environment (torchrun, SLURM, OpenMPI or
//! `ironweave launch`) on its own port: torchrun's `MASTER_PORT` + 1 unless
//! `IRONWEAVE_CKPT_PORT` names one, so it never competes with the framework's store (the
//! Python package sets `IRONWEAVE_CKPT_PORT` under torchrun to a port rank 0 found free and
//! published in torchrun's store).
//!
//! ```no_run
//! use ironweave::checkpointer::Checkpointer;
//! use ironweave::ckpt::{DType, EngineConfig, TensorSpec};
//! let specs = [TensorSpec::new("w", DType::F32, &[4])];
//! let mut ck = Checkpointer::join(&specs, EngineConfig::default(), true)?;
//! let mut w = vec![0u8; 16];
//! if let Some(r) = ck.restore(&mut [&mut w[..]])? {
//!     println!("restored step {} from {}", r.step, r.source.name());
//! }
//! for step in 1..=10u64 {
//!     // ... train, then hand over the state of this step
//!     ck.save(step, &[&w[..]])?;
//! }
//! ck.close(true)?;
//! # Ok::<(), ironweave::elastic::Error>(())
//! ```

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use ironweave_ckpt::{persist, CkptError, DType, Engine, EngineConfig, Registry, TensorSpec};
use ironweave_transport::rendezvous::{EnvSource, JobEnv};
use ironweave_transport::{CommOptions, Communicator, ReduceOp};

use crate::elastic::{Error, RestoreSource, Result};
use crate::Backend;
use ironweave_profile::{CommKind, CommSpan, LayerSpan, Phase};

/// What [`Checkpointer::restore`] restored.
#[derive(Debug, Clone, PartialEq)]
pub struct Restore {
    /// The step whose state is now in place.
    pub step: u64,
    /// Where this rank's state came from.
    pub source: RestoreSource,
    /// Bytes of this rank's state.
    pub bytes: u64,
    /// Wall time of the restore (collective), seconds.
    pub seconds: f64,
}

/// Counters of a checkpointer, for reports and benchmarks.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Stats {
    /// Saves so far.
    pub saves: u64,
    /// Time the caller spent in the last save (snapshot copy, commit agreement), seconds.
    pub last_exposed_s: f64,
    /// Time the caller spent in every save, seconds.
    pub exposed_s: f64,
    /// Bytes of this rank's state.
    pub state_bytes: u64,
    /// Replica bytes this rank sent to its holders.
    pub replica_bytes_sent: u64,
    /// Replica bytes that went to other hosts.
    pub replica_bytes_inter_host: u64,
    /// Memory passes per state byte on this rank as a sender (snapshot copy and any copy to
    /// send; a copy is 2: a read and a write), none before a save.
    pub memory_passes_send: Option<f64>,
    /// Memory passes per replica byte this rank received as a holder, none before one arrived.
    pub memory_passes_recv: Option<f64>,
    /// Kept copies adopted at start by mapping their segments, bytes (nothing copied).
    pub kept_bytes_mapped: u64,
    /// Kept copies adopted at start by reading a file, bytes.
    pub kept_bytes_copied: u64,
    /// The newest step every rank's state of is replicated (committed).
    pub committed: Option<u64>,
    /// The newest step this rank's copies in the keep directory are whole for.
    pub kept: Option<u64>,
    /// Failures the engine's threads saw (a lost holder, a copy passed over).
    pub failures: Vec<String>,
    /// Steps whose layer phases and training communications the engine profiled (from what
    /// the framework recorded: [`Checkpointer::record_layer`], [`Checkpointer::record_comm`]).
    pub profiled_steps: u64,
    /// Training communications recorded.
    pub training_comms: u64,
    /// Checkpoint chunks this rank released to its holders.
    pub chunks: u64,
    /// Of those, the chunks whose transfer lay inside an idle window of the training link
    /// (measured against the recorded communications: the share Capricorn's placement hid).
    pub chunks_in_window: u64,
}

/// The checkpointer of one rank (see the module docs).
#[derive(Debug)]
pub struct Checkpointer {
    engine: Engine,
    last: Option<u64>,
    began: bool,
    stats: Stats,
}

/// The job's environment with the checkpointer's own port: `IRONWEAVE_CKPT_PORT` if set; under
/// torchrun, SLURM or OpenMPI the master port + 1 (the framework's store has the port itself);
/// under `ironweave launch` the launcher's port (nothing else uses it there).
pub fn job_env() -> Result<JobEnv> {
    let mut env = JobEnv::from_env()?;
    let port = match std::env::var("IRONWEAVE_CKPT_PORT") {
        Ok(p) => p.parse::<u16>().map_err(|_| {
            Error::Transport(ironweave_transport::Error::Config(format!("IRONWEAVE_CKPT_PORT={p:?} is not a port number")))
        })?,
        Err(_) if env.source == EnvSource::Ironweave => env.master.port(),
        Err(_) => env.master.port().checked_add(1).ok_or_else(|| {
            Error::Transport(ironweave_transport::Error::Config(
                "the master port is 65535: set IRONWEAVE_CKPT_PORT to a free port for the checkpointer".into(),
            ))
        })?,
    };
    env.master.set_port(port);
    Ok(env)
}

/// How a checkpointer joins its job ([`Checkpointer::join_with`]).
#[derive(Debug, Default)]
pub struct JoinOptions {
    /// Every rank registers the same names, dtypes and shapes (data parallelism), checked
    /// before the engine starts.
    pub same_layout: bool,
    /// When the config names no keep directory: keep the copies under
    /// `/dev/shm/ironweave-<job id>/<name>` ([`auto_keep_dir`]), the job id as the engine
    /// resolves it (the launcher's, or one derived for this launch). `name` tells apart the
    /// engines of one job (a `Checkpointer` and a DCP writer never share files).
    pub auto_keep: Option<String>,
    /// A refusal this rank found before joining (its state cannot be registered): every rank
    /// returns it, so no rank waits for this one.
    pub refusal: Option<Error>,
}

impl Checkpointer {
    /// Joins the job in the environment ([`job_env`]) over `IRONWEAVE_BACKEND` (default TCP)
    /// and starts the engine for `specs` (collective). `same_layout`: every rank registers the
    /// same names, dtypes and shapes (data parallelism), checked before the engine starts.
    pub fn join(specs: &[TensorSpec], cfg: EngineConfig, same_layout: bool) -> Result<Self> {
        Self::join_with(specs, cfg, JoinOptions { same_layout, ..JoinOptions::default() })
    }

    /// [`Checkpointer::join`] with every option.
    pub fn join_with(specs: &[TensorSpec], cfg: EngineConfig, opts: JoinOptions) -> Result<Self> {
        let env = job_env()?;
        let comm = crate::connect(Backend::from_env()?, &env, CommOptions::from_env()?)?;
        Self::on_with(Arc::new(comm), specs, cfg, opts)
    }

    /// [`Checkpointer::join`] on a communicator the caller formed.
    pub fn on(comm: Arc<Communicator>, specs: &[TensorSpec], cfg: EngineConfig, same_layout: bool) -> Result<Self> {
        Self::on_with(comm, specs, cfg, JoinOptions { same_layout, ..JoinOptions::default() })
    }

    /// [`Checkpointer::join_with`] on a communicator the caller formed. Before the engine
    /// starts, every rank agrees (collectively) on: each rank's node (replicas go to other
    /// nodes, [`node_of`]), the job's id and keep directory (private to this user, with room
    /// for the copies, [`preflight`]), and whether any rank refuses — a refusal is every
    /// rank's error, so none waits for another.
    pub fn on_with(comm: Arc<Communicator>, specs: &[TensorSpec], mut cfg: EngineConfig, opts: JoinOptions) -> Result<Self> {
        let mut refusal = opts.refusal;
        let registry = match Registry::new(specs) {
            Ok(r) => Some(r),
            Err(e) => {
                refusal.get_or_insert(Error::Ckpt(e));
                None
            }
        };
        let state_bytes = registry.as_ref().map_or(0, |r| r.total);
        let nodes = gather_nodes(&comm, &cfg.host, state_bytes)?;
        if cfg.host.is_empty() {
            cfg.host = node_of(&nodes, comm.rank())?;
        }
        let job = cfg.resolved_job_id(&comm)?;
        cfg.job_id = Some(job.clone());
        if cfg.keep_dir.is_none() {
            cfg.keep_dir = opts.auto_keep.as_deref().and_then(|name| auto_keep_dir(&job, name));
            if cfg.keep_dir.is_some() && comm.rank() == 0 {
                // copies of this user's jobs whose launchers have all ended (out of restarts, or
                // killed) are nobody's: they go before this job takes room
                for k in kept_jobs(Path::new("/dev/shm"))
                    .into_iter()
                    .filter(|k| k.orphan && !k.dir.ends_with(format!("{KEEP_PREFIX}{}", safe_name(&job))))
                {
                    let _ = std::fs::remove_dir_all(&k.dir);
                }
            }
        }
        if let (None, Some(dir)) = (&refusal, &cfg.keep_dir) {
            let need = keep_need(&nodes, comm.rank(), &cfg);
            if let Err(e) = preflight(dir, need) {
                refusal = Some(e);
            }
        }
        agree(&comm, refusal)?;
        let registry = registry.expect("a rank without a registry refused, and every rank returned its refusal");
        if opts.same_layout {
            check_same_layout(&comm, &registry)?;
        }
        if let (Some(dir), None) = (&cfg.keep_dir, &cfg.mac_key) {
            cfg.mac_key = Some(mac_key_in(dir)?);
        }
        if let Some(dir) = &cfg.keep_dir {
            // who keeps these copies alive: `clean` removes them once no launcher lives
            let f = launcher_file(dir, comm.rank());
            std::fs::write(&f, ironweave_transport::rendezvous::launcher_identity())
                .map_err(|e| Error::Ckpt(CkptError::Io { path: f.clone(), source: e }))?;
        }
        let engine = Engine::new(comm, registry, cfg)?;
        Ok(Checkpointer { engine, last: None, began: false, stats: Stats { state_bytes, ..Stats::default() } })
    }

    /// The job's id (the launcher's, or the one derived for this launch): kept copies of
    /// another job are never adopted.
    pub fn job_id(&self) -> &str {
        &self.engine.written().job
    }

    /// Where this rank's copies outlive the process (None: memory only).
    pub fn keep_dir(&self) -> Option<&Path> {
        self.engine.config().keep_dir.as_deref()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.engine.comm().rank()
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.engine.comm().size()
    }

    /// The registered layout.
    pub fn registry(&self) -> &Registry {
        self.engine.registry()
    }

    /// Snapshots the state of `step` (after its optimizer step: one buffer per registered
    /// tensor, in order) and agrees on the newest committed step (collective); replication
    /// goes on in the background during the next step. Steps must increase.
    pub fn save(&mut self, step: u64, bufs: &[&[u8]]) -> Result<u64> {
        self.save_or_refuse(step, bufs, None)
    }

    /// [`Checkpointer::save`], or `refusal` (an error the caller found in this rank's state):
    /// every rank first agrees whether any rank refuses — a bad step, a buffer of the wrong
    /// length, or the caller's refusal — and if one does, every rank returns that rank's error
    /// at once, before anything is snapshot (no rank waits in the commit for a rank that
    /// refused; the checkpointer stays usable).
    pub fn save_or_refuse(&mut self, step: u64, bufs: &[&[u8]], refusal: Option<Error>) -> Result<u64> {
        let mine = refusal.or_else(|| {
            if let Some(last) = self.last.filter(|&last| step <= last) {
                return Some(Error::Ckpt(CkptError::Invalid(format!(
                    "step {step} is not after the last saved or restored step {last}: steps must increase"
                ))));
            }
            self.check_lengths(bufs.iter().map(|b| b.len())).err()
        });
        agree(self.engine.comm(), mine)?;
        let t0 = Instant::now();
        self.end_step();
        self.engine.checkpoint(step, bufs)?;
        let committed = self.engine.commit(false)?;
        self.engine.begin_iteration(step + 1, None);
        self.began = true;
        self.last = Some(step);
        let dt = t0.elapsed().as_secs_f64();
        self.stats.saves += 1;
        self.stats.last_exposed_s = dt;
        self.stats.exposed_s += dt;
        self.stats.committed = committed;
        Ok(step)
    }

    /// The newest step every rank's state of is replicated, as last agreed.
    pub fn committed(&self) -> Option<u64> {
        self.engine.committed()
    }

    /// Restores the newest step every rank can get a whole copy of (collective) into `bufs`,
    /// in place — all or nothing: every buffer's length is checked before any byte is written.
    /// `Ok(None)`: no rank holds any copy (a fresh start).
    pub fn restore(&mut self, bufs: &mut [&mut [u8]]) -> Result<Option<Restore>> {
        self.restore_or_refuse(bufs, None)
    }

    /// [`Checkpointer::restore`], or `refusal` on every rank (agreed first, as in
    /// [`Checkpointer::save_or_refuse`]).
    pub fn restore_or_refuse(&mut self, bufs: &mut [&mut [u8]], refusal: Option<Error>) -> Result<Option<Restore>> {
        let mine = refusal.or_else(|| self.check_lengths(bufs.iter().map(|b| b.len())).err());
        agree(self.engine.comm(), mine)?;
        let t0 = Instant::now();
        let mut any = [i64::from(self.engine.holds_anything())];
        self.engine.comm().all_reduce(&mut any, ReduceOp::Max)?;
        if any[0] == 0 {
            // nothing to restore anywhere; but a rank whose kept copies were passed over for
            // another layout means the job came back with a changed state: say so on every rank
            if let Some((rank, (key, kept, now))) =
                first_rank_with(self.engine.comm(), self.engine.kept_layout_mismatch().cloned())?
            {
                return Err(Error::StateMismatch {
                    rank,
                    key,
                    expected: format!("{kept} as the kept copies hold it (remove them to start over)"),
                    actual: now,
                });
            }
            return Ok(None);
        }
        let r = self.engine.restore_latest()?;
        for (t, b) in self.engine.registry().tensors.iter().zip(bufs.iter_mut()) {
            b.copy_from_slice(&r.snapshot.data[t.offset as usize..(t.offset + t.len) as usize]);
        }
        self.last = Some(r.iter);
        self.began = false;
        self.stats.committed = Some(r.iter);
        Ok(Some(Restore {
            step: r.iter,
            source: r.source.into(),
            bytes: r.snapshot.data.len() as u64,
            seconds: t0.elapsed().as_secs_f64(),
        }))
    }

    /// The counters (waits for a keep in flight to read its step).
    pub fn stats(&mut self) -> Result<Stats> {
        let c = self.engine.counters();
        self.stats.replica_bytes_sent = c.replica_bytes.load(Ordering::Relaxed);
        self.stats.replica_bytes_inter_host = c.replica_bytes_inter_host.load(Ordering::Relaxed);
        self.stats.kept_bytes_mapped = c.kept_bytes_mapped.load(Ordering::Relaxed);
        self.stats.kept_bytes_copied = c.kept_bytes_copied.load(Ordering::Relaxed);
        let p = self.engine.memory_passes();
        (self.stats.memory_passes_send, self.stats.memory_passes_recv) = (p.send(), p.recv());
        self.stats.kept = self.engine.kept()?;
        self.stats.failures = self.engine.failures();
        Ok(self.stats.clone())
    }

    /// Replicates the last snapshot, waits for its acknowledgements (bounded), and stops
    /// (collective). `remove_kept`: the job is over, so every rank's copies in the keep
    /// directory are removed (after a barrier: no rank still needs a peer's).
    pub fn close(mut self, remove_kept: bool) -> Result<()> {
        self.end_step();
        self.engine.commit(true)?;
        if remove_kept {
            self.engine.comm().barrier()?;
            let root = self.engine.remove_kept()?;
            if let Some(root) = &root {
                let _ = std::fs::remove_file(launcher_file(root, self.rank()));
            }
            // every rank's copies are gone: the job's directory goes with its key (and the
            // directory of the job's engines when it made it and no other engine is left). Every
            // rank tries, since each node has its own; rank 0 reports what failed.
            self.engine.comm().barrier()?;
            if let Some(root) = root {
                let _ = std::fs::remove_file(root.join(MAC_KEY_FILE));
                match std::fs::remove_dir(&root) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound && self.rank() == 0 => {
                        return Err(Error::Ckpt(CkptError::Io { path: root, source: e }))
                    }
                    _ => {}
                }
                if let Some(parent) = job_root(&root) {
                    let _ = std::fs::remove_dir(parent);
                }
            }
        }
        self.engine.shutdown()?;
        Ok(())
    }

    /// Ends the engine's iteration of the step being trained, if one began, and counts what it
    /// placed.
    fn end_step(&mut self) {
        if std::mem::take(&mut self.began) {
            let rep = self.engine.end_iteration();
            self.stats.profiled_steps += u64::from(rep.profiled);
            self.stats.chunks += u64::from(rep.chunks);
            self.stats.chunks_in_window += u64::from(rep.chunks_in_window);
        }
    }

    /// Now on the clock of the engine's profiler, ns: what [`Checkpointer::record_layer`] and
    /// [`Checkpointer::record_comm`] take.
    pub fn now_ns(&self) -> u64 {
        self.engine.profiler().now_ns()
    }

    /// Records one layer phase of the step being trained, timed by the framework (module
    /// hooks): `layer` counts the model's layers in the order the forward pass runs them. The
    /// engine anchors the link's idle windows to these. Ignored in a step the engine does not
    /// profile.
    pub fn record_layer(&self, layer: u32, phase: Phase, start_ns: u64, end_ns: u64) {
        self.engine.profiler().record_layer(LayerSpan { layer, phase, start_ns, end_ns });
    }

    /// Records one training communication of the step being trained that ran outside
    /// ironweave (torch's process group, timed by a DDP communication hook): it is a busy span
    /// of the link the checkpoint's chunks share. From these the engine predicts the link's
    /// idle windows and, as each one ends, releases the chunks planned for the window it opens.
    pub fn record_comm(&mut self, bytes: u64, start_ns: u64, end_ns: u64) {
        let link = self.engine.link_ids().first().copied().unwrap_or(0);
        self.stats.training_comms += 1;
        self.engine.profiler().record_comm(CommSpan {
            link,
            kind: CommKind::Training,
            start_ns,
            end_ns: end_ns.max(start_ns),
            bytes,
        });
    }

    fn check_lengths(&self, lens: impl ExactSizeIterator<Item = usize>) -> Result<()> {
        let reg = self.engine.registry();
        if lens.len() != reg.tensors.len() {
            return Err(Error::Ckpt(CkptError::Invalid(format!(
                "{} buffers for {} registered tensors",
                lens.len(),
                reg.tensors.len()
            ))));
        }
        for (t, n) in reg.tensors.iter().zip(lens) {
            if n as u64 != t.len {
                return Err(Error::StateMismatch {
                    rank: self.rank(),
                    key: t.name.clone(),
                    expected: format!("{} bytes ({:?} {:?})", t.len, t.dtype, t.shape),
                    actual: format!("{n} bytes"),
                });
            }
        }
        Ok(())
    }
}

/// One global tensor of a saved checkpoint, as a loader onto another layout sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedTensor {
    /// Its name (the global name every rank's slice of it carries).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
}

/// The newest iteration of the checkpoint under `dir` that every rank of the job that wrote it
/// left whole, and its global tensors. `dir` is a keep directory that outlived its job
/// ([`EngineConfig::keep_dir`]: each rank's files from its own or a peer's copy) or a
/// persistent tier. Every tensor must name its global slice (what a loader onto another layout
/// needs); a checkpoint whose tensors do not is refused, naming the tensor.
pub fn saved(dir: &Path) -> Result<(u64, Vec<SavedTensor>)> {
    let (iter, _) = persist::newest_complete(dir)?;
    let mans = persist::read_manifests(dir, iter)?;
    let idx = persist::global_index(&mans)?;
    Ok((iter, idx.into_iter().map(|(name, g)| SavedTensor { name, dtype: g.dtype, shape: g.shape }).collect()))
}

/// Checks every rank's file of iteration `iter` under `dir` against its MAC under `key` (the
/// writing job's key, [`mac_key_in`]): a copy planted or altered by someone without the key is
/// refused before anything of it is used.
pub fn check_macs(dir: &Path, iter: u64, key: &ironweave_ckpt::persist::MacKey) -> Result<()> {
    for m in persist::read_manifests(dir, iter)? {
        persist::load_keyed(dir, iter, m.rank, Some(key))?;
    }
    Ok(())
}

/// Loads iteration `iter` of the checkpoint under `dir` ([`saved`]) into `bufs`, one per spec of
/// `want`, each spec naming the slice of a global tensor it wants — whatever world size and
/// layout wrote it: the project's resharding ([`persist::load_global`]) reads each owner slice
/// that overlaps a wanted one by range and checks it against its checksum. All or nothing: the
/// buffers are written only once every slice has been read and checked. Returns the bytes
/// filled.
pub fn load_saved(dir: &Path, iter: u64, want: &[TensorSpec], bufs: &mut [&mut [u8]]) -> Result<u64> {
    let reg = Registry::new(want)?;
    {
        let lens: Vec<&[u8]> = bufs.iter().map(|b| &**b).collect();
        reg.check(&lens)?;
    }
    if let Some(t) = reg.tensors.iter().find(|t| t.global.is_none()) {
        return Err(Error::Ckpt(CkptError::Invalid(format!(
            "`{}` names no global slice: a load onto another layout must say which part of which saved tensor each buffer wants",
            t.name
        ))));
    }
    let snap = persist::load_global(dir, iter, &reg)?;
    for (t, b) in reg.tensors.iter().zip(bufs.iter_mut()) {
        b.copy_from_slice(snap.tensor(&t.name).expect("the loaded snapshot has every wanted tensor"));
    }
    Ok(reg.total)
}

/// Every rank's layout equals rank 0's (collective): the first difference found on any rank is
/// every rank's error.
fn check_same_layout(comm: &Communicator, reg: &Registry) -> Result<()> {
    // names, dtypes and shapes: where each rank's copy sits globally (which rank owns a
    // replicated tensor, each rank's own values) may differ
    let mut reg = reg.clone();
    reg.tensors.iter_mut().for_each(|t| t.global = None);
    let reg = &reg;
    let mine = serde_json::to_string(reg).map_err(|e| Error::Ckpt(CkptError::Invalid(e.to_string())))?;
    let zero = broadcast_text(comm, 0, mine)?;
    let zero: Registry = serde_json::from_str(&zero)
        .map_err(|e| Error::Ckpt(CkptError::Invalid(format!("rank 0's layout does not parse: {e}"))))?;
    match first_rank_with(comm, zero.first_difference(reg))? {
        None => Ok(()),
        Some((rank, (key, expected, actual))) => {
            Err(Error::StateMismatch { rank, key, expected: format!("rank 0's {expected}"), actual })
        }
    }
}

/// A layout difference: (tensor, one side, the other side), as `Registry::first_difference` gives it.
type Difference = (String, String, String);

/// The highest rank that has a difference, and that difference, on every rank (collective);
/// None when no rank has one.
fn first_rank_with(comm: &Communicator, mine: Option<Difference>) -> Result<Option<(usize, Difference)>> {
    let mut flag = [mine.as_ref().map_or(0, |_| comm.rank() as i64 + 1)];
    comm.all_reduce(&mut flag, ReduceOp::Max)?;
    if flag[0] == 0 {
        return Ok(None);
    }
    let from = flag[0] as usize - 1;
    // the rank that found the difference tells every rank what it is
    let text = broadcast_text(comm, from, mine.map(|(k, e, a)| format!("{k}\t{e}\t{a}")).unwrap_or_default())?;
    let mut parts = text.splitn(3, '\t').map(str::to_string);
    let mut next = || parts.next().unwrap_or_else(|| "-".into());
    Ok(Some((from, (next(), next(), next()))))
}

/// Rank `root`'s `text` on every rank (collective; the others' `text` is not read). A length
/// over 64 MiB is refused on every rank before any byte of it is sent.
fn broadcast_text(comm: &Communicator, root: usize, text: String) -> Result<String> {
    const MAX: i64 = 64 << 20;
    let text = text.into_bytes();
    let mut len = [text.len() as i64];
    comm.broadcast(&mut len, root)?;
    if !(0..=MAX).contains(&len[0]) {
        return Err(Error::Ckpt(CkptError::Invalid(format!(
            "rank {root} describes its state in {} bytes, more than {MAX}: too many tensors for one layout check",
            len[0]
        ))));
    }
    let mut buf = if comm.rank() == root { text } else { vec![0u8; len[0] as usize] };
    comm.broadcast(&mut buf, root)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Each rank's (host key, torchrun node, state bytes), as every rank said (collective).
type Nodes = Vec<[i64; 3]>;

fn host_key(host: &str) -> i64 {
    let mut h = ironweave_transport::rendezvous::Fnv::default();
    h.add(host.as_bytes());
    h.0 as i64
}

/// torchrun's node of this process (`GROUP_RANK`), -1 outside torchrun.
fn torchrun_node() -> i64 {
    std::env::var("GROUP_RANK").ok().and_then(|g| g.trim().parse().ok()).unwrap_or(-1)
}

/// The host this rank names (`host`, else `rendezvous::host_name()`: `IRONWEAVE_HOST`, else the
/// hostname), its torchrun node and its state bytes, gathered from every rank (collective).
fn gather_nodes(comm: &Communicator, host: &str, state_bytes: u64) -> Result<Nodes> {
    let host = if host.is_empty() { ironweave_transport::rendezvous::host_name() } else { host.to_string() };
    let (me, n) = (comm.rank(), comm.size());
    let mut all = vec![0i64; 3 * n];
    all[3 * me..3 * me + 3].copy_from_slice(&[host_key(&host), torchrun_node(), state_bytes as i64]);
    // each slot has one writer: the sum is every rank's triple
    comm.all_reduce(&mut all, ReduceOp::Sum)?;
    Ok(all.chunks(3).map(|c| [c[0], c[1], c[2]]).collect())
}

/// The node identity rank `me` gives its engine: its host name, checked against torchrun's
/// nodes. Ranks of one torchrun node naming different hosts is a configuration error (every
/// rank sees it); ranks of different torchrun nodes naming one host (two agents on one machine,
/// or nodes whose hostnames collide) are told apart by their node, with a warning, so a replica
/// never sits on the node it protects because two names collide.
pub fn node_of(nodes: &[[i64; 3]], me: usize) -> Result<String> {
    let host = ironweave_transport::rendezvous::host_name();
    let mut collide = false;
    for (a, x) in nodes.iter().enumerate() {
        for (b, y) in nodes.iter().enumerate().skip(a + 1) {
            if x[1] >= 0 && x[1] == y[1] && x[0] != y[0] {
                return Err(Error::Transport(ironweave_transport::Error::Config(format!(
                    "ranks {a} and {b} run under one torchrun agent (GROUP_RANK {}) but name different hosts: set IRONWEAVE_HOST to the same value for every rank a node starts, or leave it unset",
                    x[1]
                ))));
            }
            collide |= x[1] >= 0 && y[1] >= 0 && x[1] != y[1] && x[0] == y[0];
        }
    }
    if collide {
        let node = nodes[me][1];
        if me == 0 {
            eprintln!(
                "ironweave: warning: ranks of different torchrun nodes name the same host {host:?}: told apart by their node (GROUP_RANK) for replica placement; set IRONWEAVE_HOST per node if two agents share a machine"
            );
        }
        return Ok(format!("{host}/torchrun-node-{node}"));
    }
    Ok(host)
}

/// The keep directory of job `job` and engine `name` when none is configured:
/// `/dev/shm/ironweave-<job>/<name>`; None without `/dev/shm`.
pub fn auto_keep_dir(job: &str, name: &str) -> Option<std::path::PathBuf> {
    let shm = Path::new("/dev/shm");
    shm.is_dir().then(|| shm.join(format!("{KEEP_PREFIX}{}", safe_name(job))).join(safe_name(name)))
}

/// The job's directory above an engine's keep directory (`ironweave-<job>/<name>`), when it is
/// one [`auto_keep_dir`] makes.
fn job_root(dir: &Path) -> Option<&Path> {
    dir.parent().filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(KEEP_PREFIX)))
}

/// How the directories [`auto_keep_dir`] makes begin.
pub const KEEP_PREFIX: &str = "ironweave-";

/// `s` with every character outside `[A-Za-z0-9._-]` replaced by `_` (a path component).
pub fn safe_name(s: &str) -> String {
    let t: String = s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    if t.is_empty() || t.chars().all(|c| c == '.') {
        "_".into()
    } else {
        t
    }
}

/// Bytes the copies of the ranks on `me`'s node may take in the keep directory: per rank its
/// three snapshot segments and, for each of `replicas` sources, four replica segments (two
/// kept, up to two arriving), every one its own state's size. (A rank holds `replicas - 1`
/// peers' replicas: this counts one source more than it can hold.)
fn keep_need(nodes: &[[i64; 3]], me: usize, cfg: &EngineConfig) -> u64 {
    // per rank: its snapshot segments, and per source whose replicas it holds the two kept
    // and up to two arriving (`ironweave_ckpt::engine::replicate::KEPT_REPLICAS` + 2)
    let m = u64::from(cfg.replicas.max(1));
    let per = ironweave_ckpt::SNAPSHOT_BUFFERS as u64 + (ironweave_ckpt::engine::replicate::KEPT_REPLICAS as u64 + 2) * m;
    nodes.iter().filter(|n| n[0] == nodes[me][0] && n[1] == nodes[me][1]).map(|n| per * n[2].max(0) as u64).sum()
}

/// Makes the keep directory `dir` (its parents as needed) and checks it before the job trains:
/// private to this user (`board::private_dir`: a directory another user owns or could write is
/// refused, never adopted), and on a file system with room for `need` bytes more than this
/// job's copies already there take (a container's `/dev/shm` defaults to 64 MB).
pub fn preflight(dir: &Path, need: u64) -> Result<()> {
    for d in job_root(dir).into_iter().chain([dir]) {
        if let Some(parent) = d.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::Ckpt(CkptError::Io { path: parent.to_path_buf(), source: e }))?;
        }
        ironweave_transport::board::private_dir(d)?;
    }
    let have = dir_bytes(dir);
    if let Some((free, total, fs)) = ironweave_transport::board::space(dir) {
        if free.saturating_add(have) < need {
            return Err(Error::Ckpt(CkptError::Invalid(format!(
                "the keep directory {} has {:.1} MB free ({:.1} MB in all on {}, {:.1} MB of it this job's copies) but this node's ranks keep up to {:.1} MB there (per rank: 3 snapshot segments and 4 replica segments per replica, each the size of a state): give the container more shared memory (docker run --shm-size=..., a Kubernetes emptyDir with medium: Memory), set keep_dir= to a larger tmpfs, or keep_dir=None (memory only: a restart then needs a persistent tier)",
                dir.display(),
                free as f64 / 1e6,
                total as f64 / 1e6,
                fs.display(),
                have as f64 / 1e6,
                need as f64 / 1e6
            ))));
        }
    }
    Ok(())
}

/// The key the copies in the keep directory `dir` carry their MAC under ([`MAC_KEY_FILE`]):
/// read, or made (32 random bytes, 0600) by the first rank of the node to get here. It lives
/// beside the copies, in a directory only this user can read ([`preflight`]), for as long as
/// they do: a restarted process reads it whatever happened to the rest of the job (a secret
/// held by torchrun's store would be gone with the node that hosted it, taking every kept copy's
/// MAC with it), and a reader of the same user (`PeerMemoryReader`, another job) checks the
/// copies with it. Someone who cannot read it cannot make a copy that passes.
pub fn mac_key_in(dir: &Path) -> Result<ironweave_ckpt::persist::MacKey> {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(MAC_KEY_FILE);
    let io = |p: &Path, e: std::io::Error| Error::Ckpt(CkptError::Io { path: p.to_path_buf(), source: e });
    if !path.exists() {
        let mut key = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut key))
            .map_err(|e| io(Path::new("/dev/urandom"), e))?;
        // written whole under a name of this process, then linked into place: a rank that loses
        // the race reads the winner's key, never a part of one
        let tmp = dir.join(format!(".{MAC_KEY_FILE}.{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| io(&tmp, e))?;
        f.write_all(&key).and_then(|()| f.sync_all()).map_err(|e| io(&tmp, e))?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(io(&path, e)),
            _ => {}
        }
    }
    let key = std::fs::read(&path).map_err(|e| io(&path, e))?;
    if key.len() != 32 {
        return Err(Error::Ckpt(CkptError::Corrupt {
            what: path.display().to_string(),
            detail: format!("{} bytes, a key has 32: remove the job's keep directory to start over", key.len()),
        }));
    }
    Ok(ironweave_ckpt::persist::MacKey::new(&key).expect("32 bytes"))
}

/// The file of the key the kept copies carry their MAC under ([`mac_key_in`]).
pub const MAC_KEY_FILE: &str = "mac-key";

/// Bytes of the files under `dir` (0 when it cannot be read).
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => dir_bytes(&e.path()),
                    Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
                    _ => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

/// Every rank learns whether any rank refuses, and which error (collective): the lowest
/// refusing rank's error, the same on every rank. A configuration refusal travels as its
/// message, a state mismatch as its fields; any other error as its message.
fn agree(comm: &Communicator, mine: Option<Error>) -> Result<()> {
    let mut flag = [mine.as_ref().map_or(i64::MAX, |_| comm.rank() as i64)];
    comm.all_reduce(&mut flag, ReduceOp::Min)?;
    if flag[0] == i64::MAX {
        return Ok(());
    }
    let from = flag[0] as usize;
    let text = match (comm.rank() == from, mine) {
        (true, Some(Error::StateMismatch { key, expected, actual, .. })) => format!("M\t{key}\t{expected}\t{actual}"),
        (true, Some(Error::Ckpt(CkptError::Invalid(m)))) => format!("C\t{m}"),
        (
            true,
            Some(Error::Transport(e @ (ironweave_transport::Error::Config(_) | ironweave_transport::Error::Board { .. }))),
        ) => {
            format!("C\t{e}")
        }
        (true, Some(e)) => format!("E\t{e}"),
        _ => String::new(),
    };
    let text = broadcast_text(comm, from, text)?;
    let mut parts = text.splitn(4, '\t').map(str::to_string);
    let mut next = || parts.next().unwrap_or_else(|| "-".into());
    let kind = next();
    Err(match kind.as_str() {
        "M" => Error::StateMismatch { rank: from, key: next(), expected: next(), actual: next() },
        "C" => Error::Ckpt(CkptError::Invalid(format!("rank {from} refused: {}", next()))),
        _ => Error::Refused { rank: from, detail: next() },
    })
}

fn launcher_file(dir: &Path, rank: usize) -> std::path::PathBuf {
    dir.join(format!("launcher-r{rank:05}"))
}

/// A job's kept copies under a shared memory directory, as `clean` lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptJob {
    /// The job's directory (`/dev/shm/ironweave-<job>`).
    pub dir: std::path::PathBuf,
    /// Bytes of its files.
    pub bytes: u64,
    /// The launchers its ranks recorded (`PID@start`) and whether each still runs.
    pub launchers: Vec<(String, bool)>,
    /// No recorded launcher runs: no process of the job can restart and restore from them.
    pub orphan: bool,
}

/// This user's job directories under `base` (`/dev/shm`), `ironweave-*`: what they take and
/// whether any launcher that recorded itself there still runs. Another user's directories are
/// not listed (nor touched).
pub fn kept_jobs(base: &Path) -> Vec<KeptJob> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: getuid has no preconditions and cannot fail.
    let me = unsafe { libc::getuid() };
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(base) else { return out };
    for e in rd.flatten() {
        let dir = e.path();
        let mine = std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir() && m.uid() == me);
        if !mine || !e.file_name().to_string_lossy().starts_with(KEEP_PREFIX) {
            continue;
        }
        let mut launchers = Vec::new();
        let mut scan = vec![(dir.clone(), 0)];
        while let Some((d, depth)) = scan.pop() {
            for f in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let name = f.file_name().to_string_lossy().into_owned();
                if name.starts_with("launcher-r") {
                    let id = std::fs::read_to_string(f.path()).unwrap_or_default();
                    let alive = ironweave_transport::rendezvous::launcher_alive(&id);
                    launchers.push((id.trim().to_string(), alive));
                } else if depth < 1
                    && f.file_type().is_ok_and(|t| t.is_dir())
                    && !name.starts_with(ironweave_ckpt::persist::HOLDER_PREFIX)
                {
                    scan.push((f.path(), depth + 1));
                }
            }
        }
        launchers.sort();
        launchers.dedup();
        let orphan = !launchers.iter().any(|(_, alive)| *alive);
        out.push(KeptJob { bytes: dir_bytes(&dir), dir, launchers, orphan });
    }
    out.sort_by(|a, b| a.dir.cmp(&b.dir));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_tell_torchrun_nodes_apart_and_one_node_naming_two_hosts_is_refused() {
        // [host key, torchrun node, state bytes]
        let split = [[1, 0, 8], [1, 0, 8], [2, 1, 8], [2, 1, 8]];
        assert!(!node_of(&split, 2).unwrap().contains("torchrun-node"));
        // two agents on one machine (or colliding hostnames): told apart by their node
        let same = [[1, 0, 8], [1, 0, 8], [1, 1, 8], [1, 1, 8]];
        let (a, b) = (node_of(&same, 0).unwrap(), node_of(&same, 2).unwrap());
        assert_ne!(a, b);
        assert_eq!(a, node_of(&same, 1).unwrap());
        // one agent's ranks naming different hosts
        let bad = [[1, 0, 8], [2, 0, 8]];
        assert!(node_of(&bad, 0).unwrap_err().to_string().contains("IRONWEAVE_HOST"));
        // outside torchrun (node -1): the host names alone
        let plain = [[1, -1, 8], [2, -1, 8]];
        assert!(!node_of(&plain, 0).unwrap().contains("torchrun-node"));
    }

    #[test]
    fn the_keep_need_counts_the_node_s_ranks_snapshot_and_replica_segments() {
        let nodes = [[1, 0, 100], [1, 0, 50], [2, 1, 1000]];
        let cfg = EngineConfig { replicas: 2, ..EngineConfig::default() };
        // per rank: 3 snapshot segments, 4 replica segments per replica (two kept, two arriving)
        assert_eq!(keep_need(&nodes, 0, &cfg), (3 + 4 * 2) * 150);
        assert_eq!(keep_need(&nodes, 2, &cfg), (3 + 4 * 2) * 1000);
    }

    #[test]
    fn a_job_directory_is_an_orphan_once_no_launcher_it_recorded_runs() {
        let base = std::env::temp_dir().join(format!("ironweave-kept-jobs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let live = base.join(format!("{KEEP_PREFIX}live/checkpointer-0"));
        let dead = base.join(format!("{KEEP_PREFIX}dead/checkpointer-0"));
        for d in [&live, &dead] {
            std::fs::create_dir_all(d.join("holder-00000")).unwrap();
            std::fs::write(d.join("holder-00000/data"), [0u8; 10]).unwrap();
        }
        // this test's own parent runs; PID 0 never names a launcher
        std::fs::write(launcher_file(&live, 0), ironweave_transport::rendezvous::launcher_identity()).unwrap();
        std::fs::write(launcher_file(&dead, 0), "0@1").unwrap();
        let jobs = kept_jobs(&base);
        assert_eq!(jobs.len(), 2, "{jobs:?}");
        let by = |n: &str| jobs.iter().find(|j| j.dir.ends_with(format!("{KEEP_PREFIX}{n}"))).unwrap().clone();
        assert!(!by("live").orphan && by("dead").orphan);
        assert!(by("dead").bytes >= 10);
        assert_eq!(safe_name("a/b:c"), "a_b_c");
        assert_eq!(safe_name(".."), "_");
        std::fs::remove_dir_all(&base).unwrap();
    }
}

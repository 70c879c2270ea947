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

impl Checkpointer {
    /// Joins the job in the environment ([`job_env`]) over `IRONWEAVE_BACKEND` (default TCP)
    /// and starts the engine for `specs` (collective). `same_layout`: every rank registers the
    /// same names, dtypes and shapes (data parallelism), checked before the engine starts.
    pub fn join(specs: &[TensorSpec], cfg: EngineConfig, same_layout: bool) -> Result<Self> {
        let env = job_env()?;
        let comm = crate::connect(Backend::from_env()?, &env, CommOptions::from_env()?)?;
        Self::on(Arc::new(comm), specs, cfg, same_layout)
    }

    /// [`Checkpointer::join`] on a communicator the caller formed.
    pub fn on(comm: Arc<Communicator>, specs: &[TensorSpec], cfg: EngineConfig, same_layout: bool) -> Result<Self> {
        let registry = Registry::new(specs)?;
        if same_layout {
            check_same_layout(&comm, &registry)?;
        }
        let state_bytes = registry.total;
        let engine = Engine::new(comm, registry, cfg)?;
        Ok(Checkpointer { engine, last: None, began: false, stats: Stats { state_bytes, ..Stats::default() } })
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
        if let Some(last) = self.last {
            if step <= last {
                return Err(Error::Ckpt(CkptError::Invalid(format!(
                    "step {step} is not after the last saved or restored step {last}: steps must increase"
                ))));
            }
        }
        self.check_lengths(bufs.iter().map(|b| b.len()))?;
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
        self.check_lengths(bufs.iter().map(|b| b.len()))?;
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
            // every rank's copies are gone: one rank removes the job's directory
            self.engine.comm().barrier()?;
            if let (0, Some(root)) = (self.rank(), root) {
                match std::fs::remove_dir(&root) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(Error::Ckpt(CkptError::Io { path: root, source: e }))
                    }
                    _ => {}
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

//! Copies that outlive the process ([`EngineConfig::keep_dir`]).
//!
//! Why: torchrun restarts every worker of the job when one fails, so the snapshots and the
//! replicas held in process memory die with the processes that would restore from them. After
//! each commit a keeper thread copies the rank's own snapshot of the committed iteration and
//! the verified replicas it holds of that iteration into a tmpfs directory (`holder-RANK/`, the
//! persistent tier's file format, written through a temporary file and renamed); a new engine
//! of the same job and rank adopts them before the first recovery, so [`Engine::restore_latest`]
//! sees them as memory. A host that is lost takes its directory with it: its ranks' states then
//! come from the replicas other hosts kept, as they would from live peers.
//!
//! The two newest committed iterations are kept: commits are collective and each keeper waits
//! for the previous one, so when a rank dies every rank has whole copies of the iteration
//! before the newest commit, even if its newest copy was cut short.

use std::fs;
use std::path::{Path, PathBuf};

use super::*;
use crate::persist::Written;

/// The directory a rank keeps its copies in (its own states and the replicas it holds).
pub fn holder_dir(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("{}{rank:05}", persist::HOLDER_PREFIX))
}

fn remove_iterations(dir: &Path, drop: impl Fn(u64) -> bool) -> Result<()> {
    for it in persist::iteration_dirs(dir).into_iter().filter(|&it| drop(it)) {
        let d = persist::iteration_dir(dir, it);
        fs::remove_dir_all(&d).map_err(|e| CkptError::io(&d, e))?;
    }
    Ok(())
}

/// What one keep of iteration `iter` copies: this rank's snapshot and (source, copy) replicas.
fn write_kept(dir: &Path, me: usize, world: usize, own: &Snapshot, replicas: &[(usize, Snapshot)], by: &Written) -> Result<()> {
    persist::write_layout(dir, own, me as u32, world as u32, None, by)?;
    for (src, snap) in replicas {
        persist::write_layout(dir, snap, *src as u32, world as u32, None, by)?;
    }
    Ok(())
}

fn keep_error(dir: &Path, iter: u64, e: CkptError) -> CkptError {
    let full = matches!(&e, CkptError::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull);
    CkptError::Keep {
        dir: dir.to_path_buf(),
        iter,
        detail: e.to_string(),
        hint: if full {
            "the file system is full: make room in it (a tmpfs such as /dev/shm: `mount -o remount,size=...`), keep fewer replicas, or set no keep directory".into()
        } else {
            "the directory must be writable by every rank of this host; the copies of the iteration before are kept".into()
        },
    }
}

impl Engine {
    /// A kept copy of this rank's state whose layout differs from the registered one, passed
    /// over at start: (tensor, as kept, as registered) of the first difference. A job
    /// restarted with a changed model finds its old copies this way instead of starting fresh
    /// without a word.
    pub fn kept_layout_mismatch(&self) -> Option<&(String, String, String)> {
        self.kept_mismatch.as_ref()
    }

    /// Adopts what an earlier process of this rank of the same job kept: its own snapshots
    /// and the replicas it held. Copies of another job, of another layout, or that fail their
    /// checksums are passed over (and named in [`Engine::failures`]).
    pub(super) fn adopt_kept(&mut self) {
        let Some(root) = self.cfg.keep_dir.clone() else { return };
        let (me, world) = (self.comm.rank(), self.comm.size());
        let dir = holder_dir(&root, me);
        let mut own = Vec::new();
        let mut passed = Vec::new();
        // a holder directory another user could have written is read not at all
        if dir.exists() {
            if let Err(e) = ironweave_transport::board::private_dir(&dir) {
                self.shared.locked().failures.push(format!("kept copies passed over: {e}"));
                return;
            }
        }
        let iters = persist::iteration_dirs(&dir);
        for &it in &iters {
            for owner in 0..world {
                let (_, man_path) = persist::paths(&dir, it, owner as u32);
                if !man_path.exists() {
                    continue;
                }
                let snap = match persist::read_manifest(&dir, it, owner as u32) {
                    Ok(m) if m.job != self.written.job => {
                        passed.push(format!("{}: of job {:?}, not this job's {:?}", man_path.display(), m.job, self.written.job));
                        continue;
                    }
                    Ok(_) => persist::load_keyed(&dir, it, owner as u32, self.written.key.as_ref()),
                    Err(e) => Err(e),
                };
                // a replica is a peer's state: its local layout is compared (where its tensors
                // sit globally is the peer's own)
                let diff = |s: &Snapshot| {
                    if owner == me {
                        s.registry.first_difference(&self.registry)
                    } else {
                        s.registry.first_local_difference(&self.registry)
                    }
                };
                let snap = match snap.map(|s| (diff(&s), s)) {
                    Ok((None, s)) => s,
                    Ok((Some(d), _)) => {
                        passed.push(format!("{}: another layout than the registered one ({})", man_path.display(), d.0));
                        if owner == me && self.kept_mismatch.is_none() {
                            self.kept_mismatch = Some(d);
                        }
                        continue;
                    }
                    Err(e) => {
                        passed.push(e.to_string());
                        continue;
                    }
                };
                if owner == me {
                    own.push(Arc::new(snap));
                } else {
                    let man = persist::Manifest::of(&snap, owner as u32, world as u32);
                    let data = snap.data;
                    let mut sh = self.shared.locked();
                    let reps = sh.store.entry(owner).or_default();
                    reps.insert(0, replicate::Replica::kept(man, data));
                    reps.sort_by_key(|r| r.manifest.iter);
                }
            }
        }
        self.snaps.adopt_all(own);
        self.kept = iters.first().copied();
        self.shared.locked().failures.extend(passed.into_iter().map(|p| format!("kept copy passed over: {p}")));
    }

    /// After the commit of `iter`: waits for the previous keep, then starts copying `iter`'s
    /// own snapshot and the replicas held of it (a keeper thread), and removes older copies.
    pub(super) fn keep_committed(&mut self, iter: u64) -> Result<()> {
        let Some(root) = self.cfg.keep_dir.clone() else { return Ok(()) };
        let dir = holder_dir(&root, self.comm.rank());
        if self.keeping.as_ref().is_some_and(|(k, _)| *k >= iter) || self.kept.is_some_and(|k| k >= iter) {
            return Ok(());
        }
        self.join_keeper()?;
        let Some(own) = self.snaps.get(iter).cloned() else { return Ok(()) };
        let (me, world) = (self.comm.rank(), self.comm.size());
        let (shared, by, prev) = (self.shared.clone(), self.written.clone(), self.kept);
        let handle = spawn(format!("ckpt-keep-{me}"), move || -> Result<u64> {
            // the replicas are copied out under the lock (memory speed) and written after it,
            // so the receiver threads wait for a memcpy, not for the file system
            let replicas: Vec<(usize, Snapshot)> = {
                let sh = shared.locked();
                sh.store
                    .iter()
                    .filter_map(|(&src, reps)| {
                        reps.iter().find(|r| r.verified && r.manifest.iter == iter).map(|r| {
                            let reg = Arc::new(r.manifest.registry.clone());
                            (src, Snapshot::with_sums(iter, reg, r.data.clone(), r.manifest.sums.clone()))
                        })
                    })
                    .collect()
            };
            if let Some(root) = dir.parent() {
                fs::create_dir_all(root).map_err(|e| keep_error(&dir, iter, CkptError::io(root, e)))?;
            }
            // private to this user: what a restarted rank reads back is trusted
            ironweave_transport::board::private_dir(&dir).map_err(|e| keep_error(&dir, iter, e.into()))?;
            if let Err(e) = write_kept(&dir, me, world, &own, &replicas, &by) {
                let _ = remove_iterations(&dir, |it| it == iter);
                return Err(keep_error(&dir, iter, e));
            }
            // the iteration before stays: a rank that died before its copy of `iter` was whole
            // restores from it
            remove_iterations(&dir, |it| it < prev.unwrap_or(iter).min(iter)).map_err(|e| keep_error(&dir, iter, e))?;
            Ok(iter)
        })?;
        self.keeping = Some((iter, handle));
        Ok(())
    }

    /// Waits for the keeper thread (a keep in flight finishes; its error is returned).
    pub(super) fn join_keeper(&mut self) -> Result<()> {
        if let Some((_, h)) = self.keeping.take() {
            let done = h.join().map_err(|_| CkptError::Invalid("the keeper thread panicked".into()))??;
            self.kept = Some(done);
        }
        Ok(())
    }

    /// After restoring `iter`: copies of newer iterations are void (the job goes on from
    /// `iter`), so they are removed before they could be adopted by a later restart.
    pub(super) fn drop_kept_after(&mut self, iter: u64) -> Result<()> {
        let Some(root) = self.cfg.keep_dir.clone() else { return Ok(()) };
        self.join_keeper().ok();
        let dir = holder_dir(&root, self.comm.rank());
        remove_iterations(&dir, |it| it > iter)?;
        self.kept = persist::iteration_dirs(&dir).into_iter().next();
        Ok(())
    }

    /// The newest iteration this rank's copies in the keep directory are whole for (waits for
    /// a keep in flight).
    pub fn kept(&mut self) -> Result<Option<u64>> {
        self.join_keeper()?;
        Ok(self.kept)
    }

    /// Removes this rank's copies from the keep directory and keeps nothing more (the job
    /// ended; use after a barrier, so that no rank still needs a peer's copies). Returns the
    /// job's directory, holding every rank's `holder-RANK/`, for one rank to remove once every
    /// rank is done. Nothing configured: nothing to do.
    pub fn remove_kept(&mut self) -> Result<Option<PathBuf>> {
        self.join_keeper().ok();
        // a later commit (the shutdown's) keeps nothing: the directory is forgotten
        let Some(root) = self.cfg.keep_dir.take() else { return Ok(None) };
        let dir = holder_dir(&root, self.comm.rank());
        match fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(CkptError::io(&dir, e)),
        }
        self.kept = None;
        Ok(Some(root))
    }
}

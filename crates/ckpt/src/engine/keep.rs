//! Copies that outlive the process ([`EngineConfig::keep_dir`]).
//!
//! Why: torchrun restarts every worker of the job when one fails, so the snapshots and the
//! replicas held in process memory die with the processes that would restore from them. With a
//! keep directory the snapshot buffers and the replica buffers are *segments*: files of the
//! rank's holder directory (`holder-RANK/own-K.seg`, `holder-RANK/rep-SRC-K.seg`, 0600 in a
//! 0700 directory) mapped shared, made once and reused every step. The snapshot is copied into
//! its segment once and sent from there; replicas land in theirs. After each commit the rank
//! writes one small manifest per copy it holds of the committed iteration
//! (`holder-RANK/iter-N/rank-R.json`, naming the segment, with the chunk checksums and a MAC),
//! through a temporary file renamed into place: no byte of the state is written twice. A new
//! engine of the same job and rank maps the segments its manifests name (no copy), checks them
//! and holds them as memory, so [`Engine::restore_latest`] finds them. A segment is refilled
//! only after the manifest naming it is removed. A host that is lost takes its directory with
//! it: its ranks' states then come from the replicas other hosts kept, as from live peers.
//!
//! The two newest committed iterations are kept: when a rank dies every rank has whole copies
//! of the iteration before the newest commit, even if it died before its newest manifest.

use std::fs;
use std::path::{Path, PathBuf};

use super::*;

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
    /// and the replicas it held, each segment mapped again (nothing copied) and checked.
    /// Copies of another job, of another layout, or that fail their MAC or checksums are
    /// passed over (and named in [`Engine::failures`]); the segments their manifests name are
    /// left alone. Then the buffers to come are made in the holder directory.
    pub(super) fn adopt_kept(&mut self) -> Result<()> {
        let Some(root) = self.cfg.keep_dir.clone() else { return Ok(()) };
        let (me, world) = (self.comm.rank(), self.comm.size());
        let dir = holder_dir(&root, me);
        let mut own = Vec::new();
        let mut passed = Vec::new();
        let mut reserved = std::collections::BTreeSet::new();
        let mut claims = Vec::new();
        // a holder directory another user could have written is read not at all
        if dir.exists() {
            ironweave_transport::board::private_dir(&dir)?;
        }
        let iters = persist::iteration_dirs(&dir);
        for &it in &iters {
            for owner in 0..world {
                let (_, man_path) = persist::paths(&dir, it, owner as u32);
                if !man_path.exists() {
                    continue;
                }
                let man = persist::read_manifest(&dir, it, owner as u32);
                if let Some(seg) = man.as_ref().ok().and_then(|m| m.segment_path(&man_path).ok().flatten()) {
                    reserved.insert(seg);
                }
                let snap = match man {
                    Ok(m) if m.job != self.written.job => {
                        passed.push(format!("{}: of job {:?}, not this job's {:?}", man_path.display(), m.job, self.written.job));
                        continue;
                    }
                    Ok(m) => self.map_kept(m, &man_path),
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
                if let Some(p) = snap.data.path() {
                    reserved.remove(p);
                }
                if owner == me {
                    claims.push((snap.iter, man_path));
                    own.push(Arc::new(snap));
                } else {
                    let man = persist::Manifest::of(&snap, owner as u32, world as u32);
                    let mut sh = self.shared.locked();
                    let reps = sh.store.entry(owner).or_default();
                    reps.insert(0, replicate::Replica::kept(man, snap.data, Some(man_path)));
                    reps.sort_by_key(|r| r.manifest.iter);
                }
            }
        }
        self.snaps.adopt_all(own);
        for (it, m) in claims {
            self.snaps.claim(it, m);
        }
        self.kept = iters.first().copied();
        self.shared.locked().failures.extend(passed.into_iter().map(|p| format!("kept copy passed over: {p}")));
        // the buffers to come are segments of the holder directory
        if let Some(root) = dir.parent() {
            fs::create_dir_all(root).map_err(|e| CkptError::io(root, e))?;
        }
        ironweave_transport::board::private_dir(&dir)?;
        self.snaps.set_segment_dir(dir.clone(), reserved.clone());
        self.shared.locked().seg_dir = Some((dir, reserved));
        Ok(())
    }

    /// The kept copy `man` (read from `man_path`) as a snapshot: its segment mapped (no copy;
    /// counted in [`Counters::kept_bytes_mapped`]) or its `safetensors` file read (counted in
    /// [`Counters::kept_bytes_copied`]), its MAC and checksums checked.
    fn map_kept(&self, man: persist::Manifest, man_path: &Path) -> Result<Snapshot> {
        let Some(seg_path) = man.segment_path(man_path)? else {
            let s = persist::load_keyed(
                man_path.parent().and_then(Path::parent).expect("holder/iter-N/rank-R.json"),
                man.iter,
                man.rank,
                self.written.key.as_ref(),
            )?;
            self.counters.kept_bytes_copied.fetch_add(s.data.len() as u64, Ordering::Relaxed);
            return Ok(s);
        };
        let seg = crate::segment::Segment::open(&seg_path)?;
        persist::check_segment(&man, &seg_path, seg.len(), self.written.key.as_ref())?;
        Snapshot::verify(&seg, &man.sums, &seg_path.display().to_string())?;
        self.counters.kept_bytes_mapped.fetch_add(seg.len() as u64, Ordering::Relaxed);
        Ok(Snapshot::with_sums(man.iter, Arc::new(man.registry), seg, man.sums))
    }

    /// After the commit of `iter`: writes the manifest of each copy of `iter` this rank holds
    /// in a segment (its own snapshot, the verified replicas), then removes the manifests of
    /// iterations older than the one committed before (their segments are refilled later).
    /// With `again`, the copies of `iter` are written even if `iter` was kept before (a state
    /// restored from a peer or a file replaces a copy that was lost or failed its checks).
    pub(super) fn keep_committed(&mut self, iter: u64, again: bool) -> Result<()> {
        let Some(root) = self.cfg.keep_dir.clone() else { return Ok(()) };
        let dir = holder_dir(&root, self.comm.rank());
        if self.kept.is_some_and(|k| k >= iter) && !again {
            return Ok(());
        }
        let (me, world) = (self.comm.rank() as u32, self.comm.size() as u32);
        let prev = self.kept;
        let by = self.written.clone();
        let r = (|| -> Result<()> {
            // a state restored from a peer or a file is moved into a segment first
            if let Some(own) = self.snaps.settle(iter)? {
                if own.data.path().is_some_and(|p| p.parent() == Some(dir.as_path())) {
                    let mut man = persist::Manifest::of(&own, me, world);
                    let path = persist::write_segment_manifest(&dir, &mut man, &own.data, &by)?;
                    self.snaps.claim(iter, path);
                }
            }
            let mut sh = self.shared.locked();
            for reps in sh.store.values_mut() {
                for r in reps.iter_mut().filter(|r| r.verified && r.manifest.iter == iter && r.claim.is_none()) {
                    if r.data.path().is_some_and(|p| p.parent() == Some(dir.as_path())) {
                        let mut man = r.manifest.clone();
                        r.claim = Some(persist::write_segment_manifest(&dir, &mut man, &r.data, &by)?);
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = r {
            let _ = remove_iterations(&dir, |it| it == iter);
            return Err(keep_error(&dir, iter, e));
        }
        // the iteration before stays: a rank that died before its manifests of `iter` were
        // written restores from it
        if !again {
            remove_iterations(&dir, |it| it < prev.unwrap_or(iter).min(iter)).map_err(|e| keep_error(&dir, iter, e))?;
        }
        self.kept = Some(self.kept.map_or(iter, |k| k.max(iter)));
        Ok(())
    }

    /// After restoring `iter`: copies of newer iterations are void (the job goes on from
    /// `iter`), so they are removed before they could be adopted by a later restart.
    pub(super) fn drop_kept_after(&mut self, iter: u64) -> Result<()> {
        let Some(root) = self.cfg.keep_dir.clone() else { return Ok(()) };
        let dir = holder_dir(&root, self.comm.rank());
        remove_iterations(&dir, |it| it > iter)?;
        self.kept = persist::iteration_dirs(&dir).into_iter().next();
        Ok(())
    }

    /// The newest iteration this rank's copies in the keep directory are whole for.
    pub fn kept(&mut self) -> Result<Option<u64>> {
        Ok(self.kept)
    }

    /// Removes this rank's copies from the keep directory and keeps nothing more (the job
    /// ended; use after a barrier, so that no rank still needs a peer's copies). Returns the
    /// job's directory, holding every rank's `holder-RANK/`, for one rank to remove once every
    /// rank is done. Nothing configured: nothing to do.
    pub fn remove_kept(&mut self) -> Result<Option<PathBuf>> {
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

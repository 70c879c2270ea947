//! Recovery (`restore_latest`, collective): every rank verifies what it holds (its own
//! snapshots, replicas of others, its files in the persistent tier) and all ranks exchange the
//! lists; [`choose`] — pure — picks the newest iteration for which every rank's state exists
//! somewhere valid, and for each rank where to take it from: the rank's own memory, then a
//! replica (lowest holder first), then the persistent tier. Providers send the state to ranks
//! that lack it; receivers verify it again.

use ironweave_units::Locked;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use super::replicate::replica_limit;
use super::{Engine, Restored, Source};
use crate::error::{CkptError, Result};
use crate::persist;
use crate::snapshot::Snapshot;

use crate::wire::TAG_RESTORE;
/// Iterations each rank advertises per owner during recovery.
pub const ADVERTISE: usize = 4;

/// Who holds a valid copy of what: (owner rank, iteration) → [(holder rank, in memory?)].
pub type Holdings = BTreeMap<(usize, u64), Vec<(usize, bool)>>;

/// Where one rank's state comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// The rank's own snapshot in memory.
    Own,
    /// The replica in this holder's memory.
    Replica(usize),
    /// The rank's own file in the persistent tier.
    Persistent,
}

/// What recovery restores: the iteration and each rank's provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The iteration every rank restores.
    pub iter: u64,
    /// Provider of rank `r`'s state at index `r`.
    pub providers: Vec<Provider>,
}

/// One rank's advertisement: for each owner, up to [`ADVERTISE`] iterations in memory and on
/// disk (newest first, -1: none), from its verified holdings `(owner, iter, in memory?)`.
pub fn advertise(hold: &[(usize, u64, bool)], world: usize) -> Vec<i64> {
    let mut mine = vec![-1i64; world * ADVERTISE * 2];
    for owner in 0..world {
        for (slot, mem) in [(0, true), (1, false)] {
            let mut its: Vec<u64> = hold.iter().filter(|h| h.0 == owner && h.2 == mem).map(|h| h.1).collect();
            its.sort_unstable_by(|a, b| b.cmp(a));
            its.dedup();
            for (k, it) in its.iter().take(ADVERTISE).enumerate() {
                mine[(owner * ADVERTISE + k) * 2 + slot] = *it as i64;
            }
        }
    }
    mine
}

/// Every rank's advertisements (all-gathered, in rank order) as holdings.
pub fn holdings_of(all: &[i64], world: usize) -> Holdings {
    let width = world * ADVERTISE * 2;
    let mut have = Holdings::new();
    for (holder, row) in all.chunks_exact(width).enumerate().take(world) {
        for owner in 0..world {
            for k in 0..ADVERTISE {
                for (slot, mem) in [(0, true), (1, false)] {
                    let v = row[(owner * ADVERTISE + k) * 2 + slot];
                    if v >= 0 {
                        have.entry((owner, v as u64)).or_default().push((holder, mem));
                    }
                }
            }
        }
    }
    have
}

/// The newest iteration every rank's state exists for, and each rank's provider: own memory,
/// then the lowest holder's replica, then the persistent tier. `None`: no such iteration.
pub fn choose(have: &Holdings, world: usize) -> Option<Choice> {
    let candidates: BTreeSet<u64> = have.keys().map(|k| k.1).collect();
    let iter = candidates.iter().rev().copied().find(|&it| (0..world).all(|o| have.contains_key(&(o, it))))?;
    let providers = (0..world)
        .map(|o| {
            let v = &have[&(o, iter)];
            if v.contains(&(o, true)) {
                Provider::Own
            } else if let Some(&(h, _)) = v.iter().filter(|(h, m)| *m && *h != o).min() {
                Provider::Replica(h)
            } else {
                Provider::Persistent
            }
        })
        .collect();
    Some(Choice { iter, providers })
}

impl Engine {
    /// Verified copies this rank holds: (owner rank, iteration, in memory?), and the files of
    /// other jobs in the persistent tier it passed over (`iteration N (job J)`).
    fn holdings(&self) -> (Vec<(usize, u64, bool)>, Vec<String>) {
        let me = self.comm.rank();
        let mut out = Vec::new();
        for s in self.snaps.held() {
            if Snapshot::verify(&s.data, s.sums(), "local snapshot").is_ok() {
                out.push((me, s.iter, true));
            }
        }
        {
            let sh = self.shared.locked();
            for (&src, reps) in &sh.store {
                for r in reps.iter().filter(|r| r.verified) {
                    if Snapshot::verify(&r.data, &r.manifest.sums, "replica").is_ok() {
                        out.push((src, r.manifest.iter, true));
                    }
                }
            }
        }
        let mut foreign = Vec::new();
        if let Some(dir) = &self.cfg.persist_dir {
            let mut mine = 0;
            for it in persist::iterations(dir, me as u32) {
                if mine == ADVERTISE {
                    break;
                }
                // another job's file of this rank (a directory reused): never taken for this
                // job's state unless the configuration says to continue it
                match persist::read_manifest(dir, it, me as u32) {
                    Ok(m) if m.job != self.written.job && !self.cfg.restore_other_jobs => {
                        foreign.push(format!("iteration {it} (job {:?})", m.job));
                        continue;
                    }
                    Ok(_) => {}
                    Err(_) => continue,
                }
                if persist::load(dir, it, me as u32).is_ok() {
                    out.push((me, it, false));
                    mine += 1;
                }
            }
        }
        (out, foreign)
    }

    /// Whether this rank holds any valid copy (its own snapshot, a replica, a file of this
    /// job in the persistent tier): a job where no rank does starts fresh.
    pub fn holds_anything(&self) -> bool {
        !self.holdings().0.is_empty()
    }

    /// The job this engine's state belongs to ([`crate::EngineConfig::job_id`], resolved).
    pub fn job_id(&self) -> &str {
        &self.written.job
    }

    /// Restore the newest iteration every rank can get a valid copy of (collective).
    pub fn restore_latest(&mut self) -> Result<Restored> {
        crate::fault::hit_restore(self.comm.rank());
        let world = self.comm.size();
        let me = self.comm.rank();
        let (held, foreign) = self.holdings();
        let mine = advertise(&held, world);
        let mut all = vec![0i64; mine.len() * world];
        self.comm.all_gather(&mine, &mut all)?;
        let have = holdings_of(&all, world);
        let Some(choice) = choose(&have, world) else {
            let tried: Vec<String> = (0..world)
                .map(|o| {
                    let its: Vec<String> =
                        have.iter().filter(|(k, _)| k.0 == o).map(|(k, v)| format!("{} (on {:?})", k.1, v)).collect();
                    format!(
                        "rank {o}: {}",
                        if its.is_empty() { "nothing valid in any memory or file".to_string() } else { its.join(", ") }
                    )
                })
                .collect();
            return Err(CkptError::NothingToRestore {
                tried: format!(
                    "own memory, replicas on peers and the persistent tier ({}); found {}",
                    self.cfg.persist_dir.as_ref().map(|d| d.display().to_string()).unwrap_or_else(|| "not configured".into()),
                    tried.join("; ")
                ),
                hint: if foreign.is_empty() {
                    "no iteration has a valid copy of every rank's state; restart from scratch or from an older persistent checkpoint".into()
                } else {
                    format!(
                        "files of another job in the persistent tier were passed over on this rank ({}): to continue that job set `EngineConfig::restore_other_jobs` (or resume from it: `--resume-from`), else give this job an empty directory",
                        foreign.join(", ")
                    )
                },
            });
        };
        let iter = choice.iter;
        // serve others first without blocking (two providers may serve each other), then get
        // mine, then wait for the sends
        let mut sends = Vec::new();
        for (o, p) in choice.providers.iter().enumerate() {
            if *p == Provider::Replica(me) {
                let (man, data) = {
                    let sh = self.shared.locked();
                    let r = sh.store.get(&o).and_then(|v| v.iter().find(|r| r.verified && r.manifest.iter == iter)).ok_or_else(
                        || CkptError::Invalid(format!("replica of rank {o} iteration {iter} vanished while restoring")),
                    )?;
                    (serde_json::to_vec(&r.manifest).map_err(|e| CkptError::Invalid(e.to_string()))?, r.data.to_vec())
                };
                sends.push(self.comm.isend_bytes(o, TAG_RESTORE, man)?);
                sends.push(self.comm.isend_bytes(o, TAG_RESTORE, data)?);
            }
        }
        let (snapshot, source) = match choice.providers[me] {
            Provider::Own => (
                self.snaps
                    .get(iter)
                    .cloned()
                    .ok_or_else(|| CkptError::Invalid(format!("own snapshot of iteration {iter} vanished")))?,
                Source::Local,
            ),
            Provider::Persistent => {
                let dir = self.cfg.persist_dir.as_ref().expect("advertised a file, so a directory is configured");
                (Arc::new(persist::load(dir, iter, me as u32)?), Source::Persistent)
            }
            Provider::Replica(p) => {
                let man = self.comm.recv_bytes(p, TAG_RESTORE)?;
                // the manifest is checked before the state is taken: it must be this rank's,
                // of the chosen iteration, in the registered layout
                let man = crate::wire::decode_restore_manifest(p, me, iter, &man, replica_limit(self.registry.total))?;
                if man.registry != *self.registry {
                    return Err(CkptError::Corrupt {
                        what: format!("state of rank {me} from rank {p}"),
                        detail: "its layout differs from the registered one".into(),
                    });
                }
                let data = self.comm.recv_bytes(p, TAG_RESTORE)?;
                if data.len() as u64 != man.registry.total {
                    return Err(CkptError::Corrupt {
                        what: format!("state of rank {me} from rank {p}"),
                        detail: format!("{} bytes, the manifest says {}", data.len(), man.registry.total),
                    });
                }
                Snapshot::verify(&data, &man.sums, &format!("state of rank {me} from rank {p}"))?;
                (Arc::new(Snapshot::with_sums(iter, Arc::new(man.registry), data, man.sums)), Source::Peer(p))
            }
        };
        let deadline = Instant::now() + self.cfg.timeout;
        for h in sends {
            h.wait(deadline)?;
        }
        if *snapshot.registry != *self.registry {
            return Err(CkptError::Invalid(format!(
                "the restored state's layout differs from the registered one (iteration {iter})"
            )));
        }
        // Everything newer than the restored iteration is void; replication restarts from here.
        // The restored state stays held: it is the committed iteration, and this rank's copy
        // of it must outlive a failure before a newer one commits.
        self.snaps.adopt(snapshot.clone());
        self.pending = None;
        self.sched.locked().releaser = None;
        {
            let mut sh = self.shared.locked();
            sh.acks.retain(|&i, _| i <= iter);
            for v in sh.store.values_mut() {
                v.retain(|r| r.manifest.iter <= iter);
            }
        }
        self.last_sent = None;
        self.drop_kept_after(iter)?;
        // a state that came from a peer or a file is kept again at once: this rank's copy of
        // it was lost or failed its checks
        if source != Source::Local {
            self.keep_committed(iter, true)?;
        }
        self.comm.barrier()?;
        self.committed = Some(iter);
        Ok(Restored { iter, snapshot, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_takes_the_newest_iteration_every_rank_has_and_the_nearest_copy() {
        // 3 ranks. Rank 0 holds its own 5 and 6 and rank 1's replica of 6; rank 1 lost its
        // memory (restarted) but has a file of 4; rank 2 holds its own 6 and rank 0's 5;
        // rank 1's 5 is only on rank 2.
        let ads = [
            advertise(&[(0, 5, true), (0, 6, true), (1, 6, true)], 3),
            advertise(&[(1, 4, false)], 3),
            advertise(&[(2, 5, true), (2, 6, true), (0, 5, true), (1, 5, true)], 3),
        ]
        .concat();
        let have = holdings_of(&ads, 3);
        let c = choose(&have, 3).unwrap();
        assert_eq!(c.iter, 6);
        assert_eq!(c.providers, vec![Provider::Own, Provider::Replica(0), Provider::Own]);
        // without rank 0's replica of 6, iteration 5 (rank 1's from rank 2); without any 5 of
        // rank 1 either, nothing (rank 1's file of 4 is alone)
        let ads = [
            advertise(&[(0, 5, true), (0, 6, true)], 3),
            advertise(&[(1, 4, false)], 3),
            advertise(&[(2, 5, true), (2, 6, true), (1, 5, true)], 3),
        ]
        .concat();
        let c = choose(&holdings_of(&ads, 3), 3).unwrap();
        assert_eq!((c.iter, c.providers), (5, vec![Provider::Own, Provider::Replica(2), Provider::Own]));
        let ads = [advertise(&[(0, 5, true)], 3), advertise(&[(1, 4, false)], 3), advertise(&[(2, 5, true)], 3)].concat();
        assert_eq!(choose(&holdings_of(&ads, 3), 3), None);
        // everything on disk only: the persistent tier
        let ads = [advertise(&[(0, 4, false)], 2), advertise(&[(1, 4, false)], 2)].concat();
        let c = choose(&holdings_of(&ads, 2), 2).unwrap();
        assert_eq!((c.iter, c.providers), (4, vec![Provider::Persistent, Provider::Persistent]));
    }
}

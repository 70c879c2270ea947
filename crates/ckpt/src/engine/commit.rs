//! The commit protocol: iteration `i` of rank `r` is *replicated* when every holder of `r` has
//! acknowledged a verified copy of it (or, for the storage strategies, when its write
//! finished). `commit` takes, on every rank, the newest replicated iteration, and the minimum
//! over all ranks (an all-reduce) is the newest *committed* iteration: every chunk of every
//! rank's state has arrived and been verified on every replica. A torn iteration is never
//! committed.

use ironweave_units::Locked;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ironweave_transport::ReduceOp;

use super::replicate::Shared;
use super::{Engine, Strategy};
use crate::error::{CkptError, Result};

/// The newest iteration every one of `holders` acknowledged as verified. Pure.
pub fn newest_replicated(acks: &BTreeMap<u64, BTreeMap<usize, bool>>, holders: &[usize]) -> Option<u64> {
    acks.iter().rev().find(|(_, a)| holders.iter().all(|h| a.get(h) == Some(&true))).map(|(&i, _)| i)
}

impl Engine {
    fn replicated_upto(&self) -> Option<u64> {
        match self.cfg.strategy {
            Strategy::None => None,
            Strategy::Blocking | Strategy::Async => self.durable,
            _ if self.holders.is_empty() => self.last_sent,
            _ => newest_replicated(&self.shared.locked().acks, &self.holders),
        }
    }

    pub(super) fn join_writer(&mut self) -> Result<()> {
        if let Some(w) = self.writer.take() {
            let done = w.join().map_err(|_| CkptError::Invalid("the background writer panicked".into()))??;
            self.durable = Some(done);
        }
        Ok(())
    }

    /// Agree on the newest committed iteration (collective). With `wait`, first send whatever
    /// is held back and wait (bounded) until this rank's newest snapshot is acknowledged by all
    /// its holders (or written, for the storage strategies).
    pub fn commit(&mut self, wait: bool) -> Result<Option<u64>> {
        let t0 = self.now_ns();
        let r = self.commit_inner(wait);
        if let Ok(Some(c)) = r {
            self.keep_committed(c, false)?;
        }
        self.exposed_ns += self.now_ns().saturating_sub(t0);
        r
    }

    fn commit_inner(&mut self, wait: bool) -> Result<Option<u64>> {
        if let Some(s) = self.snaps.latest() {
            crate::fault::hit("commit", self.comm.rank(), s.iter);
        }
        if wait {
            if self.cfg.strategy == Strategy::Async {
                self.join_writer()?;
            }
            self.flush_pending();
            if self.cfg.strategy.in_memory() {
                self.wait_for_acks(self.last_sent);
            }
        } else if self.cfg.strategy == Strategy::Async && self.writer.as_ref().is_some_and(|w| w.is_finished()) {
            self.join_writer()?;
        }
        self.agree()
    }

    /// Waits (bounded: half the timeout, so that peers already in the next all-reduce do not
    /// time out first) until every holder answered for iteration `want`, or a holder is lost.
    pub(super) fn wait_for_acks(&self, want: Option<u64>) {
        let Some(want) = want else { return };
        let deadline = Instant::now() + self.cfg.timeout / 2;
        // no holders (a world of one): nothing to wait for
        let answered = |sh: &Shared| {
            self.holders.is_empty() || sh.acks.get(&want).is_some_and(|a| self.holders.iter().all(|h| a.contains_key(h)))
        };
        while !answered(&self.shared.locked()) && Instant::now() < deadline {
            if !self.shared.locked().lost_holders.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The all-reduce that agrees on the newest committed iteration (collective).
    pub(super) fn agree(&mut self) -> Result<Option<u64>> {
        // never below the last agreement (a restore sets it): a restarted process has no
        // acknowledgements of the restored iteration, yet every rank holds a copy of it
        let mine: [i64; 1] = [self.replicated_upto().max(self.committed).map(|i| i as i64).unwrap_or(-1)];
        let mut v = mine;
        self.comm.all_reduce(&mut v, ReduceOp::Min)?;
        self.committed = (v[0] >= 0).then_some(v[0] as u64);
        Ok(self.committed)
    }

    /// Snapshots (own and replicas) of iterations from this one on are kept: the newest
    /// committed iteration (0 while none is: keep all; `u64::MAX` for the storage strategies,
    /// whose copies are on storage).
    pub(super) fn keep_from(&self) -> u64 {
        if self.cfg.strategy.in_memory() {
            self.committed.unwrap_or(0)
        } else {
            u64::MAX
        }
    }

    /// The last agreed committed iteration.
    pub fn committed(&self) -> Option<u64> {
        self.committed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_iteration_every_holder_verified_is_replicated() {
        let mut acks: BTreeMap<u64, BTreeMap<usize, bool>> = BTreeMap::new();
        acks.entry(3).or_default().extend([(1, true), (2, true)]);
        acks.entry(4).or_default().extend([(1, true), (2, false)]);
        acks.entry(5).or_default().extend([(1, true)]);
        assert_eq!(newest_replicated(&acks, &[1, 2]), Some(3));
        assert_eq!(newest_replicated(&acks, &[1]), Some(5));
        assert_eq!(newest_replicated(&acks, &[7]), None);
    }
}

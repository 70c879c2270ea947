//! Test hooks (feature `test-hooks`, as tokio's `test-util`: off in every build but the
//! tests'): forget memory, corrupt a chunk in transit or a held replica, stall replication.

use super::*;

impl Engine {
    /// Test hook: forget everything held in memory (as a restarted process would).
    #[cfg(feature = "test-hooks")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-hooks")))]
    pub fn forget_memory_for_test(&mut self) {
        self.forget_memory();
    }

    /// Test hook: flip a bit of iteration `iter`'s first chunk on its way to every holder.
    #[cfg(feature = "test-hooks")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-hooks")))]
    pub fn corrupt_in_transit_for_test(&self, iter: u64) {
        self.corrupt_in_transit.store(iter, Ordering::SeqCst);
    }

    /// Test hook: flip a byte of the replica of `src`'s iteration `iter` held here.
    #[cfg(feature = "test-hooks")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-hooks")))]
    pub fn corrupt_replica_for_test(&self, src: usize, iter: u64, offset: usize) -> bool {
        let mut sh = self.shared.locked();
        if let Some(r) = sh.store.get_mut(&src).and_then(|v| v.iter_mut().find(|r| r.manifest.iter == iter)) {
            if let Some(b) = r.data.get_mut(offset) {
                *b ^= 0x20;
                return true;
            }
        }
        false
    }

    /// Test hook: while `on`, this rank's sender threads drop every chunk and `End` (its
    /// replicas begin on the holders and never complete: a link that delivers nothing).
    #[cfg(feature = "test-hooks")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-hooks")))]
    pub fn stall_replication_for_test(&self, on: bool) {
        self.stall_replication.store(on, Ordering::SeqCst);
    }
}

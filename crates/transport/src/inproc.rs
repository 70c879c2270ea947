//! The in-process backend: ranks are threads of one process, messages are moved through
//! shared mailboxes. Fast and deterministic; used to unit-test the collective algorithms.

use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::link::{Link, LinkInfo, Mailbox, MemKind, RecvHandle, SendHandle, SeqTable, SpeedSource, Tag};

/// One rank's link of an in-process world.
#[derive(Debug)]
pub struct InProcLink {
    rank: usize,
    info: LinkInfo,
    boxes: Arc<Vec<Arc<Mailbox>>>,
    seqs: SeqTable,
}

/// The communicators of an `n`-rank in-process world with default options: give communicator
/// `i` to the thread of rank `i` (`communicators(1)` is a world of one, for code that runs the
/// same alone and in a job).
pub fn communicators(n: usize) -> Result<Vec<crate::Communicator>> {
    world(n).into_iter().map(|l| crate::Communicator::new(vec![l], crate::CommOptions::default())).collect()
}

/// Creates the links of an `n`-rank in-process world; give link i to the thread of rank i.
pub fn world(n: usize) -> Vec<Arc<dyn Link>> {
    let boxes: Arc<Vec<Arc<Mailbox>>> = Arc::new((0..n).map(|r| Arc::new(Mailbox::new(r, n, 1, usize::MAX))).collect());
    (0..n)
        .map(|rank| {
            let info = LinkInfo {
                name: "inproc".into(),
                backend: "inproc",
                bandwidth_bytes_per_s: 10e9,
                latency_s: 1e-6,
                speed_source: SpeedSource::Declared,
                memory: vec![MemKind::Host],
            };
            Arc::new(InProcLink { rank, info, boxes: boxes.clone(), seqs: SeqTable::default() }) as Arc<dyn Link>
        })
        .collect()
}

impl InProcLink {
    fn check_peer(&self, peer: usize) -> Result<()> {
        self.boxes[self.rank].check_peer(peer)
    }
}

impl Link for InProcLink {
    fn info(&self) -> &LinkInfo {
        &self.info
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.boxes.len()
    }
    fn send(&self, peer: usize, tag: Tag, data: &[u8], _deadline: Instant) -> Result<()> {
        self.check_peer(peer)?;
        let seq = self.seqs.next(peer, tag);
        self.boxes[peer].deliver_whole(self.rank, tag, seq, data.to_vec())
    }
    fn isend(&self, peer: usize, tag: Tag, data: Vec<u8>) -> Result<SendHandle> {
        self.check_peer(peer)?;
        let seq = self.seqs.next(peer, tag);
        self.boxes[peer].deliver_whole(self.rank, tag, seq, data)?;
        // The buffer moved into the peer's mailbox; hand back an empty one.
        Ok(SendHandle::ready(Ok(Vec::new())))
    }
    fn irecv(&self, peer: usize, tag: Tag) -> Result<RecvHandle> {
        self.check_peer(peer)?;
        Ok(self.boxes[self.rank].post(peer, tag))
    }
    fn abort(&self, reason: &str) {
        for (r, mb) in self.boxes.iter().enumerate() {
            let err = if r == self.rank {
                Error::Aborted { reason: reason.into() }
            } else {
                Error::PeerAborted { rank: self.rank, reason: reason.into() }
            };
            mb.fail(err);
        }
    }
}

//! The one error type of the transport crate.

use std::time::Duration;

/// Everything that can go wrong in a transport, a collective or the rendezvous.
///
/// Errors are `Clone` because one failure (a lost peer, an abort) is reported to every
/// operation waiting on the link; I/O errors are therefore carried as text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A peer process went away (its connection closed without a goodbye).
    #[error("peer rank {rank} was lost ({detail}); the communicator is unusable: restart the job or rebuild the group without that rank")]
    PeerLost { rank: usize, detail: String },
    /// A peer aborted the job after an error of its own.
    #[error("rank {rank} aborted the communicator: {reason}")]
    PeerAborted { rank: usize, reason: String },
    /// A peer finished (said goodbye) while this rank still expected data from it.
    #[error("peer rank {rank} closed its link while rank {me} still waited for data from it: the ranks do not run the same sequence of operations")]
    PeerClosed { rank: usize, me: usize },
    /// This link was aborted locally (after an earlier error).
    #[error("the link was aborted earlier: {reason}")]
    Aborted { reason: String },
    /// A blocking call passed its deadline.
    #[error("{}", timeout_message(what, after))]
    Timeout { what: String, after: Duration },
    /// Sizes disagree between ranks (or with the counts the caller gave).
    #[error("length mismatch in {op}: expected {expected} bytes from rank {peer}, got {got}: every rank must pass buffers of matching size")]
    LengthMismatch { op: &'static str, peer: usize, expected: usize, got: usize },
    /// The caller passed arguments that cannot work.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A rank index outside the group.
    #[error("rank {rank} is out of range for a group of size {size}")]
    RankOutOfRange { rank: usize, size: usize },
    /// A buffer lives in memory this backend cannot touch.
    #[error("link {link:?} cannot touch {memory} memory; use a backend that declares it (NCCL for device memory) or stage through host memory")]
    UnsupportedMemory { link: String, memory: String },
    /// A frame or message on the wire is malformed.
    #[error("protocol error from {from}: {detail}")]
    Protocol { from: String, detail: String },
    /// The handshake with a peer failed (secret, job id, world size, version).
    #[error("handshake with {peer} rejected: {reason}")]
    HandshakeRejected { peer: String, reason: String },
    /// The environment or configuration does not describe a usable job.
    #[error("configuration: {0}")]
    Config(String),
    /// An operating-system I/O error.
    #[error("I/O error during {context}: {message}")]
    Io { context: String, message: String },
    /// A rank gave up forming a generation of an elastic job: a newer one was announced on the
    /// job's board (ranks failed or restarted meanwhile), or the job ended (`by` None).
    #[error("{}", superseded_message(*generation, by))]
    Superseded { generation: u16, by: Option<u16> },
    /// The job's board (or its commit record) could not be written: the waits it ends and the
    /// commits it remembers would be lost, so the rank stops (`ironweave launch` reports it
    /// and does not restart the job).
    #[error("the job board {path} cannot be written ({detail}; {free}): free space there or point TMPDIR at a writable file system, then start the job again")]
    Board { path: String, detail: String, free: String },
    /// A backend feature that was not compiled in.
    #[error("ironweave was built without the `{feature}` feature; rebuild with `--features {feature}`")]
    NotCompiledWith { feature: &'static str },
}

impl Error {
    /// Wraps an `std::io::Error` with what was being done.
    pub fn io(context: impl Into<String>, err: &std::io::Error) -> Self {
        Error::Io { context: context.into(), message: err.to_string() }
    }

    /// True for errors a later attempt of the same formation or operation may not meet: a
    /// deadline passed, a peer died, went away or could not be reached (a link down, a peer
    /// restarting). Not for misuse, misconfiguration or a peer speaking another protocol.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::PeerLost { .. } | Error::PeerClosed { .. } | Error::Io { .. })
    }

    /// True for errors after which the link can no longer be used.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, Error::InvalidArgument(_) | Error::RankOutOfRange { .. } | Error::UnsupportedMemory { .. })
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

fn superseded_message(generation: u16, by: &Option<u16>) -> String {
    match by {
        Some(b) => format!("generation {generation} was given up: generation {b} was announced on the job board (ranks failed or restarted meanwhile); join that one"),
        None => format!("generation {generation} was given up: the job finished (every rank passed its final barrier)"),
    }
}

/// A timeout said as it happened: after how long, or that the deadline had passed before the
/// wait began (an earlier step of the same operation used up the time).
fn timeout_message(what: &str, after: &Duration) -> String {
    if after.is_zero() {
        format!(
            "{what} did not complete: its deadline had already passed when it began (an earlier step used up the time: a peer is stuck, dead or runs a different sequence of operations; raise IRONWEAVE_TIMEOUT_S if it is just slow)"
        )
    } else {
        format!(
            "{what} did not complete within {after:?}: a peer is stuck, dead or runs a different sequence of operations (raise IRONWEAVE_TIMEOUT_S if it is just slow)"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_passed_before_the_wait_says_so() {
        let late = Error::Timeout { what: "connecting to 10.0.0.1:5".into(), after: Duration::ZERO }.to_string();
        assert!(late.contains("deadline had already passed") && !late.contains("0ns"), "{late}");
        let slow = Error::Timeout { what: "receive from rank 1".into(), after: Duration::from_secs(3) }.to_string();
        assert!(slow.contains("did not complete within 3s"), "{slow}");
    }
}

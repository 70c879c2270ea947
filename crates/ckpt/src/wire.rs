//! Every message the checkpoint engine exchanges with peers, encoded and decoded in one place.
//! Decoders see bytes a peer chose: they check every length before reading, refuse a manifest
//! whose claims do not hold before anything is allocated for it, and name the peer in every
//! error. The fuzz target `ckpt_wire` drives them (`fuzz/`, corpus replayed by `cargo test`).
//!
//! Replication (tag [`TAG_DATA`], on the link view the chunk was routed to):
//! `Begin`: `0 | keep_from u64 | manifest JSON` (sent on every link the engine uses,
//! idempotent; `keep_from`: the sender's newest committed iteration, whose replica and newer
//! ones the holder keeps);
//! `Chunk`: `1 | iter u64 | offset u64 | bytes`; `End`: `2 | iter u64` (on the first link).
//! Acknowledgements (tag [`TAG_ACK`], first link): `iter u64 | verified u8 (0 or 1)`.
//! Restore (tag [`TAG_RESTORE`]): the manifest JSON, then the state's bytes.

use std::ops::Range;

use crate::error::{CkptError, Result};
use crate::persist::Manifest;

/// Tag of replica messages.
pub const TAG_DATA: u32 = 0x4943_4b01;
/// Tag of acknowledgements.
pub const TAG_ACK: u32 = 0x4943_4b02;
/// Tag of a restore's manifest and state.
pub const TAG_RESTORE: u32 = 0x4943_4b03;
const MSG_BEGIN: u8 = 0;
const MSG_CHUNK: u8 = 1;
const MSG_END: u8 = 2;
/// Bytes before a chunk's payload.
pub const CHUNK_HEADER: usize = 17;

/// One replica message as it arrived from a peer.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplicaMsg<'a> {
    /// A replica begins: its manifest (checked), and from which iteration on the holder keeps
    /// this sender's replicas (the sender's newest committed one; 0: every one).
    Begin {
        /// The manifest.
        manifest: Manifest,
        /// Replicas of iterations from this one on are kept.
        keep_from: u64,
    },
    /// Bytes of the replica of `iter` at `offset`.
    Chunk {
        /// Iteration.
        iter: u64,
        /// Byte offset in the state.
        offset: u64,
        /// The payload.
        bytes: &'a [u8],
    },
    /// The sender released every chunk of `iter`.
    End {
        /// Iteration.
        iter: u64,
    },
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at.checked_add(8)?).map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
}

fn corrupt(what: String, detail: impl Into<String>) -> CkptError {
    CkptError::Corrupt { what, detail: detail.into() }
}

impl<'a> ReplicaMsg<'a> {
    /// `Begin` of `man`; the holder keeps this sender's replicas from `keep_from` on.
    pub fn encode_begin(man: &Manifest, keep_from: u64) -> Result<Vec<u8>> {
        let mut v = vec![MSG_BEGIN];
        v.extend_from_slice(&keep_from.to_le_bytes());
        serde_json::to_writer(&mut v, man).map_err(|e| CkptError::Invalid(e.to_string()))?;
        Ok(v)
    }

    /// `Chunk` of `bytes` at `offset` of iteration `iter`.
    pub fn encode_chunk(iter: u64, offset: u64, bytes: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(CHUNK_HEADER + bytes.len());
        v.push(MSG_CHUNK);
        v.extend_from_slice(&iter.to_le_bytes());
        v.extend_from_slice(&offset.to_le_bytes());
        v.extend_from_slice(bytes);
        v
    }

    /// The header of a `Chunk` at `offset` of iteration `iter`: sent with the payload as one
    /// message from where the payload lies ([`ironweave_transport::Communicator::send_bytes_parts`]).
    pub fn chunk_header(iter: u64, offset: u64) -> [u8; CHUNK_HEADER] {
        let mut h = [0u8; CHUNK_HEADER];
        h[0] = MSG_CHUNK;
        h[1..9].copy_from_slice(&iter.to_le_bytes());
        h[9..17].copy_from_slice(&offset.to_le_bytes());
        h
    }

    /// `End` of iteration `iter`.
    pub fn encode_end(iter: u64) -> Vec<u8> {
        let mut v = vec![MSG_END];
        v.extend_from_slice(&iter.to_le_bytes());
        v
    }

    /// Decodes a message from rank `src`; a `Begin`'s manifest must pass
    /// [`Manifest::check_from`] with `limit` (the most bytes one replica may claim here).
    pub fn decode(src: usize, msg: &'a [u8], limit: u64) -> Result<Self> {
        match msg.first() {
            Some(&MSG_BEGIN) => {
                let Some(keep_from) = u64_at(msg, 1) else {
                    return Err(corrupt(format!("begin from rank {src}"), format!("short header ({} bytes)", msg.len())));
                };
                let man: Manifest =
                    serde_json::from_slice(&msg[9..]).map_err(|e| corrupt(format!("manifest from rank {src}"), e.to_string()))?;
                man.check_from(src, limit)?;
                Ok(ReplicaMsg::Begin { manifest: man, keep_from })
            }
            Some(&MSG_CHUNK) => match (u64_at(msg, 1), u64_at(msg, 9)) {
                (Some(iter), Some(offset)) => Ok(ReplicaMsg::Chunk { iter, offset, bytes: &msg[CHUNK_HEADER..] }),
                _ => Err(corrupt(format!("chunk from rank {src}"), format!("short header ({} bytes)", msg.len()))),
            },
            Some(&MSG_END) => match u64_at(msg, 1) {
                Some(iter) if msg.len() == 9 => Ok(ReplicaMsg::End { iter }),
                _ => Err(corrupt(format!("end from rank {src}"), format!("{} bytes, expected 9", msg.len()))),
            },
            Some(k) => Err(corrupt(format!("message from rank {src}"), format!("unknown kind {k}"))),
            None => Err(corrupt(format!("message from rank {src}"), "empty")),
        }
    }
}

impl ReplicaMsg<'_> {
    /// The (iteration, offset) of a `Chunk` from the first bytes of its message (a chunk whose
    /// payload arrived in parts).
    pub fn decode_chunk_header(src: usize, first: &[u8]) -> Result<(u64, u64)> {
        match (first.first(), u64_at(first, 1), u64_at(first, 9)) {
            (Some(&MSG_CHUNK), Some(iter), Some(offset)) => Ok((iter, offset)),
            (Some(&MSG_CHUNK), ..) => {
                Err(corrupt(format!("chunk from rank {src}"), format!("short header ({} bytes)", first.len())))
            }
            _ => Err(corrupt(format!("message from rank {src}"), "a message in parts that is not a chunk")),
        }
    }
}

/// Where a chunk of `len` bytes at `offset` lands in a replica of `total` bytes; `None` when
/// any byte of it falls outside (no arithmetic on the peer's numbers can overflow).
pub fn chunk_range(offset: u64, len: usize, total: usize) -> Option<Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(len)?;
    (end <= total).then_some(start..end)
}

/// An acknowledgement: the holder verified (or failed to verify) its replica of `iter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    /// Iteration.
    pub iter: u64,
    /// Whether every checksum matched.
    pub verified: bool,
}

impl Ack {
    /// Wire form.
    pub fn encode(self) -> [u8; 9] {
        let mut v = [0u8; 9];
        v[..8].copy_from_slice(&self.iter.to_le_bytes());
        v[8] = u8::from(self.verified);
        v
    }

    /// Decodes an acknowledgement from `holder`: exactly 9 bytes, a verdict of 0 or 1.
    pub fn decode(holder: usize, msg: &[u8]) -> Result<Ack> {
        let what = || format!("acknowledgement from rank {holder}");
        if msg.len() != 9 {
            return Err(corrupt(what(), format!("{} bytes, expected 9", msg.len())));
        }
        let iter = u64_at(msg, 0).expect("9 bytes");
        match msg[8] {
            0 | 1 => Ok(Ack { iter, verified: msg[8] == 1 }),
            v => Err(corrupt(what(), format!("verdict {v}, expected 0 or 1"))),
        }
    }
}

/// Decodes the manifest rank `provider` sends with rank `owner`'s state during a restore of
/// `iter`: it must be `owner`'s, of `iter`, laid out as `owner` registered (`registry_total`
/// bytes and the same layout are checked by the caller against its registry) and pass
/// [`Manifest::check_from`] with `limit`.
pub fn decode_restore_manifest(provider: usize, owner: usize, iter: u64, msg: &[u8], limit: u64) -> Result<Manifest> {
    let what = || format!("state of rank {owner} from rank {provider}");
    let man: Manifest = serde_json::from_slice(msg).map_err(|e| corrupt(what(), format!("manifest: {e}")))?;
    if man.iter != iter || man.rank as usize != owner {
        return Err(corrupt(what(), format!("got rank {}'s iteration {}, expected iteration {iter}", man.rank, man.iter)));
    }
    man.check_from(owner, limit).map_err(|e| corrupt(what(), e.to_string()))?;
    Ok(man)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persist::FORMAT;
    use crate::registry::{DType, Registry, TensorSpec};

    fn manifest(rank: u32, iter: u64) -> Manifest {
        let registry = Registry::new(&[TensorSpec::new("w", DType::F32, &[4])]).unwrap();
        Manifest {
            format: FORMAT.into(),
            rank,
            world: 2,
            iter,
            registry,
            sums: vec![],
            tensor_xxh3: vec![],
            layout: Default::default(),
            job: String::new(),
            mac: String::new(),
            segment: String::new(),
        }
    }

    #[test]
    fn messages_round_trip() {
        let m = manifest(3, 7);
        assert_eq!(
            ReplicaMsg::decode(3, &ReplicaMsg::encode_begin(&m, 5).unwrap(), 1 << 20).unwrap(),
            ReplicaMsg::Begin { manifest: m, keep_from: 5 }
        );
        let c = ReplicaMsg::encode_chunk(7, 12, &[1, 2, 3]);
        assert_eq!(c[..CHUNK_HEADER], ReplicaMsg::chunk_header(7, 12));
        assert_eq!(ReplicaMsg::decode(3, &c, 0).unwrap(), ReplicaMsg::Chunk { iter: 7, offset: 12, bytes: &[1, 2, 3] });
        assert_eq!(ReplicaMsg::decode(3, &ReplicaMsg::encode_end(7), 0).unwrap(), ReplicaMsg::End { iter: 7 });
        let a = Ack { iter: 9, verified: true };
        assert_eq!(Ack::decode(1, &a.encode()).unwrap(), a);
    }

    #[test]
    fn hostile_lengths_and_values_are_refused_naming_the_peer() {
        let err = |r: Result<ReplicaMsg<'_>>| r.unwrap_err().to_string();
        assert!(err(ReplicaMsg::decode(5, &[], 0)).contains("rank 5"));
        assert!(err(ReplicaMsg::decode(5, &[2, 1, 2], 0)).contains("expected 9"));
        assert!(err(ReplicaMsg::decode(5, &[2; 20], 0)).contains("expected 9"));
        assert!(err(ReplicaMsg::decode(5, &[1; 16], 0)).contains("short header"));
        assert!(err(ReplicaMsg::decode(5, &[0; 8], 0)).contains("short header"));
        assert!(Ack::decode(4, &[0; 8]).unwrap_err().to_string().contains("rank 4"));
        assert!(Ack::decode(4, &[0; 10]).is_err());
        assert!(Ack::decode(4, &[0, 0, 0, 0, 0, 0, 0, 0, 2]).unwrap_err().to_string().contains("verdict 2"));
        // a chunk at an absurd offset cannot overflow into a valid range
        assert_eq!(chunk_range(u64::MAX, 16, 64), None);
        assert_eq!(chunk_range(u64::MAX - 3, 8, usize::MAX), None);
        assert_eq!(chunk_range(48, 16, 64), Some(48..64));
        assert_eq!(chunk_range(49, 16, 64), None);
    }

    #[test]
    fn a_restore_manifest_must_be_the_owners_iteration() {
        let m = serde_json::to_vec(&manifest(1, 7)).unwrap();
        assert!(decode_restore_manifest(0, 1, 7, &m, 1 << 20).is_ok());
        let e = decode_restore_manifest(0, 1, 8, &m, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("from rank 0") && e.contains("expected iteration 8"), "{e}");
        let e = decode_restore_manifest(0, 2, 7, &m, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("rank 2"), "{e}");
        // a claim over the limit
        let e = decode_restore_manifest(0, 1, 7, &m, 8).unwrap_err().to_string();
        assert!(e.contains("limit"), "{e}");
        assert!(decode_restore_manifest(0, 1, 7, b"{", 1 << 20).is_err());
    }
}

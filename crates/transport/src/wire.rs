//! Wire formats shared by the TCP backend and the rendezvous: the data frame header and the
//! handshake messages. Decoders check every length before using it and never allocate what a
//! peer merely claims: a header is fixed-size, a handshake message is capped at
//! [`MAX_HANDSHAKE`] bytes, and a data payload is only read after its claimed size passed the
//! receiver's limit.

use sha2::{Digest, Sha256};

/// Size of an encoded [`FrameHeader`].
pub const HEADER_LEN: usize = 48;
/// Largest handshake message accepted.
pub const MAX_HANDSHAKE: usize = 4096;
/// Protocol version carried in the handshake.
pub const VERSION: u16 = 1;

const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"IWF1");
const HS_MAGIC: u32 = u32::from_le_bytes(*b"IWH1");

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:#010x}: not an ironweave peer")]
    BadMagic(u32),
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    #[error("reserved bytes are not zero")]
    Reserved,
    #[error("payload of {len} bytes at offset {offset} does not fit a {total}-byte message")]
    Overrun { offset: u64, len: u64, total: u64 },
    #[error("message of {total} bytes exceeds the limit of {limit} bytes")]
    TooLarge { total: u64, limit: u64 },
    #[error("truncated: needed {needed} bytes, have {have}")]
    Truncated { needed: usize, have: usize },
    #[error("{0}")]
    Malformed(&'static str),
}

/// Kind of a data-connection frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// Part of a message: `len` payload bytes at `offset` of a `total`-byte message.
    Data = 1,
    /// The sender closes this connection on purpose; no frame follows.
    Goodbye = 2,
    /// The sender aborted; the payload is the reason (UTF-8, at most 4 KiB).
    Abort = 3,
}

/// Header of every frame on a data connection (48 bytes, little endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub tag: u64,
    pub seq: u64,
    pub total: u64,
    pub offset: u64,
    pub len: u64,
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.total.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and validates a header; `max_message` bounds `total` (and so `len`).
    pub fn decode(b: &[u8], max_message: u64) -> Result<FrameHeader, WireError> {
        if b.len() < HEADER_LEN {
            return Err(WireError::Truncated { needed: HEADER_LEN, have: b.len() });
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != FRAME_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let kind = match b[4] {
            1 => FrameKind::Data,
            2 => FrameKind::Goodbye,
            3 => FrameKind::Abort,
            k => return Err(WireError::BadKind(k)),
        };
        if b[5..8] != [0, 0, 0] {
            return Err(WireError::Reserved);
        }
        let h = FrameHeader { kind, tag: u64_at(8), seq: u64_at(16), total: u64_at(24), offset: u64_at(32), len: u64_at(40) };
        let limit = match kind {
            FrameKind::Data => max_message,
            FrameKind::Goodbye => 0,
            FrameKind::Abort => 4096,
        };
        if h.total > limit {
            return Err(WireError::TooLarge { total: h.total, limit });
        }
        if h.offset.checked_add(h.len).is_none_or(|end| end > h.total) {
            return Err(WireError::Overrun { offset: h.offset, len: h.len, total: h.total });
        }
        if kind != FrameKind::Data && (h.offset != 0 || h.len != h.total) {
            return Err(WireError::Malformed("control frames carry their whole payload at offset 0"));
        }
        Ok(h)
    }
}

/// What a connection is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A rank registering with the rendezvous server.
    Rendezvous = 0,
    /// A data connection between two ranks.
    Data = 1,
}

/// Handshake messages. The client opens with `Hello`; the server answers `Challenge` (proving
/// it knows the secret) or `Reject`; the client proves it knows the secret with `Proof`; the
/// server ends with `Accept` or `Reject`. Secrets never cross the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handshake {
    Hello { version: u16, role: Role, job: String, rank: u32, world: u32, link: u16, conn: u16, nonce: [u8; 16] },
    Challenge { nonce: [u8; 16], proof: [u8; 32] },
    Proof { proof: [u8; 32] },
    Accept,
    Reject { reason: String },
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or(WireError::Truncated { needed: self.at.saturating_add(n), have: self.b.len() })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn string(&mut self) -> Result<String, WireError> {
        let n = usize::from(self.u16()?);
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| WireError::Malformed("string is not UTF-8"))
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Strings are capped well below the message limit; longer ones are cut at a char boundary.
    let mut end = s.len().min(1024);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

impl Handshake {
    /// Encodes the message with its 4-byte length prefix.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; 4];
        b.extend_from_slice(&HS_MAGIC.to_le_bytes());
        match self {
            Handshake::Hello { version, role, job, rank, world, link, conn, nonce } => {
                b.push(1);
                b.extend_from_slice(&version.to_le_bytes());
                b.push(*role as u8);
                put_str(&mut b, job);
                b.extend_from_slice(&rank.to_le_bytes());
                b.extend_from_slice(&world.to_le_bytes());
                b.extend_from_slice(&link.to_le_bytes());
                b.extend_from_slice(&conn.to_le_bytes());
                b.extend_from_slice(nonce);
            }
            Handshake::Challenge { nonce, proof } => {
                b.push(2);
                b.extend_from_slice(nonce);
                b.extend_from_slice(proof);
            }
            Handshake::Proof { proof } => {
                b.push(3);
                b.extend_from_slice(proof);
            }
            Handshake::Accept => b.push(4),
            Handshake::Reject { reason } => {
                b.push(5);
                put_str(&mut b, reason);
            }
        }
        let len = (b.len() - 4) as u32;
        b[0..4].copy_from_slice(&len.to_le_bytes());
        b
    }

    /// Checks a length prefix before anything is read or allocated.
    pub fn check_len(prefix: [u8; 4]) -> Result<usize, WireError> {
        let n = u32::from_le_bytes(prefix) as usize;
        if n > MAX_HANDSHAKE {
            return Err(WireError::TooLarge { total: n as u64, limit: MAX_HANDSHAKE as u64 });
        }
        Ok(n)
    }

    /// Decodes a message body (without the length prefix).
    pub fn decode(body: &[u8]) -> Result<Handshake, WireError> {
        if body.len() > MAX_HANDSHAKE {
            return Err(WireError::TooLarge { total: body.len() as u64, limit: MAX_HANDSHAKE as u64 });
        }
        let mut c = Cursor { b: body, at: 0 };
        let magic = c.u32()?;
        if magic != HS_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let msg = match c.u8()? {
            1 => {
                let version = c.u16()?;
                let role = match c.u8()? {
                    0 => Role::Rendezvous,
                    1 => Role::Data,
                    _ => return Err(WireError::Malformed("unknown role")),
                };
                let job = c.string()?;
                Handshake::Hello {
                    version,
                    role,
                    job,
                    rank: c.u32()?,
                    world: c.u32()?,
                    link: c.u16()?,
                    conn: c.u16()?,
                    nonce: c.arr()?,
                }
            }
            2 => Handshake::Challenge { nonce: c.arr()?, proof: c.arr()? },
            3 => Handshake::Proof { proof: c.arr()? },
            4 => Handshake::Accept,
            5 => Handshake::Reject { reason: c.string()? },
            k => return Err(WireError::BadKind(k)),
        };
        if c.at != body.len() {
            return Err(WireError::Malformed("trailing bytes after handshake message"));
        }
        Ok(msg)
    }
}

/// The proof that one side knows the job secret, bound to both nonces, the job and the side.
pub fn proof(secret: &[u8], side: &str, job: &str, client_nonce: &[u8; 16], server_nonce: &[u8; 16]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"ironweave-handshake-v1\0");
    h.update((secret.len() as u64).to_le_bytes());
    h.update(secret);
    h.update(side.as_bytes());
    h.update([0]);
    h.update(job.as_bytes());
    h.update([0]);
    h.update(client_nonce);
    h.update(server_nonce);
    h.finalize().into()
}

/// 16 unpredictable bytes from the OS (falls back to time and address entropy if
/// `/dev/urandom` cannot be read).
pub fn nonce() -> [u8; 16] {
    use std::io::Read;
    let mut n = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut n)).is_ok() {
        return n;
    }
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let mut h = Sha256::new();
    h.update(t.to_le_bytes());
    h.update((&n as *const _ as usize).to_le_bytes());
    h.update(std::process::id().to_le_bytes());
    n.copy_from_slice(&h.finalize()[..16]);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip_and_limits() {
        let h = FrameHeader { kind: FrameKind::Data, tag: 7, seq: 3, total: 100, offset: 40, len: 60 };
        assert_eq!(FrameHeader::decode(&h.encode(), 1000), Ok(h));
        assert!(matches!(FrameHeader::decode(&h.encode(), 99), Err(WireError::TooLarge { .. })));
        let bad = FrameHeader { offset: 41, ..h };
        assert!(matches!(FrameHeader::decode(&bad.encode(), 1000), Err(WireError::Overrun { .. })));
        let wrap = FrameHeader { offset: u64::MAX, len: 2, ..h };
        assert!(matches!(FrameHeader::decode(&wrap.encode(), u64::MAX), Err(WireError::Overrun { .. })));
        assert!(matches!(FrameHeader::decode(&[0u8; 10], 1000), Err(WireError::Truncated { .. })));
    }

    #[test]
    fn handshake_roundtrip() {
        let msgs = [
            Handshake::Hello {
                version: 1,
                role: Role::Data,
                job: "j".into(),
                rank: 3,
                world: 4,
                link: 1,
                conn: 2,
                nonce: [9; 16],
            },
            Handshake::Challenge { nonce: [1; 16], proof: [2; 32] },
            Handshake::Proof { proof: [3; 32] },
            Handshake::Accept,
            Handshake::Reject { reason: "wrong secret".into() },
        ];
        for m in msgs {
            let b = m.encode();
            let n = Handshake::check_len(b[..4].try_into().unwrap()).unwrap();
            assert_eq!(n, b.len() - 4);
            assert_eq!(Handshake::decode(&b[4..]).unwrap(), m);
            // Every truncation is an error, never a panic.
            for cut in 0..b.len() - 4 {
                assert!(Handshake::decode(&b[4..4 + cut]).is_err());
            }
        }
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut buf = [0u8; 96];
        for i in 0..200_000 {
            for b in buf.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            // Plant the magic now and then so deeper paths are reached.
            if i % 3 == 0 {
                buf[..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
                buf[4] = (x % 4) as u8;
                buf[5..8].fill(0);
            }
            let _ = FrameHeader::decode(&buf[..(x as usize % 96)], 1 << 30);
            if i % 3 == 1 {
                buf[..4].copy_from_slice(&HS_MAGIC.to_le_bytes());
                buf[4] = (x % 6) as u8;
            }
            let _ = Handshake::decode(&buf[..(x as usize % 96)]);
        }
    }
}

//! Receive buffers: a message's bytes handed to the caller ([`RecvBuf`]) and the pool that
//! recycles them ([`BufPool`]).

use std::sync::{Arc, Mutex};

use ironweave_units::Locked;

/// A received message: one or more parts that together cover `len` bytes in order
/// (a message striped over several connections arrives as one part per connection).
#[derive(Debug, Default)]
pub struct RecvBuf {
    pub(super) parts: Vec<(usize, Vec<u8>)>,
    pub(super) len: usize,
    /// The bytes were written straight into the receiver's landing zone; `parts` is empty.
    pub(super) landed: bool,
    pub(super) pool: Option<Arc<BufPool>>,
}

impl Drop for RecvBuf {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            for (_, v) in self.parts.drain(..) {
                pool.put(v);
            }
        }
    }
}

impl RecvBuf {
    /// A message made of one contiguous buffer.
    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        RecvBuf { parts: vec![(0, v)], len, landed: false, pool: None }
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length message.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when the bytes already sit in the landing zone given to
    /// [`Mailbox::post_into`](super::Mailbox::post_into) (or
    /// [`Link::irecv_into`](super::Link::irecv_into)); there is nothing to copy.
    pub fn is_landed(&self) -> bool {
        self.landed
    }

    /// The parts in order, each with its offset in the message.
    pub fn parts(&self) -> impl Iterator<Item = (usize, &[u8])> {
        self.parts.iter().map(|(o, p)| (*o, p.as_slice()))
    }

    /// Copies the message into `dst`, which must be exactly as long (a landed message has
    /// no bytes here: check [`RecvBuf::is_landed`] first).
    pub fn copy_to(&self, dst: &mut [u8]) {
        debug_assert!(!self.landed, "copy_to on a landed message");
        assert_eq!(dst.len(), self.len, "RecvBuf::copy_to: length mismatch (callers check first)");
        for (off, p) in &self.parts {
            dst[*off..*off + p.len()].copy_from_slice(p);
        }
    }

    /// The message as one vector (no copy when it arrived in one part).
    pub fn into_vec(mut self) -> Vec<u8> {
        if self.parts.len() == 1 {
            self.pool = None;
            return self.parts.pop().map(|(_, v)| v).unwrap_or_default();
        }
        let mut v = vec![0u8; self.len];
        self.copy_to(&mut v);
        v
    }
}

/// Recycles receive buffers: fresh large allocations cost a page fault per 4 KiB (the kernel
/// zeroes every page), which on loopback costs as much as the transfer itself.
#[derive(Debug, Default)]
pub struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
}

impl BufPool {
    const MIN: usize = 64 * 1024;
    const MAX_BUFFERS: usize = 64;
    const MAX_BYTES: usize = 512 << 20;

    /// A vector of exactly `len` bytes whose contents are unspecified (old data of a recycled
    /// buffer, or zeros): callers overwrite all of it. Recycled buffers are not zeroed again.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= Self::MIN {
            let mut free = self.free.locked();
            // Best fit among buffers no more than twice as large.
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, v)| v.capacity() >= len && v.capacity() <= len.saturating_mul(2))
                .min_by_key(|(_, v)| v.capacity())
                .map(|(i, _)| i);
            if let Some(i) = best {
                let mut v = free.swap_remove(i);
                if v.len() >= len {
                    v.truncate(len);
                } else {
                    v.resize(len, 0);
                }
                return v;
            }
        }
        vec![0u8; len]
    }

    /// Gives a buffer back for reuse (small ones and overflow are freed).
    pub fn put(&self, v: Vec<u8>) {
        if v.capacity() < Self::MIN {
            return;
        }
        let mut free = self.free.locked();
        let held: usize = free.iter().map(Vec::capacity).sum();
        if free.len() < Self::MAX_BUFFERS && held + v.capacity() <= Self::MAX_BYTES {
            free.push(v);
        }
    }
}

//! Splitting a snapshot into chunks that fit the predicted idle windows (Capricorn) or into
//! fixed-size chunks (Gemini). Pure functions, tested exactly.

use serde::{Deserialize, Serialize};

/// A piece of the snapshot and the window it is meant for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// Offset in the snapshot.
    pub offset: u64,
    /// Length.
    pub len: u64,
    /// Index of the window it fits in; `None`: leftover, sent after the last window.
    pub window: Option<usize>,
}

/// Capricorn: fill windows in order, each with a chunk of at most its capacity (bytes the
/// link moves in the window), skipping windows smaller than `min_chunk` unless what remains
/// is smaller; whatever does not fit becomes leftover chunks of at most `max_leftover` bytes.
/// Chunks cover `[0, total)` exactly, in order.
pub fn partition(total: u64, capacities: &[u64], min_chunk: u64, max_leftover: u64) -> Vec<Chunk> {
    let mut out = Vec::new();
    let mut offset = 0u64;
    for (i, &cap) in capacities.iter().enumerate() {
        let left = total - offset;
        if left == 0 {
            break;
        }
        let len = cap.min(left);
        if len == 0 || (len < min_chunk && len < left) {
            continue;
        }
        out.push(Chunk { offset, len, window: Some(i) });
        offset += len;
    }
    let step = max_leftover.max(1);
    while offset < total {
        let len = (total - offset).min(step);
        out.push(Chunk { offset, len, window: None });
        offset += len;
    }
    out
}

/// Gemini: fixed-size chunks, as many per span as fit whole (`span capacity / chunk`), in
/// order; the rest is leftover.
pub fn partition_fixed(total: u64, chunk: u64, capacities: &[u64]) -> Vec<Chunk> {
    let chunk = chunk.max(1);
    let mut out = Vec::new();
    let mut offset = 0u64;
    for (i, &cap) in capacities.iter().enumerate() {
        let mut room = cap;
        while offset < total && room >= chunk.min(total - offset) {
            let len = chunk.min(total - offset);
            out.push(Chunk { offset, len, window: Some(i) });
            offset += len;
            room -= len;
        }
    }
    while offset < total {
        let len = chunk.min(total - offset);
        out.push(Chunk { offset, len, window: None });
        offset += len;
    }
    out
}

/// Bytes that did not fit any window.
pub fn leftover(chunks: &[Chunk]) -> u64 {
    chunks.iter().filter(|c| c.window.is_none()).map(|c| c.len).sum()
}

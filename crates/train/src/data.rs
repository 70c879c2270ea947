//! Byte-level data: the corpus is read once; the batch of iteration `i` on rank `r` is a pure
//! function of (seed, i, r), so the data position a checkpoint must carry is the iteration.

use crate::error::{Result, TrainError};
use crate::model::Rng;

/// The corpus in memory.
#[derive(Debug, Clone)]
pub struct Corpus {
    bytes: Vec<u8>,
}

impl Corpus {
    /// Read a text file.
    pub fn load(path: &std::path::Path, seq: usize) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| TrainError::Data { path: path.display().to_string(), why: e.to_string() })?;
        if bytes.len() < seq + 2 {
            return Err(TrainError::Data {
                path: path.display().to_string(),
                why: format!("{} bytes, shorter than a sequence of {seq}", bytes.len()),
            });
        }
        Ok(Corpus { bytes })
    }

    /// From bytes (tests).
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Corpus { bytes }
    }

    /// Inputs and targets (`b × seq` each) of iteration `iter` on rank `rank`.
    pub fn batch(&self, seed: u64, iter: u64, rank: usize, b: usize, seq: usize) -> (Vec<u32>, Vec<u32>) {
        let mut rng = Rng(seed ^ iter.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ (rank as u64).wrapping_mul(0x9E37_79B9));
        let span = (self.bytes.len() - seq - 1) as u64;
        let mut x = Vec::with_capacity(b * seq);
        let mut y = Vec::with_capacity(b * seq);
        for _ in 0..b {
            let start = (rng.next_u64() % span) as usize;
            x.extend(self.bytes[start..start + seq].iter().map(|&c| c as u32));
            y.extend(self.bytes[start + 1..start + seq + 1].iter().map(|&c| c as u32));
        }
        (x, y)
    }
}

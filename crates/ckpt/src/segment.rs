//! Memory a snapshot or a replica lives in: a heap buffer, or a file of the keep directory
//! mapped shared (a *segment*).
//!
//! Why segments: a copy that must outlive the process (torchrun restarts every worker when one
//! fails) used to be written a second time, into a tmpfs file, after each commit. A segment is
//! both: the snapshot is copied into it once, sent from it, and a restarted process maps it
//! again instead of reading it. The file is created once per job (0600, in the 0700 keep
//! directory) and reused every step, so no step pays for fresh zeroed pages.

use std::fs::{File, OpenOptions};
use std::ops::{Deref, DerefMut};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::error::{CkptError, Result};

/// Bytes of a snapshot or replica: on the heap, or in a mapped file of the keep directory.
pub struct Segment {
    mem: Mem,
}

enum Mem {
    Heap(Vec<u8>),
    Mapped { map: memmap2::MmapMut, path: PathBuf },
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.mem {
            Mem::Heap(v) => write!(f, "Segment(heap, {} bytes)", v.len()),
            Mem::Mapped { map, path } => write!(f, "Segment({}, {} bytes)", path.display(), map.len()),
        }
    }
}

impl Default for Segment {
    fn default() -> Self {
        Segment::from(Vec::new())
    }
}

impl From<Vec<u8>> for Segment {
    fn from(v: Vec<u8>) -> Self {
        Segment { mem: Mem::Heap(v) }
    }
}

impl Deref for Segment {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.mem {
            Mem::Heap(v) => v,
            Mem::Mapped { map, .. } => map,
        }
    }
}

impl DerefMut for Segment {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Mem::Heap(v) => v,
            Mem::Mapped { map, .. } => map,
        }
    }
}

impl PartialEq for Segment {
    fn eq(&self, other: &Segment) -> bool {
        **self == **other
    }
}

impl PartialEq<[u8]> for Segment {
    fn eq(&self, other: &[u8]) -> bool {
        **self == *other
    }
}

impl PartialEq<Vec<u8>> for Segment {
    fn eq(&self, other: &Vec<u8>) -> bool {
        **self == **other
    }
}

/// Writes one byte per page of `b` (a value the compiler cannot know is already there, so the
/// store is kept): the pages are allocated now, not inside a training step.
fn touch(b: &mut [u8]) {
    for i in (0..b.len()).step_by(4096) {
        b[i] = std::hint::black_box(b[i]);
    }
}

impl Segment {
    /// `len` zeroed heap bytes, every page touched.
    pub fn heap(len: usize) -> Self {
        let mut v = vec![0u8; len];
        touch(&mut v);
        Segment::from(v)
    }

    /// The segment file `path` of `len` bytes (created 0600, or resized), mapped shared, every
    /// page touched.
    pub fn create(path: &Path, len: usize) -> Result<Self> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(|e| CkptError::io(path, e))?;
        f.set_len(len as u64).map_err(|e| CkptError::io(path, e))?;
        let mut s = Self::map(f, path)?;
        touch(&mut s);
        Ok(s)
    }

    /// A new segment of `len` bytes in `dir`, named `STEM-K.seg` with the lowest `K` whose path
    /// `taken` does not claim (held by a live segment, or named by a kept manifest).
    pub fn create_free(dir: &Path, stem: &str, len: usize, taken: impl Fn(&Path) -> bool) -> Result<Self> {
        let path = (0..).map(|k| dir.join(format!("{stem}-{k}.seg"))).find(|p| !taken(p)).expect("unbounded");
        Self::create(&path, len)
    }

    /// Maps the existing segment file `path` (a copy a process of this job kept): no byte is
    /// read or copied here.
    pub fn open(path: &Path) -> Result<Self> {
        let f = OpenOptions::new().read(true).write(true).open(path).map_err(|e| CkptError::io(path, e))?;
        Self::map(f, path)
    }

    fn map(f: File, path: &Path) -> Result<Self> {
        let len = f.metadata().map_err(|e| CkptError::io(path, e))?.len();
        if len == 0 {
            // an empty mapping is refused by mmap; nothing to share either
            return Ok(Segment::default());
        }
        // SAFETY: the file lives in the keep directory, which is private to this user (0700,
        // checked before use) and each segment is written by one engine only: its owner rank's
        // snapshot buffers or one receiver of the holder. The mapping is shared so that what is
        // written reaches the file; nobody else truncates it while mapped (a job's directory is
        // removed only after its engines closed). Reads of bytes another process of the user
        // changed behind us are caught by the checksums, never trusted.
        let map = unsafe { memmap2::MmapOptions::new().map_mut(&f) }.map_err(|e| CkptError::io(path, e))?;
        Ok(Segment { mem: Mem::Mapped { map, path: path.to_path_buf() } })
    }

    /// The file behind the segment (none: heap memory).
    pub fn path(&self) -> Option<&Path> {
        match &self.mem {
            Mem::Heap(_) => None,
            Mem::Mapped { path, .. } => Some(path),
        }
    }

    /// Removes the segment's file (heap memory: nothing); the mapping goes with the value.
    pub fn discard(self) {
        if let Some(p) = self.path() {
            let _ = std::fs::remove_file(p);
        }
    }

    /// The bytes as an owned vector (a copy for a mapped segment).
    pub fn into_vec(self) -> Vec<u8> {
        match self.mem {
            Mem::Heap(v) => v,
            Mem::Mapped { map, .. } => map.to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_outlives_its_mapping_and_maps_again_without_a_copy() {
        let dir = std::env::temp_dir().join(format!("iw-seg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("own-0.seg");
        {
            let mut s = Segment::create(&p, 10_000).unwrap();
            s[..4].copy_from_slice(b"abcd");
            s[9_999] = 7;
        }
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        let s = Segment::open(&p).unwrap();
        assert_eq!((&s[..4], s[9_999], s.len(), s.path()), (&b"abcd"[..], 7, 10_000, Some(p.as_path())));
        // resized in place for another layout
        drop(s);
        assert_eq!(Segment::create(&p, 100).unwrap().len(), 100);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! The job's board: a directory a launcher shares with every rank it starts, where the job's
//! newest generation and its end are announced (`ironweave launch` sets [`BOARD_VAR`]).
//!
//! Ranks that fail moments apart must not split into generations that wait on each other: a
//! process that goes to generation `g` announces `g` here, and every rank waiting to form an
//! older generation gives it up ([`crate::Error::Superseded`]) and goes to the newest one. A
//! job whose ranks all passed their final barrier says so ([`Board::finish`]), so a rank the
//! launcher restarted after the end leaves at once instead of waiting for peers that are gone.
//!
//! Announcements are empty files (`gen-NNNNN`, `finished`): creating one is atomic, several
//! processes may announce at once, and the newest generation is the largest name. Without a
//! board (torchrun, srun, mpirun restart every rank together) nothing is announced.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The environment variable naming the board's directory.
pub const BOARD_VAR: &str = "IRONWEAVE_JOB_BOARD";

const FINISHED: &str = "finished";

/// A job's board (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Board {
    dir: PathBuf,
}

impl Board {
    /// The board in `dir` (created when missing: the launcher's call).
    pub fn create(dir: impl Into<PathBuf>) -> Result<Board> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("creating the job board {}", dir.display()), &e))?;
        Ok(Board { dir })
    }

    /// The board in `dir`, as the launcher made it.
    pub fn at(dir: impl Into<PathBuf>) -> Board {
        Board { dir: dir.into() }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Announces that this process goes to generation `gen`.
    pub fn announce(&self, gen: u16) -> Result<()> {
        let p = self.dir.join(format!("gen-{gen:05}"));
        std::fs::File::create(&p).map(drop).map_err(|e| Error::io(format!("announcing generation {gen} at {}", p.display()), &e))
    }

    /// The newest generation announced (None: none yet, or no board directory).
    pub fn generation(&self) -> Option<u16> {
        std::fs::read_dir(&self.dir)
            .ok()?
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_prefix("gen-")).and_then(|n| n.parse().ok()))
            .max()
    }

    /// Says that the job ended: every rank passed its final barrier.
    pub fn finish(&self) -> Result<()> {
        let p = self.dir.join(FINISHED);
        std::fs::File::create(&p).map(drop).map_err(|e| Error::io(format!("marking the job finished at {}", p.display()), &e))
    }

    /// Whether the job ended.
    pub fn finished(&self) -> bool {
        self.dir.join(FINISHED).exists()
    }

    /// Why a rank forming generation `gen` should stop waiting for it: a newer generation
    /// was announced, or the job ended. None: keep waiting.
    pub fn superseded(&self, gen: u16) -> Option<Error> {
        if self.finished() {
            return Some(Error::Superseded { generation: gen, by: None });
        }
        match self.generation() {
            Some(newer) if newer > gen => Some(Error::Superseded { generation: gen, by: Some(newer) }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_generation_wins_and_the_end_supersedes_every_one() {
        let dir = std::env::temp_dir().join(format!("iw-board-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let b = Board::create(&dir).unwrap();
        assert_eq!((b.generation(), b.superseded(0)), (None, None));
        b.announce(1).unwrap();
        b.announce(3).unwrap();
        b.announce(2).unwrap();
        b.announce(3).unwrap();
        assert_eq!(b.generation(), Some(3));
        assert_eq!(b.superseded(1), Some(Error::Superseded { generation: 1, by: Some(3) }));
        assert_eq!(b.superseded(3), None);
        assert!(!b.finished());
        b.finish().unwrap();
        assert_eq!(b.superseded(3), Some(Error::Superseded { generation: 3, by: None }));
        // a board whose directory is gone announces nothing and supersedes nothing
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!((b.generation(), b.superseded(0)), (None, None));
    }
}

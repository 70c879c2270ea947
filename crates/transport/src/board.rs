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
//!
//! The board is also the job's memory of its commits ([`Board::commits`], [`CommitRecord::record`]): each rank
//! records the newest iteration it saw committed (`committed-rNNNNN`, replaced atomically), so
//! a job whose every process died — a rank lost between its last iteration and the job's end
//! makes the survivors exit and the launcher restart them all — knows that it committed, and
//! never starts over from its initial state without a word. A [`CommitRecord`] is that part
//! alone, for launchers without a board (torchrun).
//!
//! A board that cannot be written is an error ([`Error::Board`], with the path and the free
//! space), never a warning: a failed announcement brings back the waits the board ends.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The environment variable naming the board's directory.
pub const BOARD_VAR: &str = "IRONWEAVE_JOB_BOARD";

const FINISHED: &str = "finished";
const COMMITTED: &str = "committed-r";

/// Bytes available to this user and the size of the file system holding `path` (or its
/// nearest existing ancestor, which is returned too); None when statvfs fails.
pub fn space(path: &Path) -> Option<(u64, u64, PathBuf)> {
    let p = path.ancestors().find(|a| a.exists()).unwrap_or(path);
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs fills the zeroed struct we own from a NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid C string and `st` a valid out-pointer for the call's duration.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64 * st.f_frsize as u64, st.f_blocks as u64 * st.f_frsize as u64, p.to_path_buf()))
}

/// Free space of the file system holding `path` (or its nearest existing ancestor), for an
/// error message: `N bytes free of M` or why it is unknown.
pub fn free_space(path: &Path) -> String {
    match space(path) {
        Some((free, total, p)) => format!("{free} bytes free of {total} on the file system of {}", p.display()),
        None => format!("free space of {} unknown: {}", path.display(), std::io::Error::last_os_error()),
    }
}

/// Makes `dir` (its parent must exist) private to this user, or checks that it is: a directory
/// under a shared temporary directory must be neither planted nor readable by another user —
/// the job trusts what it reads there. A directory that exists and is a link, another user's,
/// or open to group or others is refused.
pub fn private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(board_error(dir, "creating the directory", &e)),
    }
    let m = std::fs::symlink_metadata(dir).map_err(|e| board_error(dir, "reading the directory's owner", &e))?;
    // SAFETY: getuid has no preconditions and cannot fail.
    let me = unsafe { libc::getuid() };
    if !m.is_dir() || m.uid() != me || m.mode() & 0o077 != 0 {
        return Err(Error::Board {
            path: dir.display().to_string(),
            detail: format!(
                "refused: a {} of uid {} with mode {:o}, not a directory of uid {me} with mode 700 (another user could plant or read what the job keeps there)",
                if m.is_dir() { "directory" } else { "file or link" },
                m.uid(),
                m.mode() & 0o7777
            ),
            free: free_space(dir),
        });
    }
    Ok(())
}

fn board_error(path: &Path, what: &str, e: &std::io::Error) -> Error {
    Error::Board { path: path.display().to_string(), detail: format!("{what}: {e}"), free: free_space(path) }
}

/// A job's board (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Board {
    dir: PathBuf,
}

impl Board {
    /// The board in `dir` (created when missing, private to this user: the launcher's call),
    /// checked writable.
    pub fn create(dir: impl Into<PathBuf>) -> Result<Board> {
        let dir = dir.into();
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent).map_err(|e| board_error(parent, "creating the job board's parent", &e))?;
        }
        private_dir(&dir)?;
        let b = Board { dir };
        // an announcement written and taken back: a board nobody can write fails here, at the
        // launcher, not in the middle of a recovery
        let probe = b.dir.join(".probe");
        std::fs::File::create(&probe).map_err(|e| board_error(&probe, "writing to the job board", &e))?;
        let _ = std::fs::remove_file(&probe);
        Ok(b)
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
        std::fs::File::create(&p).map(drop).map_err(|e| board_error(&p, &format!("announcing generation {gen}"), &e))
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
        std::fs::File::create(&p).map(drop).map_err(|e| board_error(&p, "marking the job finished", &e))
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

    /// The job's record of its commits, on this board.
    pub fn commits(&self) -> CommitRecord {
        CommitRecord { dir: self.dir.clone() }
    }
}

/// The newest iteration a job committed, kept in a directory that outlives its processes (a
/// launcher's [`Board`], or one of its own under torchrun): one small file per rank, written to
/// a temporary name and renamed, so a reader sees a whole number or the one before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitRecord {
    dir: PathBuf,
}

impl CommitRecord {
    /// The record in `dir` (created at the first [`CommitRecord::record`]).
    pub fn at(dir: impl Into<PathBuf>) -> CommitRecord {
        CommitRecord { dir: dir.into() }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records that `rank` saw iteration `iter` committed.
    pub fn record(&self, rank: usize, iter: u64) -> Result<()> {
        let p = self.dir.join(format!("{COMMITTED}{rank:05}"));
        let tmp = self.dir.join(format!(".{COMMITTED}{rank:05}.tmp"));
        let what = format!("recording iteration {iter} committed");
        private_dir(&self.dir)?;
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
            f.write_all(iter.to_string().as_bytes())
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            board_error(&tmp, &what, &e)
        })?;
        std::fs::rename(&tmp, &p).map_err(|e| board_error(&p, &what, &e))
    }

    /// The newest iteration any rank recorded committed (None: none, or no record, or a
    /// directory that is not this user's alone: its numbers are not trusted, and the job's
    /// first commit then fails naming it).
    pub fn newest(&self) -> Option<u64> {
        if std::fs::symlink_metadata(&self.dir).is_err() || private_dir(&self.dir).is_err() {
            return None;
        }
        std::fs::read_dir(&self.dir)
            .ok()?
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with(COMMITTED)))
            .filter_map(|e| std::fs::read_to_string(e.path()).ok()?.trim().parse().ok())
            .max()
    }

    /// Forgets every commit (a new job that reuses the record's place).
    pub fn clear(&self) -> Result<()> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return Ok(()) };
        for e in rd.flatten() {
            if e.file_name().to_str().is_some_and(|n| n.starts_with(COMMITTED)) {
                std::fs::remove_file(e.path()).map_err(|err| board_error(&e.path(), "clearing the commit record", &err))?;
            }
        }
        Ok(())
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

    #[test]
    fn commits_are_remembered_across_processes_newest_of_any_rank() {
        let dir = std::env::temp_dir().join(format!("iw-board-commits-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let b = Board::create(&dir).unwrap();
        let rec = b.commits();
        assert_eq!(rec.newest(), None);
        rec.record(0, 3).unwrap();
        rec.record(1, 4).unwrap();
        rec.record(0, 5).unwrap();
        // another process's view of the same directory
        assert_eq!(CommitRecord::at(&dir).newest(), Some(5));
        assert_eq!(b.generation(), None, "a commit is not a generation");
        rec.clear().unwrap();
        assert_eq!(rec.newest(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_record_is_private_and_one_open_to_others_is_neither_read_nor_written() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("iw-board-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let rec = CommitRecord::at(&dir);
        rec.record(2, 9).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&dir), mode(&dir.join("committed-r00002"))), (0o700, 0o600));
        assert_eq!(rec.newest(), Some(9));
        // a directory others may write (as one planted in /tmp would be): not trusted, not used
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(rec.newest(), None);
        let e = rec.record(2, 10).unwrap_err();
        assert!(matches!(&e, Error::Board { detail, .. } if detail.contains("refused") && detail.contains("777")), "{e}");
        assert!(matches!(Board::create(&dir), Err(Error::Board { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_board_that_cannot_be_written_is_an_error_naming_the_path_and_the_free_space() {
        // a regular file where the board's directory should be: unwritable even for root
        let file = std::env::temp_dir().join(format!("iw-board-file-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let b = Board::at(file.join("board"));
        for e in [b.announce(2).unwrap_err(), b.finish().unwrap_err(), b.commits().record(0, 7).unwrap_err()] {
            let Error::Board { path, free, .. } = &e else { panic!("{e:?}") };
            assert!(path.starts_with(&*file.to_string_lossy()), "{e}");
            assert!(free.contains("bytes free of"), "{e}");
        }
        assert!(matches!(Board::create(file.join("board")), Err(Error::Board { .. })));
        std::fs::remove_file(&file).unwrap();
    }
}

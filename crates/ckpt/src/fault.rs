//! Named fault points for reliability campaigns (`ironweave chaos`): a process armed through
//! the environment kills itself with SIGKILL at one point of the checkpoint engine's work —
//! the middle of a replica transfer, the commit, the restore, the middle of a persistent-tier
//! write. Production runs never set the variable; unset, a point costs one atomic load.
//!
//! `IRONWEAVE_FAULT=POINT:RANK:AT` arms rank `RANK`'s *original* process (generation 0: a
//! restarted rank is never armed again, so a fault fires once):
//! - `replica:R:I` — after the first chunk of iteration `I`'s snapshot went to a holder;
//! - `commit:R:I` — entering the commit of iteration `I`;
//! - `persist:R:I` — after the first block of iteration `I`'s persistent file was written;
//! - `restore:R:N` — entering the `N`-th restore of the process (1: the first);
//! - `done:R:N` — in an elastic job of `N` iterations, after its last iteration and whatever
//!   the program does after `Job::run`, before the end every rank passes together
//!   (`Finished::shutdown`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The environment variable that arms a fault point.
pub const VAR: &str = "IRONWEAVE_FAULT";

/// The points a campaign can arm.
pub const POINTS: [&str; 5] = ["replica", "commit", "persist", "restore", "done"];

#[derive(Debug, Clone, PartialEq, Eq)]
struct Armed {
    point: String,
    rank: usize,
    at: u64,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let v = std::env::var(VAR).ok()?;
            let gen: u64 = std::env::var("IRONWEAVE_GENERATION").ok().and_then(|g| g.parse().ok()).unwrap_or(0);
            if gen > 0 {
                return None;
            }
            match parse(&v) {
                Ok(a) => Some(a),
                Err(e) => {
                    eprintln!("ironweave: ignoring {VAR}={v:?}: {e}");
                    None
                }
            }
        })
        .as_ref()
}

fn parse(v: &str) -> std::result::Result<Armed, String> {
    let parts: Vec<&str> = v.split(':').collect();
    let [point, rank, at] = parts.as_slice() else {
        return Err("expected POINT:RANK:AT".into());
    };
    if !POINTS.contains(point) {
        return Err(format!("unknown point {point:?} (known: {})", POINTS.join(", ")));
    }
    let rank = rank.parse().map_err(|_| format!("rank {rank:?} is not a number"))?;
    let at = at.parse().map_err(|_| format!("{at:?} is not a number"))?;
    Ok(Armed { point: point.to_string(), rank, at })
}

/// Kills this process with SIGKILL if `point` is armed for `rank` at `at`.
pub fn hit(point: &str, rank: usize, at: u64) {
    let Some(a) = armed() else { return };
    if a.point == point && a.rank == rank && a.at == at {
        eprintln!("rank {rank}: {VAR}: killing myself with SIGKILL at fault point `{point}` ({at})");
        // SAFETY: kill(2) on our own pid with a valid signal number.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Counts this process's restores and hits `restore` with the count (1: the first).
pub fn hit_restore(rank: usize) {
    static RESTORES: AtomicU64 = AtomicU64::new(0);
    let n = RESTORES.fetch_add(1, Ordering::SeqCst) + 1;
    hit("restore", rank, n);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_or_say_why_not() {
        assert_eq!(parse("commit:2:7"), Ok(Armed { point: "commit".into(), rank: 2, at: 7 }));
        assert!(parse("commit:2").unwrap_err().contains("POINT:RANK:AT"));
        assert!(parse("explode:1:1").unwrap_err().contains("unknown point"));
        assert!(parse("replica:x:1").unwrap_err().contains("not a number"));
    }
}

//! Compute threads per rank. Every rank's compute pool (rayon, which candle's CPU kernels use,
//! and OpenMP in libraries that use it) is as wide as the machine by default, so N ranks on one
//! host run N × cores threads that fight for the cores: two ranks on two cores ran slower than
//! one. torchrun sets `OMP_NUM_THREADS=1` per process for this reason; we give each rank
//! `max(1, cores / ranks on this host)` threads unless the user chose.
//!
//! The choice is pure ([`choose`]); [`ThreadChoice::env`] gives the variables a launcher sets
//! for its children, and [`apply_to_process`] sets them in a rank started by torchrun, srun or
//! mpirun, before any pool exists.

use std::fmt;

use crate::error::{Error, Result};

/// Variables that size a rank's compute pools, in the order a user's value is looked for.
/// candle reads `RAYON_NUM_THREADS` for its matrix kernels; rayon sizes its global pool by it.
pub const THREAD_VARS: [&str; 2] = ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"];

/// `max(1, cores / ranks_on_host)`: every core busy, none shared.
pub fn default_threads(cores: usize, ranks_on_host: usize) -> usize {
    (cores / ranks_on_host.max(1)).max(1)
}

/// Where the number of threads came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ThreadSource {
    /// `--threads-per-rank`.
    Flag,
    /// A variable the user set (its name).
    User(&'static str),
    /// `cores / ranks on this host`.
    Default { cores: usize, ranks_on_host: usize },
}

/// Compute threads for each rank on a host, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadChoice {
    pub threads: usize,
    pub source: ThreadSource,
}

impl fmt::Display for ThreadChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.threads;
        let s = if n == 1 { "" } else { "s" };
        match &self.source {
            ThreadSource::Flag => write!(f, "{n} compute thread{s} per rank (--threads-per-rank)"),
            ThreadSource::User(var) => write!(f, "{n} compute thread{s} per rank ({var} set by the user)"),
            ThreadSource::Default { cores, ranks_on_host } => write!(
                f,
                "{n} compute thread{s} per rank ({cores} cores / {ranks_on_host} rank{} on this host; \
                 --threads-per-rank or RAYON_NUM_THREADS to change)",
                if *ranks_on_host == 1 { "" } else { "s" }
            ),
        }
    }
}

impl ThreadChoice {
    /// The variables to set for a rank: all of [`THREAD_VARS`] with the flag; the ones the user
    /// left unset otherwise (a user's value is never overwritten).
    pub fn env(&self, get: impl Fn(&str) -> Option<String>) -> Vec<(&'static str, String)> {
        THREAD_VARS
            .iter()
            .filter(|v| self.source == ThreadSource::Flag || get(v).is_none())
            .map(|v| (*v, self.threads.to_string()))
            .collect()
    }
}

/// Picks the threads per rank: `flag` if given, else the first of [`THREAD_VARS`] the user set,
/// else [`default_threads`]. A user value that is not a positive integer is an error naming it.
pub fn choose(
    get: impl Fn(&str) -> Option<String>,
    cores: usize,
    ranks_on_host: usize,
    flag: Option<usize>,
) -> Result<ThreadChoice> {
    if let Some(n) = flag {
        if n == 0 {
            return Err(Error::Config("--threads-per-rank must be at least 1".into()));
        }
        return Ok(ThreadChoice { threads: n, source: ThreadSource::Flag });
    }
    for var in THREAD_VARS {
        if let Some(v) = get(var) {
            let n =
                v.trim().parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                    Error::Config(format!("{var}={v:?} is not a positive number of threads: unset it or give one"))
                })?;
            return Ok(ThreadChoice { threads: n, source: ThreadSource::User(var) });
        }
    }
    let ranks_on_host = ranks_on_host.max(1);
    Ok(ThreadChoice { threads: default_threads(cores, ranks_on_host), source: ThreadSource::Default { cores, ranks_on_host } })
}

/// Cores this process may run on (affinity and cgroup limits included; 1 if unknown).
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// For a rank started by another launcher (torchrun, srun, mpirun): chooses its threads from
/// the ranks on its host (`local_world_size`, 1 if unknown) and sets the variables the user
/// left unset in this process. Call it first thing in `main`, before any thread pool starts and
/// before other threads exist (it changes the environment). Returns the choice, or `None` when
/// the user (or our launcher) already set every variable.
pub fn apply_to_process(local_world_size: Option<usize>) -> Result<Option<ThreadChoice>> {
    let get = |k: &str| std::env::var(k).ok();
    if THREAD_VARS.iter().all(|v| get(v).is_some()) {
        return Ok(None);
    }
    let choice = choose(get, available_cores(), local_world_size.unwrap_or(1), None)?;
    for (k, v) in choice.env(|k| std::env::var(k).ok()) {
        // Edition 2021: set_var is safe; the contract above keeps other threads from reading
        // the environment meanwhile.
        std::env::set_var(k, v);
    }
    Ok(Some(choice))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(kv: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn default_divides_the_cores() {
        assert_eq!(default_threads(2, 1), 2);
        assert_eq!(default_threads(2, 2), 1);
        assert_eq!(default_threads(2, 4), 1);
        assert_eq!(default_threads(16, 4), 4);
        assert_eq!(default_threads(16, 0), 16);
        let c = choose(env(&[]), 8, 2, None).unwrap();
        assert_eq!(c, ThreadChoice { threads: 4, source: ThreadSource::Default { cores: 8, ranks_on_host: 2 } });
        assert_eq!(c.env(env(&[])), vec![("RAYON_NUM_THREADS", "4".to_string()), ("OMP_NUM_THREADS", "4".to_string())]);
    }

    #[test]
    fn user_values_win_and_are_kept() {
        let e = env(&[("OMP_NUM_THREADS", "3")]);
        let c = choose(&e, 8, 2, None).unwrap();
        assert_eq!(c, ThreadChoice { threads: 3, source: ThreadSource::User("OMP_NUM_THREADS") });
        // only the unset variable is filled in, with the user's number
        assert_eq!(c.env(&e), vec![("RAYON_NUM_THREADS", "3".to_string())]);
        let c = choose(env(&[("RAYON_NUM_THREADS", "5"), ("OMP_NUM_THREADS", "3")]), 8, 2, None).unwrap();
        assert_eq!(c.threads, 5);
    }

    #[test]
    fn flag_overrides_everything() {
        let e = env(&[("RAYON_NUM_THREADS", "5")]);
        let c = choose(&e, 8, 2, Some(2)).unwrap();
        assert_eq!(c.source, ThreadSource::Flag);
        assert_eq!(c.env(&e).len(), 2);
        assert!(choose(&e, 8, 2, Some(0)).is_err());
    }

    #[test]
    fn bad_user_value_is_an_error_naming_it() {
        let err = choose(env(&[("RAYON_NUM_THREADS", "lots")]), 8, 2, None).unwrap_err().to_string();
        assert!(err.contains("RAYON_NUM_THREADS"), "{err}");
        assert!(choose(env(&[("OMP_NUM_THREADS", "0")]), 8, 2, None).is_err());
    }

    #[test]
    fn says_why() {
        let c = choose(env(&[]), 2, 2, None).unwrap().to_string();
        assert!(c.starts_with("1 compute thread per rank (2 cores / 2 ranks"), "{c}");
    }
}

/// Name prefixes of the threads the transport starts: the collective threads (`iw-coll-*`),
/// TCP readers, senders and acceptors (`iw-tcp-*`), UCX and verbs progress threads, the
/// rendezvous server. [`comm_cpu_ns`] sums their CPU. (Prefixes, not `iw-` alone: a binary
/// named `iw-something` names its main thread so.)
pub const COMM_THREAD_PREFIXES: [&str; 5] = ["iw-coll-", "iw-tcp-", "iw-ucx-", "iw-verbs-", "iw-rendezvous"];

/// CPU time, ns, the live threads of this process whose name starts with one of `prefixes`
/// have used (from `/proc/self/task/*/schedstat`, nanosecond precision; `stat`'s ticks where
/// schedstat is missing). Threads that already ended are not counted: read it while the
/// communicators are open. `None` off Linux or when `/proc` cannot be read.
pub fn threads_cpu_ns(prefixes: &[&str]) -> Option<u64> {
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    let mut total = 0u64;
    for t in tasks.flatten() {
        let p = t.path();
        let Ok(name) = std::fs::read_to_string(p.join("comm")) else { continue };
        if !prefixes.iter().any(|x| name.trim_end().starts_with(x)) {
            continue;
        }
        total += task_cpu_ns(&p).unwrap_or(0);
    }
    Some(total)
}

/// CPU of short-lived communication threads that have ended (striped collectives' lanes, a
/// backward's gradient thread), ns: they add their own at the end ([`count_this_thread`]).
static ENDED_CPU_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Adds the calling thread's CPU so far to the communication CPU: the last call of a
/// short-lived communication thread (not named after [`COMM_THREAD_PREFIXES`], so it is
/// counted once).
pub fn count_this_thread() {
    ENDED_CPU_NS.fetch_add(this_thread_cpu_ns(), std::sync::atomic::Ordering::Relaxed);
}

/// CPU time the calling thread has used, ns (0 where the clock cannot be read).
pub fn this_thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we own; the clock id is a valid constant.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if r != 0 {
        return 0;
    }
    (ts.tv_sec.max(0) as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec.max(0) as u64)
}

/// CPU time every thread of this process has used so far, ended ones included, ns
/// (`getrusage(RUSAGE_SELF)`: user and system time, microsecond resolution; 0 where it cannot
/// be read). The difference of two runs of one job is what the second one's extra work cost,
/// wherever it ran (the way iperf3 reports its own CPU).
pub fn process_cpu_ns() -> u64 {
    // SAFETY: an all-zero rusage is a valid value for this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we own; RUSAGE_SELF is a valid constant.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0;
    }
    let ns =
        |t: libc::timeval| (t.tv_sec.max(0) as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_usec.max(0) as u64 * 1000);
    ns(ru.ru_utime).saturating_add(ns(ru.ru_stime))
}

/// CPU of this process's communication so far, ns: its live threads named after
/// [`COMM_THREAD_PREFIXES`] (collective threads, TCP readers and senders) and the short-lived
/// ones that ended ([`count_this_thread`]). Read it before the communicators close.
pub fn comm_cpu_ns() -> Option<u64> {
    Some(threads_cpu_ns(&COMM_THREAD_PREFIXES)? + ENDED_CPU_NS.load(std::sync::atomic::Ordering::Relaxed))
}

fn task_cpu_ns(task: &std::path::Path) -> Option<u64> {
    if let Ok(s) = std::fs::read_to_string(task.join("schedstat")) {
        return s.split_whitespace().next()?.parse().ok();
    }
    // stat: utime and stime are fields 14 and 15, after the `(comm)` that may hold spaces
    let s = std::fs::read_to_string(task.join("stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf takes a valid constant and has no other preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(ticks * 1_000_000_000 / hz)
}

#[cfg(test)]
mod cpu_tests {
    use super::*;

    #[test]
    fn a_named_thread_that_spins_is_counted_and_others_are_not() {
        let before = threads_cpu_ns(&["iw-cputest"]).unwrap();
        assert_eq!(before, 0, "no such thread yet");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::Builder::new()
            .name("iw-cputest".into())
            .spawn(move || {
                let t0 = std::time::Instant::now();
                let mut x = 0u64;
                while t0.elapsed() < std::time::Duration::from_millis(60) {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
                rx.recv().ok();
                x
            })
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(80));
        let during = threads_cpu_ns(&["iw-cputest"]).unwrap();
        tx.send(()).unwrap();
        t.join().unwrap();
        assert!(during >= 10_000_000, "a thread that spun for 60 ms used {during} ns");
        assert_eq!(threads_cpu_ns(&["iw-no-such-thread"]).unwrap(), 0);
    }
}

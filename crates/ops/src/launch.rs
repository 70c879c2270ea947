//! `ironweave launch`: starts N local ranks with the job in their environment, prefixes their
//! output with the rank, and when one fails stops the others and reports which and how.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use crate::error::{bail, Context, Result};
use ironweave_transport::rendezvous::{free_base_port, RENDEZVOUS_SPAN};

static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    SIGNALLED.store(sig, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to a flag the launcher polls, so that it can forward them.
pub fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `on_signal` is an `extern "C"` function that only performs an atomic store,
        // which is async-signal-safe; `signal` has no other preconditions.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

/// Signals a rank's whole process group (the rank and anything it started).
fn send_signal(child: &Child, sig: libc::c_int) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: `kill` has no memory-safety preconditions; the negative pid names the
        // process group we created for this rank (its leader is not reaped yet, so the id
        // cannot have been reused).
        unsafe {
            libc::kill(-pid, sig);
        }
    }
}

/// `ironweave launch`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct LaunchArgs {
    /// Number of ranks (default with --topology: hosts x --ranks-per-host).
    #[arg(short = 'n', long = "ranks")]
    pub ranks: Option<usize>,
    /// Run on the emulated cluster of this topology file (see `ironweave cluster up`).
    #[arg(long)]
    pub topology: Option<std::path::PathBuf>,
    /// Ranks per emulated host.
    #[arg(long, default_value_t = 1)]
    pub ranks_per_host: usize,
    /// Backend the ranks should use (exported as IRONWEAVE_BACKEND).
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Stop the job after this many seconds.
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Do not prefix output lines with the rank.
    #[arg(long)]
    pub no_prefix: bool,
    /// Restart ranks that fail, up to this many times in all; a restarted rank runs with
    /// IRONWEAVE_GENERATION set to the job's next generation (see docs/ARCHITECTURE.md).
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// On a failure, stop every rank and restart all of them as the next generation (as
    /// torchrun does), instead of only the failed ones: for frameworks whose surviving
    /// processes cannot re-form their job (PyTorch's process groups).
    #[arg(long)]
    pub restart_all: bool,
    /// Compute threads per rank (RAYON_NUM_THREADS and OMP_NUM_THREADS of every rank).
    /// Default: the user's RAYON_NUM_THREADS / OMP_NUM_THREADS, else cores / ranks per host.
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// `ironweave launch`: the ranks of `a.command`, supervised to their end (signals forwarded);
/// returns the command's exit status ([`Outcome::exit_code`]).
pub fn command(a: &LaunchArgs) -> Result<i32> {
    crate::backend::check(&a.backend)?;
    let topology = match &a.topology {
        Some(p) => Some((crate::topology::Topology::load(p)?, a.ranks_per_host.max(1))),
        None => None,
    };
    let ranks = match (a.ranks, &topology) {
        (Some(n), _) => n,
        (None, Some((t, k))) => t.hosts * k,
        (None, None) => bail!("give the number of ranks with -n (or a --topology)"),
    };
    let Some((program, args)) = a.command.split_first() else { bail!("give the program to start after --") };
    install_signal_handlers();
    let spec = LaunchSpec {
        topology,
        ranks,
        program: program.clone(),
        args: args.to_vec(),
        prefix: !a.no_prefix,
        env: vec![("IRONWEAVE_BACKEND".into(), a.backend.clone())],
        timeout: a.timeout.map(Duration::from_secs_f64),
        max_restarts: a.max_restarts,
        restart_all: a.restart_all,
        threads_per_rank: a.threads_per_rank,
    };
    Ok(run(&spec)?.exit_code())
}

/// Runs this binary's hidden worker subcommand `args` on `ranks` ranks (on an emulated cluster
/// with `topology`), their output prefixed, no restarts; an error unless every rank succeeded.
pub fn helpers(ranks: usize, args: Vec<String>, topology: Option<(crate::topology::Topology, usize)>, what: &str) -> Result<()> {
    let exe = std::env::current_exe().context("locating the ironweave binary")?;
    let spec = LaunchSpec {
        ranks,
        program: exe.to_string_lossy().into_owned(),
        args,
        prefix: true,
        env: vec![],
        timeout: None,
        topology,
        max_restarts: 0,
        restart_all: false,
        threads_per_rank: None,
    };
    install_signal_handlers();
    match run(&spec)? {
        Outcome::Success => Ok(()),
        other => bail!("the {what} ranks did not finish: {other:?}"),
    }
}

/// How to run the ranks.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub ranks: usize,
    pub program: String,
    pub args: Vec<String>,
    /// Prefix every output line with `[rank i]`.
    pub prefix: bool,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// Stop everything after this long (None: no limit).
    pub timeout: Option<Duration>,
    /// Run on an emulated cluster: each rank inside its host's namespace, `ranks_per_host` per
    /// host, one TCP link per topology link.
    pub topology: Option<(crate::topology::Topology, usize)>,
    /// Restart failed ranks this many times (0: the first failure stops the job). A restarted
    /// rank gets `IRONWEAVE_GENERATION` = the job's next generation; ranks re-form the job on
    /// master port `IRONWEAVE_MASTER_PORT + generation`.
    pub max_restarts: usize,
    /// A failure restarts every rank (the survivors are stopped first), all as the next
    /// generation.
    pub restart_all: bool,
    /// Compute threads per rank (`--threads-per-rank`); None: the user's `RAYON_NUM_THREADS` /
    /// `OMP_NUM_THREADS`, else cores / ranks per host (see `ironweave_transport::threads`).
    pub threads_per_rank: Option<usize>,
}

/// The thread choice for the ranks of `spec` (printed once by [`run`]). Every rank this
/// launcher starts runs on this machine's cores, emulated hosts included (they are network
/// namespaces, not machines), so all of them count as ranks on this host.
pub fn thread_choice(spec: &LaunchSpec) -> Result<ironweave_transport::threads::ThreadChoice> {
    use ironweave_transport::threads;
    Ok(threads::choose(|k| std::env::var(k).ok(), threads::available_cores(), spec.ranks, spec.threads_per_rank)?)
}

/// How the job ended.
#[derive(Debug)]
pub enum Outcome {
    Success,
    /// The first rank that failed, with how.
    RankFailed {
        code: i32,
    },
    Interrupted {
        signal: i32,
    },
    TimedOut,
}

impl Outcome {
    /// The exit status a command that launched the ranks should end with: 0 on success, the
    /// failed rank's code (at least 1), 128 + the signal that interrupted, 124 on timeout.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Success => 0,
            Outcome::RankFailed { code } => (*code).max(1),
            Outcome::Interrupted { signal } => 128 + signal,
            Outcome::TimedOut => 124,
        }
    }
}

fn describe(st: ExitStatus) -> (String, i32) {
    use std::os::unix::process::ExitStatusExt;
    if let Some(c) = st.code() {
        (format!("exited with status {c}"), c)
    } else if let Some(s) = st.signal() {
        let name = match s {
            libc::SIGKILL => " (SIGKILL)",
            libc::SIGTERM => " (SIGTERM)",
            libc::SIGINT => " (SIGINT)",
            libc::SIGSEGV => " (SIGSEGV)",
            libc::SIGABRT => " (SIGABRT)",
            _ => "",
        };
        (format!("was killed by signal {s}{name}"), 128 + s)
    } else {
        ("ended in an unknown way".into(), 1)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Starts the ranks and supervises them until they all end or one fails.
/// The ranks of a training run: this binary's hidden worker subcommand (`args`, e.g.
/// `train-worker ...`) on `ranks` local or emulated ranks, with the backend (`backend`) and
/// `--quiet` exported to them, restarting failed ranks up to `max_restarts` times. Returns the
/// command's exit status.
pub fn workers(
    ranks: usize,
    args: Vec<String>,
    backend: &str,
    quiet: bool,
    topology: Option<(crate::topology::Topology, usize)>,
    max_restarts: usize,
    threads_per_rank: Option<usize>,
) -> Result<i32> {
    let exe = std::env::current_exe().context("locating the ironweave binary")?;
    let spec = LaunchSpec {
        ranks,
        program: exe.to_string_lossy().into_owned(),
        args,
        prefix: false,
        env: [("IRONWEAVE_BACKEND", backend)]
            .into_iter()
            .chain(quiet.then_some((crate::progress::QUIET_VAR, "1")))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        timeout: None,
        topology,
        max_restarts,
        restart_all: false,
        threads_per_rank,
    };
    install_signal_handlers();
    Ok(run(&spec)?.exit_code())
}

pub fn run(spec: &LaunchSpec) -> Result<Outcome> {
    if spec.ranks == 0 {
        bail!("--ranks/-n must be at least 1");
    }
    let threads = thread_choice(spec)?;
    eprintln!("ironweave launch: {threads}");
    let thread_env = threads.env(|k| std::env::var(k).ok());
    // one port per generation, below the kernel's ephemeral range
    let port = free_base_port(RENDEZVOUS_SPAN).context("finding a free port for the rendezvous")?;
    let secret = hex(&ironweave_transport::wire::nonce());
    let job = format!("iw-{}-{port}", std::process::id());
    // the job's board: ranks announce the generation they go to and the job's end there (a
    // directory every rank reaches, emulated hosts included: they share this file system)
    let board = ironweave_transport::board::Board::create(std::env::temp_dir().join(format!("ironweave-board-{job}")))?;
    let _remove_board = RemoveOnDrop(board.dir().to_path_buf());
    let mut children: Vec<Option<Child>> = Vec::new();
    let mut pumps = Vec::new();
    let master = match &spec.topology {
        Some((t, k)) => {
            if spec.ranks != t.hosts * k {
                bail!("{} ranks do not fit {} hosts x {k} ranks per host", spec.ranks, t.hosts);
            }
            t.addr(0, 0)
        }
        None => "127.0.0.1".to_string(),
    };
    let spawn_rank = |rank: usize, gen: usize, pumps: &mut Vec<std::thread::JoinHandle<()>>| -> Result<Child> {
        let mut cmd = match &spec.topology {
            Some((t, k)) => {
                let h = rank / k;
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &t.host_ns(h), &spec.program])
                    .env("IRONWEAVE_TCP_LINKS", t.tcp_links_env(h))
                    .env("IRONWEAVE_HOST", h.to_string());
                c
            }
            None => Command::new(&spec.program),
        };
        let (local, local_size) = match &spec.topology {
            Some((_, k)) => (rank % k, *k),
            None => (rank, spec.ranks),
        };
        cmd.args(&spec.args)
            .env("IRONWEAVE_RANK", rank.to_string())
            .env("IRONWEAVE_WORLD_SIZE", spec.ranks.to_string())
            .env("IRONWEAVE_LOCAL_RANK", local.to_string())
            .env("IRONWEAVE_LOCAL_WORLD_SIZE", local_size.to_string())
            .env("IRONWEAVE_MASTER_ADDR", &master)
            .env("IRONWEAVE_MASTER_PORT", port.to_string())
            .env("IRONWEAVE_JOB_ID", &job)
            .env("IRONWEAVE_SECRET", &secret)
            .env("IRONWEAVE_GENERATION", gen.to_string())
            .env(ironweave_transport::board::BOARD_VAR, board.dir())
            .envs(thread_env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            // Each rank leads its own process group so that a stop reaches whatever it started;
            // the launcher forwards Ctrl-C (SIGINT) and SIGTERM to every group.
            .process_group(0);
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        if spec.prefix {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = cmd.spawn().with_context(|| format!("cannot start {:?} for rank {rank}", spec.program))?;
        if spec.prefix {
            if let Some(out) = child.stdout.take() {
                pumps.push(std::thread::spawn(move || pump(rank, out, false)));
            }
            if let Some(err) = child.stderr.take() {
                pumps.push(std::thread::spawn(move || pump(rank, err, true)));
            }
        }
        Ok(child)
    };
    for rank in 0..spec.ranks {
        match spawn_rank(rank, 0, &mut pumps) {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    send_signal(c, libc::SIGKILL);
                    let _ = c.wait();
                }
                return Err(e);
            }
        }
    }
    let mut generation = 0usize;
    let mut restarts_left = spec.max_restarts;
    let started = Instant::now();
    let mut outcome = None;
    let mut remaining = spec.ranks;
    while remaining > 0 {
        let sig = SIGNALLED.swap(0, Ordering::SeqCst);
        if sig != 0 {
            eprintln!("ironweave launch: got signal {sig}, forwarding it to every rank");
            for c in children.iter().flatten() {
                send_signal(c, sig);
            }
            outcome.get_or_insert(Outcome::Interrupted { signal: sig });
            stop_all(&mut children);
            break;
        }
        if spec.timeout.is_some_and(|t| started.elapsed() > t) {
            eprintln!("ironweave launch: the job ran past its --timeout, stopping every rank");
            outcome.get_or_insert(Outcome::TimedOut);
            stop_all(&mut children);
            break;
        }
        let mut failed = Vec::new();
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            match c.try_wait() {
                Ok(Some(st)) => {
                    *slot = None;
                    remaining -= 1;
                    if !st.success() {
                        failed.push((rank, st));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("ironweave launch: cannot wait for rank {rank}: {e}");
                }
            }
        }
        if !failed.is_empty() && board.finished() {
            // every rank passed the final barrier before these died: the job's work is done
            for (rank, st) in failed.drain(..) {
                eprintln!("ironweave launch: rank {rank} {} after the job finished; not restarted", describe(st).0);
            }
        }
        // a rank that could not write the job's board: its waits and its record of commits are
        // gone, and a restart would meet the same file system — said here, with the board's
        // path and free space, and the job stopped
        if let Some((rank, _)) = failed.iter().find(|(_, st)| st.code() == Some(EXIT_BOARD)) {
            eprintln!(
                "ironweave launch: rank {rank} could not write the job board {} ({}); stopping the job: free space there or set TMPDIR to a writable file system",
                board.dir().display(),
                ironweave_transport::board::free_space(board.dir())
            );
        }
        // a rank that says its job cannot recover is not restarted (nor is anyone else)
        let unrecoverable = failed.iter().any(|(_, st)| matches!(st.code(), Some(EXIT_UNRECOVERABLE | EXIT_BOARD)));
        if !failed.is_empty() && restarts_left > 0 && !unrecoverable {
            // ranks that die together (a host, a rank and its replica peer) are one failure
            std::thread::sleep(Duration::from_millis(300));
            for (rank, slot) in children.iter_mut().enumerate() {
                if let Some(c) = slot {
                    if let Ok(Some(st)) = c.try_wait() {
                        *slot = None;
                        remaining -= 1;
                        if !st.success() {
                            failed.push((rank, st));
                        }
                    }
                }
            }
            restarts_left -= 1;
            generation += 1;
            // the failed ranks, and with --restart-all the survivors too (stopped first): every
            // one of them comes back as the new generation
            let mut restart: Vec<(usize, String)> = failed.iter().map(|(r, st)| (*r, describe(*st).0)).collect();
            if spec.restart_all {
                let alive: Vec<usize> = (0..children.len()).filter(|&r| children[r].is_some()).collect();
                stop_all(&mut children);
                remaining = 0;
                restart.extend(alive.into_iter().map(|r| (r, "was stopped (--restart-all)".to_string())));
                restart.sort_by_key(|r| r.0);
            }
            let mut ok = true;
            for (rank, how) in &restart {
                eprintln!(
                    "ironweave launch: rank {rank} {how}; restarting it as generation {generation} ({} restart{} left)",
                    restarts_left,
                    if restarts_left == 1 { "" } else { "s" }
                );
                match spawn_rank(*rank, generation, &mut pumps) {
                    Ok(c) => {
                        children[*rank] = Some(c);
                        remaining += 1;
                    }
                    Err(e) => {
                        eprintln!("ironweave launch: {e:#}");
                        ok = false;
                    }
                }
            }
            if ok {
                continue;
            }
        }
        if let Some(&(rank, st)) = failed.first() {
            let (how, code) = describe(st);
            eprintln!("ironweave launch: rank {rank} {how}; stopping the other ranks");
            outcome = Some(Outcome::RankFailed { code });
            stop_all(&mut children);
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Output pipes may still be held by something a rank left behind: wait briefly only.
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until && pumps.iter().any(|p| !p.is_finished()) {
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(outcome.unwrap_or(Outcome::Success))
}

/// The exit status of a rank whose job cannot recover (every copy of a committed iteration is
/// gone): the launcher stops the job instead of restarting ranks.
pub const EXIT_UNRECOVERABLE: i32 = 75;

/// The exit status of a rank that could not write the job's board (`ironweave::elastic::
/// EXIT_BOARD`): the launcher reports the board's path and free space and stops the job.
pub const EXIT_BOARD: i32 = 74;

/// Removes a directory when dropped (the job's board, whichever way the launcher returns).
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// SIGTERM to every running rank, SIGKILL after a grace period, then reap them all.
fn stop_all(children: &mut [Option<Child>]) {
    for c in children.iter().flatten() {
        send_signal(c, libc::SIGTERM);
    }
    let until = Instant::now() + Duration::from_secs(3);
    for slot in children.iter_mut() {
        let Some(c) = slot else { continue };
        loop {
            match c.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= until => {
                    send_signal(c, libc::SIGKILL);
                    let _ = c.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        *slot = None;
    }
}

fn pump(rank: usize, r: impl std::io::Read, err: bool) {
    for line in BufReader::new(r).lines() {
        let Ok(line) = line else { break };
        if err {
            let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {line}");
        } else {
            let _ = writeln!(std::io::stdout().lock(), "[rank {rank}] {line}");
        }
    }
}

//! Rendezvous: who am I, how many are we, and an all-gather of bytes through rank 0.
//!
//! The job is read from the environment, in this order: ironweave's own variables
//! (`IRONWEAVE_RANK`, `IRONWEAVE_WORLD_SIZE`, `IRONWEAVE_MASTER_ADDR`, `IRONWEAVE_MASTER_PORT`,
//! ...), then torchrun's (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`),
//! SLURM's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_JOB_ID`) and OpenMPI's
//! (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`). Rank 0 runs a
//! small server at the master address; every rank (rank 0 too) registers there, and
//! [`Rendezvous::all_gather`] hands every rank everybody's bytes (link addresses, UCX worker
//! addresses, NCCL unique ids).

use ironweave_units::Locked;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::handshake::{self, Credentials};
use crate::wire::Role;

/// Largest rendezvous payload per rank.
pub const MAX_PAYLOAD: usize = 16 << 20;

/// Which convention described the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    Ironweave,
    Torchrun,
    Slurm,
    OpenMpi,
}

/// One rank's description of the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    /// Ranks on this rank's host, when the launcher says (`IRONWEAVE_LOCAL_WORLD_SIZE`,
    /// torchrun's `LOCAL_WORLD_SIZE`, SLURM's `SLURM_NTASKS_PER_NODE`, OpenMPI's
    /// `OMPI_COMM_WORLD_LOCAL_SIZE`): how many ranks share its cores.
    pub local_world_size: Option<usize>,
    pub master: SocketAddr,
    pub job_id: String,
    pub secret: Vec<u8>,
    pub source: EnvSource,
    /// The generation of an elastic job this process joins (`IRONWEAVE_GENERATION`; 0: the
    /// job's first).
    pub generation: u16,
    /// The launcher's job board (`IRONWEAVE_JOB_BOARD`): waits of a formation end when a newer
    /// generation is announced there or the job ended ([`crate::board`]).
    pub board: Option<crate::board::Board>,
}

impl JobEnv {
    /// Reads the job from the process environment.
    pub fn from_env() -> Result<JobEnv> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the job through `get` (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<JobEnv> {
        let num = |k: &str| -> Result<Option<usize>> {
            match get(k) {
                None => Ok(None),
                Some(v) => {
                    v.trim().parse().map(Some).map_err(|_| Error::Config(format!("{k}={v:?} is not a non-negative integer")))
                }
            }
        };
        let conventions: [(EnvSource, &str, &str, &str, &str); 4] = [
            (
                EnvSource::Ironweave,
                "IRONWEAVE_RANK",
                "IRONWEAVE_WORLD_SIZE",
                "IRONWEAVE_LOCAL_RANK",
                "IRONWEAVE_LOCAL_WORLD_SIZE",
            ),
            (EnvSource::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
            (EnvSource::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
            (
                EnvSource::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
        ];
        let mut found = None;
        for (src, r, w, l, lw) in conventions {
            if let (Some(rank), Some(world)) = (num(r)?, num(w)?) {
                // a malformed local size only costs the thread choice its hint, never the job
                let local_world = get(lw).and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0);
                found = Some((src, rank, world, num(l)?.unwrap_or(rank), local_world));
                break;
            }
        }
        let (source, rank, world_size, local_rank, local_world_size) = found.ok_or_else(|| {
            Error::Config(
                "no job in the environment: start ranks with `ironweave launch`, torchrun, srun or mpirun, \
                 or set IRONWEAVE_RANK, IRONWEAVE_WORLD_SIZE, IRONWEAVE_MASTER_ADDR and IRONWEAVE_MASTER_PORT"
                    .into(),
            )
        })?;
        if world_size == 0 || rank >= world_size {
            return Err(Error::Config(format!("rank {rank} is out of range for world size {world_size}")));
        }
        let first = |keys: &[&str]| keys.iter().find_map(|k| get(k).filter(|v| !v.is_empty()));
        let host = first(&["IRONWEAVE_MASTER_ADDR", "MASTER_ADDR", "SLURM_LAUNCH_NODE_IPADDR"]).ok_or_else(|| {
            Error::Config(format!(
                "{source:?} job without a master address: set IRONWEAVE_MASTER_ADDR (or MASTER_ADDR) to rank 0's host"
            ))
        })?;
        let job_id = job_id_from(&get);
        let port = match first(&["IRONWEAVE_MASTER_PORT", "MASTER_PORT"]) {
            Some(p) => p
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| Error::Config(format!("master port {p:?} is not a port number 1-65535")))?,
            // SLURM without a port: derive one from the job id so every rank agrees.
            None if source == EnvSource::Slurm => {
                20000 + (job_id.bytes().fold(0u32, |a, b| a.wrapping_mul(31).wrapping_add(u32::from(b))) % 20000) as u16
            }
            None => return Err(Error::Config("no master port: set IRONWEAVE_MASTER_PORT (or MASTER_PORT)".into())),
        };
        let master = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| Error::Config(format!("cannot resolve master address {host:?}: {e}")))?
            .next()
            .ok_or_else(|| Error::Config(format!("master address {host:?} resolves to nothing")))?;
        let secret = get("IRONWEAVE_SECRET").unwrap_or_default().into_bytes();
        if secret.is_empty() && !master.ip().is_loopback() && rank == 0 {
            // the launcher sets a random secret; a job started by another launcher across hosts
            // without one authenticates nobody
            eprintln!(
                "ironweave: warning: a multi-host job without IRONWEAVE_SECRET: any process that reaches {master} can join it; set IRONWEAVE_SECRET to the same random value on every rank"
            );
        }
        let generation = match get("IRONWEAVE_GENERATION") {
            None => 0,
            Some(g) => g.trim().parse::<u16>().map_err(|_| {
                Error::Config(format!("IRONWEAVE_GENERATION={g:?} is not a generation number 0-65535 (the launcher sets it)"))
            })?,
        };
        let board = get(crate::board::BOARD_VAR).filter(|d| !d.is_empty()).map(crate::board::Board::at);
        Ok(JobEnv { rank, world_size, local_rank, local_world_size, master, job_id, secret, source, generation, board })
    }

    /// Rank `rank` of a `world`-rank job on loopback port `port` named `job_id`, as a program
    /// that plays the launcher itself (threads as ranks, tests) describes it: generation 0, no
    /// board, every rank on this host.
    pub fn loopback(rank: usize, world: usize, port: u16, job_id: impl Into<String>) -> JobEnv {
        JobEnv {
            rank,
            world_size: world,
            local_rank: rank,
            local_world_size: Some(world),
            master: (std::net::Ipv4Addr::LOCALHOST, port).into(),
            job_id: job_id.into(),
            secret: b"local".to_vec(),
            source: EnvSource::Ironweave,
            generation: 0,
            board: None,
        }
    }

    /// The job's id as the launcher set it, or derived (see [`job_id_from_env`]).
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// Whether no launcher named the job ([`job_id_from_env`] derived its id).
    pub fn job_id_is_derived(&self) -> bool {
        self.job_id.starts_with(DERIVED_JOB_ID_PREFIX)
    }

    /// Why this process should stop waiting to form its generation (a newer one was
    /// announced, or the job ended); None without a board.
    pub fn superseded(&self) -> Option<Error> {
        self.board.as_ref().and_then(|b| b.superseded(self.generation))
    }

    /// The handshake credentials of this job.
    pub fn credentials(&self) -> Credentials {
        Credentials { job: self.job_id.clone(), secret: self.secret.clone(), world: self.world_size as u32 }
    }
}

/// Variables that name the job, in the order they are read.
pub const JOB_ID_VARS: [&str; 4] = ["IRONWEAVE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_MCA_ess_base_jobid"];

/// How a job id that no launcher gave begins ([`job_id_from_env`]).
pub const DERIVED_JOB_ID_PREFIX: &str = "derived-";

/// The job's id: as its launcher set it — `IRONWEAVE_JOB_ID` (unique per `ironweave launch`),
/// torchrun's `TORCHELASTIC_RUN_ID` (its `--rdzv-id`; torchrun's `none`, the id of every job
/// without one, does not count), `SLURM_JOB_ID` with `SLURM_STEP_ID`, OpenMPI's job id — else
/// one derived from what every rank of this job shares and another job does not: the master
/// endpoint and the program with its arguments (`derived-<hash>`; the elastic runtime adds
/// rank 0's launcher, its PID and start time, once the job has formed). Two unrelated jobs
/// therefore never share an id by default, so neither adopts the other's files. Every process
/// of one job, restarted ones included, reads the same id.
pub fn job_id_from_env() -> String {
    job_id_from(&|k: &str| std::env::var(k).ok())
}

fn job_id_from(get: &dyn Fn(&str) -> Option<String>) -> String {
    let given = |k: &str| get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty() && v != "none");
    for k in JOB_ID_VARS {
        if let Some(v) = given(k) {
            return match (k, given("SLURM_STEP_ID")) {
                // the steps of one allocation are different jobs
                ("SLURM_JOB_ID", Some(step)) => format!("{v}.{step}"),
                _ => v,
            };
        }
    }
    let mut h = Fnv::default();
    for k in ["IRONWEAVE_MASTER_ADDR", "MASTER_ADDR", "IRONWEAVE_MASTER_PORT", "MASTER_PORT"] {
        h.add(get(k).unwrap_or_default().as_bytes());
    }
    if let Ok(exe) = std::env::current_exe() {
        h.add(exe.as_os_str().as_encoded_bytes());
    }
    for a in std::env::args_os() {
        h.add(a.as_encoded_bytes());
    }
    format!("{DERIVED_JOB_ID_PREFIX}{:016x}", h.0)
}

/// FNV-1a, 64 bits: a stable digest of a few strings (ids, not security).
#[derive(Debug, Clone, Copy)]
pub struct Fnv(pub u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    /// Adds `b` and a separator.
    pub fn add(&mut self, b: &[u8]) {
        for &x in b.iter().chain(&[0xff]) {
            self.0 ^= u64::from(x);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// Who started this process, as a string that differs between two launches: the parent's PID
/// and its start time (clock ticks after boot, `/proc/PID/stat`). Rank 0's is what makes a
/// derived job id unique per launch (torchrun's agent keeps its PID across worker restarts).
pub fn launcher_identity() -> String {
    // SAFETY: getppid has no preconditions and cannot fail.
    let ppid = unsafe { libc::getppid() };
    format!("{ppid}@{}", start_time(ppid as u32).unwrap_or_default())
}

/// A process's start time (clock ticks after boot), from `/proc/PID/stat`.
fn start_time(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(19).map(str::to_string)))
}

/// Whether the process a [`launcher_identity`] names still runs (the same PID with the same
/// start time: a reused PID is another process). An identity that does not parse is not alive.
pub fn launcher_alive(id: &str) -> bool {
    let Some((pid, start)) = id.trim().split_once('@') else { return false };
    match pid.parse::<u32>() {
        Ok(pid) if pid > 0 => start_time(pid).is_some_and(|s| s == start),
        _ => false,
    }
}

fn write_framed(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(body.len() + 4);
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.extend_from_slice(body);
    s.write_all(&b)
}

fn read_framed(s: &mut TcpStream, limit: usize, deadline: Instant) -> std::io::Result<Vec<u8>> {
    s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))?;
    let mut pre = [0u8; 4];
    s.read_exact(&mut pre)?;
    let n = u32::from_le_bytes(pre) as usize;
    if n > limit {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("message of {n} bytes exceeds {limit}")));
    }
    let mut body = Vec::new();
    s.take(n as u64).read_to_end(&mut body)?;
    if body.len() != n {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "truncated message"));
    }
    Ok(body)
}

const MSG_PUT: u8 = 1;
const MSG_ALL: u8 = 2;
const MSG_FAIL: u8 = 3;
/// The rendezvous failed because ranks did not arrive in time: a timeout on every rank, which a
/// re-formation may retry once a link is back.
const MSG_FAIL_TIMEOUT: u8 = 4;
/// The rendezvous was given up because the job board announced a newer generation (or the
/// end of the job): the body is the generation announced, 2 bytes (0xffff: the end).
const MSG_FAIL_SUPERSEDED: u8 = 5;

/// The rendezvous failed because a rank that had registered went away: the body is its rank
/// (4 bytes) and what happened.
const MSG_FAIL_LOST: u8 = 6;

/// How often a waiting formation looks at the job board.
pub const WATCH_EVERY: Duration = Duration::from_millis(50);

/// A rank's connection to the rendezvous.
pub struct Rendezvous {
    stream: TcpStream,
    rank: usize,
    size: usize,
    timeout: Duration,
    server: Option<JoinHandle<Result<()>>>,
    /// Why to stop waiting (the job board's word), checked while a round waits.
    watch: Watch,
}

/// Says why a rank should stop waiting for its formation (see [`JobEnv::superseded`]).
pub type Watch = Box<dyn Fn() -> Option<Error> + Send + Sync>;

/// The watch of `env`'s formation: its board's word on its generation, read at most every
/// [`WATCH_EVERY`] however often it is asked (a loop may ask on every turn).
pub fn watcher(env: &JobEnv) -> Watch {
    let env = env.clone();
    let last = std::sync::Mutex::new((Instant::now() - WATCH_EVERY, None));
    Box::new(move || {
        let mut l = last.locked();
        if l.1.is_none() && l.0.elapsed() >= WATCH_EVERY {
            *l = (Instant::now(), env.superseded());
        }
        l.1.clone()
    })
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous").field("rank", &self.rank).field("size", &self.size).field("timeout", &self.timeout).finish()
    }
}

impl Rendezvous {
    /// Registers with rank 0's server (rank 0 starts it first). Waits at most `timeout`.
    pub fn connect(env: &JobEnv, timeout: Duration) -> Result<Rendezvous> {
        let creds = env.credentials();
        let server = if env.rank == 0 {
            let listener = match TcpListener::bind(env.master) {
                Ok(l) => l,
                Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
                    let any = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), env.master.port());
                    TcpListener::bind(any).map_err(|e| Error::io(format!("bind rendezvous port {any}"), &e))?
                }
                Err(e) => {
                    // a re-formed job's generation g listens on the base port + g (mod the span)
                    let which = match env.generation {
                        0 => String::new(),
                        g => format!(", generation {g}'s port: IRONWEAVE_MASTER_PORT + {}", g % RENDEZVOUS_SPAN),
                    };
                    return Err(Error::Config(format!(
                        "rank 0 cannot listen on {} ({e}{which}): pick an IRONWEAVE_MASTER_PORT whose next \
                         ports are free too, below the ephemeral range (`ironweave launch` does)",
                        env.master
                    )));
                }
            };
            let (c, size, watch) = (creds.clone(), env.world_size, watcher(env));
            Some(
                std::thread::Builder::new()
                    .name("iw-rendezvous".into())
                    .spawn(move || serve(listener, c, size, timeout, &*watch))
                    .map_err(|e| Error::io("spawn rendezvous server", &e))?,
            )
        } else {
            None
        };
        let deadline = Instant::now() + timeout;
        let watch = watcher(env);
        let joined = handshake::connect_retry_watching(env.master, deadline, &*watch)
            .and_then(|mut s| handshake::connect(&mut s, &creds, Role::Rendezvous, env.rank as u32, 0, 0, timeout).map(|_| s));
        match joined {
            Ok(stream) => Ok(Rendezvous { stream, rank: env.rank, size: env.world_size, timeout, server, watch }),
            // On rank 0 the server's own failure (a rejected peer, say) is the real cause.
            Err(e) => match server.map(|h| h.join()) {
                Some(Ok(Err(server_err))) => Err(server_err),
                _ => Err(e),
            },
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Every rank's `data` for this round, in rank order. All ranks must call it with the same
    /// `key`, in the same order.
    pub fn all_gather(&mut self, key: &str, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        if data.len() > MAX_PAYLOAD || key.len() > 255 {
            return Err(Error::InvalidArgument(format!("rendezvous payload of {} bytes exceeds {MAX_PAYLOAD}", data.len())));
        }
        let mut body = vec![MSG_PUT, key.len() as u8];
        body.extend_from_slice(key.as_bytes());
        body.extend_from_slice(data);
        let deadline = Instant::now() + self.timeout;
        let lost = |e: std::io::Error| Error::Io {
            context: format!("rendezvous round {key:?}"),
            message: format!("{e} (rank 0 or its rendezvous server is gone)"),
        };
        write_framed(&mut self.stream, &body).map_err(lost)?;
        // wait for the reply's first byte, giving the round up when the board says so
        loop {
            if let Some(e) = (self.watch)() {
                return Err(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let _ = self.stream.set_read_timeout(Some(left.min(WATCH_EVERY)));
            match self.stream.peek(&mut [0u8; 1]) {
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
                _ => break,
            }
        }
        let reply = match read_framed(&mut self.stream, MAX_PAYLOAD * self.size + 4 * self.size + 16, deadline) {
            Ok(r) => r,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(Error::Timeout {
                    what: format!("rendezvous round {key:?} (some rank did not arrive)"),
                    after: self.timeout,
                })
            }
            Err(e) => return Err(self.server_error().unwrap_or_else(|| lost(e))),
        };
        decode_all(&reply, self.size, self.timeout)
    }

    fn server_error(&mut self) -> Option<Error> {
        let h = self.server.take()?;
        if !h.is_finished() {
            self.server = Some(h);
            return None;
        }
        h.join().ok().and_then(|r| r.err())
    }

    /// Closes the connection; rank 0 waits for its server to finish.
    pub fn close(mut self) -> Result<()> {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(h) = self.server.take() {
            return h.join().unwrap_or_else(|_| Err(Error::Config("rendezvous server panicked".into())));
        }
        Ok(())
    }
}

fn decode_all(reply: &[u8], size: usize, timeout: Duration) -> Result<Vec<Vec<u8>>> {
    let bad = |d: &str| Error::Protocol { from: "rendezvous server".into(), detail: d.into() };
    match reply.first() {
        Some(&MSG_ALL) => {}
        Some(&MSG_FAIL) => return Err(Error::Config(format!("rendezvous failed: {}", String::from_utf8_lossy(&reply[1..])))),
        Some(&MSG_FAIL_LOST) => {
            let r = reply.get(1..5).ok_or_else(|| bad("truncated reply"))?;
            let rank = u32::from_le_bytes([r[0], r[1], r[2], r[3]]) as usize;
            return Err(Error::PeerLost { rank, detail: format!("rendezvous: {}", String::from_utf8_lossy(&reply[5..])) });
        }
        Some(&MSG_FAIL_SUPERSEDED) => {
            let b = reply.get(1..5).ok_or_else(|| bad("truncated reply"))?;
            let (gen, by) = (u16::from_le_bytes([b[0], b[1]]), u16::from_le_bytes([b[2], b[3]]));
            return Err(Error::Superseded { generation: gen, by: (by != u16::MAX).then_some(by) });
        }
        Some(&MSG_FAIL_TIMEOUT) => {
            return Err(Error::Timeout {
                what: format!("rendezvous (rank 0 says: {})", String::from_utf8_lossy(&reply[1..])),
                after: timeout,
            })
        }
        _ => return Err(bad("unknown reply")),
    }
    let mut at = 1;
    let mut out = Vec::with_capacity(size);
    for _ in 0..size {
        let n = reply.get(at..at + 4).ok_or_else(|| bad("truncated reply"))?;
        let n = u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize;
        let d = reply.get(at + 4..at + 4 + n).ok_or_else(|| bad("truncated reply"))?;
        out.push(d.to_vec());
        at += 4 + n;
    }
    if at != reply.len() {
        return Err(bad("trailing bytes in reply"));
    }
    Ok(out)
}

fn serve(
    listener: TcpListener,
    creds: Credentials,
    size: usize,
    timeout: Duration,
    watch: &(dyn Fn() -> Option<Error> + Send + Sync),
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut conns: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    let fail_all_as = |conns: &mut Vec<Option<TcpStream>>, kind: u8, reason: &str| {
        let mut b = vec![kind];
        b.extend_from_slice(reason.as_bytes());
        for s in conns.iter_mut().flatten() {
            let _ = write_framed(s, &b);
        }
    };
    let fail_all = |conns: &mut Vec<Option<TcpStream>>, reason: &str| fail_all_as(conns, MSG_FAIL, reason);
    listener.set_nonblocking(true).map_err(|e| Error::io("rendezvous listener", &e))?;
    let mut dropped = Vec::new();
    while conns.iter().any(Option::is_none) {
        if let Some(e) = watch() {
            let mut b = vec![MSG_FAIL_SUPERSEDED];
            if let Error::Superseded { generation, by } = &e {
                b.extend_from_slice(&generation.to_le_bytes());
                b.extend_from_slice(&by.unwrap_or(u16::MAX).to_le_bytes());
            }
            for s in conns.iter_mut().flatten() {
                let _ = write_framed(s, &b);
            }
            return Err(e);
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (0..size).filter(|&r| conns[r].is_none()).collect();
            let reason = format!("ranks {missing:?} never registered within {timeout:?} (dropped connections: {dropped:?})");
            fail_all_as(&mut conns, MSG_FAIL_TIMEOUT, &reason);
            return Err(Error::Timeout { what: format!("rendezvous: {reason}"), after: timeout });
        }
        match listener.accept() {
            Ok((mut s, addr)) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_nodelay(true);
                match handshake::accept(&mut s, &creds, Role::Rendezvous, Duration::from_secs(5).min(timeout)) {
                    // a second registration of a rank is a newer process of that rank (the
                    // launcher restarted it after the first died registered): it replaces
                    // the older one, whose connection is closed
                    Ok(Some(h)) => {
                        if let Some(old) = conns[h.rank as usize].replace(s) {
                            let _ = old.shutdown(std::net::Shutdown::Both);
                        }
                    }
                    Ok(None) => dropped.push(addr),
                    Err(e) => {
                        fail_all(&mut conns, &e.to_string());
                        return Err(e);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => return Err(Error::io("rendezvous accept", &e)),
        }
    }
    drop(listener);
    let mut conns: Vec<TcpStream> = conns.into_iter().flatten().collect();
    loop {
        let mut puts = Vec::with_capacity(size);
        let mut key0: Option<Vec<u8>> = None;
        // every read of a round has the job's deadline and watches the board: a rank that
        // stopped or was cut off never holds this thread and its sockets past them
        let deadline = Instant::now() + timeout;
        for r in 0..size {
            let got = match read_watching(&mut conns[r], MAX_PAYLOAD + 260, deadline, watch) {
                Err(Wait::Superseded(e)) => {
                    let mut b = vec![MSG_FAIL_SUPERSEDED];
                    if let Error::Superseded { generation, by } = &e {
                        b.extend_from_slice(&generation.to_le_bytes());
                        b.extend_from_slice(&by.unwrap_or(u16::MAX).to_le_bytes());
                    }
                    for s in conns.iter_mut() {
                        let _ = write_framed(s, &b);
                    }
                    return Err(e);
                }
                // at a round boundary nobody waits for rank 0's next round: the job is done
                // with the rendezvous (or rank 0 is gone) and nothing is owed to anyone
                Err(Wait::Late) if r == 0 && !conns[1..].iter().any(has_data) => return Ok(()),
                Err(Wait::Late) => {
                    let reason = format!("rank {r} did not arrive at a rendezvous round within {timeout:?}");
                    let mut all: Vec<Option<TcpStream>> = conns.into_iter().map(Some).collect();
                    fail_all_as(&mut all, MSG_FAIL_TIMEOUT, &reason);
                    return Err(Error::Timeout { what: format!("rendezvous: {reason}"), after: timeout });
                }
                Err(Wait::Io(e)) => Err(e),
                Ok(b) => Ok(b),
            };
            match got {
                Ok(b) if b.len() >= 2 && b[0] == MSG_PUT && b.len() >= 2 + usize::from(b[1]) => {
                    let k = b[2..2 + usize::from(b[1])].to_vec();
                    if key0.get_or_insert_with(|| k.clone()) != &k {
                        let reason = format!(
                            "rank {r} is in round {:?} while rank 0 is in {:?}",
                            String::from_utf8_lossy(&k),
                            String::from_utf8_lossy(key0.as_deref().unwrap_or_default())
                        );
                        let mut all: Vec<Option<TcpStream>> = conns.into_iter().map(Some).collect();
                        fail_all(&mut all, &reason);
                        return Err(Error::Config(reason));
                    }
                    puts.push(b[2 + usize::from(b[1])..].to_vec());
                }
                // Everyone closing at a round boundary is the normal end.
                Err(_) if r == 0 => return Ok(()),
                _ => {
                    // a rank that died after it registered: its peers may form again
                    let detail = "it left the rendezvous in the middle of a round".to_string();
                    let mut b = vec![MSG_FAIL_LOST];
                    b.extend_from_slice(&(r as u32).to_le_bytes());
                    b.extend_from_slice(detail.as_bytes());
                    for s in conns.iter_mut() {
                        let _ = write_framed(s, &b);
                    }
                    return Err(Error::PeerLost { rank: r, detail });
                }
            }
        }
        let mut reply = vec![MSG_ALL];
        for p in &puts {
            reply.extend_from_slice(&(p.len() as u32).to_le_bytes());
            reply.extend_from_slice(p);
        }
        for s in conns.iter_mut() {
            let _ = write_framed(s, &reply);
        }
    }
}

/// Why a wait of the rendezvous server for a rank's message ended without it.
enum Wait {
    /// The round's deadline passed.
    Late,
    /// The board announced a newer generation or the job's end.
    Superseded(Error),
    /// The connection failed (closed: the rank left).
    Io(std::io::Error),
}

/// Whether a message (or the connection's end) is waiting to be read on `s`, without waiting.
fn has_data(s: &TcpStream) -> bool {
    let _ = s.set_nonblocking(true);
    let r = s.peek(&mut [0u8; 1]).is_ok();
    let _ = s.set_nonblocking(false);
    r
}

/// One framed message from `s` by `deadline`, looking at `watch` every [`WATCH_EVERY`] while
/// nothing has arrived.
fn read_watching(
    s: &mut TcpStream,
    limit: usize,
    deadline: Instant,
    watch: &(dyn Fn() -> Option<Error> + Send + Sync),
) -> std::result::Result<Vec<u8>, Wait> {
    loop {
        if let Some(e) = watch() {
            return Err(Wait::Superseded(e));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Wait::Late);
        }
        s.set_read_timeout(Some(left.min(WATCH_EVERY))).map_err(Wait::Io)?;
        match s.peek(&mut [0u8; 1]) {
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) => return Err(Wait::Io(e)),
            Ok(_) => break,
        }
    }
    read_framed(s, limit, deadline).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Wait::Late,
        _ => Wait::Io(e),
    })
}

/// The host this process runs on, as a string equal on every rank of a host and different
/// between hosts: `IRONWEAVE_HOST` (set by the launcher for each host of an emulated cluster,
/// whose namespaces share one hostname), else the kernel's hostname. Checkpoint replicas go to
/// other hosts by it.
pub fn host_name() -> String {
    host_name_from(|k| std::env::var(k).ok(), || std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
}

fn host_name_from(get: impl Fn(&str) -> Option<String>, kernel: impl Fn() -> Option<String>) -> String {
    if let Some(h) = get("IRONWEAVE_HOST").filter(|h| !h.trim().is_empty()) {
        return format!("emulated-host-{}", h.trim());
    }
    kernel().or_else(|| get("HOSTNAME")).map(|h| h.trim().to_string()).unwrap_or_default()
}

/// How many rendezvous ports a job launched by `ironweave launch` may use: one per generation
/// (`IRONWEAVE_MASTER_PORT + generation`), so a re-formed job never meets a stale one. (A
/// restarted rank goes one generation past every one announced, and ranks failing moments
/// apart each do: a job with a few restarts can use a few dozen.)
pub const RENDEZVOUS_SPAN: u16 = 128;

/// The rendezvous port of generation `gen` of a job whose generation 0 meets on `base`: the
/// [`RENDEZVOUS_SPAN`] ports from `base` in turn, wrapping after the last, so a job that
/// re-forms any number of times stays inside the span its launcher found free. (Generations
/// `g` and `g + RENDEZVOUS_SPAN` share a port; the older one's server gave up at its deadline
/// long before.) An error where the port would pass 65535.
pub fn generation_port(base: u16, gen: u16) -> Result<u16> {
    base.checked_add(gen % RENDEZVOUS_SPAN).ok_or_else(|| {
        Error::Config(format!(
            "generation {gen} of a job on base port {base} would meet past port 65535: pick an IRONWEAVE_MASTER_PORT at most {} (`ironweave launch` does)",
            u16::MAX - RENDEZVOUS_SPAN + 1
        ))
    })
}

/// A base port for a job's rendezvous whose next `span` ports (one per generation, see
/// [`RENDEZVOUS_SPAN`]) are free now, chosen below the kernel's ephemeral range
/// (`/proc/sys/net/ipv4/ip_local_port_range`).
///
/// Why below it: a port the kernel hands to an outgoing connection — any of the job's own data
/// links — can then never take a later generation's rendezvous port. A port from
/// `bind(…:0)` is in that range, and Linux gives `bind` odd ports and `connect` even ones, so
/// `port + 1`, generation 1's, is exactly where an outgoing connection lands.
pub fn free_base_port(span: u16) -> Result<u16> {
    let span = span.max(1);
    let (lo, hi) = (10_000u16, ephemeral_low().saturating_sub(span));
    if hi <= lo {
        // an unusual ephemeral range leaves no room below it: whatever the kernel gives
        return TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| Error::Config(format!("no free loopback port for the rendezvous: {e}")));
    }
    // Jobs of one process (tests running side by side, a tool forming many) never get
    // overlapping spans while one of them may still be about to listen: the check below only
    // sees ports already bound. The newest spans are remembered, at most REMEMBERED ports in
    // all, so a process that forms hundreds of jobs still finds room.
    const REMEMBERED: u32 = 4096;
    static GIVEN: std::sync::Mutex<std::collections::VecDeque<(u16, u16)>> =
        std::sync::Mutex::new(std::collections::VecDeque::new());
    let nonce = crate::wire::nonce();
    let mut x = u64::from_le_bytes(nonce[..8].try_into().expect("16 bytes"));
    let mut given = GIVEN.locked();
    for _ in 0..64 {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let base = lo + ((x >> 33) % u64::from(hi - lo)) as u16;
        let overlaps = given.iter().any(|&(b, n)| base < b + n && b < base + span);
        if !overlaps && (0..span).all(|g| TcpListener::bind(("0.0.0.0", base + g)).is_ok()) {
            given.push_back((base, span));
            while given.iter().map(|&(_, n)| u32::from(n)).sum::<u32>() > REMEMBERED {
                given.pop_front();
            }
            return Ok(base);
        }
    }
    Err(Error::Config(format!(
        "no {span} consecutive free ports between {lo} and {hi} for the rendezvous after 64 tries: \
         set IRONWEAVE_MASTER_PORT to a free one"
    )))
}

/// The first port of the kernel's ephemeral range (Linux's default where it cannot be read).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(32768)
}

/// Runs an `n`-rank job inside this process: one thread per rank calls `join` with its
/// [`JobEnv`] (a loopback rendezvous on a free port, job id `local-<what>-<port>`). Returns
/// the results in rank order, or the first rank's error. Backends build their `local_world`
/// (tests, benchmarks, single-host tools) on it.
pub fn local_job<T, F>(n: usize, what: &str, join: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(JobEnv) -> Result<T> + Send + Sync + 'static,
{
    let port = free_base_port(1)?;
    let join = std::sync::Arc::new(join);
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            let (join, what) = (join.clone(), what.to_string());
            std::thread::spawn(move || join(JobEnv::loopback(rank, n, port, format!("local-{what}-{port}"))))
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for (rank, h) in hs.into_iter().enumerate() {
        out.push(h.join().map_err(|_| Error::Config(format!("rank {rank}'s thread panicked while joining the local job")))??);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {

    use super::*;
    use std::collections::HashMap;

    #[test]
    fn the_host_is_the_emulated_one_then_the_kernel_s_name() {
        fn env(v: Option<&'static str>) -> impl Fn(&str) -> Option<String> {
            move |k: &str| if k == "IRONWEAVE_HOST" { v.map(str::to_string) } else { None }
        }
        assert_eq!(host_name_from(env(Some("1")), || Some("box\n".into())), "emulated-host-1");
        assert_eq!(host_name_from(env(None), || Some("box\n".into())), "box");
        assert_eq!(host_name_from(env(Some(" ")), || None), "");
    }

    #[test]
    fn a_base_port_lies_below_the_ephemeral_range_with_its_span_free() {
        let low = ephemeral_low();
        for span in [1, 4, RENDEZVOUS_SPAN] {
            let base = free_base_port(span).unwrap();
            // no outgoing connection can be handed any of the job's generation ports
            assert!(base >= 10_000 && base + span <= low, "base {base} span {span} ephemeral from {low}");
            // each is free, the last included (the check does not leave them bound)
            let ls: Vec<_> = (0..span).map(|g| TcpListener::bind(("127.0.0.1", base + g))).collect();
            assert!(ls.iter().all(std::result::Result::is_ok), "a port of {base}+{span} is taken");
        }
        // jobs formed side by side in one process never share a port, even before they listen
        let spans: Vec<u16> = (0..100).map(|_| free_base_port(4).unwrap()).collect();
        for (i, a) in spans.iter().enumerate() {
            assert!(spans[i + 1..].iter().all(|b| a.abs_diff(*b) >= 4), "{a} overlaps another span of {spans:?}");
        }
        // a process that launches job after job (a benchmark's rounds) always finds room
        for _ in 0..1000 {
            free_base_port(RENDEZVOUS_SPAN).unwrap();
        }
    }

    /// Rank `rank` of a `world`-rank job on loopback `port` (job `rv-test`).
    fn local_env(rank: usize, world: usize, port: u16, board: Option<crate::board::Board>) -> JobEnv {
        JobEnv { board, ..JobEnv::loopback(rank, world, port, format!("rv-test-{port}")) }
    }

    /// Runs `f` on a thread and gives its result, or None if it took longer than `limit` (the
    /// thread is left behind: a test that would hang fails instead).
    fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(limit).ok()
    }

    #[test]
    fn a_rank_that_stops_inside_a_round_frees_the_server_at_the_job_s_deadline() {
        let port = free_base_port(1).unwrap();
        let t = Duration::from_millis(800);
        let r1 = std::thread::spawn(move || {
            let mut rv = Rendezvous::connect(&local_env(1, 2, port, None), t).unwrap();
            rv.all_gather("a", b"1").unwrap();
            // alive, connected, and silent: as a stopped process (SIGSTOP) or one cut off
            std::thread::sleep(Duration::from_secs(4));
            drop(rv);
        });
        let mut rv = Rendezvous::connect(&local_env(0, 2, port, None), t).unwrap();
        assert_eq!(rv.all_gather("a", b"0").unwrap(), vec![b"0".to_vec(), b"1".to_vec()]);
        let t0 = Instant::now();
        let e = rv.all_gather("b", b"0").unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        // the server thread gave up the silent rank at the deadline (it read it for a year)
        let closed = within(Duration::from_secs(3), move || rv.close());
        let closed = closed.expect("the rendezvous server still waits for the silent rank");
        assert!(matches!(closed, Err(Error::Timeout { ref what, .. }) if what.contains("rank 1")), "{closed:?}");
        assert!(t0.elapsed() < Duration::from_secs(3));
        r1.join().unwrap();
    }

    #[test]
    fn a_round_waiting_for_a_rank_gives_up_when_the_board_announces_a_newer_generation() {
        let port = free_base_port(1).unwrap();
        let dir = std::env::temp_dir().join(format!("iw-rv-board-{}-{port}", std::process::id()));
        let board = crate::board::Board::create(&dir).unwrap();
        let t = Duration::from_secs(30);
        let b1 = board.clone();
        let r1 = std::thread::spawn(move || {
            let mut rv = Rendezvous::connect(&local_env(1, 2, port, Some(b1)), t).unwrap();
            rv.all_gather("a", b"1").unwrap();
            std::thread::sleep(Duration::from_secs(3));
        });
        let mut rv = Rendezvous::connect(&local_env(0, 2, port, Some(board.clone())), t).unwrap();
        rv.all_gather("a", b"0").unwrap();
        let b0 = board.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            b0.announce(1).unwrap();
        });
        let e = rv.all_gather("b", b"0").unwrap_err();
        assert_eq!(e, Error::Superseded { generation: 0, by: Some(1) });
        // and the server left too, long before the 30 s deadline
        let closed = within(Duration::from_secs(2), move || rv.close()).expect("the server still waits");
        assert_eq!(closed, Err(Error::Superseded { generation: 0, by: Some(1) }));
        r1.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Registers as `rank` by hand (a raw client of the rendezvous), as a process would.
    fn register(env: &JobEnv) -> TcpStream {
        let dl = Instant::now() + Duration::from_secs(10);
        let mut s = handshake::connect_retry_watching(env.master, dl, &|| None).unwrap();
        handshake::connect(&mut s, &env.credentials(), Role::Rendezvous, env.rank as u32, 0, 0, Duration::from_secs(10)).unwrap();
        s
    }

    #[test]
    fn a_second_registration_of_a_rank_replaces_the_first() {
        let port = free_base_port(1).unwrap();
        let t = Duration::from_secs(10);
        let gather = move |rank: usize, data: &'static [u8]| {
            std::thread::spawn(move || {
                let mut rv = Rendezvous::connect(&local_env(rank, 3, port, None), t).unwrap();
                let got = rv.all_gather("a", data);
                let _ = rv.close();
                got
            })
        };
        let r0 = gather(0, b"0");
        // rank 1's first process registers, then (as a restarted process) its second does,
        // both before the last rank arrives
        let mut first = register(&local_env(1, 3, port, None));
        let r1 = gather(1, b"new");
        std::thread::sleep(Duration::from_millis(300));
        let r2 = gather(2, b"2");
        let want = vec![b"0".to_vec(), b"new".to_vec(), b"2".to_vec()];
        for r in [r0, r1, r2] {
            assert_eq!(r.join().unwrap().unwrap(), want);
        }
        // the older one was closed by the server
        first.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(first.read(&mut [0u8; 1]).unwrap(), 0, "the first registration is closed");
    }

    #[test]
    fn a_registered_rank_that_dies_is_reported_as_lost_to_every_rank() {
        let port = free_base_port(1).unwrap();
        let t = Duration::from_secs(10);
        let env1 = local_env(1, 2, port, None);
        let r0 = std::thread::spawn(move || {
            let mut rv = Rendezvous::connect(&local_env(0, 2, port, None), t).unwrap();
            let t0 = Instant::now();
            (rv.all_gather("a", b"0"), t0.elapsed())
        });
        // rank 1 registers, then dies before its first round (its socket closes)
        let s = register(&env1);
        std::thread::sleep(Duration::from_millis(200));
        drop(s);
        let (got, took) = r0.join().unwrap();
        assert!(matches!(got, Err(Error::PeerLost { rank: 1, .. })), "{got:?}");
        assert!(took < Duration::from_secs(5), "reported at once, not at the deadline: {took:?}");
    }

    #[test]
    fn generations_stay_inside_the_launcher_s_span() {
        assert_eq!(generation_port(20_000, 0).unwrap(), 20_000);
        assert_eq!(generation_port(20_000, RENDEZVOUS_SPAN - 1).unwrap(), 20_000 + RENDEZVOUS_SPAN - 1);
        assert_eq!(generation_port(20_000, RENDEZVOUS_SPAN).unwrap(), 20_000);
        for g in 0..=u16::MAX {
            let p = generation_port(20_000, g).unwrap();
            assert!((20_000..20_000 + RENDEZVOUS_SPAN).contains(&p));
        }
        assert!(matches!(generation_port(65_500, 100), Err(Error::Config(m)) if m.contains("65535")));
    }

    fn env_of(pairs: &[(&str, &str)]) -> Result<JobEnv> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        JobEnv::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn conventions_in_order() {
        let e = env_of(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.source), (1, 4, EnvSource::Torchrun));
        let e = env_of(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "3"), ("SLURM_JOB_ID", "77"), ("MASTER_ADDR", "127.0.0.1")])
            .unwrap();
        assert_eq!((e.rank, e.world_size, e.source, e.job_id.as_str()), (2, 3, EnvSource::Slurm, "77"));
        let e = env_of(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(e.source, EnvSource::OpenMpi);
        let e = env_of(&[
            ("IRONWEAVE_RANK", "0"),
            ("IRONWEAVE_WORLD_SIZE", "1"),
            ("RANK", "5"),
            ("WORLD_SIZE", "9"),
            ("IRONWEAVE_MASTER_ADDR", "127.0.0.1"),
            ("IRONWEAVE_MASTER_PORT", "5"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.source), (0, EnvSource::Ironweave));
    }

    #[test]
    fn a_job_without_an_id_gets_one_of_its_own_never_a_shared_default() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
        let a = env_of(&base).unwrap();
        assert!(a.job_id_is_derived() && a.job_id != "default", "{}", a.job_id);
        // torchrun's `none` (static rendezvous, no --rdzv-id) names no job
        let none = env_of(&[base.as_slice(), &[("TORCHELASTIC_RUN_ID", "none")]].concat()).unwrap();
        assert_eq!(none.job_id, a.job_id);
        // another endpoint is another job
        let b = env_of(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29501")]).unwrap();
        assert_ne!(a.job_id, b.job_id);
        // a launcher's id wins; SLURM's steps of one allocation differ
        let t = env_of(&[base.as_slice(), &[("TORCHELASTIC_RUN_ID", "abc")]].concat()).unwrap();
        assert_eq!((t.job_id.as_str(), t.job_id_is_derived()), ("abc", false));
        let s = env_of(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_JOB_ID", "77"),
            ("SLURM_STEP_ID", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
        ])
        .unwrap();
        assert_eq!(s.job_id, "77.3");
        assert!(launcher_identity().contains('@'));
    }

    #[test]
    fn bad_environments_say_what_to_set() {
        assert!(matches!(env_of(&[]), Err(Error::Config(m)) if m.contains("IRONWEAVE_RANK")));
        assert!(matches!(env_of(&[("RANK", "4"), ("WORLD_SIZE", "4")]), Err(Error::Config(m)) if m.contains("out of range")));
        assert!(matches!(env_of(&[("RANK", "x"), ("WORLD_SIZE", "4")]), Err(Error::Config(m)) if m.contains("RANK")));
        assert!(
            matches!(env_of(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")]), Err(Error::Config(m)) if m.contains("port"))
        );
    }
}

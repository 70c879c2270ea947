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

    /// The job's id as the launcher set it (see [`job_id_from_env`]).
    pub fn job_id(&self) -> &str {
        &self.job_id
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

/// The job's id as its launcher set it: `IRONWEAVE_JOB_ID` (unique per `ironweave launch`),
/// torchrun's `TORCHELASTIC_RUN_ID` (its `--rdzv-id`), `SLURM_JOB_ID`, OpenMPI's job id; else
/// `default`. Every process of one job, restarted ones included, reads the same id.
pub fn job_id_from_env() -> String {
    job_id_from(&|k: &str| std::env::var(k).ok())
}

fn job_id_from(get: &dyn Fn(&str) -> Option<String>) -> String {
    JOB_ID_VARS.iter().find_map(|k| get(k).filter(|v| !v.is_empty())).unwrap_or_else(|| "default".into())
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
                    // a re-formed job's generation g listens on the base port + g
                    let which = match env.generation {
                        0 => String::new(),
                        g => format!(", generation {g}'s port: IRONWEAVE_MASTER_PORT + {g}"),
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
        for r in 0..size {
            // Rounds have no overall deadline here: each client enforces its own.
            let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
            match read_framed(&mut conns[r], MAX_PAYLOAD + 260, far) {
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
            std::thread::spawn(move || {
                join(JobEnv {
                    rank,
                    world_size: n,
                    local_rank: rank,
                    local_world_size: Some(n),
                    master: (std::net::Ipv4Addr::LOCALHOST, port).into(),
                    job_id: format!("local-{what}-{port}"),
                    secret: b"local".to_vec(),
                    source: EnvSource::Ironweave,
                    generation: 0,
                    board: None,
                })
            })
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
    fn bad_environments_say_what_to_set() {
        assert!(matches!(env_of(&[]), Err(Error::Config(m)) if m.contains("IRONWEAVE_RANK")));
        assert!(matches!(env_of(&[("RANK", "4"), ("WORLD_SIZE", "4")]), Err(Error::Config(m)) if m.contains("out of range")));
        assert!(matches!(env_of(&[("RANK", "x"), ("WORLD_SIZE", "4")]), Err(Error::Config(m)) if m.contains("RANK")));
        assert!(
            matches!(env_of(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")]), Err(Error::Config(m)) if m.contains("port"))
        );
    }
}

//! # ironweave-tcp
//!
//! The default backend: pure Rust over `std::net`, no async runtime, no system library.
//!
//! Each rank opens one listener per configured link (one link per interface) and, through the
//! rendezvous, `conns_per_peer` connections to every other rank on every link (the higher rank
//! connects). Every connection is authenticated by the handshake in
//! [`ironweave_transport::handshake`]. Frames ([`ironweave_transport::wire::FrameHeader`]) are
//! decoded into the shared [`Mailbox`] by whichever thread is there first (`rx.rs`): a caller
//! waiting for a message reads the link's sockets itself, MPI-style, and so does a sender whose
//! socket is full; a reader thread per connection takes over when nobody waits. Blocking sends
//! are written by the calling thread straight from the caller's buffer (zero copy), large
//! messages striped over all connections of the peer at once; non-blocking sends of owned
//! buffers go through one sender thread per peer. A peer whose connection closes without a
//! goodbye fails every pending and future operation with `PeerLost`.
//!
//! ```
//! use ironweave_tcp::{local_world, TcpConfig};
//! use ironweave_transport::{CommOptions, ReduceOp};
//! // a 2-rank job over loopback sockets, one thread per rank
//! let world = local_world(2, &TcpConfig::default(), CommOptions::default())?;
//! std::thread::scope(|s| {
//!     for c in world {
//!         s.spawn(move || {
//!             let mut x = [c.rank() as f32 + 1.0];
//!             c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
//!             assert_eq!(x[0], 3.0);
//!         });
//!     }
//! });
//! # Ok::<(), ironweave_transport::Error>(())
//! ```

mod rx;

use ironweave_units::Locked;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ironweave_transport::handshake::{self, Credentials};
use ironweave_transport::rendezvous::{JobEnv, Rendezvous};
use ironweave_transport::shm::{ShmConfig, ShmGroup};
use ironweave_transport::wire::{FrameHeader, FrameKind, Role, HEADER_LEN};
use ironweave_transport::{
    CommOptions, Communicator, Error, Link, LinkInfo, Mailbox, MemKind, RecvHandle, Result, SendCompleter, SendHandle, SeqTable,
    SpeedSource, Tag,
};

/// One link: a name and the local address to bind (one per interface).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkSpec {
    pub name: String,
    /// Address to bind; unspecified (0.0.0.0) means "the address that routes to the master".
    pub bind: IpAddr,
    /// Declared rate in bytes per second (`name=ip@1gbit`), if known.
    pub rate_bytes_per_s: Option<u64>,
}

/// Tunables of the TCP backend.
#[derive(Debug, Clone, PartialEq)]
pub struct TcpConfig {
    /// Links to open; empty means one link bound to the address that reaches the master.
    pub links: Vec<LinkSpec>,
    /// Connections per peer per link; large messages are striped over all of them.
    pub conns_per_peer: usize,
    /// Messages at least this large are striped.
    pub stripe_min_bytes: usize,
    /// Largest message accepted from a peer.
    pub max_message_bytes: u64,
    /// At most this many received-but-unconsumed bytes are buffered per link (beyond it the
    /// readers stop reading and TCP pushes back).
    pub buffer_cap_bytes: usize,
    /// How long closing waits for peers' goodbyes.
    pub linger: Duration,
    /// Deadline for setup and for non-blocking sends.
    pub timeout: Duration,
    /// The intra-host shared-memory path for the world's collectives when every rank is on
    /// one host (`IRONWEAVE_SHM`, `IRONWEAVE_SHM_SLOT_BYTES`).
    pub shm: ShmConfig,
    /// A caller waiting for a message reads the link's sockets itself (`IRONWEAVE_TCP_POLL`,
    /// default on; off: reader threads deliver everything).
    pub poll: bool,
    /// Congestion control for connections whose two ends are on this host (the same address
    /// on both ends, or loopback): `reno` by default, `None` keeps the system's
    /// (`IRONWEAVE_TCP_CONGESTION`, `default` for `None`). Between two sockets of one kernel
    /// nothing is congested, while a pacing algorithm (BBR, the default of many distributions)
    /// still spaces the segments out: on this project's machine, 2-rank collectives at 16 and
    /// 64 MiB ran 1.2–1.4x faster with `reno` (docs/BENCHMARKS.md). Connections between hosts
    /// keep the system's choice.
    pub local_congestion: Option<String>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            links: Vec::new(),
            conns_per_peer: 2,
            stripe_min_bytes: 4 << 20,
            max_message_bytes: 16 << 30,
            buffer_cap_bytes: 2 << 30,
            linger: Duration::from_secs(10),
            timeout: ironweave_transport::DEFAULT_TIMEOUT,
            shm: ShmConfig::default(),
            poll: true,
            local_congestion: Some("reno".into()),
        }
    }
}

fn env_num<T: std::str::FromStr>(k: &str) -> Result<Option<T>> {
    match std::env::var(k) {
        Err(_) => Ok(None),
        Ok(v) => v.trim().parse().map(Some).map_err(|_| Error::Config(format!("{k}={v:?} is not a valid number"))),
    }
}

impl TcpConfig {
    /// Reads `IRONWEAVE_TCP_LINKS` (`name=ip,name=ip`), `IRONWEAVE_TCP_CONNS`,
    /// `IRONWEAVE_TCP_STRIPE_MIN`, `IRONWEAVE_TCP_LINGER_S`, `IRONWEAVE_TCP_POLL`,
    /// `IRONWEAVE_TCP_CONGESTION`, `IRONWEAVE_TIMEOUT_S` and the shared-memory path's `IRONWEAVE_SHM*` ([`ShmConfig::from_env`]).
    pub fn from_env() -> Result<Self> {
        let mut c = TcpConfig::default();
        if let Ok(v) = std::env::var("IRONWEAVE_TCP_LINKS") {
            c.links = parse_links(&v)?;
        }
        if let Some(n) = env_num::<usize>("IRONWEAVE_TCP_CONNS")? {
            if n == 0 || n > 64 {
                return Err(Error::Config(format!("IRONWEAVE_TCP_CONNS={n}: use 1 to 64 connections per peer")));
            }
            c.conns_per_peer = n;
        }
        if let Some(n) = env_num::<usize>("IRONWEAVE_TCP_STRIPE_MIN")? {
            c.stripe_min_bytes = n;
        }
        if let Some(s) = env_num::<f64>("IRONWEAVE_TCP_LINGER_S")? {
            c.linger = Duration::from_secs_f64(s.clamp(0.0, 3600.0));
        }
        c.timeout = CommOptions::from_env()?.timeout;
        c.shm = ShmConfig::from_env()?;
        if let Some(on) = ironweave_transport::shm::env_flag("IRONWEAVE_TCP_POLL", " (yield before sleeping)")? {
            c.poll = on;
        }
        if let Ok(v) = std::env::var("IRONWEAVE_TCP_CONGESTION") {
            c.local_congestion = parse_congestion(&v)?;
        }
        Ok(c)
    }
}

/// Parses a congestion control name (`IRONWEAVE_TCP_CONGESTION`): `default` (or empty) keeps
/// the system's, else a kernel algorithm name such as `reno` or `cubic`.
pub fn parse_congestion(v: &str) -> Result<Option<String>> {
    let v = v.trim();
    if v.is_empty() || v == "default" {
        return Ok(None);
    }
    // The kernel's names are at most 15 bytes (TCP_CA_NAME_MAX) of [a-z0-9_].
    if v.len() > 15 || !v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        return Err(Error::Config(format!(
            "IRONWEAVE_TCP_CONGESTION={v:?} is not a congestion control name: use `default` or one of \
             /proc/sys/net/ipv4/tcp_available_congestion_control (e.g. reno, cubic)"
        )));
    }
    Ok(Some(v.to_string()))
}

/// Sets congestion control `cc` on `s` when both its ends are on this host (the same address,
/// or loopback); whether it did. An algorithm the kernel lacks or does not allow this process
/// is an error that names the files to look at.
fn tune_local(s: &TcpStream, cc: &str) -> Result<bool> {
    let (Ok(local), Ok(peer)) = (s.local_addr(), s.peer_addr()) else { return Ok(false) };
    if local.ip() != peer.ip() && !peer.ip().is_loopback() {
        return Ok(false);
    }
    // SAFETY: `s` is an open socket; the option value is `cc`'s bytes, alive for the call.
    let r = unsafe {
        libc::setsockopt(s.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_CONGESTION, cc.as_ptr().cast(), cc.len() as libc::socklen_t)
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::Config(format!(
            "setting TCP congestion control {cc:?} on a connection within this host failed ({e}): see \
             /proc/sys/net/ipv4/tcp_available_congestion_control and tcp_allowed_congestion_control, \
             or set IRONWEAVE_TCP_CONGESTION=default to keep the system's"
        )));
    }
    Ok(true)
}

/// Parses `name=ip[@rate][,name=ip[@rate]...]`; rates as `tc` writes them (`1gbit`,
/// `300mbit`, `500kbit`, `1000000bit`).
pub fn parse_links(v: &str) -> Result<Vec<LinkSpec>> {
    v.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|item| {
            let (name, rest) =
                item.split_once('=').ok_or_else(|| Error::Config(format!("link {item:?}: expected name=ip[@rate]")))?;
            let (ip, rate) = match rest.split_once('@') {
                Some((ip, rate)) => (ip, Some(parse_rate(rate)?)),
                None => (rest, None),
            };
            let bind = ip.trim().parse().map_err(|_| Error::Config(format!("link {name:?}: {ip:?} is not an IP address")))?;
            Ok(LinkSpec { name: name.trim().to_string(), bind, rate_bytes_per_s: rate })
        })
        .collect()
}

/// Parses a rate like `1gbit`, `300mbit`, `64kbit` or `2500bit` into bytes per second
/// ([`ironweave_units::parse_rate`], as a configuration error).
pub fn parse_rate(s: &str) -> Result<u64> {
    ironweave_units::parse_rate(s).map_err(|e| Error::Config(e.to_string()))
}

/// Joins the job described by the environment and returns the world communicator over TCP.
pub fn init_from_env() -> Result<Communicator> {
    let env = JobEnv::from_env()?;
    connect(&env, &TcpConfig::from_env()?, CommOptions::from_env()?)
}

/// An `n`-rank job inside this process on loopback, one thread per rank, each with its own
/// rendezvous client, listeners and sockets (tests, examples, single-host tools). Returns the
/// communicators in rank order, or the first rank's error.
pub fn local_world(n: usize, cfg: &TcpConfig, opts: CommOptions) -> Result<Vec<Communicator>> {
    let cfg = cfg.clone();
    ironweave_transport::rendezvous::local_job(n, "tcp", move |env| connect(&env, &cfg, opts.clone()))
}

/// [`local_world`] over one unshaped loopback link per name, every wait bounded by `timeout`:
/// a job with several links inside this process (tests, examples).
pub fn local_world_on_links(n: usize, names: &[&str], timeout: Duration) -> Result<Vec<Communicator>> {
    let links = names
        .iter()
        .map(|name| LinkSpec { name: (*name).into(), bind: IpAddr::V4(Ipv4Addr::LOCALHOST), rate_bytes_per_s: None })
        .collect();
    let cfg = TcpConfig { links, timeout, linger: Duration::from_secs(2), ..TcpConfig::default() };
    local_world(n, &cfg, CommOptions { timeout, ..CommOptions::default() })
}

/// Joins the job: rendezvous, one link per [`LinkSpec`], the world communicator. When every
/// rank is on one host, the first link also gets the intra-host shared-memory path
/// ([`ironweave_transport::shm`]), which the world communicator's collectives then take.
pub fn connect(env: &JobEnv, cfg: &TcpConfig, opts: CommOptions) -> Result<Communicator> {
    let mut rv = Rendezvous::connect(env, cfg.timeout)?;
    let links = connect_links(env, &mut rv, cfg)?;
    let health = ironweave_transport::shm::mailbox_health(links[0].shared.mailbox.clone());
    // the link keeps the group to abort it with its own failure; the communicator runs on it
    let intra = ironweave_transport::shm::join_job(env, &mut rv, &cfg.shm, health)?.map(Arc::new);
    if let Some(g) = &intra {
        let _ = links[0].shm.set(g.clone());
    }
    rv.close()?;
    Ok(Communicator::new(links.into_iter().map(|l| l as Arc<dyn Link>).collect(), opts)?.with_intra_host(intra))
}

fn route_to(master: SocketAddr) -> IpAddr {
    if master.ip().is_loopback() {
        return master.ip();
    }
    // A connected UDP socket tells which local address routes to the master; nothing is sent.
    UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .and_then(|s| s.connect(master).and_then(|_| s.local_addr()))
        .map(|a| a.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// Opens every link of `cfg` to every peer, exchanging addresses through `rv`.
pub fn connect_links(env: &JobEnv, rv: &mut Rendezvous, cfg: &TcpConfig) -> Result<Vec<Arc<TcpLink>>> {
    let specs = if cfg.links.is_empty() {
        vec![LinkSpec { name: "tcp".into(), bind: route_to(env.master), rate_bytes_per_s: None }]
    } else {
        cfg.links.clone()
    };
    let mut listeners = Vec::new();
    let mut mine = String::new();
    for s in &specs {
        let l = TcpListener::bind((s.bind, 0)).map_err(|e| {
            Error::Config(format!(
                "link {:?}: cannot listen on {} ({e}): is the address configured on this host?",
                s.name, s.bind
            ))
        })?;
        let mut addr = l.local_addr().map_err(|e| Error::io("listener address", &e))?;
        if addr.ip().is_unspecified() {
            addr.set_ip(route_to(env.master));
        }
        mine.push_str(&format!("{}={}\n", s.name, addr));
        listeners.push(l);
    }
    let table: Vec<Vec<(String, SocketAddr)>> = rv
        .all_gather("tcp-links", mine.as_bytes())?
        .into_iter()
        .enumerate()
        .map(|(r, b)| {
            String::from_utf8_lossy(&b)
                .lines()
                .map(|line| {
                    let (n, a) = line.split_once('=').unwrap_or(("", ""));
                    let a = a.parse().map_err(|_| Error::Protocol {
                        from: format!("rank {r}"),
                        detail: format!("bad link address {line:?}"),
                    })?;
                    Ok((n.to_string(), a))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<_>>()?;
    for (r, t) in table.iter().enumerate() {
        if t.len() != specs.len() {
            return Err(Error::Config(format!(
                "rank {r} has {} TCP links, this rank {}: give every rank the same IRONWEAVE_TCP_LINKS",
                t.len(),
                specs.len()
            )));
        }
    }
    let creds = env.credentials();
    let (rank, size, conns) = (env.rank, env.world_size, cfg.conns_per_peer.max(1));
    let deadline = Instant::now() + cfg.timeout;
    let mut out = Vec::new();
    for (li, (spec, listener)) in specs.iter().zip(listeners).enumerate() {
        let expected = (size - 1 - rank) * conns;
        let c2 = creds.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        // our own setup failed, or the job board gave this generation up
        let watch = ironweave_transport::rendezvous::watcher(env);
        let give_up = move || match stop2.load(Ordering::SeqCst) {
            true => Some(Error::Aborted { reason: "setup of this link was abandoned".into() }),
            false => watch(),
        };
        let acceptor = std::thread::Builder::new()
            .name(format!("iw-tcp-accept-{li}"))
            .spawn(move || accept_all(listener, &c2, li as u16, expected, conns, deadline, &give_up))
            .map_err(|e| Error::io("spawn acceptor", &e))?;
        let mut streams: Vec<Vec<Option<TcpStream>>> = (0..size).map(|_| (0..conns).map(|_| None).collect()).collect();
        let mut connect_err = None;
        // a peer that died after the rendezvous never listens: the board says when to stop
        let watch = ironweave_transport::rendezvous::watcher(env);
        'outer: for (j, row) in table.iter().enumerate().take(rank) {
            for (c, slot) in streams[j].iter_mut().enumerate() {
                let res = handshake::connect_retry_watching(row[li].1, deadline, &*watch).and_then(|mut s| {
                    handshake::connect(&mut s, &creds, Role::Data, rank as u32, li as u16, c as u16, cfg.timeout).map(|_| s)
                });
                match res {
                    Ok(s) => *slot = Some(s),
                    Err(e) => {
                        connect_err = Some(e);
                        break 'outer;
                    }
                }
            }
        }
        if connect_err.is_some() {
            // Our own setup failed: do not wait out the acceptor's deadline.
            stop.store(true, Ordering::SeqCst);
        }
        let accepted = acceptor.join().unwrap_or_else(|_| Err(Error::Config("acceptor thread panicked".into())));
        if let Some(e) = connect_err {
            return Err(e);
        }
        for (peer, c, s) in accepted? {
            streams[peer][c] = Some(s);
        }
        out.push(TcpLink::start(spec, rank, size, streams, cfg)?);
    }
    Ok(out)
}

fn accept_all(
    listener: TcpListener,
    creds: &Credentials,
    link: u16,
    expected: usize,
    conns: usize,
    deadline: Instant,
    give_up: &(dyn Fn() -> Option<Error> + Send + Sync),
) -> Result<Vec<(usize, usize, TcpStream)>> {
    let mut got: Vec<(usize, usize, TcpStream)> = Vec::new();
    let mut dropped = 0usize;
    let start = Instant::now();
    listener.set_nonblocking(true).map_err(|e| Error::io("listener", &e))?;
    while got.len() < expected {
        if let Some(e) = give_up() {
            return Err(e);
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: format!(
                    "waiting for {} of {expected} peer connections on link {link} ({dropped} garbage connections dropped)",
                    expected - got.len()
                ),
                // zero when the deadline had passed before the wait began: the message says so
                after: start.elapsed().min(deadline.saturating_duration_since(start)),
            });
        }
        match listener.accept() {
            Ok((mut s, _)) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_nodelay(true);
                let left = deadline.saturating_duration_since(Instant::now());
                match handshake::accept(&mut s, creds, Role::Data, left.min(Duration::from_secs(5)))? {
                    None => dropped += 1,
                    Some(h) => {
                        let (p, c) = (h.rank as usize, usize::from(h.conn));
                        if h.link != link || c >= conns || got.iter().any(|(gp, gc, _)| (*gp, *gc) == (p, c)) {
                            return Err(Error::HandshakeRejected {
                                peer: format!("rank {p}"),
                                reason: format!("unexpected connection (link {}, conn {c}) on link {link}: ranks disagree on IRONWEAVE_TCP_LINKS or IRONWEAVE_TCP_CONNS", h.link),
                            });
                        }
                        got.push((p, c, s));
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => return Err(Error::io("accept", &e)),
        }
    }
    Ok(got)
}

#[derive(Debug)]
struct Conn {
    writer: Mutex<TcpStream>,
    /// A second handle used only to shut the socket down from any thread.
    control: TcpStream,
}

struct Job {
    tag: Tag,
    seq: u64,
    data: Vec<u8>,
    done: SendCompleter,
}

#[derive(Debug)]
struct Peer {
    conns: Vec<Conn>,
    rr: AtomicUsize,
    sender: Mutex<Option<mpsc::Sender<Job>>>,
}

#[derive(Debug)]
struct Shared {
    rank: usize,
    info: LinkInfo,
    peers: Vec<Option<Peer>>,
    /// Every connection's decoder (`rx.rs`), and the epoll set over them.
    slots: Vec<Arc<rx::Slot>>,
    ready: rx::Ready,
    /// Callers driving the decoders themselves (the reader threads park meanwhile).
    drivers: rx::Drivers,
    mailbox: Arc<Mailbox>,
    seqs: SeqTable,
    closing: AtomicBool,
    /// Set by the first failure, which is told to every peer before anyone can observe it;
    /// held while telling, so that a concurrent failure (and the socket shutdown of an abort)
    /// waits until the cause is on the wire.
    cause_sent: Mutex<bool>,
    cfg: TcpConfig,
}

/// One rank's TCP link to every peer.
#[derive(Debug)]
pub struct TcpLink {
    shared: Arc<Shared>,
    /// The intra-host path over this link's world, when the job is on one host.
    shm: std::sync::OnceLock<Arc<ShmGroup>>,
    readers: Mutex<Vec<JoinHandle<()>>>,
    senders: Mutex<Vec<JoinHandle<()>>>,
}

impl TcpLink {
    fn start(
        spec: &LinkSpec,
        rank: usize,
        size: usize,
        streams: Vec<Vec<Option<TcpStream>>>,
        cfg: &TcpConfig,
    ) -> Result<Arc<TcpLink>> {
        let conns = cfg.conns_per_peer.max(1);
        let mut peers = Vec::with_capacity(size);
        let mut read_halves = Vec::new();
        for (p, row) in streams.into_iter().enumerate() {
            if p == rank {
                peers.push(None);
                continue;
            }
            let mut cs = Vec::with_capacity(conns);
            for (c, s) in row.into_iter().enumerate() {
                let s = s.ok_or_else(|| Error::Config(format!("no connection {c} to rank {p}")))?;
                if let Some(cc) = &cfg.local_congestion {
                    tune_local(&s, cc)?;
                }
                let r = s.try_clone().map_err(|e| Error::io("clone socket", &e))?;
                let control = s.try_clone().map_err(|e| Error::io("clone socket", &e))?;
                read_halves.push((p, r));
                cs.push(Conn { writer: Mutex::new(s), control });
            }
            peers.push(Some(Peer { conns: cs, rr: AtomicUsize::new(0), sender: Mutex::new(None) }));
        }
        let info = LinkInfo {
            name: format!("tcp:{}", spec.name),
            backend: "tcp",
            // Without a declared rate the figures are placeholders (the probe measures them).
            bandwidth_bytes_per_s: spec.rate_bytes_per_s.map_or(1.25e9, |r| r as f64),
            latency_s: 20e-6,
            speed_source: if spec.rate_bytes_per_s.is_some() { SpeedSource::Declared } else { SpeedSource::Unknown },
            memory: vec![MemKind::Host],
        };
        let slots: Vec<Arc<rx::Slot>> = read_halves.into_iter().map(|(p, s)| Arc::new(rx::Slot::new(p, s))).collect();
        let ready = rx::Ready::new(&slots).map_err(|e| Error::io("epoll set of the link's connections", &e))?;
        let shared = Arc::new(Shared {
            rank,
            info,
            peers,
            slots,
            ready,
            drivers: rx::Drivers::default(),
            mailbox: Arc::new(Mailbox::new(rank, size, conns, cfg.buffer_cap_bytes)),
            seqs: SeqTable::default(),
            closing: AtomicBool::new(false),
            cause_sent: Mutex::new(false),
            cfg: cfg.clone(),
        });
        // A waiting caller reads the link's sockets itself (MPI-style) before it sleeps: no
        // reader thread has to be scheduled between a message's arrival and its receiver.
        if cfg.poll {
            shared.mailbox.set_progress_driver(Box::new(rx::Driver { shared: Arc::downgrade(&shared) }));
        }
        let mut readers = Vec::new();
        for slot in &shared.slots {
            let (sh, slot) = (shared.clone(), slot.clone());
            let p = slot.peer();
            readers.push(
                std::thread::Builder::new()
                    .name(format!("iw-tcp-rx-{p}"))
                    .spawn(move || rx::reader(sh, slot))
                    .map_err(|e| Error::io("spawn reader", &e))?,
            );
        }
        Ok(Arc::new(TcpLink {
            shared,
            shm: std::sync::OnceLock::new(),
            readers: Mutex::new(readers),
            senders: Mutex::new(Vec::new()),
        }))
    }

    fn peer(&self, p: usize) -> Result<Option<&Peer>> {
        self.shared.mailbox.check_peer(p)?;
        Ok(self.shared.peers[p].as_ref())
    }
}

/// Bytes in `s`'s send queue: not yet sent, or sent and not yet acknowledged (`SIOCOUTQ`).
fn queued_bytes(s: &TcpStream) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: `s` owns a valid socket descriptor for the call; SIOCOUTQ (TIOCOUTQ on Linux)
    // writes one c_int through the pointer, which points at `n`.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, std::ptr::from_mut(&mut n)) };
    if r == 0 {
        Ok(usize::try_from(n).unwrap_or(0))
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The bytes `[start, end)` of the concatenation of `parts`, as slices of them (no copy).
fn sub_parts<'a>(parts: &[&'a [u8]], start: usize, end: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for p in parts {
        let (a, b) = (start.max(at), end.min(at + p.len()));
        if a < b {
            out.push(&p[a - at..b - at]);
        }
        at += p.len();
        if at >= end {
            break;
        }
    }
    out
}

fn write_frame(s: &mut TcpStream, h: &FrameHeader, payload: &[&[u8]], deadline: Instant) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed before the write"));
    }
    s.set_write_timeout(Some(left))?;
    let len: usize = payload.iter().map(|p| p.len()).sum();
    if len <= 64 * 1024 {
        let mut b = Vec::with_capacity(HEADER_LEN + len);
        b.extend_from_slice(&h.encode());
        for p in payload {
            b.extend_from_slice(p);
        }
        s.write_all(&b)
    } else {
        // Header and payload in one system call: no separate tiny segment for the header, and
        // a payload in several parts is written from where it lies.
        let hdr = h.encode();
        let mut bufs: Vec<std::io::IoSlice<'_>> =
            std::iter::once(std::io::IoSlice::new(&hdr)).chain(payload.iter().map(|p| std::io::IoSlice::new(p))).collect();
        let mut rest = &mut bufs[..];
        while !rest.is_empty() {
            match s.write_vectored(rest) {
                Ok(0) => return Err(std::io::Error::new(std::io::ErrorKind::WriteZero, "socket accepted no bytes")),
                Ok(n) => std::io::IoSlice::advance_slices(&mut rest, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Shared {
    /// Writes one message (striped when large) to peer `p`.
    /// The message is the concatenation of `data`'s parts, written from where they lie.
    fn write_message(&self, peer: &Peer, p: usize, tag: Tag, seq: u64, data: &[&[u8]], deadline: Instant) -> Result<()> {
        let n = peer.conns.len();
        let len: usize = data.iter().map(|d| d.len()).sum();
        let total = len as u64;
        let one = |c: &Conn, off: usize, part: &[&[u8]]| -> Result<()> {
            let part_len: usize = part.iter().map(|d| d.len()).sum();
            let h = FrameHeader { kind: FrameKind::Data, tag: tag.0, seq, total, offset: off as u64, len: part_len as u64 };
            // The writer is released before the error is handled: failing the link tells the
            // peers, which needs the writers.
            let written = {
                let mut w = c.writer.locked();
                if self.cfg.poll {
                    // While its socket is full this thread decodes what arrives, and may find
                    // the link failed there: `fail_with` must not wait for this writer then.
                    let _held = rx::HoldingWriter::new(c);
                    rx::send_frame(self, &w, &h, part, deadline)
                } else {
                    write_frame(&mut w, &h, part, deadline)
                }
            };
            written.map_err(|e| {
                // A partly written frame leaves the stream unusable: fail the link.
                let err = if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                    Error::Timeout { what: format!("send to rank {p}"), after: self.cfg.timeout }
                } else {
                    // A peer that closes on purpose sends the cause first, and its socket's
                    // reader will deliver it: give the reader a moment before blaming the peer.
                    let until = Instant::now() + Duration::from_millis(500);
                    while self.mailbox.failure().is_none() && Instant::now() < until {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    self.mailbox.failure().unwrap_or_else(|| Error::PeerLost { rank: p, detail: format!("send failed: {e}") })
                };
                self.fail_with(err.clone(), Some(p));
                err
            })
        };
        if n == 1 || len < self.cfg.stripe_min_bytes {
            // Prefer an idle connection so small messages do not queue behind a large one.
            let start = peer.rr.fetch_add(1, Ordering::Relaxed);
            let idx = (0..n).map(|k| (start + k) % n).find(|&k| peer.conns[k].writer.try_lock().is_ok()).unwrap_or(start % n);
            return one(&peer.conns[idx], 0, data);
        }
        let step = len.div_ceil(n).next_multiple_of(64);
        std::thread::scope(|s| {
            let hs: Vec<_> = (1..n)
                .filter(|k| k * step < len)
                .map(|k| {
                    let part = sub_parts(data, k * step, ((k + 1) * step).min(len));
                    let c = &peer.conns[k];
                    s.spawn(move || one(c, k * step, &part))
                })
                .collect();
            let first = one(&peer.conns[0], 0, &sub_parts(data, 0, step.min(len)));
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(Error::InvalidArgument("stripe writer panicked".into()))))
                .fold(first, |a, b| a.and(b))
        })
    }

    /// Records a failure. The first one is sent to every other peer (on every connection,
    /// so it precedes any later close on the same socket) *before* the mailbox fails: a rank
    /// that exits after seeing the failure can then never be mistaken for its cause.
    fn fail_with(&self, err: Error, culprit: Option<usize>) {
        let mut sent = self.cause_sent.locked();
        if !*sent {
            *sent = true;
            let body = encode_cause(self.rank, &err);
            let h = FrameHeader {
                kind: FrameKind::Abort,
                tag: 0,
                seq: 0,
                total: body.len() as u64,
                offset: 0,
                len: body.len() as u64,
            };
            for (q, peer) in self.peers.iter().enumerate() {
                let Some(peer) = peer.as_ref().filter(|_| Some(q) != culprit) else { continue };
                for c in &peer.conns {
                    // A frame of this thread's is half written there: the cause cannot go on
                    // this connection (the peer drains our others before it blames us).
                    if rx::HoldingWriter::is_held_here(c) {
                        continue;
                    }
                    // A writer busy with a stuck write is skipped after a short wait.
                    let until = Instant::now() + Duration::from_millis(500);
                    loop {
                        if let Ok(mut w) = c.writer.try_lock() {
                            let _ = write_frame(&mut w, &h, &[&body], Instant::now() + Duration::from_secs(1));
                            break;
                        }
                        if Instant::now() >= until {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        }
        drop(sent);
        self.mailbox.fail(err);
    }

    fn send_self(&self, tag: Tag, seq: u64, data: Vec<u8>) -> Result<()> {
        self.mailbox.deliver_whole(self.rank, tag, seq, data)
    }
}

impl Link for TcpLink {
    fn info(&self) -> &LinkInfo {
        &self.shared.info
    }
    fn rank(&self) -> usize {
        self.shared.rank
    }
    fn size(&self) -> usize {
        self.shared.peers.len()
    }
    fn send(&self, p: usize, tag: Tag, data: &[u8], deadline: Instant) -> Result<()> {
        let peer = self.peer(p)?;
        let seq = self.shared.seqs.next(p, tag);
        match peer {
            None => self.shared.send_self(tag, seq, data.to_vec()),
            Some(peer) => self.shared.write_message(peer, p, tag, seq, &[data], deadline),
        }
    }
    fn send_parts(&self, p: usize, tag: Tag, parts: &[&[u8]], deadline: Instant) -> Result<bool> {
        let peer = self.peer(p)?;
        let seq = self.shared.seqs.next(p, tag);
        match peer {
            None => self.shared.send_self(tag, seq, parts.concat()).map(|()| true),
            // written from where the parts lie (writev / sendmsg with one iovec per part)
            Some(peer) => self.shared.write_message(peer, p, tag, seq, parts, deadline).map(|()| false),
        }
    }
    fn isend(&self, p: usize, tag: Tag, data: Vec<u8>) -> Result<SendHandle> {
        let peer = self.peer(p)?;
        let seq = self.shared.seqs.next(p, tag);
        let Some(peer) = peer else {
            let len = data.len();
            self.shared.send_self(tag, seq, data)?;
            let _ = len;
            return Ok(SendHandle::ready(Ok(Vec::new())));
        };
        let (handle, done) = SendHandle::pending();
        let mut tx = peer.sender.locked();
        if tx.is_none() {
            let (t, rx) = mpsc::channel::<Job>();
            let sh = self.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("iw-tcp-tx-{p}"))
                .spawn(move || {
                    for job in rx {
                        let peer = sh.peers[p].as_ref().expect("sender threads exist only for remote peers");
                        let dl = Instant::now() + sh.cfg.timeout;
                        let r = sh.write_message(peer, p, job.tag, job.seq, &[&job.data], dl);
                        job.done.complete(r.map(|_| job.data));
                    }
                })
                .map_err(|e| Error::io("spawn sender", &e))?;
            self.senders.locked().push(h);
            *tx = Some(t);
        }
        let job = Job { tag, seq, data, done };
        if let Some(Err(mpsc::SendError(job))) = tx.as_ref().map(|t| t.send(job)) {
            job.done.complete(Err(Error::Aborted { reason: "sender thread stopped".into() }));
        }
        Ok(handle)
    }
    fn irecv(&self, p: usize, tag: Tag) -> Result<RecvHandle> {
        self.peer(p)?;
        Ok(self.shared.mailbox.post(p, tag))
    }
    unsafe fn irecv_into(&self, p: usize, tag: Tag, dst: *mut u8, len: usize) -> Result<RecvHandle> {
        // Messages to ourselves are copied anyway; only remote peers land directly.
        if self.peer(p)?.is_none() {
            return Ok(self.shared.mailbox.post(p, tag));
        }
        // SAFETY: forwarded contract: the caller keeps `dst..dst+len` valid and private until
        // the handle is waited on or dropped, and does not leak the handle.
        Ok(unsafe { self.shared.mailbox.post_into(p, tag, dst, len) })
    }
    fn unacked_bytes(&self, p: usize) -> Option<usize> {
        let peer = self.shared.peers.get(p)?.as_ref()?;
        // A reset connection keeps reporting what it never got acknowledged: once the link
        // failed, or a connection to this peer ended, there is no answer (and the caller's next
        // operation gets the link's error).
        if self.shared.mailbox.failure().is_some() || self.shared.slots.iter().any(|s| s.peer() == p && s.has_ended()) {
            return None;
        }
        peer.conns.iter().map(|c| queued_bytes(&c.control).ok()).sum()
    }

    fn abort(&self, reason: &str) {
        self.fail_because(Error::Aborted { reason: reason.into() });
    }

    fn abort_with(&self, cause: &Error) {
        self.fail_because(cause.clone());
    }
}

impl TcpLink {
    /// Fails the link with `err` (told to the peers if it is the link's first failure) and
    /// shuts every socket.
    fn fail_because(&self, err: Error) {
        if let Some(g) = self.shm.get() {
            g.abort(&err.to_string());
        }
        // Only the first failure is told to the peers; the sockets are shut in any case, so
        // that no reader or writer of ours stays inside a transfer.
        self.shared.fail_with(err, None);
        // Shut every socket so that our own writers stuck on a peer return at once.
        self.shared.closing.store(true, Ordering::SeqCst);
        for peer in self.shared.peers.iter().flatten() {
            for c in &peer.conns {
                let _ = c.control.shutdown(Shutdown::Both);
            }
        }
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        let sh = &self.shared;
        // Stop the sender threads after they drained their queues; on a failed link, shut the
        // sockets first so that a sender stuck on a dead peer returns at once.
        for peer in sh.peers.iter().flatten() {
            peer.sender.locked().take();
        }
        let healthy = sh.mailbox.failure().is_none();
        sh.closing.store(true, Ordering::SeqCst);
        if !healthy {
            for c in sh.peers.iter().flatten().flat_map(|p| &p.conns) {
                let _ = c.control.shutdown(Shutdown::Both);
            }
        }
        for h in self.senders.get_mut().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = h.join();
        }
        if healthy {
            let h = FrameHeader { kind: FrameKind::Goodbye, tag: 0, seq: 0, total: 0, offset: 0, len: 0 };
            for peer in sh.peers.iter().flatten() {
                for c in &peer.conns {
                    let mut w = c.writer.locked();
                    let _ = write_frame(&mut w, &h, &[], Instant::now() + Duration::from_secs(1));
                    let _ = c.control.shutdown(Shutdown::Write);
                }
            }
            // Wait (bounded) for the peers' goodbyes, so nothing they still send is cut off.
            let until = Instant::now() + sh.cfg.linger;
            let readers = self.readers.get_mut().unwrap_or_else(|e| e.into_inner());
            while Instant::now() < until && readers.iter().any(|h| !h.is_finished()) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        sh.mailbox.fail(Error::Aborted { reason: "link closed".into() });
        for peer in sh.peers.iter().flatten() {
            for c in &peer.conns {
                let _ = c.control.shutdown(Shutdown::Both);
            }
        }
        for h in self.readers.get_mut().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = h.join();
        }
    }
}

const CAUSE_LOST: u8 = 1;
const CAUSE_ABORTED: u8 = 2;

/// Abort payload: what went wrong and at which rank, so that every survivor reports the
/// root cause rather than the rank that told it.
fn encode_cause(me: usize, err: &Error) -> Vec<u8> {
    let (code, rank, text) = match err {
        Error::PeerLost { rank, detail } => (CAUSE_LOST, *rank, detail.clone()),
        Error::PeerAborted { rank, reason } => (CAUSE_ABORTED, *rank, reason.clone()),
        Error::Aborted { reason } => (CAUSE_ABORTED, me, reason.clone()),
        other => (CAUSE_ABORTED, me, other.to_string()),
    };
    let mut b = vec![code];
    b.extend_from_slice(&(rank as u32).to_le_bytes());
    let t = text.as_bytes();
    b.extend_from_slice(&t[..t.len().min(4000)]);
    b
}

fn decode_cause(from: usize, b: &[u8]) -> Error {
    let text = |s: &[u8]| String::from_utf8_lossy(s).into_owned();
    match b {
        [code, r0, r1, r2, r3, rest @ ..] if *code == CAUSE_LOST || *code == CAUSE_ABORTED => {
            let rank = u32::from_le_bytes([*r0, *r1, *r2, *r3]) as usize;
            if *code == CAUSE_LOST {
                Error::PeerLost { rank, detail: format!("reported by rank {from}: {}", text(rest)) }
            } else {
                Error::PeerAborted { rank, reason: text(rest) }
            }
        }
        _ => Error::PeerAborted { rank: from, reason: text(b) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn congestion_of(s: &TcpStream) -> String {
        let mut buf = [0u8; 16];
        let mut len = buf.len() as libc::socklen_t;
        // SAFETY: an open socket, a 16-byte buffer and its length, alive for the call.
        let r = unsafe {
            libc::getsockopt(s.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_CONGESTION, buf.as_mut_ptr().cast(), &mut len)
        };
        assert_eq!(r, 0, "getsockopt(TCP_CONGESTION): {}", std::io::Error::last_os_error());
        String::from_utf8_lossy(&buf[..len as usize]).trim_end_matches('\0').to_string()
    }

    #[test]
    fn a_connection_within_the_host_gets_the_configured_congestion_control() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (a, _) = l.accept().unwrap();
        assert!(tune_local(&c, "reno").unwrap());
        assert!(tune_local(&a, "reno").unwrap());
        assert_eq!(congestion_of(&c), "reno");
        assert_eq!(congestion_of(&a), "reno");
        // An algorithm the kernel does not have is a configuration error that says where to look.
        let e = tune_local(&c, "nosuchalgo").unwrap_err().to_string();
        assert!(e.contains("tcp_available_congestion_control"), "{e}");
    }

    #[test]
    fn congestion_names_are_checked() {
        assert_eq!(parse_congestion("default").unwrap(), None);
        assert_eq!(parse_congestion(" ").unwrap(), None);
        assert_eq!(parse_congestion("cubic").unwrap().as_deref(), Some("cubic"));
        assert!(parse_congestion("reno; rm").is_err());
        assert!(parse_congestion("a_name_far_too_long_for_the_kernel").is_err());
        assert_eq!(TcpConfig::default().local_congestion.as_deref(), Some("reno"));
    }
}

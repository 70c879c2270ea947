//! Intra-host collectives through one shared-memory segment: the path ranks on one host take
//! by default (the TCP and UCX backends set it up when every rank of the job is on one host).
//!
//! Why: over sockets the kernel copies every byte twice and each message wakes a reader thread;
//! between processes on one host a shared segment lets a rank read (and reduce straight out
//! of) what its peers wrote, with no system call on the data path. Each rank owns a *slot* of
//! two buffers in the segment. A collective proceeds in *windows*: every rank copies its part
//! of the window into its own slot, publishes a phase number, waits until every peer published
//! it, then reads what it needs from the others' slots. Windows alternate between the two
//! buffers, so a rank may fill the next window while a slow peer still reads the last one; the
//! phase a rank waits for before writing a buffer again proves every reader of it is done.
//!
//! No progress thread: the calling thread copies and reduces; a wait spins briefly, then
//! yields the core (two ranks may share one core), then sleeps on a futex the publishers ring.
//! Every wait has the communicator's deadline and checks, every millisecond (every 20 ms once
//! it has waited 10 ms; an abort rings the sleepers awake at once), the
//! segment's abort word, the owning link's failure (a peer's socket closing is how a killed
//! process shows) and whether each peer's process still exists.
//!
//! Every collective's first phase also carries a descriptor (operation, byte count, dtype,
//! operator, root); a rank that called something else, or with other sizes, is detected
//! there and every rank returns the same typed error at the same phase.

use ironweave_units::Locked;
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::dtype::{reduce_into, DType, ReduceOp};
use crate::error::{Error, Result};
use crate::rendezvous::{JobEnv, Rendezvous};

const MAGIC: u64 = 0x6977_5348_4d00_0001; // "iwSHM", layout version 1
const HEADER_BYTES: usize = 4096;
const CTRL_BYTES: usize = 128;
const REASON_MAX: usize = 2048;
/// The pids of the ranks follow the reason in the header page.
const PIDS_OFF: usize = 2560;
/// At most this many ranks on one host share a segment (more use the link).
pub const MAX_RANKS: usize = (HEADER_BYTES - PIDS_OFF) / 4;
/// At most this many channels per segment.
pub const MAX_CHANNELS: usize = 16;
/// Default channels: communicators over the whole world that may each run collectives
/// (the world's link view, a `dup` for gradients, the non-blocking executor's `dup`, ...).
pub const DEFAULT_CHANNELS: usize = 4;
/// Blocks of at least this many bytes move in one copy, read straight out of the peer's own
/// buffer (`process_vm_readv`), instead of through the slots (two copies).
pub const SINGLE_COPY_MIN: usize = 256 << 10;
/// Default bytes per slot buffer: large enough that a window's synchronisation is cheap
/// against its copying, small enough that a window stays in the caches between writer and
/// readers.
pub const DEFAULT_SLOT_BYTES: usize = 1 << 20;

// Descriptor opcodes.
const OP_BARRIER: u64 = 1;
const OP_ALL_REDUCE: u64 = 2;
const OP_ALL_GATHER: u64 = 3;
const OP_REDUCE_SCATTER: u64 = 4;
const OP_BROADCAST: u64 = 5;
const OP_ALL_TO_ALL: u64 = 6;

fn op_name(code: u64) -> &'static str {
    match code {
        OP_BARRIER => "barrier",
        OP_ALL_REDUCE => "all_reduce",
        OP_ALL_GATHER => "all_gather",
        OP_REDUCE_SCATTER => "reduce_scatter",
        OP_BROADCAST => "broadcast",
        OP_ALL_TO_ALL => "all_to_all_v",
        _ => "an unknown operation",
    }
}

/// The segment header (first page).
#[repr(C)]
struct Header {
    magic: AtomicU64,
    size: AtomicU64,
    slot_bytes: AtomicU64,
    /// 0, or 1 + the rank that aborted (its reason follows).
    abort: AtomicU32,
    /// Claimed by the first rank to abort, so one reason is written whole.
    abort_claim: AtomicU32,
    /// Rung (incremented) by every publication; sleepers wait on it.
    bell: AtomicU32,
    sleepers: AtomicU32,
    reason_len: AtomicU32,
    channels: AtomicU64,
    /// Which communicator (1 << 32 | context id) owns each channel; 0 = free. Claimed once,
    /// never released, in the shared segment: every rank sees the same owner.
    chan_keys: [AtomicU64; MAX_CHANNELS],
}

/// Per-rank, per-channel control block (its own cache lines).
#[repr(C)]
struct Ctrl {
    /// The last phase this rank published.
    arrive: AtomicU64,
    /// Descriptors of the current collective, by collective parity.
    desc: [[AtomicU64; 4]; 2],
    /// Where this rank's source buffer is, for single-copy reads, by collective parity.
    addr: [AtomicU64; 2],
}

const _: () = assert!(std::mem::size_of::<Header>() + REASON_MAX <= PIDS_OFF);
const _: () = assert!(std::mem::size_of::<Ctrl>() <= CTRL_BYTES);

/// Tunables of the shared-memory path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmConfig {
    /// Use the path at all (`IRONWEAVE_SHM=0` turns it off: collectives then go over the link).
    pub enabled: bool,
    /// Bytes per slot buffer (`IRONWEAVE_SHM_SLOT_BYTES`).
    pub slot_bytes: usize,
    /// Channels: whole-world communicators that can use the path (`IRONWEAVE_SHM_CHANNELS`);
    /// further ones use the link.
    pub channels: usize,
    /// Directory of the segment file (`IRONWEAVE_SHM_DIR`, default `/dev/shm`).
    pub dir: PathBuf,
    /// Large all-gather and all-to-all blocks are read straight out of the peer's buffer
    /// when every rank may (`IRONWEAVE_SHM_SINGLE_COPY=1`). Off by default: on the machine
    /// of docs/BENCHMARKS.md the kernel's copy (it pins the peer's pages 16 at a time) is
    /// slower than two copies through the cache.
    pub single_copy: bool,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            enabled: true,
            slot_bytes: DEFAULT_SLOT_BYTES,
            channels: DEFAULT_CHANNELS,
            dir: PathBuf::from("/dev/shm"),
            single_copy: false,
        }
    }
}

impl ShmConfig {
    /// Reads `IRONWEAVE_SHM` (`0`/`1`), `IRONWEAVE_SHM_SLOT_BYTES`, `IRONWEAVE_SHM_CHANNELS`
    /// `IRONWEAVE_SHM_SINGLE_COPY` and `IRONWEAVE_SHM_DIR`.
    pub fn from_env() -> Result<Self> {
        let mut c = ShmConfig::default();
        if let Some(on) = env_flag("IRONWEAVE_SHM", " (shared memory between ranks on a host)")? {
            c.enabled = on;
        }
        if let Ok(v) = std::env::var("IRONWEAVE_SHM_SLOT_BYTES") {
            c.slot_bytes = v
                .trim()
                .parse()
                .ok()
                .filter(|&b: &usize| (4096..=1 << 30).contains(&b))
                .ok_or_else(|| Error::Config(format!("IRONWEAVE_SHM_SLOT_BYTES={v:?}: use 4096 to 1073741824 bytes")))?;
        }
        if let Ok(v) = std::env::var("IRONWEAVE_SHM_CHANNELS") {
            c.channels = v
                .trim()
                .parse()
                .ok()
                .filter(|&b: &usize| (1..=MAX_CHANNELS).contains(&b))
                .ok_or_else(|| Error::Config(format!("IRONWEAVE_SHM_CHANNELS={v:?}: use 1 to {MAX_CHANNELS}")))?;
        }
        if let Some(on) = env_flag("IRONWEAVE_SHM_SINGLE_COPY", "")? {
            c.single_copy = on;
        }
        if let Ok(v) = std::env::var("IRONWEAVE_SHM_DIR") {
            c.dir = PathBuf::from(v);
        }
        Ok(c)
    }
}

/// What identifies a host for the shared-memory path: the boot, the network namespace (ranks
/// in different namespaces are different hosts on the emulated cluster, whose links they must
/// use) and the mount namespace (which decides what `/dev/shm` is).
pub fn host_key() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    let link = |p: &str| std::fs::read_link(p).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    format!(
        "{}|{}|{}|{}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id"),
        link("/proc/self/ns/net"),
        link("/proc/self/ns/mnt")
    )
}

/// A link's health, asked while waiting: `Err` once the link failed (a peer lost or aborted).
pub type Health = Box<dyn Fn() -> Result<()> + Send + Sync>;

/// The health of a link whose receive side is `mailbox`: its first failure, if any.
pub fn mailbox_health(mailbox: std::sync::Arc<crate::Mailbox>) -> Health {
    Box::new(move || mailbox.failure().map_or(Ok(()), Err))
}

/// An on/off setting from the environment: `None` when unset, else `1`/`on`/`true`/`yes`/empty
/// or `0`/`off`/`false`/`no`; anything else is a `Config` error saying `use 1{hint} or 0`.
pub fn env_flag(key: &str, hint: &str) -> Result<Option<bool>> {
    let Ok(v) = std::env::var(key) else { return Ok(None) };
    match v.trim() {
        "0" | "off" | "false" | "no" => Ok(Some(false)),
        "1" | "on" | "true" | "yes" | "" => Ok(Some(true)),
        _ => Err(Error::Config(format!("{key}={v:?}: use 1{hint} or 0"))),
    }
}

struct Mapping {
    base: *mut u8,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is the mapping made in `map_file`, unmapped once here; no
        // reference into it outlives the group that owns this mapping.
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

fn map_file(f: &File, len: usize) -> Result<Mapping> {
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh shared mapping of a file we hold open, of the file's length; the kernel
    // picks the address. The result is checked before use.
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        return Err(Error::io("mapping the shared-memory segment", &std::io::Error::last_os_error()));
    }
    Ok(Mapping { base: p.cast(), len })
}

struct State {
    /// The last phase this rank published.
    phase: u64,
    /// Windows run so far (selects the buffer).
    window: u64,
    /// Collectives run so far (selects the descriptor).
    colls: u64,
}

/// One rank's view of the shared segment of its host's ranks.
pub struct ShmGroup {
    map: Mapping,
    rank: usize,
    size: usize,
    slot: usize,
    chan_bytes: usize,
    states: Vec<Mutex<State>>,
    colls: AtomicU64,
    /// Every rank may read every peer's memory (agreed through the rendezvous).
    single_copy: std::sync::atomic::AtomicBool,
    /// More ranks on the host than cores: spinning only delays the peer we wait for.
    crowded: bool,
    health: Health,
    path: PathBuf,
}

/// One channel of a segment: the window protocol of one communicator.
#[derive(Debug)]
pub struct Chan<'a> {
    g: &'a ShmGroup,
    ch: usize,
}

impl std::ops::Deref for Chan<'_> {
    type Target = ShmGroup;
    fn deref(&self) -> &ShmGroup {
        self.g
    }
}

// SAFETY: the mapping is shared memory accessed only through atomics (control words) or
// under the window protocol (data buffers: a buffer is written only by its owner while the
// protocol guarantees no reader); the raw pointer is not tied to a thread.
unsafe impl Send for ShmGroup {}
// SAFETY: as above; the only mutable local state is behind a mutex.
unsafe impl Sync for ShmGroup {}

impl std::fmt::Debug for ShmGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmGroup")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("slot_bytes", &self.slot)
            .field("path", &self.path)
            .finish()
    }
}

/// Bytes per channel and of the whole segment.
fn layout(size: usize, slot: usize, channels: usize) -> (usize, usize) {
    let chan = (size * CTRL_BYTES).next_multiple_of(4096) + size * 2 * slot;
    (chan, HEADER_BYTES + channels * chan)
}

impl ShmGroup {
    /// Creates the segment file at `path` (which must not exist) for `size` ranks and maps it.
    pub fn create(path: &Path, rank: usize, size: usize, slot_bytes: usize, channels: usize, health: Health) -> Result<ShmGroup> {
        if size > MAX_RANKS || !(1..=MAX_CHANNELS).contains(&channels) {
            return Err(Error::InvalidArgument(format!(
                "a shared segment serves at most {MAX_RANKS} ranks and 1 to {MAX_CHANNELS} channels, not {size} ranks and {channels}"
            )));
        }
        let slot = slot_bytes.max(4096).max(32 * size).next_multiple_of(64);
        let (chan_bytes, len) = layout(size, slot, channels);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| Error::io(format!("creating the shared-memory segment {}", path.display()), &e))?;
        // from here on a failure removes the file it made (a failed round must leave nothing)
        let unlink = Unlink(Some(path.to_path_buf()));
        f.set_len(len as u64).map_err(|e| Error::io(format!("sizing {} to {len} bytes", path.display()), &e))?;
        // Reserve every page now: a tmpfs too small for the segment is an error here, not a
        // SIGBUS in the middle of a collective.
        {
            use std::os::fd::AsRawFd;
            // SAFETY: posix_fallocate on the file descriptor we own, within its length.
            let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len as libc::off_t) };
            if rc != 0 {
                return Err(Error::io(
                    format!("reserving {len} bytes for {} (is the tmpfs large enough?)", path.display()),
                    &std::io::Error::from_raw_os_error(rc),
                ));
            }
        }
        let map = map_file(&f, len)?;
        // the caller unlinks it once every rank mapped it
        unlink.keep();
        let g = ShmGroup::from_map(map, rank, size, slot, chan_bytes, channels, health, path);
        let h = g.header();
        h.size.store(size as u64, Ordering::Relaxed);
        h.slot_bytes.store(slot as u64, Ordering::Relaxed);
        h.channels.store(channels as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        g.pid(rank).store(std::process::id(), Ordering::Release);
        Ok(g)
    }

    /// Maps the segment another rank created at `path`, checking it was made for `size` ranks.
    pub fn open(path: &Path, rank: usize, size: usize, health: Health) -> Result<ShmGroup> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening the shared-memory segment {}", path.display()), &e))?;
        let len = f.metadata().map_err(|e| Error::io("reading the segment's size", &e))?.len() as usize;
        if len < HEADER_BYTES || size > MAX_RANKS {
            return Err(Error::Protocol {
                from: path.display().to_string(),
                detail: format!("segment of {len} bytes is too small"),
            });
        }
        let map = map_file(&f, len)?;
        let base = map.base;
        // SAFETY: the mapping is at least a header long (checked) and page-aligned.
        let h = unsafe { &*base.cast::<Header>() };
        let (magic, n, slot) = (
            h.magic.load(Ordering::Acquire),
            h.size.load(Ordering::Relaxed) as usize,
            h.slot_bytes.load(Ordering::Relaxed) as usize,
        );
        let channels = h.channels.load(Ordering::Relaxed) as usize;
        let ok_shape = magic == MAGIC
            && n == size
            && (1..=MAX_CHANNELS).contains(&channels)
            && slot >= (4096).max(32 * size)
            && slot <= 1 << 30;
        let (chan_bytes, want) = if ok_shape { layout(size, slot, channels) } else { (0, usize::MAX) };
        if !ok_shape || len != want {
            return Err(Error::Protocol {
                from: path.display().to_string(),
                detail: format!(
                    "not a segment of this layout for {size} ranks (magic {magic:#x}, {n} ranks, {slot}-byte slots, {len} bytes)"
                ),
            });
        }
        let g = ShmGroup::from_map(map, rank, size, slot, chan_bytes, channels, health, path);
        g.pid(rank).store(std::process::id(), Ordering::Release);
        Ok(g)
    }

    #[allow(clippy::too_many_arguments)]
    fn from_map(
        map: Mapping,
        rank: usize,
        size: usize,
        slot: usize,
        chan_bytes: usize,
        channels: usize,
        health: Health,
        path: &Path,
    ) -> ShmGroup {
        ShmGroup {
            map,
            rank,
            size,
            slot,
            chan_bytes,
            states: (0..channels).map(|_| Mutex::new(State { phase: 0, window: 0, colls: 0 })).collect(),
            colls: AtomicU64::new(0),
            single_copy: std::sync::atomic::AtomicBool::new(false),
            crowded: std::thread::available_parallelism().map_or(true, |c| size > c.get()),
            health,
            path: path.to_path_buf(),
        }
    }

    /// The channel of the communicator with context id `ctx`: the one it claimed before, or
    /// a free one claimed now; `None` when every channel belongs to another communicator
    /// (the same answer on every rank: claims live in the shared segment and are final).
    pub fn channel(&self, ctx: u32) -> Option<Chan<'_>> {
        let key = (1u64 << 32) | u64::from(ctx);
        let h = self.header();
        for (ch, slot) in h.chan_keys.iter().enumerate().take(self.states.len()) {
            match slot.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(Chan { g: self, ch }),
                Err(owner) if owner == key => return Some(Chan { g: self, ch }),
                Err(_) => {}
            }
        }
        None
    }

    /// Turns single-copy reads on or off; every rank must agree (see [`join_job`]).
    pub fn set_single_copy(&self, on: bool) {
        self.single_copy.store(on, Ordering::Relaxed);
    }

    /// Whether large blocks are read straight out of the peers' buffers.
    pub fn single_copy(&self) -> bool {
        self.single_copy.load(Ordering::Relaxed)
    }

    /// Copies `dst.len()` bytes at address `remote` of rank `p`'s process into `dst`, in one
    /// kernel copy. The kernel checks the remote range: a wrong address is an error, not a
    /// fault.
    fn read_peer(&self, p: usize, remote: u64, dst: &mut [u8]) -> Result<()> {
        read_process(self.pid(p).load(Ordering::Acquire), remote, dst).map_err(|e| match e.raw_os_error() {
            Some(libc::ESRCH) => Error::PeerLost { rank: p, detail: "its process is gone (seen reading its buffer)".into() },
            _ => Error::io(format!("reading rank {p}'s buffer (process_vm_readv)"), &e),
        })
    }

    /// Channel `i` (an index [`Chan::index`] gave before).
    pub fn chan_at(&self, i: usize) -> Chan<'_> {
        assert!(i < self.states.len(), "channel {i} of {}", self.states.len());
        Chan { g: self, ch: i }
    }

    fn pid(&self, r: usize) -> &AtomicU32 {
        assert!(r < self.size && r < MAX_RANKS);
        // SAFETY: the pid table lies inside the header page (r < MAX_RANKS), 4-byte aligned.
        unsafe { &*self.map.base.add(PIDS_OFF + 4 * r).cast::<AtomicU32>() }
    }

    /// Ranks sharing the segment.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Bytes per slot buffer.
    pub fn slot_bytes(&self) -> usize {
        self.slot
    }

    /// Collectives this rank ran through the segment so far, on every channel (a counter, for
    /// benchmarks to show which path their calls took).
    pub fn collectives_run(&self) -> u64 {
        self.colls.load(Ordering::Relaxed)
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a page-aligned header (length checked on open).
        unsafe { &*self.map.base.cast::<Header>() }
    }

    /// Marks the segment aborted (first reason wins) and wakes every waiter.
    pub fn abort(&self, reason: &str) {
        let h = self.header();
        if h.abort_claim.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            let b = reason.as_bytes();
            let n = b.len().min(REASON_MAX);
            // SAFETY: the reason area follows the header struct inside the first page; only the
            // claim winner writes it, before publishing `abort` with release ordering.
            unsafe {
                std::ptr::copy_nonoverlapping(b.as_ptr(), self.map.base.add(std::mem::size_of::<Header>()), n);
            }
            h.reason_len.store(n as u32, Ordering::Relaxed);
            h.abort.store(1 + self.rank as u32, Ordering::Release);
        }
        self.ring(true);
    }

    fn check_abort(&self) -> Result<()> {
        let h = self.header();
        let a = h.abort.load(Ordering::Acquire);
        if a == 0 {
            return Ok(());
        }
        let n = (h.reason_len.load(Ordering::Relaxed) as usize).min(REASON_MAX);
        // SAFETY: written whole before `abort` was published (acquire above).
        let reason = unsafe { std::slice::from_raw_parts(self.map.base.add(std::mem::size_of::<Header>()), n) };
        let reason = String::from_utf8_lossy(reason).into_owned();
        let who = (a - 1) as usize;
        Err(if who == self.rank { Error::Aborted { reason } } else { Error::PeerAborted { rank: who, reason } })
    }

    /// Wakes sleepers (all of them, when `force`): the bell's word changes only when someone
    /// sleeps, so a publication costs no shared write on the fast path.
    fn ring(&self, force: bool) {
        let h = self.header();
        if force || h.sleepers.load(Ordering::SeqCst) > 0 {
            h.bell.fetch_add(1, Ordering::SeqCst);
            futex_wake(&h.bell);
        }
    }

    /// A peer whose process is gone (the pid no longer exists).
    fn dead_peer(&self) -> Option<usize> {
        let me = std::process::id();
        (0..self.size).filter(|&p| p != self.rank).find(|&p| {
            let pid = self.pid(p).load(Ordering::Acquire);
            // SAFETY: kill with signal 0 sends nothing; it only asks whether the pid exists.
            pid != 0
                && pid != me
                && unsafe { libc::kill(pid as libc::pid_t, 0) } == -1
                && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
        })
    }
}

impl Chan<'_> {
    /// This channel's index in its segment.
    pub fn index(&self) -> usize {
        self.ch
    }

    fn chan_base(&self) -> *mut u8 {
        // SAFETY: channel `ch` < channels lies inside the mapping (layout checked on open).
        unsafe { self.g.map.base.add(HEADER_BYTES + self.ch * self.g.chan_bytes) }
    }

    fn ctrl(&self, r: usize) -> &Ctrl {
        assert!(r < self.size);
        // SAFETY: the channel starts with one control block per rank, inside the mapping.
        unsafe { &*self.chan_base().add(r * CTRL_BYTES).cast::<Ctrl>() }
    }

    /// Start of rank `r`'s buffer `b`.
    fn buf_ptr(&self, r: usize, b: usize) -> *mut u8 {
        assert!(r < self.size && b < 2);
        // SAFETY: inside the channel: its control area, then 2 buffers per rank (checked).
        unsafe { self.chan_base().add((self.size * CTRL_BYTES).next_multiple_of(4096) + (r * 2 + b) * self.slot) }
    }

    /// Peer `r`'s buffer `b` (read only, under the window protocol).
    fn peer_buf(&self, r: usize, b: usize, range: std::ops::Range<usize>) -> &[u8] {
        assert!(range.end <= self.slot);
        // SAFETY: within the slot; the protocol guarantees the owner does not write it while
        // any reader holds this window.
        unsafe { std::slice::from_raw_parts(self.buf_ptr(r, b).add(range.start), range.len()) }
    }

    /// This rank's buffer `b` (written only by this rank, under the window protocol).
    #[allow(clippy::mut_from_ref)]
    fn own_buf(&self, b: usize, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(range.end <= self.slot);
        // SAFETY: within our own slot; the protocol guarantees no peer reads this buffer
        // while we write it, and the state mutex keeps our own uses sequential.
        unsafe { std::slice::from_raw_parts_mut(self.buf_ptr(self.rank, b).add(range.start), range.len()) }
    }

    fn publish(&self, phase: u64) {
        self.ctrl(self.rank).arrive.store(phase, Ordering::SeqCst);
        self.ring(false);
    }

    /// Waits until every peer published `phase`.
    fn wait_all(&self, phase: u64, dl: Instant, what: &'static str) -> Result<()> {
        let h = self.header();
        let ready = || (0..self.size).all(|p| p == self.rank || self.ctrl(p).arrive.load(Ordering::Acquire) >= phase);
        if ready() {
            return Ok(());
        }
        let start = Instant::now();
        let mut spins = 0u32;
        let mut next_check = start;
        loop {
            for _ in 0..if self.crowded { 1 } else { 64 } {
                if ready() {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            self.check_abort()?;
            spins += 1;
            let now = Instant::now();
            if now >= next_check {
                (self.health)()?;
                if let Some(p) = self.dead_peer() {
                    return Err(Error::PeerLost { rank: p, detail: format!("its process is gone (seen waiting in {what})") });
                }
                if now >= dl {
                    let late: Vec<String> = (0..self.size)
                        .filter(|&p| p != self.rank && self.ctrl(p).arrive.load(Ordering::Acquire) < phase)
                        .map(|p| p.to_string())
                        .collect();
                    return Err(Error::Timeout {
                        what: format!("{what} on the shared-memory path (waiting for rank(s) {})", late.join(", ")),
                        after: now - start,
                    });
                }
                next_check = now + Duration::from_millis(1);
            }
            if spins < 4 && !self.crowded {
                continue;
            }
            // Give the core away: on a busy host the peer we wait for may need it.
            if now - start < Duration::from_micros(200) {
                std::thread::yield_now();
                continue;
            }
            h.sleepers.fetch_add(1, Ordering::SeqCst);
            let bell = h.bell.load(Ordering::SeqCst);
            if !ready() {
                // Publishers ring the bell when someone sleeps, so the timeout only paces the
                // checks below: every millisecond at first, every 20 ms in a long wait (a rank
                // idle in a barrier then costs a fraction of a percent of a core, not 3%).
                let slice = if now - start < Duration::from_millis(10) { 1 } else { 20 };
                let left = dl.saturating_duration_since(now).max(Duration::from_micros(50));
                futex_wait(&h.bell, bell, Duration::from_millis(slice).min(left));
            }
            h.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Starts a collective: takes the state, writes this rank's descriptor.
    fn begin(&self, desc: [u64; 4]) -> std::sync::MutexGuard<'_, State> {
        let st = self.g.states[self.ch].locked();
        let d = &self.ctrl(self.rank).desc[(st.colls % 2) as usize];
        for (slot, v) in d.iter().zip(desc) {
            slot.store(v, Ordering::Relaxed);
        }
        st
    }

    /// Checks every peer's descriptor against ours (after the first phase published them).
    fn check_desc(&self, st: &State, desc: [u64; 4]) -> Result<()> {
        let op = op_name(desc[0]);
        for p in (0..self.size).filter(|&p| p != self.rank) {
            let d = &self.ctrl(p).desc[(st.colls % 2) as usize];
            let theirs: Vec<u64> = d.iter().map(|a| a.load(Ordering::Relaxed)).collect();
            if theirs[0] != desc[0] {
                return Err(Error::InvalidArgument(format!(
                    "rank {p} called {} while rank {} called {op}: every rank must run the same collectives in the same order",
                    op_name(theirs[0]),
                    self.rank
                )));
            }
            if theirs[1] != desc[1] {
                return Err(Error::LengthMismatch {
                    op: op_name(desc[0]),
                    peer: p,
                    expected: desc[1] as usize,
                    got: theirs[1] as usize,
                });
            }
            if theirs[2..] != desc[2..] {
                return Err(Error::InvalidArgument(format!(
                    "{op}: rank {p} passed dtype/operator/root {:?}, rank {} passed {:?}: every rank must pass the same",
                    &theirs[2..],
                    self.rank,
                    &desc[2..]
                )));
            }
        }
        Ok(())
    }

    /// One synchronisation: publish the next phase and wait for every peer to reach it.
    fn sync(&self, st: &mut State, dl: Instant, what: &'static str) -> Result<()> {
        st.phase += 1;
        self.publish(st.phase);
        self.wait_all(st.phase, dl, what)
    }

    fn next_buffer(st: &mut State) -> usize {
        let b = (st.window % 2) as usize;
        st.window += 1;
        b
    }

    /// Runs `body` as one collective: descriptor, windows, and on error the abort that stops
    /// the peers (unless a peer caused it).
    fn run(&self, desc: [u64; 4], body: impl FnOnce(&Self, &mut State, &mut bool) -> Result<()>) -> Result<()> {
        let mut st = self.begin(desc);
        let mut checked = false;
        let r = body(self, &mut st, &mut checked);
        st.colls += 1;
        self.g.colls.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = &r {
            if !matches!(e, Error::PeerAborted { .. } | Error::PeerLost { .. } | Error::Aborted { .. }) {
                self.abort(&format!("{} failed on rank {}: {e}", op_name(desc[0]), self.rank));
            }
        }
        r
    }

    /// The first sync of a collective also checks the descriptors.
    fn sync_first(&self, st: &mut State, checked: &mut bool, desc: [u64; 4], dl: Instant) -> Result<()> {
        self.sync_around(st, checked, desc, dl, || {})
    }

    /// Like [`Chan::sync_first`], running `between` after publishing and before waiting: work
    /// that needs no peer (this rank's own block) hides the wait for the slowest peer.
    fn sync_around(&self, st: &mut State, checked: &mut bool, desc: [u64; 4], dl: Instant, between: impl FnOnce()) -> Result<()> {
        let what = op_name(desc[0]);
        st.phase += 1;
        self.publish(st.phase);
        between();
        self.wait_all(st.phase, dl, what)?;
        if !*checked {
            *checked = true;
            self.check_desc(st, desc)?;
        }
        Ok(())
    }

    /// Blocks until every rank arrived.
    pub fn barrier(&self, dl: Instant) -> Result<()> {
        let desc = [OP_BARRIER, 0, 0, 0];
        self.run(desc, |g, st, ck| g.sync_first(st, ck, desc, dl))
    }

    /// In-place all-reduce (`Avg` sums; the caller divides).
    pub fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp, dl: Instant) -> Result<()> {
        let es = dtype.size();
        let desc = [OP_ALL_REDUCE, buf.len() as u64, dtype as u64, op as u64];
        let (n, me) = (self.size, self.rank);
        self.run(desc, |g, st, ck| {
            if buf.len() <= g.slot && buf.len() <= 64 << 10 {
                // Small: one phase; every rank reduces all slots in rank order (same bits
                // everywhere).
                let b = Self::next_buffer(st);
                g.own_buf(b, 0..buf.len()).copy_from_slice(buf);
                g.sync_first(st, ck, desc, dl)?;
                buf.copy_from_slice(g.peer_buf(0, b, 0..buf.len()));
                for p in 1..n {
                    reduce_into(dtype, buf, g.peer_buf(p, b, 0..buf.len()), op);
                }
                return Ok(());
            }
            // Large: per window, rank r reduces piece r out of every slot, then all copy the
            // reduced pieces out of their owners' slots.
            let win = (g.slot / es / n).max(1) * es * n;
            let mut at = 0;
            loop {
                let end = (at + win).min(buf.len());
                let w = &mut buf[at..end];
                let pieces = piece_ranges(w.len() / es, n, es);
                let b = Self::next_buffer(st);
                for (q, r) in pieces.iter().enumerate() {
                    if q != me {
                        g.own_buf(b, r.clone()).copy_from_slice(&w[r.clone()]);
                    }
                }
                g.sync_first(st, ck, desc, dl)?;
                let mine = pieces[me].clone();
                for p in (1..n).map(|k| (me + k) % n) {
                    reduce_into(dtype, &mut w[mine.clone()], g.peer_buf(p, b, mine.clone()), op);
                }
                g.own_buf(b, mine.clone()).copy_from_slice(&w[mine]);
                g.sync(st, dl, "all_reduce")?;
                for (q, r) in pieces.iter().enumerate() {
                    if q != me {
                        w[r.clone()].copy_from_slice(g.peer_buf(q, b, r.clone()));
                    }
                }
                at = end;
                if at >= buf.len() {
                    return Ok(());
                }
            }
        })
    }

    /// All-gather: `output` holds size × `input`, in rank order.
    pub fn all_gather(&self, input: &[u8], output: &mut [u8], dl: Instant) -> Result<()> {
        let m = input.len();
        let desc = [OP_ALL_GATHER, m as u64, 0, 0];
        let (n, me) = (self.size, self.rank);
        self.run(desc, |g, st, ck| {
            if output.len() != n * m {
                return Err(Error::InvalidArgument(format!(
                    "all_gather output holds {} bytes, expected {n} × {m}",
                    output.len()
                )));
            }
            if g.single_copy() && m >= SINGLE_COPY_MIN {
                // One copy per block, straight out of each peer's input; the second phase
                // keeps every input alive until all readers are done.
                g.ctrl(me).addr[(st.colls % 2) as usize].store(input.as_ptr() as u64, Ordering::Relaxed);
                let own = &mut output[me * m..(me + 1) * m];
                g.sync_around(st, ck, desc, dl, || own.copy_from_slice(input))?;
                for p in (1..n).map(|k| (me + k) % n) {
                    let at = g.ctrl(p).addr[(st.colls % 2) as usize].load(Ordering::Relaxed);
                    g.read_peer(p, at, &mut output[p * m..(p + 1) * m])?;
                }
                return g.sync(st, dl, "all_gather");
            }
            let mut at = 0;
            loop {
                let end = (at + g.slot).min(m);
                let b = Self::next_buffer(st);
                g.own_buf(b, 0..end - at).copy_from_slice(&input[at..end]);
                // Our own block comes out of the slot we just wrote (still in this core's
                // cache), while the peers catch up.
                let stream = output.len() >= stream_min();
                let own = &mut output[me * m + at..me * m + end];
                g.sync_around(st, ck, desc, dl, || put(own, g.peer_buf(me, b, 0..end - at), stream))?;
                for p in (1..n).map(|k| (me + k) % n) {
                    put(&mut output[p * m + at..p * m + end], g.peer_buf(p, b, 0..end - at), stream);
                }
                at = end;
                if at >= m {
                    return Ok(());
                }
            }
        })
    }

    /// Broadcast of `buf` from rank `root`.
    pub fn broadcast(&self, buf: &mut [u8], root: usize, dl: Instant) -> Result<()> {
        let m = buf.len();
        let desc = [OP_BROADCAST, m as u64, root as u64, 0];
        let me = self.rank;
        self.run(desc, |g, st, ck| {
            if root >= g.size {
                return Err(Error::RankOutOfRange { rank: root, size: g.size });
            }
            let mut at = 0;
            loop {
                let end = (at + g.slot).min(m);
                let b = Self::next_buffer(st);
                if me == root {
                    g.own_buf(b, 0..end - at).copy_from_slice(&buf[at..end]);
                }
                g.sync_first(st, ck, desc, dl)?;
                if me != root {
                    put(&mut buf[at..end], g.peer_buf(root, b, 0..end - at), m >= stream_min());
                }
                at = end;
                if at >= m {
                    return Ok(());
                }
            }
        })
    }

    /// Reduce-scatter: `input` holds size × `output`; rank r gets the reduction of block r,
    /// reduced straight out of the peers' slots (`Avg` sums; the caller divides).
    pub fn reduce_scatter(&self, input: &[u8], output: &mut [u8], dtype: DType, op: ReduceOp, dl: Instant) -> Result<()> {
        let (n, me, m, es) = (self.size, self.rank, output.len(), dtype.size());
        let desc = [OP_REDUCE_SCATTER, m as u64, dtype as u64, op as u64];
        self.run(desc, |g, st, ck| {
            if input.len() != n * m {
                return Err(Error::InvalidArgument(format!(
                    "reduce_scatter input holds {} bytes, expected {n} × {m}",
                    input.len()
                )));
            }
            if n == 1 {
                output.copy_from_slice(input);
                return Ok(());
            }
            // Each slot holds one region per other rank: block q's window goes to region j(q).
            let c = (g.slot / (n - 1) / es).max(1) * es;
            let mut at = 0;
            loop {
                let end = (at + c).min(m);
                let len = end - at;
                let b = Self::next_buffer(st);
                for q in (0..n).filter(|&q| q != me) {
                    let j = region(me, q);
                    g.own_buf(b, j * c..j * c + len).copy_from_slice(&input[q * m + at..q * m + end]);
                }
                let out = &mut output[at..end];
                g.sync_around(st, ck, desc, dl, || out.copy_from_slice(&input[me * m + at..me * m + end]))?;
                for p in (1..n).map(|k| (me + k) % n) {
                    let j = region(p, me);
                    reduce_into(dtype, out, g.peer_buf(p, b, j * c..j * c + len), op);
                }
                at = end;
                if at >= m {
                    return Ok(());
                }
            }
        })
    }

    /// All-to-all with byte ranges: `send[so[q]]` goes to rank q, `recv[ro[p]]` comes from
    /// rank p. The counts travel with the first window (at the tail of each buffer), so a peer
    /// sending a count this rank did not expect is a typed error here.
    pub fn all_to_all_v(
        &self,
        send: &[u8],
        so: &[std::ops::Range<usize>],
        recv: &mut [u8],
        ro: &[std::ops::Range<usize>],
        dl: Instant,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let desc = [OP_ALL_TO_ALL, n as u64, 0, 0];
        self.run(desc, |g, st, ck| {
            let fits = so.len() == n
                && ro.len() == n
                && so.iter().chain(ro).all(|r| r.start <= r.end)
                && so.iter().all(|r| r.end <= send.len())
                && ro.iter().all(|r| r.end <= recv.len());
            if !fits {
                return Err(Error::InvalidArgument("all_to_all_v ranges do not fit the buffers".into()));
            }
            // Buffer layout: one data region per other rank, then counts and starts (n u64 each).
            let meta = g.slot - 16 * n;
            let c = (meta / (n - 1).max(1)).max(1);
            let word = |p: usize, b: usize, i: usize| -> u64 {
                u64::from_le_bytes(g.peer_buf(p, b, meta + i * 8..meta + i * 8 + 8).try_into().unwrap_or([0; 8]))
            };
            // After the first window: the longest block anywhere (how many windows everybody
            // runs), and whether every peer sends what we expect.
            let learn = |b: usize| -> Result<usize> {
                let mut longest = 0;
                for p in 0..n {
                    for q in 0..n {
                        longest = longest.max(word(p, b, q) as usize);
                    }
                }
                for (p, r) in ro.iter().enumerate() {
                    let got = word(p, b, me) as usize;
                    if got != r.len() {
                        return Err(Error::LengthMismatch { op: "all_to_all_v", peer: p, expected: r.len(), got });
                    }
                }
                Ok(longest)
            };
            let write_meta = |b: usize| {
                for (q, r) in so.iter().enumerate() {
                    g.own_buf(b, meta + q * 8..meta + q * 8 + 8).copy_from_slice(&(r.len() as u64).to_le_bytes());
                    g.own_buf(b, meta + (n + q) * 8..meta + (n + q) * 8 + 8).copy_from_slice(&(r.start as u64).to_le_bytes());
                }
            };
            if g.single_copy() && n > 1 {
                // The counts alone first: large blocks then move in one copy each.
                let b = Self::next_buffer(st);
                write_meta(b);
                g.ctrl(me).addr[(st.colls % 2) as usize].store(send.as_ptr() as u64, Ordering::Relaxed);
                g.sync_first(st, ck, desc, dl)?;
                let longest = learn(b)?;
                if longest >= SINGLE_COPY_MIN {
                    let base = |p: usize| g.ctrl(p).addr[(st.colls % 2) as usize].load(Ordering::Relaxed);
                    let sources: Vec<u64> = (0..n).map(|p| base(p).wrapping_add(word(p, b, n + me))).collect();
                    recv[ro[me].clone()].copy_from_slice(&send[so[me].clone()]);
                    for p in (1..n).map(|k| (me + k) % n) {
                        g.read_peer(p, sources[p], &mut recv[ro[p].clone()])?;
                    }
                    // Every send buffer stays untouched until all readers are done.
                    return g.sync(st, dl, "all_to_all_v");
                }
                return g.a2a_windows(st, ck, desc, dl, (send, so), (recv, ro), longest, c, 0);
            }
            // Slots only: the counts ride on the first window.
            let mut longest = 0;
            g.a2a_window(st, ck, desc, dl, (send, so), (&mut *recv, ro), c, 0, write_meta, |b| {
                longest = learn(b)?;
                Ok(())
            })?;
            g.a2a_windows(st, ck, desc, dl, (send, so), (recv, ro), longest, c, c)
        })
    }

    /// The windows of an all-to-all from byte `from` of every block on.
    #[allow(clippy::too_many_arguments)]
    fn a2a_windows(
        &self,
        st: &mut State,
        ck: &mut bool,
        desc: [u64; 4],
        dl: Instant,
        (send, so): (&[u8], &[std::ops::Range<usize>]),
        (recv, ro): (&mut [u8], &[std::ops::Range<usize>]),
        longest: usize,
        c: usize,
        from: usize,
    ) -> Result<()> {
        let mut at = from;
        while at < longest {
            self.a2a_window(st, ck, desc, dl, (send, so), (&mut *recv, ro), c, at, |_| {}, |_| Ok(()))?;
            at += c;
        }
        Ok(())
    }

    /// One all-to-all window: bytes `at..at + c` of every block. `fill` writes more into this
    /// rank's buffer before the phase is published, `check` reads the peers' buffers after it
    /// (the first window carries the counts).
    #[allow(clippy::too_many_arguments)]
    fn a2a_window(
        &self,
        st: &mut State,
        ck: &mut bool,
        desc: [u64; 4],
        dl: Instant,
        (send, so): (&[u8], &[std::ops::Range<usize>]),
        (recv, ro): (&mut [u8], &[std::ops::Range<usize>]),
        c: usize,
        at: usize,
        fill: impl FnOnce(usize),
        check: impl FnOnce(usize) -> Result<()>,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let window = |r: &std::ops::Range<usize>| (r.start + at).min(r.end)..(r.start + at + c).min(r.end);
        let b = Self::next_buffer(st);
        fill(b);
        for q in (0..n).filter(|&q| q != me) {
            let w = window(&so[q]);
            let j = region(me, q);
            self.own_buf(b, j * c..j * c + w.len()).copy_from_slice(&send[w]);
        }
        // Our own block's window moves while the peers catch up (the shorter of the two until
        // the first window's counts proved them equal).
        let (ow, rw) = (window(&so[me]), window(&ro[me]));
        let k = ow.len().min(rw.len());
        let stream = recv.len() >= stream_min();
        let own = &mut recv[rw.start..rw.start + k];
        self.sync_around(st, ck, desc, dl, || put(own, &send[ow.start..ow.start + k], stream))?;
        check(b)?;
        for p in (1..n).map(|k| (me + k) % n) {
            let w = window(&ro[p]);
            let j = region(p, me);
            let len = w.len();
            put(&mut recv[w], self.peer_buf(p, b, j * c..j * c + len), stream);
        }
        Ok(())
    }
}

/// Where a slot's owner keeps the region meant for rank `q` (one region per other rank).
fn region(owner: usize, q: usize) -> usize {
    if q < owner {
        q
    } else {
        q - 1
    }
}

/// `count` elements of `es` bytes split into `n` near-equal pieces, as byte ranges.
fn piece_ranges(count: usize, n: usize, es: usize) -> Vec<std::ops::Range<usize>> {
    let (base, extra) = (count / n, count % n);
    let mut at = 0;
    (0..n)
        .map(|i| {
            let c = base + usize::from(i < extra);
            let r = at * es..(at + c) * es;
            at += c;
            r
        })
        .collect()
}

/// Outputs of at least this many bytes are written with non-temporal stores: a large
/// all-gather or all-to-all output is not read again soon, and streaming it to memory saves
/// reading every destination line first (half the memory traffic of the write).
pub const STREAM_MIN: usize = 8 << 20;

/// [`STREAM_MIN`], or `IRONWEAVE_SHM_STREAM_MIN` (bytes; read once).
fn stream_min() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("IRONWEAVE_SHM_STREAM_MIN").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(STREAM_MIN))
}

/// `dst.copy_from_slice(src)`, with non-temporal stores when `stream`.
fn put(dst: &mut [u8], src: &[u8], stream: bool) {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    if stream && dst.len() >= 256 {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let body = (dst.len() - head) / 16 * 16;
        let (d, sp) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        // SAFETY: SSE2 is part of x86_64; `d` is 16-byte aligned and `d..d+body`,
        // `sp..sp+body` lie inside `dst` and `src` (which do not overlap: one is borrowed
        // mutably); the loads are unaligned loads. The fence orders the streamed stores before
        // anything this thread does next, as ordinary stores would be.
        unsafe {
            for k in (0..body).step_by(16) {
                _mm_stream_si128(d.add(k).cast::<__m128i>(), _mm_loadu_si128(sp.add(k).cast::<__m128i>()));
            }
            _mm_sfence();
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
        return;
    }
    let _ = stream;
    dst.copy_from_slice(src);
}

/// `process_vm_readv` of `dst.len()` bytes at `remote` in process `pid`, until done.
fn read_process(pid: u32, remote: u64, dst: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        let rest = &mut dst[done..];
        let local = libc::iovec { iov_base: rest.as_mut_ptr().cast(), iov_len: rest.len() };
        let far = libc::iovec { iov_base: (remote as usize).wrapping_add(done) as *mut libc::c_void, iov_len: rest.len() };
        // SAFETY: the local iovec covers `rest`, which we borrow mutably; the remote one is only
        // read by the kernel, which checks it against the other process's mappings.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &far, 1, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the peer's buffer ended early"));
        }
        done += n as usize;
    }
    Ok(())
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: FUTEX_WAIT (shared, not private: the word is in a segment mapped by several
    // processes) on a live, aligned u32 with a relative timeout; the kernel only reads the
    // word. Spurious returns are fine: the caller re-checks.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec, 0usize, 0u32);
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, aligned u32 of the shared mapping; wakes every sleeper.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
    }
}

/// Sets up the shared-memory path for a job through its rendezvous: every rank sends its
/// [`host_key`]; when all ranks share one host (and the path is enabled), rank 0 creates the
/// segment, the others map it, and once all have, rank 0 unlinks the file (the mappings stay:
/// nothing is left behind even if the job is killed). Returns `None`, the same on every rank,
/// when the job spans hosts, the path is off, or any rank could not map the segment (the
/// reason is printed once by rank 0; collectives then use the link).
pub fn join_job(env: &JobEnv, rv: &mut Rendezvous, cfg: &ShmConfig, health: Health) -> Result<Option<ShmGroup>> {
    let (rank, size) = (env.rank, env.world_size);
    let flag = if cfg.enabled { "1" } else { "0" };
    let keys = rv.all_gather("iw-shm-host", format!("{flag}{}", host_key()).as_bytes())?;
    if size < 2 || keys.iter().any(|k| k.first() != Some(&b'1') || k != &keys[0]) {
        return Ok(None);
    }
    // Rank 0 creates; its answer is the path, or empty with the reason after a NUL.
    let mut health = Some(health);
    let mut made = None;
    let mut offer = Vec::new();
    let mut unlink = Unlink(None);
    if rank == 0 {
        let safe: String = env.job_id.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).take(64).collect();
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let path = cfg.dir.join(format!("ironweave-{safe}-{}-{nanos:08x}", std::process::id()));
        match ShmGroup::create(&path, 0, size, cfg.slot_bytes, cfg.channels, health.take().unwrap_or_else(|| Box::new(|| Ok(()))))
        {
            Ok(g) => {
                offer = path.to_string_lossy().into_owned().into_bytes();
                made = Some(g);
                // unlinked on every path out of here: after the ranks mapped it, or when a
                // round fails (a rank lost, a deadline) — ~8 MiB x world each time otherwise
                unlink = Unlink(Some(path));
            }
            Err(e) => offer = format!("\0{e}").into_bytes(),
        }
    }
    let offers = rv.all_gather("iw-shm-path", &offer)?;
    let path = offers.first().cloned().unwrap_or_default();
    let (group, status) = if path.first() == Some(&0) || path.is_empty() {
        (None, String::from_utf8_lossy(path.get(1..).unwrap_or_default()).into_owned())
    } else if rank == 0 {
        (made, String::new())
    } else {
        let p = PathBuf::from(String::from_utf8_lossy(&path).into_owned());
        match ShmGroup::open(&p, rank, size, health.take().unwrap_or_else(|| Box::new(|| Ok(())))) {
            Ok(g) => (Some(g), String::new()),
            Err(e) => (None, e.to_string()),
        }
    };
    let statuses = rv.all_gather("iw-shm-ready", status.as_bytes());
    // every rank mapped it (or gave up): the mappings stay, the name goes
    drop(unlink);
    let statuses = statuses?;
    if let Some((r, why)) = statuses.iter().enumerate().find(|(_, s)| !s.is_empty()) {
        if rank == 0 {
            eprintln!(
                "ironweave: rank {r} could not use the shared-memory path ({}); collectives go over the link (IRONWEAVE_SHM=0 silences this)",
                String::from_utf8_lossy(why)
            );
        }
        return Ok(None);
    }
    let Some(group) = group else { return Ok(None) };
    // Single copy needs every rank to be allowed to read every peer (same user, ptrace rules):
    // each rank reads a probe word of the next one, and all must succeed.
    let probe = Box::new(PROBE ^ rank as u64);
    let mine = format!("{} {}", std::process::id(), &*probe as *const u64 as u64);
    let all = rv.all_gather("iw-shm-cma", mine.as_bytes())?;
    let peer = (rank + 1) % size;
    let ok = cfg.single_copy
        && String::from_utf8_lossy(&all[peer]).split_once(' ').is_some_and(|(pid, addr)| {
            let mut got = [0u8; 8];
            match (pid.parse::<u32>(), addr.parse::<u64>()) {
                (Ok(pid), Ok(addr)) => {
                    read_process(pid, addr, &mut got).is_ok() && u64::from_ne_bytes(got) == PROBE ^ peer as u64
                }
                _ => false,
            }
        });
    let oks = rv.all_gather("iw-shm-cma-ok", if ok { b"1" } else { b"0" })?;
    drop(probe);
    group.set_single_copy(oks.iter().all(|o| o == b"1"));
    Ok(Some(group))
}

const PROBE: u64 = 0x5eed_c0de_0000_0000;

/// Removes a segment file when dropped, unless [`Unlink::keep`] was called: every way out of
/// a failed formation (a round that fails, a mapping that fails) unlinks what it made.
struct Unlink(Option<PathBuf>);

impl Unlink {
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Unlink {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group_of(n: usize, slot: usize) -> (Vec<ShmGroup>, PathBuf) {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("iw-shm-test-{}-{n}-{slot}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = std::fs::remove_file(&path);
        let ok = || -> Health { Box::new(|| Ok(())) };
        let mut v = vec![ShmGroup::create(&path, 0, n, slot, 2, ok()).unwrap()];
        for r in 1..n {
            v.push(ShmGroup::open(&path, r, n, ok()).unwrap());
        }
        std::fs::remove_file(&path).unwrap();
        (v, path)
    }

    #[test]
    fn a_failed_round_leaves_no_segment_behind() {
        use crate::rendezvous::{free_base_port, Rendezvous};
        let cfg = ShmConfig::default();
        if !cfg.dir.is_dir() {
            return;
        }
        let port = free_base_port(1).unwrap();
        let env = move |rank| JobEnv::loopback(rank, 2, port, format!("shm-leak-{port}"));
        let mine = format!("ironweave-shm_leak_{port}-");
        let count = || {
            std::fs::read_dir(&cfg.dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&mine)).count()
        };
        let before = count();
        for round in 0..50 {
            // rank 1 agrees that both share a host, then dies before the segment's path round
            let key = format!("1{}", host_key());
            let peer = std::thread::spawn(move || {
                let mut rv = Rendezvous::connect(&env(1), Duration::from_secs(10)).unwrap();
                rv.all_gather("iw-shm-host", key.as_bytes()).unwrap();
            });
            let mut rv = Rendezvous::connect(&env(0), Duration::from_secs(10)).unwrap();
            let got = join_job(&env(0), &mut rv, &cfg, Box::new(|| Ok(())));
            assert!(got.is_err(), "round {round}: the rendezvous lost rank 1, the formation must fail");
            peer.join().unwrap();
            drop(rv);
        }
        assert_eq!(count(), before, "segments left in {} by 50 failed rounds", cfg.dir.display());
    }

    fn dl() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    #[test]
    fn windows_smaller_than_the_data_reassemble_every_collective() {
        // A 4 KiB slot forces many windows and both buffers through every algorithm.
        for n in [2, 3, 4] {
            let (gs, _) = group_of(n, 4096);
            std::thread::scope(|s| {
                for g in &gs {
                    s.spawn(move || {
                        let g = g.channel(7).unwrap();
                        let r = g.rank();
                        let count = 5000 + 3;
                        let mut v: Vec<f32> = (0..count).map(|i| (i % 97) as f32 + r as f32).collect();
                        g.all_reduce(bytemuck::cast_slice_mut(&mut v), DType::F32, ReduceOp::Sum, dl()).unwrap();
                        let want = |i: usize| (n * (i % 97)) as f32 + (n * (n - 1) / 2) as f32;
                        assert!(v.iter().enumerate().all(|(i, &x)| x == want(i)), "all_reduce n={n}");

                        let input: Vec<u8> = (0..10_001).map(|i| (i * 7 + r) as u8).collect();
                        let mut out = vec![0u8; n * input.len()];
                        g.all_gather(&input, &mut out, dl()).unwrap();
                        for p in 0..n {
                            assert!(out[p * 10_001..(p + 1) * 10_001].iter().enumerate().all(|(i, &x)| x == (i * 7 + p) as u8));
                        }

                        let blocks: Vec<i32> = (0..n * 3001).map(|i| (i as i32) * (r as i32 + 1)).collect();
                        let mut rs = vec![0i32; 3001];
                        g.reduce_scatter(
                            bytemuck::cast_slice(&blocks),
                            bytemuck::cast_slice_mut(&mut rs),
                            DType::I32,
                            ReduceOp::Sum,
                            dl(),
                        )
                        .unwrap();
                        let tri = (n * (n + 1) / 2) as i32;
                        assert!(rs.iter().enumerate().all(|(i, &x)| x == ((r * 3001 + i) as i32) * tri));

                        let mut bc: Vec<u8> = if r == 1 { (0..9000).map(|i| i as u8).collect() } else { vec![0; 9000] };
                        g.broadcast(&mut bc, 1, dl()).unwrap();
                        assert!(bc.iter().enumerate().all(|(i, &x)| x == i as u8));

                        // Rank q sends q + 1 + p bytes of value q to rank p.
                        let lens: Vec<usize> = (0..n).map(|p| (r + 1 + p) * 1500).collect();
                        let mut so = Vec::new();
                        let mut at = 0;
                        for &l in &lens {
                            so.push(at..at + l);
                            at += l;
                        }
                        let send = vec![r as u8; at];
                        let rl: Vec<usize> = (0..n).map(|q| (q + 1 + r) * 1500).collect();
                        let mut ro = Vec::new();
                        let mut at = 0;
                        for &l in &rl {
                            ro.push(at..at + l);
                            at += l;
                        }
                        let mut recv = vec![0xffu8; at];
                        g.all_to_all_v(&send, &so, &mut recv, &ro, dl()).unwrap();
                        for (q, rr) in ro.iter().enumerate() {
                            assert!(recv[rr.clone()].iter().all(|&x| x == q as u8), "a2a from {q}");
                        }
                        g.barrier(dl()).unwrap();
                    });
                }
            });
        }
    }

    #[test]
    fn single_copy_reads_large_blocks_straight_out_of_the_peers_buffers() {
        for n in [2, 3] {
            let (gs, _) = group_of(n, 4096);
            for g in &gs {
                g.set_single_copy(true);
            }
            std::thread::scope(|s| {
                for g in &gs {
                    s.spawn(move || {
                        let c = g.channel(3).unwrap();
                        let r = g.rank();
                        let m = SINGLE_COPY_MIN + 13;
                        let input: Vec<u8> = (0..m).map(|i| (i * 3 + r) as u8).collect();
                        let mut out = vec![0u8; n * m];
                        c.all_gather(&input, &mut out, dl()).unwrap();
                        for p in 0..n {
                            assert!(out[p * m..(p + 1) * m].iter().enumerate().all(|(i, &x)| x == (i * 3 + p) as u8), "from {p}");
                        }
                        let blk = SINGLE_COPY_MIN + 5;
                        let so: Vec<_> = (0..n).map(|q| q * blk..(q + 1) * blk).collect();
                        let send: Vec<u8> = (0..n * blk).map(|i| ((i / blk) * 16 + r) as u8).collect();
                        let mut recv = vec![0u8; n * blk];
                        c.all_to_all_v(&send, &so, &mut recv, &so, dl()).unwrap();
                        for p in 0..n {
                            assert!(recv[p * blk..(p + 1) * blk].iter().all(|&x| x == (r * 16 + p) as u8), "a2a from {p}");
                        }
                    });
                }
            });
        }
    }

    #[test]
    fn different_sizes_or_operations_are_typed_errors_on_every_rank() {
        let (gs, _) = group_of(2, 4096);
        let errs: Vec<Error> = std::thread::scope(|s| {
            let hs: Vec<_> = gs
                .iter()
                .map(|g| {
                    s.spawn(move || {
                        let g = g.channel(7).unwrap();
                        let mut v = vec![0u8; if g.rank() == 0 { 64 } else { 128 }];
                        g.all_reduce(&mut v, DType::U8, ReduceOp::Sum, dl()).unwrap_err()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Each rank names the other's size, or learns of the other's abort.
        for e in &errs {
            assert!(matches!(e, Error::LengthMismatch { .. } | Error::PeerAborted { .. }), "{e:?}");
        }
        assert!(errs.iter().any(|e| matches!(e, Error::LengthMismatch { .. })), "{errs:?}");
    }

    #[test]
    fn a_peer_that_never_comes_is_a_timeout_naming_it_and_an_abort_reaches_waiters() {
        let (gs, _) = group_of(3, 4096);
        let e = gs[0].channel(1).unwrap().barrier(Instant::now() + Duration::from_millis(100)).unwrap_err();
        match &e {
            Error::Timeout { what, .. } => assert!(what.contains("rank(s) 1, 2"), "{what}"),
            other => panic!("{other:?}"),
        }
        // rank 0 aborted the segment on its way out: the others fail at once, naming it.
        let e = gs[1].channel(1).unwrap().barrier(dl()).unwrap_err();
        assert!(matches!(e, Error::PeerAborted { rank: 0, .. }), "{e:?}");
    }

    #[test]
    fn a_failed_link_stops_a_waiter() {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("iw-shm-health-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let lost: Health = Box::new(|| Err(Error::PeerLost { rank: 1, detail: "socket closed".into() }));
        let g = ShmGroup::create(&path, 0, 2, 4096, 1, lost).unwrap();
        std::fs::remove_file(&path).unwrap();
        let e = g.channel(1).unwrap().barrier(dl()).unwrap_err();
        assert!(matches!(e, Error::PeerLost { rank: 1, .. }), "{e:?}");
    }

    #[test]
    fn channels_are_claimed_once_for_every_rank_and_run_side_by_side() {
        let (gs, _) = group_of(2, 4096);
        // Two communicators claim the two channels; a third finds none, on every rank.
        let (a0, b1) = (gs[0].channel(10).unwrap().ch, gs[1].channel(20).unwrap().ch);
        assert_ne!(a0, b1);
        assert_eq!(gs[1].channel(10).unwrap().ch, a0);
        assert_eq!(gs[0].channel(20).unwrap().ch, b1);
        assert!(gs[0].channel(30).is_none() && gs[1].channel(30).is_none());
        // Collectives on the two channels from two threads per rank at once.
        std::thread::scope(|s| {
            for g in &gs {
                for ctx in [10, 20] {
                    s.spawn(move || {
                        let c = g.channel(ctx).unwrap();
                        for k in 0..50 {
                            let mut v = vec![(ctx + k) as i64 + g.rank() as i64; 3000];
                            c.all_reduce(bytemuck::cast_slice_mut(&mut v), DType::I64, ReduceOp::Sum, dl()).unwrap();
                            assert!(v.iter().all(|&x| x == 2 * (ctx + k) as i64 + 1));
                        }
                    });
                }
            }
        });
    }

    #[test]
    fn a_foreign_file_is_refused() {
        let path = std::env::temp_dir().join(format!("iw-shm-foreign-{}", std::process::id()));
        std::fs::write(&path, vec![7u8; 1 << 16]).unwrap();
        let e = ShmGroup::open(&path, 1, 2, Box::new(|| Ok(()))).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(e, Error::Protocol { .. }), "{e:?}");
    }
}

//! Links: one path to the peers, moving tagged bytes point to point.
//!
//! A backend implements [`Link`]. Matching is shared by every backend through [`Mailbox`]:
//! each message carries a sequence number per (peer, tag), assigned when the send is issued,
//! and a receive posted as the k-th on (peer, tag) takes the k-th message, whatever order the
//! bytes arrive in (several connections, several threads).

use ironweave_units::Locked;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crate::error::{Error, Result};

/// A message tag. Communicators put their context id in the upper 32 bits so that
/// sub-groups and collectives never match each other's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(pub u64);

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Ordinary host memory.
    Host,
    /// Memory of an accelerator, by device ordinal.
    Device(u32),
}

impl std::fmt::Display for MemKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemKind::Host => f.write_str("host"),
            MemKind::Device(d) => write!(f, "device {d}"),
        }
    }
}

/// Whether a link's speed figures were measured or only declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpeedSource {
    /// From configuration or a backend's nominal figure.
    Declared,
    /// From a probe run (ping-pong and streaming).
    Measured,
    /// Nothing known; the figures are placeholders the planner must not trust.
    Unknown,
}

/// Name, speed and reach of a link.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkInfo {
    /// Human name, e.g. `tcp:lo` or `tcp:veth-a`.
    pub name: String,
    /// Which backend drives it (`tcp`, `inproc`, ...).
    pub backend: &'static str,
    /// Bandwidth in bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// One-way latency of a small message in seconds.
    pub latency_s: f64,
    /// Where the figures come from.
    pub speed_source: SpeedSource,
    /// Memory kinds this link can read and write.
    pub memory: Vec<MemKind>,
}

impl LinkInfo {
    /// True when the link can move buffers living in `mem`.
    pub fn can_touch(&self, mem: MemKind) -> bool {
        self.memory.contains(&mem)
    }
}

/// A received message: one or more parts that together cover `len` bytes in order
/// (a message striped over several connections arrives as one part per connection).
#[derive(Debug, Default)]
pub struct RecvBuf {
    parts: Vec<(usize, Vec<u8>)>,
    len: usize,
    /// The bytes were written straight into the receiver's landing zone; `parts` is empty.
    landed: bool,
    pool: Option<Arc<BufPool>>,
}

impl Drop for RecvBuf {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            for (_, v) in self.parts.drain(..) {
                pool.put(v);
            }
        }
    }
}

impl RecvBuf {
    /// A message made of one contiguous buffer.
    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        RecvBuf { parts: vec![(0, v)], len, landed: false, pool: None }
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length message.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when the bytes already sit in the landing zone given to
    /// [`Mailbox::post_into`] (or [`Link::irecv_into`]); there is nothing to copy.
    pub fn is_landed(&self) -> bool {
        self.landed
    }

    /// The parts in order, each with its offset in the message.
    pub fn parts(&self) -> impl Iterator<Item = (usize, &[u8])> {
        self.parts.iter().map(|(o, p)| (*o, p.as_slice()))
    }

    /// Copies the message into `dst`, which must be exactly as long (a landed message has
    /// no bytes here: check [`RecvBuf::is_landed`] first).
    pub fn copy_to(&self, dst: &mut [u8]) {
        debug_assert!(!self.landed, "copy_to on a landed message");
        assert_eq!(dst.len(), self.len, "RecvBuf::copy_to: length mismatch (callers check first)");
        for (off, p) in &self.parts {
            dst[*off..*off + p.len()].copy_from_slice(p);
        }
    }

    /// The message as one vector (no copy when it arrived in one part).
    pub fn into_vec(mut self) -> Vec<u8> {
        if self.parts.len() == 1 {
            self.pool = None;
            return self.parts.pop().map(|(_, v)| v).unwrap_or_default();
        }
        let mut v = vec![0u8; self.len];
        self.copy_to(&mut v);
        v
    }
}

/// Recycles receive buffers: fresh large allocations cost a page fault per 4 KiB (the kernel
/// zeroes every page), which on loopback costs as much as the transfer itself.
#[derive(Debug, Default)]
pub struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
}

impl BufPool {
    const MIN: usize = 64 * 1024;
    const MAX_BUFFERS: usize = 64;
    const MAX_BYTES: usize = 512 << 20;

    /// A vector of exactly `len` bytes whose contents are unspecified (old data of a recycled
    /// buffer, or zeros): callers overwrite all of it. Recycled buffers are not zeroed again.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= Self::MIN {
            let mut free = self.free.locked();
            // Best fit among buffers no more than twice as large.
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, v)| v.capacity() >= len && v.capacity() <= len.saturating_mul(2))
                .min_by_key(|(_, v)| v.capacity())
                .map(|(i, _)| i);
            if let Some(i) = best {
                let mut v = free.swap_remove(i);
                if v.len() >= len {
                    v.truncate(len);
                } else {
                    v.resize(len, 0);
                }
                return v;
            }
        }
        vec![0u8; len]
    }

    /// Gives a buffer back for reuse (small ones and overflow are freed).
    pub fn put(&self, v: Vec<u8>) {
        if v.capacity() < Self::MIN {
            return;
        }
        let mut free = self.free.locked();
        let held: usize = free.iter().map(Vec::capacity).sum();
        if free.len() < Self::MAX_BUFFERS && held + v.capacity() <= Self::MAX_BYTES {
            free.push(v);
        }
    }
}

/// Operations a backend with its own collectives (NCCL) provides. The communicator calls
/// them instead of the point-to-point algorithms for buffers outside host memory, on the
/// backend's world group (sub-groups from `split` need the backend's own split, later).
pub trait NativeCollectives: Send + Sync {
    /// In-place all-reduce over the link's whole world.
    fn all_reduce(&self, buf: BufMut<'_>, dtype: crate::DType, op: crate::ReduceOp) -> Result<()>;
    /// Broadcast from world rank `root`.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// All-gather: `output` holds world-size × `input`.
    fn all_gather(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()>;
    /// Reduce-scatter: `input` holds world-size × `output`.
    fn reduce_scatter(&self, input: Buf<'_>, output: BufMut<'_>, dtype: crate::DType, op: crate::ReduceOp) -> Result<()>;
}

/// A device buffer handed through the API untouched (interpreted by a device backend).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlice {
    /// Device pointer.
    pub ptr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Device ordinal.
    pub device: u32,
}

/// A read-only buffer in host or device memory.
#[derive(Debug, Clone, Copy)]
pub enum Buf<'a> {
    /// Host bytes.
    Host(&'a [u8]),
    /// Device bytes.
    Device(DeviceSlice),
}

impl Buf<'_> {
    /// Where the buffer lives.
    pub fn memory(&self) -> MemKind {
        match self {
            Buf::Host(_) => MemKind::Host,
            Buf::Device(d) => MemKind::Device(d.device),
        }
    }
}

/// A mutable buffer in host or device memory.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// Host bytes.
    Host(&'a mut [u8]),
    /// Device bytes.
    Device(DeviceSlice),
}

impl BufMut<'_> {
    /// Where the buffer lives.
    pub fn memory(&self) -> MemKind {
        match self {
            BufMut::Host(_) => MemKind::Host,
            BufMut::Device(d) => MemKind::Device(d.device),
        }
    }
}

/// One path to the peers. Implemented by every backend.
///
/// Ranks are world ranks of the link. Sends and receives on the same (peer, tag) match in
/// the order they were issued; different tags are independent.
pub trait Link: Send + Sync + std::fmt::Debug {
    /// Name, speed and the memory the link can touch.
    fn info(&self) -> &LinkInfo;
    /// This process's rank in the link's world.
    fn rank(&self) -> usize;
    /// Number of ranks in the link's world.
    fn size(&self) -> usize;
    /// Sends borrowed bytes; returns once the buffer may be reused.
    fn send(&self, peer: usize, tag: Tag, data: &[u8], deadline: Instant) -> Result<()>;
    /// Starts sending an owned buffer; the handle hands it back when done.
    fn isend(&self, peer: usize, tag: Tag, data: Vec<u8>) -> Result<SendHandle>;
    /// Posts a receive; it takes the next message from `peer` on `tag` in issue order.
    fn irecv(&self, peer: usize, tag: Tag) -> Result<RecvHandle>;
    /// Like [`Link::irecv`], but the backend may write the message straight into
    /// `dst..dst+len` (saving a copy); the result's [`RecvBuf::is_landed`] says whether it did.
    /// The default ignores the zone.
    ///
    /// # Safety
    /// As for [`Mailbox::post_into`]: the memory stays valid and untouched by anyone else until
    /// the handle is waited on successfully or dropped, and the handle is never leaked.
    unsafe fn irecv_into(&self, peer: usize, tag: Tag, dst: *mut u8, len: usize) -> Result<RecvHandle> {
        let _ = (dst, len);
        self.irecv(peer, tag)
    }
    /// Makes every pending and future operation on this link fail, here and at every peer
    /// (best effort), with `reason`.
    fn abort(&self, reason: &str);
    /// Like [`Link::abort`], for a failure another link of the same communicator saw first (a
    /// lost or aborting peer): a backend that tells its peers about failures passes `cause` on
    /// as it is, so that every rank names the root cause on every link. The default aborts
    /// with its text.
    fn abort_with(&self, cause: &Error) {
        self.abort(&cause.to_string());
    }
    /// Native collectives, for backends that have them.
    fn native_collectives(&self) -> Option<&dyn NativeCollectives> {
        None
    }
    /// Bytes sent to `peer` that the peer has not acknowledged yet (the kernel's send queues
    /// for TCP), where the backend can tell; `None` otherwise. A send returns once its bytes
    /// are handed over, which can be long before they cross a link with a deep queue: this is
    /// how a caller sharing work between links sees how far behind each really is.
    fn unacked_bytes(&self, peer: usize) -> Option<usize> {
        let _ = peer;
        None
    }
}

/// Completion of a non-blocking send. Dropping it does not cancel the send.
#[derive(Debug, Clone)]
pub struct SendHandle {
    inner: Arc<Filled<Vec<u8>>>,
}

/// A result filled once by one thread and taken by another, which may sleep for it. Filling
/// wakes the taker only if it sleeps: a condition variable's notify is a system call even when
/// nobody waits, and most results here are filled before anyone looks.
#[derive(Debug)]
pub(crate) struct Filled<R> {
    /// The result, and how many threads sleep for it.
    slot: Mutex<(Option<Result<R>>, usize)>,
    cv: Condvar,
}

impl<R> Default for Filled<R> {
    fn default() -> Self {
        Filled { slot: Mutex::new((None, 0)), cv: Condvar::new() }
    }
}

impl<R> Filled<R> {
    /// Fills the slot and wakes a sleeping taker.
    pub(crate) fn fill(&self, r: Result<R>) {
        let mut g = self.slot.locked();
        g.0 = Some(r);
        let sleeping = g.1 > 0;
        drop(g);
        if sleeping {
            self.cv.notify_all();
        }
    }

    pub(crate) fn is_filled(&self) -> bool {
        self.slot.locked().0.is_some()
    }

    /// Takes the result once filled, or `Timeout` naming `what` when `deadline` passes first.
    pub(crate) fn take(&self, deadline: Instant, what: &str) -> Result<R> {
        let mut g = self.slot.locked();
        if let Some(r) = g.0.take() {
            return r;
        }
        let start = Instant::now();
        loop {
            if let Some(r) = g.0.take() {
                return r;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { what: what.into(), after: now - start });
            }
            g.1 += 1;
            g = self.cv.wait_timeout(g, deadline - now).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
            g.1 -= 1;
        }
    }
}

/// The producer side of a [`SendHandle`], held by the backend's progress thread.
#[derive(Debug)]
pub struct SendCompleter {
    inner: Arc<Filled<Vec<u8>>>,
}

impl SendCompleter {
    /// Completes the send, handing the buffer (or the error) to the waiter.
    pub fn complete(self, result: Result<Vec<u8>>) {
        self.inner.fill(result);
    }
}

impl SendHandle {
    /// A handle that is already complete.
    pub fn ready(result: Result<Vec<u8>>) -> Self {
        let inner = Arc::new(Filled::default());
        inner.fill(result);
        SendHandle { inner }
    }

    /// A pending handle and the completer that finishes it.
    pub fn pending() -> (SendHandle, SendCompleter) {
        let inner = Arc::new(Filled::default());
        (SendHandle { inner: inner.clone() }, SendCompleter { inner })
    }

    /// True once the send finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.inner.is_filled()
    }

    /// Waits for the send and returns the buffer.
    pub fn wait(self, deadline: Instant) -> Result<Vec<u8>> {
        self.inner.take(deadline, "send")
    }
}

enum Payload {
    Owned(Vec<u8>),
    Borrowed(*const u8, usize),
}

/// A send a caller hands to a backend's progress thread: the bytes (owned, or borrowed from a
/// caller that blocks until completion) and the completer of the caller's [`SendHandle`].
/// Dropping it unfinished completes the handle with an error, so no caller waits for a send
/// that a closing backend discarded.
#[derive(Debug)]
pub struct PendingSend {
    data: Payload,
    done: Option<SendCompleter>,
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Payload::Owned(v) => write!(f, "Owned({} bytes)", v.len()),
            Payload::Borrowed(_, n) => write!(f, "Borrowed({n} bytes)"),
        }
    }
}

// SAFETY: the only non-Send part is the pointer of a borrowed send, whose caller blocks until
// the send completes (see `PendingSend::borrowed`).
unsafe impl Send for PendingSend {}

impl PendingSend {
    /// A send of an owned buffer (returned through the handle when done).
    pub fn owned(data: Vec<u8>) -> (PendingSend, SendHandle) {
        let (h, c) = SendHandle::pending();
        (PendingSend { data: Payload::Owned(data), done: Some(c) }, h)
    }

    /// A send of borrowed bytes.
    ///
    /// # Safety
    /// `data` must stay valid and unchanged until the handle completes: the caller waits for it
    /// (and, on a deadline, aborts the link and waits again, see [`wait_blocking_send`]).
    pub unsafe fn borrowed(data: &[u8]) -> (PendingSend, SendHandle) {
        let (h, c) = SendHandle::pending();
        (PendingSend { data: Payload::Borrowed(data.as_ptr(), data.len()), done: Some(c) }, h)
    }

    /// A send nobody waits for (control messages).
    pub fn detached(data: Vec<u8>) -> PendingSend {
        PendingSend { data: Payload::Owned(data), done: None }
    }

    /// The bytes to send.
    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            Payload::Owned(v) => v,
            // SAFETY: valid until completion by `borrowed`'s contract; completion consumes self.
            Payload::Borrowed(p, n) => unsafe { std::slice::from_raw_parts(*p, *n) },
        }
    }

    /// Completes the caller's handle (owned buffers go back to it).
    pub fn finish(mut self, result: Result<()>) {
        if let Some(c) = self.done.take() {
            let data = std::mem::replace(&mut self.data, Payload::Owned(Vec::new()));
            c.complete(result.map(|()| match data {
                Payload::Owned(v) => v,
                Payload::Borrowed(..) => Vec::new(),
            }));
        }
    }
}

impl Drop for PendingSend {
    fn drop(&mut self) {
        if let Some(c) = self.done.take() {
            c.complete(Err(Error::Aborted { reason: "the link closed before the send was issued".into() }));
        }
    }
}

/// Joins a backend's thread if it finishes by `until` (polling; a thread stuck in a driver
/// call is left behind rather than hanging the caller).
pub fn join_until(t: std::thread::JoinHandle<()>, until: Instant) {
    while !t.is_finished() && Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    if t.is_finished() {
        let _ = t.join();
    }
}

/// Waits for a blocking send handed to a progress thread. On the deadline it aborts the link
/// (`abort`), which makes the backend cancel the send, and waits (up to `grace` more) for the
/// backend to let go of the caller's bytes before reporting the timeout.
pub fn wait_blocking_send(h: SendHandle, deadline: Instant, grace: std::time::Duration, abort: impl FnOnce()) -> Result<()> {
    match h.clone().wait(deadline) {
        Ok(_) => Ok(()),
        Err(e @ Error::Timeout { .. }) => {
            abort();
            let _ = h.wait(Instant::now() + grace);
            Err(e)
        }
        Err(e) => Err(e),
    }
}

/// A posted receive. Dropping it without waiting discards the matching message when it comes.
#[derive(Debug)]
pub struct RecvHandle {
    mailbox: Arc<Mailbox>,
    src: usize,
    tag: Tag,
    seq: u64,
    done: bool,
}

impl RecvHandle {
    /// Waits for the message.
    pub fn wait(mut self, deadline: Instant) -> Result<RecvBuf> {
        let r = self.mailbox.wait(self.src, self.tag, self.seq, deadline);
        self.done = r.is_ok();
        r
    }

    /// Waits until `deadline` without giving the receive up: `Ok(None)` if the message has not
    /// arrived by then (the receive stays posted; poll again), the message when it has, or the
    /// link's failure. For service threads that must notice a stop request while idle.
    pub fn poll_until(&mut self, deadline: Instant) -> Result<Option<RecvBuf>> {
        if self.done {
            return Err(Error::InvalidArgument("this receive has already completed".into()));
        }
        match self.mailbox.wait(self.src, self.tag, self.seq, deadline) {
            Ok(b) => {
                self.done = true;
                Ok(Some(b))
            }
            Err(Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// True when the message has fully arrived (a `wait` would not block).
    pub fn is_ready(&self) -> bool {
        self.mailbox.is_complete(self.src, self.tag, self.seq)
    }

    /// The peer this receive is from.
    pub fn peer(&self) -> usize {
        self.src
    }
}

impl Drop for RecvHandle {
    fn drop(&mut self) {
        if !self.done {
            self.mailbox.abandon(self.src, self.tag, self.seq);
        }
    }
}

/// A hasher for the small integer keys of the mailbox and the sequence tables (ranks, tags,
/// sequence numbers). SipHash's defence against chosen keys buys nothing for keys from
/// authenticated peers and cost about a tenth of an 8-byte message's CPU time.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IntHasher(u64);

impl IntHasher {
    fn add(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl std::hash::Hasher for IntHasher {
    fn finish(&self) -> u64 {
        // Fold the high bits down: tags differ mostly in their upper half (the context id),
        // and the table picks buckets by the low bits.
        let x = self.0 ^ (self.0 >> 29);
        x.wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (x >> 32)
    }
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            self.add(u64::from_le_bytes(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.add(x);
    }
    fn write_usize(&mut self, x: usize) {
        self.add(x as u64);
    }
}

/// A hash map over [`IntHasher`].
pub(crate) type IntMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IntHasher>>;

/// Per (peer, tag) send sequence numbers. Backends call [`SeqTable::next`] when a send is issued.
#[derive(Debug, Default)]
pub struct SeqTable {
    next: Mutex<IntMap<(usize, Tag), u64>>,
}

impl SeqTable {
    /// The sequence number of the next message to `peer` on `tag`.
    pub fn next(&self, peer: usize, tag: Tag) -> u64 {
        let mut m = self.next.locked();
        let e = m.entry((peer, tag)).or_insert(0);
        let s = *e;
        *e += 1;
        s
    }
}

#[derive(Debug, Default)]
struct Partial {
    total: usize,
    got: usize,
    frames: usize,
    parts: Vec<(usize, Vec<u8>)>,
    /// Bytes of `parts` counted against the mailbox's budget.
    buffered: usize,
    abandoned: bool,
    /// Where the receiver wants the bytes written directly (address, length).
    zone: Option<(usize, usize)>,
    /// Ranges of the zone handed to writers so far (never overlapping).
    claimed: Vec<(usize, usize)>,
    /// Writers currently writing into the zone.
    writers: usize,
    /// The message goes (or went) to the zone rather than to `parts`.
    landed: bool,
    /// A part was turned away from landing: the whole message takes the buffered path (a
    /// zone posted later must not receive the other parts, or the two halves would split).
    buffering: bool,
}

impl Partial {
    fn complete(&self) -> bool {
        self.frames > 0 && self.got == self.total
    }

    /// Where a message of `total` bytes may be written straight: the posted zone, if it is of
    /// exactly that length, still wanted, and the message has not taken the buffered path.
    fn zone_for(&self, total: usize) -> Option<usize> {
        self.zone.filter(|&(_, zlen)| zlen == total && !self.abandoned && !self.buffering).map(|(base, _)| base)
    }
}

#[derive(Debug, Default)]
struct TagQueue {
    next_claim: u64,
    msgs: IntMap<u64, Partial>,
}

#[derive(Debug)]
struct MbState {
    queues: IntMap<(usize, Tag), TagQueue>,
    fatal: Option<Error>,
    goodbyes: Vec<usize>,
    buffered: usize,
    /// Threads asleep on `cv` and on `space`: notifying a condition variable is a system call
    /// even when nobody sleeps, so changes notify only when someone does.
    sleepers: usize,
    space_sleepers: usize,
}

/// The receive side shared by all backends: matching, reassembly, bounded buffering,
/// failure propagation to every waiter.
#[derive(Debug)]
pub struct Mailbox {
    me: usize,
    size: usize,
    pool: Arc<BufPool>,
    goodbyes_needed: usize,
    cap_bytes: usize,
    state: Mutex<MbState>,
    cv: Condvar,
    space: Condvar,
    on_post: std::sync::OnceLock<PostHook>,
    progress: std::sync::OnceLock<ProgressHook>,
    /// Set when the mailbox fails: the send path's check needs no lock.
    failed: std::sync::atomic::AtomicBool,
}

/// Called after every receive is posted (see [`Mailbox::set_on_post`]).
struct PostHook(Box<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for PostHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PostHook")
    }
}

/// A backend driven by the threads that wait on its mailbox (MPI-style progress): see
/// [`Mailbox::set_progress_driver`].
pub trait Progress: Send + Sync {
    /// A waiter starts driving the backend (before its first [`Progress::poll`]).
    fn begin(&self) {}
    /// One round of progress; returns whether anything happened.
    fn poll(&self) -> bool;
    /// The waiter stops driving: it has its message or failed (`to_sleep` false), or it is
    /// about to sleep until the backend's own threads deliver (`to_sleep` true). Called once
    /// per `begin`.
    fn end(&self, to_sleep: bool) {
        let _ = to_sleep;
    }
}

/// A closure as a [`Progress`] without begin or end.
struct PollFn(Box<dyn Fn() -> bool + Send + Sync>);

impl Progress for PollFn {
    fn poll(&self) -> bool {
        (self.0)()
    }
}

/// Drives the backend from a waiting thread (see [`Mailbox::set_progress_driver`]).
struct ProgressHook(Box<dyn Progress>);

impl std::fmt::Debug for ProgressHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProgressHook")
    }
}

/// Ends a waiter's driving of the backend on every way out of the wait.
struct Driving<'a> {
    hook: Option<&'a ProgressHook>,
}

impl Driving<'_> {
    fn stop(&mut self, to_sleep: bool) {
        if let Some(h) = self.hook.take() {
            h.0.end(to_sleep);
        }
    }
}

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        self.stop(false);
    }
}

/// How long a waiter keeps driving a backend's progress hook without anything happening
/// before it sleeps on the condition variable (the backend's own thread then delivers).
pub const PROGRESS_SPIN: std::time::Duration = std::time::Duration::from_micros(200);

thread_local! {
    static BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as a background receiver (a checkpoint replica or acknowledgement
/// thread): its waits never drive the backend's progress hook — no polling of the sockets, no
/// [`PROGRESS_SPIN`] — but sleep at once until the backend's own threads deliver. A waiter that
/// polls saves a thread hand-off per message, worth it on a training collective's critical
/// path; a thread that waits most of its life would spend the training cores on it.
pub fn set_background_thread(on: bool) {
    BACKGROUND.with(|b| b.set(on));
}

fn is_background_thread() -> bool {
    BACKGROUND.with(std::cell::Cell::get)
}

impl Mailbox {
    /// Installs `f`, called (without the mailbox lock) after each receive is posted: a
    /// backend whose progress thread holds rendezvous messages until their receive is posted
    /// uses it to wake that thread. Only the first hook installed is kept.
    pub fn set_on_post(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_post.set(PostHook(f));
    }

    /// Installs `f`, which a waiting receiver calls (without the mailbox lock) to drive the
    /// backend itself instead of sleeping until a progress thread delivers: MPI-style progress
    /// in the waiting thread saves the thread hand-offs on every message. `f` returns whether
    /// anything happened; after [`PROGRESS_SPIN`] without progress the waiter sleeps. Only the
    /// first hook installed is kept.
    pub fn set_progress(&self, f: Box<dyn Fn() -> bool + Send + Sync>) {
        self.set_progress_driver(Box::new(PollFn(f)));
    }

    /// Like [`Mailbox::set_progress`], for a backend that needs to know when waiters start and
    /// stop driving it (for example to keep its own threads out of the way meanwhile).
    pub fn set_progress_driver(&self, d: Box<dyn Progress>) {
        let _ = self.progress.set(ProgressHook(d));
    }

    fn posted_hook(&self) {
        if let Some(h) = self.on_post.get() {
            (h.0)();
        }
    }

    /// A mailbox for rank `me` of `size`; a peer counts as closed after `goodbyes_needed`
    /// goodbyes (one per connection); at most `cap_bytes` of unconsumed data are buffered
    /// (a single larger message is still accepted when nothing else is buffered).
    pub fn new(me: usize, size: usize, goodbyes_needed: usize, cap_bytes: usize) -> Self {
        Mailbox {
            me,
            size,
            pool: Arc::default(),
            goodbyes_needed: goodbyes_needed.max(1),
            cap_bytes,
            state: Mutex::new(MbState {
                queues: HashMap::default(),
                fatal: None,
                goodbyes: vec![0; size],
                buffered: 0,
                sleepers: 0,
                space_sleepers: 0,
            }),
            cv: Condvar::new(),
            space: Condvar::new(),
            on_post: std::sync::OnceLock::new(),
            progress: std::sync::OnceLock::new(),
            failed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// `RankOutOfRange` unless `peer` is a rank of this mailbox's world.
    pub fn check_rank(&self, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::RankOutOfRange { rank: peer, size: self.size });
        }
        Ok(())
    }

    /// [`Mailbox::check_rank`], then the mailbox's failure if it failed: what a backend checks
    /// before it starts a send.
    pub fn check_peer(&self, peer: usize) -> Result<()> {
        self.check_rank(peer)?;
        if !self.failed.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        self.failure().map_or(Ok(()), Err)
    }

    /// Backend side: message `seq` from `src` on `tag` arrived whole, as `bytes` the backend
    /// still owns: copied straight into its posted landing zone when there is one (and of its
    /// length), else into a buffer. Under one lock what `land`/`land_done` or
    /// `reserve`/`deliver` take two for — small messages, such as UCX's eager ones. The buffered
    /// bytes count against the budget without waiting for it.
    pub fn deliver_copy(&self, src: usize, tag: Tag, seq: u64, bytes: &[u8]) -> Result<()> {
        let len = bytes.len();
        let mut st = self.state.locked();
        let stp = &mut *st;
        let q = stp.queues.entry((src, tag)).or_default();
        let p = q.msgs.entry(seq).or_default();
        if p.frames > 0 || p.landed || p.buffering {
            return Err(Error::Protocol {
                from: format!("rank {src}"),
                detail: format!("message {seq} on tag {:#x} arrived twice", tag.0),
            });
        }
        p.total = len;
        p.got = len;
        p.frames = 1;
        match p.zone_for(len) {
            Some(base) => {
                // SAFETY: the zone was granted by `post_into`, whose caller keeps `len` bytes at
                // `base` valid and untouched until its handle completes or is dropped; both
                // need this lock, which we hold, and no other writer exists (the message came
                // whole, once).
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), base as *mut u8, len) };
                p.landed = true;
            }
            None => {
                p.buffering = true;
                if len > 0 {
                    let mut v = self.pool.take(len);
                    v.copy_from_slice(bytes);
                    p.parts.push((0, v));
                    p.buffered += len;
                    stp.buffered += len;
                }
                if p.abandoned {
                    stp.buffered -= p.buffered;
                    q.msgs.remove(&seq);
                }
            }
        }
        if stp.sleepers > 0 {
            self.cv.notify_all();
        }
        Ok(())
    }

    /// Delivers a whole message from `src` (reserving its bytes first): a send to oneself, or
    /// a backend that moves messages in one piece.
    pub fn deliver_whole(&self, src: usize, tag: Tag, seq: u64, data: Vec<u8>) -> Result<()> {
        let len = data.len();
        self.reserve(len);
        self.deliver(src, tag, seq, len, 0, data)
    }

    /// Posts a receive from `src` on `tag`.
    pub fn post(self: &Arc<Self>, src: usize, tag: Tag) -> RecvHandle {
        let mut st = self.state.locked();
        let q = st.queues.entry((src, tag)).or_default();
        let seq = q.next_claim;
        q.next_claim += 1;
        drop(st);
        self.posted_hook();
        RecvHandle { mailbox: self.clone(), src, tag, seq, done: false }
    }

    /// A buffer of `len` bytes to receive into (contents unspecified), recycled when possible.
    pub fn buffer(&self, len: usize) -> Vec<u8> {
        self.pool.take(len)
    }

    /// Reserves `len` more bytes of buffering if that needs no wait: `Some(true)` when
    /// reserved, `None` when the budget is full (try again later, or [`Mailbox::reserve`] from
    /// a thread that may block), `Some(false)` when the mailbox failed.
    pub fn try_reserve(&self, len: usize) -> Option<bool> {
        let mut st = self.state.locked();
        if st.fatal.is_some() {
            return Some(false);
        }
        if st.buffered > 0 && st.buffered + len > self.cap_bytes {
            return None;
        }
        st.buffered += len;
        Some(true)
    }

    /// Waits until `len` more bytes may be buffered. Returns `false` when the mailbox failed.
    pub fn reserve(&self, len: usize) -> bool {
        let mut st = self.state.locked();
        while st.fatal.is_none() && st.buffered > 0 && st.buffered + len > self.cap_bytes {
            st.space_sleepers += 1;
            st = self.space.wait(st).unwrap_or_else(|e| e.into_inner());
            st.space_sleepers -= 1;
        }
        st.buffered += len;
        st.fatal.is_none()
    }

    /// Adds one received part of message `seq` from `src` on `tag` (already reserved).
    pub fn deliver(&self, src: usize, tag: Tag, seq: u64, total: usize, offset: usize, data: Vec<u8>) -> Result<()> {
        let mut st = self.state.locked();
        let st = &mut *st;
        let len = data.len();
        let bad = |detail: String| Error::Protocol { from: format!("rank {src}"), detail };
        if offset.checked_add(len).is_none_or(|end| end > total) {
            return Err(bad(format!("part at {offset}+{len} overruns a {total}-byte message")));
        }
        let q = st.queues.entry((src, tag)).or_default();
        let p = q.msgs.entry(seq).or_default();
        if p.frames == 0 {
            p.total = total;
        }
        if p.total != total || p.got + len > total {
            return Err(bad(format!("message {seq} on tag {:#x}: parts disagree on its length", tag.0)));
        }
        p.got += len;
        p.frames += 1;
        if p.landed {
            // The rest of a landed message whose zone was withdrawn: count it, drop it.
            st.buffered -= len;
        } else if len > 0 {
            p.buffered += len;
            p.parts.push((offset, data));
        }
        if p.complete() && p.abandoned {
            st.buffered -= p.buffered;
            q.msgs.remove(&seq);
            if st.space_sleepers > 0 {
                self.space.notify_all();
            }
        }
        if st.sleepers > 0 {
            self.cv.notify_all();
        }
        Ok(())
    }

    /// Posts a receive whose bytes may be written by the backend straight into `dst..dst+len`
    /// (the message must then be exactly `len` bytes; otherwise it is buffered as usual and
    /// the wait reports its real length). The handle's [`RecvBuf::is_landed`] says which
    /// happened.
    ///
    /// # Safety
    /// `dst..dst+len` must be valid for writes and neither read nor written by anyone else
    /// until the handle has been waited on successfully or dropped; the handle must not be
    /// leaked (`mem::forget`), since dropping it is what withdraws the zone and waits for a
    /// writer in progress.
    pub unsafe fn post_into(self: &Arc<Self>, src: usize, tag: Tag, dst: *mut u8, len: usize) -> RecvHandle {
        let mut st = self.state.locked();
        let q = st.queues.entry((src, tag)).or_default();
        let seq = q.next_claim;
        q.next_claim += 1;
        let p = q.msgs.entry(seq).or_default();
        // A message that already started on the buffered path stays there.
        if !p.buffering && !p.landed && p.frames == 0 {
            p.zone = Some((dst as usize, len));
        }
        drop(st);
        self.posted_hook();
        RecvHandle { mailbox: self.clone(), src, tag, seq, done: false }
    }

    /// Backend side: asks where to write `len` bytes at `offset` of message `seq` (of `total`
    /// bytes). `Some(ptr)` means: write exactly there, then call [`Mailbox::land_done`];
    /// `None` means: buffer the part and [`Mailbox::deliver`] it. Overlapping or oversized
    /// parts are a protocol error.
    pub fn land(&self, src: usize, tag: Tag, seq: u64, total: usize, offset: usize, len: usize) -> Result<Option<*mut u8>> {
        let mut st = self.state.locked();
        let p = st.queues.entry((src, tag)).or_default().msgs.entry(seq).or_default();
        let Some(base) = p.zone_for(total) else {
            if !p.landed {
                // Decided under the lock: this message is buffered, whatever is posted later.
                p.buffering = true;
            }
            return Ok(None);
        };
        let end = offset.checked_add(len).filter(|&e| e <= total);
        let end = end.ok_or_else(|| Error::Protocol {
            from: format!("rank {src}"),
            detail: format!("part {offset}+{len} overruns {total}"),
        })?;
        if len > 0 && p.claimed.iter().any(|&(a, b)| offset < b && a < end) {
            return Err(Error::Protocol {
                from: format!("rank {src}"),
                detail: format!("part {offset}..{end} of message {seq} overlaps another"),
            });
        }
        p.claimed.push((offset, end));
        p.total = total;
        p.landed = true;
        p.writers += 1;
        Ok(Some((base + offset) as *mut u8))
    }

    /// Backend side: a write granted by [`Mailbox::land`] finished (`ok`) or failed.
    pub fn land_done(&self, src: usize, tag: Tag, seq: u64, len: usize, ok: bool) {
        let mut st = self.state.locked();
        if let Some(p) = st.queues.get_mut(&(src, tag)).and_then(|q| q.msgs.get_mut(&seq)) {
            p.writers -= 1;
            if ok {
                p.got += len;
                p.frames += 1;
            }
        }
        let sleeping = st.sleepers > 0;
        drop(st);
        if sleeping {
            self.cv.notify_all();
        }
    }

    /// Whether the receive that will take message `seq` from `src` on `tag` has been posted:
    /// `None` if not yet, `Some(true)` if it offers a landing zone, `Some(false)` if it takes
    /// a buffered message. Backends with a rendezvous protocol use it to fetch the data when
    /// its destination is known (straight into the zone) instead of buffering it first.
    pub fn posted(&self, src: usize, tag: Tag, seq: u64) -> Option<bool> {
        let st = self.state.locked();
        let q = st.queues.get(&(src, tag))?;
        if q.next_claim <= seq {
            return None;
        }
        Some(q.msgs.get(&seq).is_some_and(|p| p.zone.is_some() && !p.abandoned))
    }

    fn is_complete(&self, src: usize, tag: Tag, seq: u64) -> bool {
        let st = self.state.locked();
        st.queues.get(&(src, tag)).and_then(|q| q.msgs.get(&seq)).is_some_and(Partial::complete)
    }

    fn abandon(&self, src: usize, tag: Tag, seq: u64) {
        let mut st = self.state.locked();
        loop {
            let Some(q) = st.queues.get_mut(&(src, tag)) else { return };
            let p = q.msgs.entry(seq).or_default();
            // Withdraw the landing zone; a writer already inside it must finish first (the
            // caller's memory is released when we return). Writers are bounded: a failed or
            // aborted link shuts its sockets, which ends any read in progress.
            p.zone = None;
            p.abandoned = true;
            if p.writers > 0 {
                st.sleepers += 1;
                st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                st.sleepers -= 1;
                continue;
            }
            if p.complete() {
                let b = p.buffered;
                q.msgs.remove(&seq);
                st.buffered -= b;
                if st.space_sleepers > 0 {
                    self.space.notify_all();
                }
            }
            return;
        }
    }

    fn wait(&self, src: usize, tag: Tag, seq: u64, deadline: Instant) -> Result<RecvBuf> {
        // The clock is read lazily: not at all for a message that is already there, and every
        // few rounds only while driving the backend (clock reads showed at a sixth of an 8-byte
        // message's CPU time when read on every round).
        let mut start: Option<Instant> = None;
        let mut last_progress = deadline;
        let mut progressed = false;
        let (mut now, mut rounds) = (deadline, 0u32);
        // Declared before the lock guard, so that a driver's `end` runs after it is released.
        let mut driving = Driving { hook: None };
        let mut st = self.state.locked();
        loop {
            if let Some(q) = st.queues.get_mut(&(src, tag)) {
                if q.msgs.get(&seq).is_some_and(|p| p.complete() && p.writers == 0) {
                    let mut p = q.msgs.remove(&seq).unwrap_or_default();
                    st.buffered -= p.buffered;
                    if st.space_sleepers > 0 {
                        self.space.notify_all();
                    }
                    p.parts.sort_unstable_by_key(|(o, _)| *o);
                    return Ok(RecvBuf {
                        parts: std::mem::take(&mut p.parts),
                        len: p.total,
                        landed: p.landed,
                        pool: Some(self.pool.clone()),
                    });
                }
            }
            if let Some(e) = &st.fatal {
                return Err(e.clone());
            }
            if st.goodbyes.get(src).is_some_and(|&g| g >= self.goodbyes_needed) {
                return Err(Error::PeerClosed { rank: src, me: self.me });
            }
            if driving.hook.is_none() || rounds % 8 == 0 {
                now = Instant::now();
                let s0 = *start.get_or_insert(now);
                if progressed || last_progress == deadline {
                    last_progress = if progressed { now } else { s0 };
                    progressed = false;
                }
            }
            rounds = rounds.wrapping_add(1);
            if now >= deadline {
                let after = now.saturating_duration_since(start.unwrap_or(now));
                return Err(Error::Timeout { what: format!("receive from rank {src}"), after });
            }
            if let Some(p) = self.progress.get().filter(|_| {
                (progressed || now.saturating_duration_since(last_progress) < PROGRESS_SPIN) && !is_background_thread()
            }) {
                drop(st);
                if driving.hook.is_none() {
                    p.0.begin();
                    driving.hook = Some(p);
                }
                if p.0.poll() {
                    progressed = true;
                } else {
                    std::hint::spin_loop();
                }
                st = self.state.locked();
                continue;
            }
            if driving.hook.is_some() {
                // The backend's own threads deliver from here on: let them know first.
                drop(st);
                driving.stop(true);
                st = self.state.locked();
                continue;
            }
            st.sleepers += 1;
            st = self.cv.wait_timeout(st, deadline - now).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
            st.sleepers -= 1;
        }
    }

    /// Records one goodbye from `src` (one per connection).
    pub fn goodbye(&self, src: usize) {
        let mut st = self.state.locked();
        if let Some(g) = st.goodbyes.get_mut(src) {
            *g += 1;
        }
        let sleeping = st.sleepers > 0;
        drop(st);
        if sleeping {
            self.cv.notify_all();
        }
    }

    /// Fails every pending and future receive with `err` (the first failure wins; returns
    /// whether this was it).
    pub fn fail(&self, err: Error) -> bool {
        let mut st = self.state.locked();
        let first = st.fatal.is_none();
        if first {
            st.fatal = Some(err);
            self.failed.store(true, std::sync::atomic::Ordering::Release);
        }
        drop(st);
        self.cv.notify_all();
        self.space.notify_all();
        first
    }

    /// The failure, if the mailbox failed.
    pub fn failure(&self) -> Option<Error> {
        self.state.locked().fatal.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[test]
    fn receives_match_sequence_numbers_not_arrival_order() {
        let mb = Arc::new(Mailbox::new(0, 2, 1, usize::MAX));
        let (a, b) = (mb.post(1, Tag(5)), mb.post(1, Tag(5)));
        mb.deliver(1, Tag(5), 1, 3, 0, b"two".to_vec()).unwrap();
        mb.deliver(1, Tag(5), 0, 3, 0, b"one".to_vec()).unwrap();
        assert_eq!(b.wait(soon()).unwrap().into_vec(), b"two");
        assert_eq!(a.wait(soon()).unwrap().into_vec(), b"one");
    }

    #[test]
    fn parts_reassemble_and_bad_parts_are_protocol_errors() {
        let mb = Arc::new(Mailbox::new(0, 2, 1, usize::MAX));
        let h = mb.post(1, Tag(1));
        mb.deliver(1, Tag(1), 0, 6, 3, b"def".to_vec()).unwrap();
        assert!(!h.is_ready());
        mb.deliver(1, Tag(1), 0, 6, 0, b"abc".to_vec()).unwrap();
        assert_eq!(h.wait(soon()).unwrap().into_vec(), b"abcdef");
        assert!(matches!(mb.deliver(1, Tag(1), 1, 4, 2, b"xyz".to_vec()), Err(Error::Protocol { .. })));
        mb.deliver(1, Tag(1), 2, 4, 0, b"ab".to_vec()).unwrap();
        assert!(matches!(mb.deliver(1, Tag(1), 2, 5, 2, b"cd".to_vec()), Err(Error::Protocol { .. })));
    }

    #[test]
    fn buffering_is_bounded_until_the_consumer_takes_data() {
        let mb = Arc::new(Mailbox::new(0, 2, 1, 100));
        assert!(mb.reserve(60));
        mb.deliver(1, Tag(0), 0, 60, 0, vec![1; 60]).unwrap();
        let second_in = Arc::new(AtomicBool::new(false));
        let (mb2, flag) = (mb.clone(), second_in.clone());
        let t = std::thread::spawn(move || {
            assert!(mb2.reserve(60));
            flag.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!second_in.load(Ordering::SeqCst), "a reader went past the byte budget");
        assert_eq!(mb.post(1, Tag(0)).wait(soon()).unwrap().len(), 60);
        t.join().unwrap();
        assert!(second_in.load(Ordering::SeqCst));
    }

    #[test]
    fn landing_zones_receive_in_place_and_reject_overlaps() {
        let mb = Arc::new(Mailbox::new(0, 2, 1, usize::MAX));
        let mut buf = vec![0u8; 8];
        // SAFETY: `buf` outlives the handle, which is waited on below, and is not touched
        // until then.
        let h = unsafe { mb.post_into(1, Tag(2), buf.as_mut_ptr(), buf.len()) };
        let p = mb.land(1, Tag(2), 0, 8, 4, 4).unwrap().unwrap();
        assert!(matches!(mb.land(1, Tag(2), 0, 8, 2, 4), Err(Error::Protocol { .. })));
        // SAFETY: `land` granted 4 bytes at `p` inside `buf`.
        unsafe { std::ptr::copy_nonoverlapping(b"5678".as_ptr(), p, 4) };
        mb.land_done(1, Tag(2), 0, 4, true);
        let p = mb.land(1, Tag(2), 0, 8, 0, 4).unwrap().unwrap();
        // SAFETY: as above, the first half.
        unsafe { std::ptr::copy_nonoverlapping(b"1234".as_ptr(), p, 4) };
        mb.land_done(1, Tag(2), 0, 4, true);
        let m = h.wait(soon()).unwrap();
        assert!(m.is_landed());
        assert_eq!(buf, b"12345678");
        // A message of another length is buffered, not landed.
        let mut small = vec![0u8; 2];
        // SAFETY: `small` outlives the handle, which is waited on below.
        let h = unsafe { mb.post_into(1, Tag(2), small.as_mut_ptr(), 2) };
        assert!(mb.land(1, Tag(2), 1, 3, 0, 3).unwrap().is_none());
        mb.deliver(1, Tag(2), 1, 3, 0, b"abc".to_vec()).unwrap();
        let m = h.wait(soon()).unwrap();
        assert!(!m.is_landed() && m.len() == 3);
        assert_eq!(small, [0, 0]);
    }

    #[test]
    fn a_failure_reaches_every_waiter() {
        let mb = Arc::new(Mailbox::new(0, 3, 1, usize::MAX));
        let h = mb.post(2, Tag(0));
        let mb2 = mb.clone();
        let t = std::thread::spawn(move || h.wait(soon()));
        assert!(mb.fail(Error::PeerLost { rank: 1, detail: "test".into() }));
        assert!(!mb.fail(Error::Aborted { reason: "later".into() }));
        assert!(matches!(t.join().unwrap(), Err(Error::PeerLost { rank: 1, .. })));
        assert!(matches!(mb2.post(1, Tag(0)).wait(soon()), Err(Error::PeerLost { rank: 1, .. })));
    }
}

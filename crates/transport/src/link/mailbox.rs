//! The [`Mailbox`] every backend's receive side uses: per (peer, tag) sequence numbers assigned
//! when a send is issued, reassembly of parts, landing zones, a byte budget, progress drivers,
//! and the first failure fanned out to every waiter; [`RecvHandle`] is a posted receive.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use ironweave_units::Locked;

use crate::error::{Error, Result};

use super::*;

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

    /// What a backend's [`Link::irecv`](super::Link::irecv) is when its receive side is this
    /// mailbox: the rank checked, then [`Mailbox::post`].
    pub fn irecv(self: &Arc<Self>, src: usize, tag: Tag) -> Result<RecvHandle> {
        self.check_rank(src)?;
        Ok(self.post(src, tag))
    }

    /// What a backend's [`Link::irecv_into`](super::Link::irecv_into) is: the rank checked,
    /// then [`Mailbox::post_into`].
    ///
    /// # Safety
    /// As [`Mailbox::post_into`].
    pub unsafe fn irecv_into(self: &Arc<Self>, src: usize, tag: Tag, dst: *mut u8, len: usize) -> Result<RecvHandle> {
        self.check_rank(src)?;
        // SAFETY: forwarded from the caller (this function's contract is post_into's).
        Ok(unsafe { self.post_into(src, tag, dst, len) })
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

//! The receive side of the TCP links: a frame decoder per connection that any thread may
//! drive, the reader threads that drive it when nobody else does, and the progress driver
//! through which a waiting caller drives it itself.
//!
//! Why: with a reader thread per connection doing the reading, every message needs a second
//! thread to run before its receiver sees it; on a host whose cores are all busy (two ranks on
//! two cores, each spinning on its own receive) that thread waits for a time slice, which is
//! most of a small message's latency. MPI reads its sockets from the thread that waits. Here,
//! a caller waiting on the link's mailbox asks the link's epoll set which connections have
//! bytes and decodes them itself, straight into the landing zone where one is posted; the
//! reader threads stay parked while any caller drives, and take over again (for senders that
//! must not be blocked by a full socket, and for callers that went to sleep) when the last
//! one stops.
//!
//! The decoder reads with `MSG_DONTWAIT` only, so it never blocks while held: a frame can be
//! begun by one thread and finished by another.

use ironweave_units::Locked;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use ironweave_transport::wire::{FrameHeader, FrameKind, HEADER_LEN};
use ironweave_transport::{Error, Progress, Tag};

use crate::Shared;

/// How long a reader thread sleeps in `poll` before it looks at the link again.
const READER_POLL: Duration = Duration::from_millis(100);
/// How long a parked reader thread waits before it checks whether callers still drive.
const PARK_CHECK: Duration = Duration::from_millis(20);

/// Where a connection's decoder is.
enum State {
    /// Reading a frame header.
    Header { buf: [u8; HEADER_LEN], got: usize },
    /// Reading a data payload straight into a landing zone granted by the mailbox.
    Land { h: FrameHeader, ptr: *mut u8, got: usize },
    /// A data frame whose buffering has not been reserved yet (the budget was full).
    Reserve { h: FrameHeader },
    /// Reading a payload into a buffer (data to deliver, or a control frame's body).
    Body { h: FrameHeader, buf: Vec<u8>, got: usize },
}

/// One connection's decoder.
pub(crate) struct RxConn {
    peer: usize,
    stream: TcpStream,
    state: State,
    said_goodbye: bool,
}

// SAFETY: the raw pointer in `State::Land` is a grant of the mailbox (`Mailbox::land`), valid
// until `land_done` is called for it whichever thread reads into it; the grant's owner waits
// for writers before releasing the memory. Everything else is `Send`.
unsafe impl Send for RxConn {}

/// A connection's decoder and whether the connection has ended (closed, failed or garbled:
/// nobody reads it again).
pub(crate) struct Slot {
    conn: Mutex<RxConn>,
    ended: AtomicBool,
    fd: RawFd,
    peer: usize,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Slot(rank {}, ended {})", self.peer, self.ended.load(Ordering::Relaxed))
    }
}

impl Slot {
    pub(crate) fn peer(&self) -> usize {
        self.peer
    }

    /// The connection closed, failed or was garbled: nobody reads it again.
    pub(crate) fn has_ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }

    pub(crate) fn new(peer: usize, stream: TcpStream) -> Self {
        let fd = stream.as_raw_fd();
        Slot {
            conn: Mutex::new(RxConn { peer, stream, state: State::Header { buf: [0; HEADER_LEN], got: 0 }, said_goodbye: false }),
            ended: AtomicBool::new(false),
            fd,
            peer,
        }
    }
}

thread_local! {
    /// The connection whose writer this thread holds while it drives receives (see
    /// [`send_frame`]), by address.
    static HOLDING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// This thread is draining a peer's other connections before blaming it (no nesting).
    static DRAINING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks, for as long as it lives, that this thread holds `c`'s writer.
pub(crate) struct HoldingWriter(usize);

impl HoldingWriter {
    pub(crate) fn new(c: &crate::Conn) -> Self {
        let prev = HOLDING.with(|h| h.replace(std::ptr::from_ref(c) as usize));
        HoldingWriter(prev)
    }

    /// Whether this thread holds `c`'s writer (in the middle of one of its frames).
    pub(crate) fn is_held_here(c: &crate::Conn) -> bool {
        HOLDING.with(|h| h.get()) == std::ptr::from_ref(c) as usize
    }
}

impl Drop for HoldingWriter {
    fn drop(&mut self) {
        HOLDING.with(|h| h.set(self.0));
    }
}

/// Before peer `p` is blamed for a connection that closed without a goodbye: a rank that fails
/// on purpose sends its cause on its other connections before it exits, and one of them may
/// still hold it unread (connections are not ordered with each other). Decodes what they hold.
fn drain_peer(sh: &Shared, p: usize, except: RawFd) {
    if DRAINING.with(|d| d.replace(true)) {
        return;
    }
    for slot in sh.slots.iter().filter(|s| s.peer == p && s.fd != except) {
        // One another thread holds is being decoded by it, cause included.
        if let Ok(mut c) = slot.conn.try_lock() {
            c.pump(sh, &slot.ended, false);
        }
    }
    DRAINING.with(|d| d.set(false));
}

/// What one `recv` gave.
enum Got {
    Bytes(usize),
    /// Nothing to read now.
    Empty,
    /// The peer closed its end.
    Eof,
}

fn recv_some(fd: RawFd, dst: *mut u8, len: usize) -> std::io::Result<Got> {
    loop {
        // SAFETY: `dst..dst+len` is writable memory owned by the caller for this call (a
        // header array, a buffer, or a landing zone granted by the mailbox); MSG_DONTWAIT
        // makes the call return at once.
        let r = unsafe { libc::recv(fd, dst.cast(), len, libc::MSG_DONTWAIT) };
        if r > 0 {
            return Ok(Got::Bytes(r as usize));
        }
        if r == 0 {
            return Ok(if len == 0 { Got::Bytes(0) } else { Got::Eof });
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => return Ok(Got::Empty),
            std::io::ErrorKind::Interrupted => {}
            _ => return Err(e),
        }
    }
}

impl RxConn {
    /// Decodes what the socket holds now, frame after frame, until it would block. `may_block`
    /// allows waiting for buffering budget (a reader thread); a caller leaves a frame that needs
    /// it to the reader threads. Returns whether any byte was read; on a closed, failed or
    /// garbled connection fails the link as the reader always did and marks the slot ended.
    fn pump(&mut self, sh: &Shared, ended: &AtomicBool, may_block: bool) -> bool {
        let mut progress = false;
        let p = self.peer;
        let fd = self.stream.as_raw_fd();
        let lost = |detail: String| {
            if !sh.closing.load(Ordering::SeqCst) {
                drain_peer(sh, p, fd);
                sh.fail_with(Error::PeerLost { rank: p, detail }, Some(p));
            }
        };
        let end = |stream: &TcpStream, shut: bool| {
            ended.store(true, Ordering::SeqCst);
            sh.ready.forget(fd);
            if shut {
                let _ = stream.shutdown(Shutdown::Both);
            }
        };
        loop {
            if ended.load(Ordering::SeqCst) {
                return progress;
            }
            match &mut self.state {
                State::Header { buf, got } => {
                    match recv_some(fd, buf[*got..].as_mut_ptr(), HEADER_LEN - *got) {
                        Ok(Got::Bytes(n)) => {
                            progress = true;
                            *got += n;
                        }
                        Ok(Got::Empty) => return progress,
                        Ok(Got::Eof) => {
                            if !self.said_goodbye {
                                lost("connection closed".into());
                            }
                            end(&self.stream, false);
                            return true;
                        }
                        Err(e) => {
                            if !self.said_goodbye {
                                lost(format!("connection closed: {e}"));
                            }
                            end(&self.stream, false);
                            return true;
                        }
                    }
                    if *got < HEADER_LEN {
                        continue;
                    }
                    // The claimed size passes the receiver's limit (control frames: 4 KiB) before
                    // anything is allocated for it.
                    let h = match FrameHeader::decode(buf, sh.cfg.max_message_bytes) {
                        Ok(h) => h,
                        Err(e) => {
                            sh.fail_with(Error::Protocol { from: format!("rank {p}"), detail: e.to_string() }, Some(p));
                            end(&self.stream, true);
                            return true;
                        }
                    };
                    self.state = if h.kind == FrameKind::Data {
                        // Straight into the receiver's memory when it posted a landing zone.
                        match sh.mailbox.land(p, Tag(h.tag), h.seq, h.total as usize, h.offset as usize, h.len as usize) {
                            Ok(Some(ptr)) => State::Land { h, ptr, got: 0 },
                            Ok(None) => State::Reserve { h },
                            Err(e) => {
                                sh.fail_with(e, Some(p));
                                end(&self.stream, true);
                                return true;
                            }
                        }
                    } else {
                        State::Body { h, buf: vec![0u8; h.len as usize], got: 0 }
                    };
                }
                State::Land { h, ptr, got } => {
                    let len = h.len as usize;
                    if *got < len {
                        // SAFETY: `ptr..ptr+len` was granted by `land` for this frame and stays
                        // valid and ours alone until `land_done` (see `RxConn`'s Send).
                        let at = unsafe { ptr.add(*got) };
                        match recv_some(fd, at, len - *got) {
                            Ok(Got::Bytes(n)) => {
                                progress = true;
                                *got += n;
                            }
                            Ok(Got::Empty) => return progress,
                            Ok(Got::Eof) | Err(_) => {
                                sh.mailbox.land_done(p, Tag(h.tag), h.seq, len, false);
                                lost(format!("connection closed inside a {len}-byte payload"));
                                end(&self.stream, false);
                                return true;
                            }
                        }
                    }
                    if *got == len {
                        sh.mailbox.land_done(p, Tag(h.tag), h.seq, len, true);
                        self.state = State::Header { buf: [0; HEADER_LEN], got: 0 };
                    }
                }
                State::Reserve { h } => {
                    let len = h.len as usize;
                    let reserved = if may_block { Some(sh.mailbox.reserve(len)) } else { sh.mailbox.try_reserve(len) };
                    match reserved {
                        // The budget is full: a reader thread (which may wait) takes it from here.
                        None => return progress,
                        Some(false) => {
                            end(&self.stream, false);
                            return progress;
                        }
                        Some(true) => {
                            let h = *h;
                            // The claimed size passed the receiver's limit and the budget.
                            self.state = State::Body { h, buf: sh.mailbox.buffer(len), got: 0 };
                        }
                    }
                }
                State::Body { h, buf, got } => {
                    let len = buf.len();
                    if *got < len {
                        match recv_some(fd, buf[*got..].as_mut_ptr(), len - *got) {
                            Ok(Got::Bytes(n)) => {
                                progress = true;
                                *got += n;
                            }
                            Ok(Got::Empty) => return progress,
                            Ok(Got::Eof) | Err(_) => {
                                lost(format!("connection closed inside a {len}-byte payload"));
                                end(&self.stream, false);
                                return true;
                            }
                        }
                    }
                    if *got < len {
                        continue;
                    }
                    let h = *h;
                    let body = std::mem::take(buf);
                    self.state = State::Header { buf: [0; HEADER_LEN], got: 0 };
                    match h.kind {
                        FrameKind::Data => {
                            let r = sh.mailbox.deliver(p, Tag(h.tag), h.seq, h.total as usize, h.offset as usize, body);
                            if let Err(e) = r {
                                sh.fail_with(e, Some(p));
                                end(&self.stream, false);
                                return true;
                            }
                        }
                        FrameKind::Goodbye => {
                            self.said_goodbye = true;
                            sh.mailbox.goodbye(p);
                        }
                        FrameKind::Abort => {
                            sh.fail_with(crate::decode_cause(p, &body), None);
                            end(&self.stream, false);
                            return true;
                        }
                    }
                }
            }
        }
    }
}

/// Callers driving the link and the parking place of its reader threads.
#[derive(Default)]
pub(crate) struct Drivers {
    count: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl std::fmt::Debug for Drivers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Drivers({})", self.count.load(Ordering::Relaxed))
    }
}

impl Drivers {
    fn any(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0
    }

    /// A reader thread waits here while callers drive (bounded, so a closing link is seen).
    fn park(&self) {
        let g = self.lock.locked();
        if self.any() {
            let _ = self.cv.wait_timeout(g, PARK_CHECK);
        }
    }

    fn release(&self) {
        let _g = self.lock.locked();
        self.cv.notify_all();
    }
}

/// The connection's reader thread: drives the decoder whenever no caller does.
pub(crate) fn reader(sh: Arc<Shared>, slot: Arc<Slot>) {
    loop {
        if slot.ended.load(Ordering::SeqCst) {
            return;
        }
        if sh.drivers.any() {
            sh.drivers.park();
            continue;
        }
        let mut pfd = libc::pollfd { fd: slot.fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call; the descriptor stays open
        // while the slot lives (the stream is in it).
        let r = unsafe { libc::poll(&mut pfd, 1, READER_POLL.as_millis() as libc::c_int) };
        if r <= 0 {
            continue;
        }
        let mut conn = slot.conn.locked();
        conn.pump(&sh, &slot.ended, true);
    }
}

/// The link's epoll set over its connections: which have bytes to read.
pub(crate) struct Ready {
    epfd: std::os::fd::OwnedFd,
}

impl std::fmt::Debug for Ready {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ready")
    }
}

impl Ready {
    /// An epoll set over `slots` (each registered with its index).
    pub(crate) fn new(slots: &[Arc<Slot>]) -> std::io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain system call; a non-negative result is a new descriptor we own.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by epoll_create1 and is owned by nobody else.
        let epfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        for (i, s) in slots.iter().enumerate() {
            let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: i as u64 };
            // SAFETY: valid epoll descriptor, a socket descriptor kept open by the slot, and
            // an event struct that lives for the call.
            let r = unsafe { libc::epoll_ctl(epfd.as_raw_fd(), libc::EPOLL_CTL_ADD, s.fd, &mut ev) };
            if r != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(Ready { epfd })
    }

    /// Takes an ended connection out of the set (its end of file would stay "readable").
    fn forget(&self, fd: RawFd) {
        // SAFETY: valid epoll descriptor; removing a descriptor that is not (or no longer) in
        // the set is a harmless error.
        let _ = unsafe { libc::epoll_ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }

    /// Sleeps until some connection has bytes to read, at most `timeout`; whether one has.
    fn wait(&self, timeout: Duration) -> bool {
        let mut pfd = libc::pollfd { fd: self.epfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis().max(1) as libc::c_int) };
        r > 0
    }

    /// Indices of the connections with bytes to read now (at most 32).
    fn now(&self, out: &mut [libc::epoll_event; 32]) -> usize {
        // SAFETY: `out` holds 32 writable events; timeout 0 returns at once.
        let n = unsafe { libc::epoll_wait(self.epfd.as_raw_fd(), out.as_mut_ptr(), 32, 0) };
        usize::try_from(n).unwrap_or(0)
    }
}

/// How long a waiting caller polls its sockets (yielding its core between polls) before it
/// sleeps in `epoll_wait` on them. Sleeping at once was measured too: on a host with more ranks
/// than cores (4 on 2) it doubled the 8-byte all-reduce (101 against 46 us), as waking a
/// sleeping thread costs more than the polls.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(100);

thread_local! {
    /// When this thread began driving its current wait.
    static DRIVING_SINCE: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// The progress driver a TCP link installs on its mailbox: a waiting caller decodes the
/// connections that have bytes, parking the reader threads meanwhile.
pub(crate) struct Driver {
    pub(crate) shared: Weak<Shared>,
}

impl Progress for Driver {
    fn begin(&self) {
        if let Some(sh) = self.shared.upgrade() {
            sh.drivers.count.fetch_add(1, Ordering::AcqRel);
            DRIVING_SINCE.with(|c| c.set(Some(Instant::now())));
        }
    }

    fn poll(&self) -> bool {
        let Some(sh) = self.shared.upgrade() else { return false };
        // A connection another thread holds (a reader finishing a frame, another caller) is
        // skipped: that thread delivers.
        if pump_ready(&sh) {
            return true;
        }
        let waited = DRIVING_SINCE.with(|c| c.get()).map_or(Duration::ZERO, |t| t.elapsed());
        if sh.drivers.count.load(Ordering::Acquire) == 1 && waited >= SPIN_BEFORE_SLEEP {
            // The only thread receiving on this link: sleep until its sockets have bytes. The
            // kernel wakes this thread directly (no reader thread in between). A message that
            // another thread delivers (a reader still inside `poll` when this wait began) is
            // seen at the latest when the sleep times out; the timeout grows with the wait.
            let nap = (waited / 8).clamp(Duration::from_millis(1), Duration::from_millis(20));
            if sh.ready.wait(nap) {
                pump_ready(&sh);
            }
            // Keep driving: for as long as it waits, this thread is the link's receiver.
            return true;
        }
        std::thread::yield_now();
        false
    }

    fn end(&self, to_sleep: bool) {
        DRIVING_SINCE.with(|c| c.set(None));
        if let Some(sh) = self.shared.upgrade() {
            let last = sh.drivers.count.fetch_sub(1, Ordering::AcqRel) == 1;
            // A caller that got its message does not wake the readers (the next wait usually
            // follows at once; waking them would put two more threads on the cores between
            // two messages): they notice within PARK_CHECK. One that goes to sleep needs them
            // now.
            if last && to_sleep {
                sh.drivers.release();
            }
        }
    }
}

/// Writes one frame (header and payload in one `sendmsg`, no copy) without ever blocking in the
/// kernel: while the socket cannot take more, this thread drives the link's receive side and
/// waits (bounded by `deadline`) for room or for bytes to read. Two ranks sending to each other
/// at once then also receive at once, from their own threads, as MPI does; nobody depends on a
/// reader thread being scheduled to drain the other's socket.
pub(crate) fn send_frame(
    sh: &Shared,
    s: &TcpStream,
    h: &FrameHeader,
    payload: &[&[u8]],
    deadline: Instant,
) -> std::io::Result<()> {
    let fd = s.as_raw_fd();
    let hdr = h.encode();
    let total = HEADER_LEN + payload.iter().map(|p| p.len()).sum::<usize>();
    let mut sent = 0usize;
    let mut driving = false;
    let r = loop {
        if sent == total {
            break Ok(());
        }
        // what is left of the header and of each part, from `sent` on
        let mut skip = sent;
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(1 + payload.len());
        for p in std::iter::once(&hdr[..]).chain(payload.iter().copied()) {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            let rest = &p[skip..];
            skip = 0;
            iov.push(libc::iovec { iov_base: rest.as_ptr() as *mut libc::c_void, iov_len: rest.len() });
        }
        // SAFETY: a zeroed msghdr is valid; we set only the iovec array and its length.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        // SAFETY: `fd` is the open socket of `s`; the iovecs point into `hdr` and the parts of
        // `payload`, all alive and unmodified for the call (the kernel only reads them).
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n >= 0 {
            sent += n as usize;
            continue;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => {}
            std::io::ErrorKind::WouldBlock => {
                if !driving {
                    sh.drivers.count.fetch_add(1, Ordering::AcqRel);
                    driving = true;
                }
                if let Err(e) = wait_writable(sh, fd, deadline) {
                    break Err(e);
                }
            }
            _ => break Err(e),
        }
    };
    if driving && sh.drivers.count.fetch_sub(1, Ordering::AcqRel) == 1 && r.is_err() {
        sh.drivers.release();
    }
    r
}

/// Waits until `fd` can take bytes, decoding whatever the link's connections receive
/// meanwhile; `TimedOut` at `deadline`.
fn wait_writable(sh: &Shared, fd: RawFd, deadline: Instant) -> std::io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed while the socket was full"));
        }
        let mut fds = [
            libc::pollfd { fd, events: libc::POLLOUT, revents: 0 },
            libc::pollfd { fd: sh.ready.epfd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        let ms = left.as_millis().clamp(1, 100) as libc::c_int;
        // SAFETY: two valid pollfds for the duration of the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            pump_ready(sh);
        }
        if fds[0].revents != 0 {
            // Writable, or failed: the next sendmsg says which.
            return Ok(());
        }
    }
}

/// Decodes every connection of the link that has bytes now (skipping those another thread
/// holds); returns whether any byte was read.
fn pump_ready(sh: &Shared) -> bool {
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 32];
    let n = sh.ready.now(&mut events);
    let mut progress = false;
    for ev in &events[..n] {
        let Some(slot) = sh.slots.get(ev.u64 as usize) else { continue };
        if slot.ended.load(Ordering::SeqCst) {
            continue;
        }
        if let Ok(mut conn) = slot.conn.try_lock() {
            progress |= conn.pump(sh, &slot.ended, false);
        }
    }
    progress
}

//! [`UcxLink`]: one UCX worker (one transport set) moving tagged messages as active messages.
//!
//! Every UCX call runs on the link's progress thread, which owns the context, the worker and
//! the endpoints. Callers hand it commands through a channel and wake it with
//! `ucp_worker_signal`; it progresses the worker, spins briefly after activity and otherwise
//! sleeps on the worker's event descriptor. Messages are active messages whose 20-byte header
//! carries (source rank, tag, sequence number); the receive side feeds the shared [`Mailbox`],
//! so matching is the same as in every other backend. Rendezvous-sized messages are received
//! straight into a posted landing zone when there is one (zero copy), else into a pooled buffer.

use ironweave_units::Locked;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::rc::Rc;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ironweave_transport::{
    join_until, wait_blocking_send, Error, Link, LinkInfo, Mailbox, PendingSend, RecvHandle, Result, SendHandle, SeqTable, Tag,
    PROGRESS_SPIN,
};
use ironweave_ucx_sys as sys;

use crate::ucp::{self, Context, Endpoint, Signal, Worker};

const AM_DATA: u32 = 0;
const AM_BYE: u32 = 1;
const AM_ABORT: u32 = 2;
const HDR: usize = 20;
/// How long a rendezvous message waits for its receive to be posted before it is fetched into
/// a buffer anyway.
const RNDV_GRACE: Duration = Duration::from_millis(20);

/// What one link is: a name and the UCX transports it may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxLinkSpec {
    /// Short name (`shm`, `tcp`); the link is called `ucx:<name>`.
    pub name: String,
    /// Value for `UCX_TLS`; `None` leaves UCX's own choice (and the environment's `UCX_TLS`).
    pub tls: Option<String>,
}

/// Tunables shared by the links of one job.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tuning {
    pub spin: Duration,
    pub linger: Duration,
}

/// A send handed to the progress thread: the active-message header and the bytes.
struct SendOp {
    peer: usize,
    header: [u8; HDR],
    hlen: usize,
    send: PendingSend,
    /// The link's mailbox: a send UCX cancels reports the failure that made the link cancel it.
    mailbox: Arc<Mailbox>,
}

/// The engine behind the shared lock.
struct Core(Engine);

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Core")
    }
}

// SAFETY: the worker runs in UCS_THREAD_MODE_SERIALIZED, and every use of the engine (UCX calls
// and the callbacks they run, which touch the `CbState`) happens under `Shared::core`'s mutex,
// so no two threads ever touch it at once; the `Rc`s inside are never cloned out of it.
unsafe impl Send for Core {}

/// State shared by the API side and the progress thread.
#[derive(Debug)]
struct Shared {
    rank: usize,
    size: usize,
    info: LinkInfo,
    mailbox: Arc<Mailbox>,
    seq: SeqTable,
    /// The engine, once wired; `None` after the link closed. Any thread may drive it.
    core: Mutex<Option<Core>>,
    /// Set by `UcxLink::drop`: the progress thread says goodbye and closes.
    closing: std::sync::atomic::AtomicBool,
    /// Cleared (under the lock) by the progress thread before it destroys the worker.
    signal: Mutex<Option<Signal>>,
    /// Rendezvous messages waiting for their receive (the post hook wakes the thread then).
    held: std::sync::atomic::AtomicUsize,
    /// Callers driving the engine from their waits; the progress thread parks meanwhile.
    drivers: std::sync::atomic::AtomicUsize,
    park: (Mutex<()>, std::sync::Condvar),
}

impl Shared {
    fn wake(&self) {
        if let Some(s) = self.signal.locked().as_ref() {
            // SAFETY: the worker exists while the signal is stored (cleared under this lock
            // before the worker is destroyed).
            unsafe { s.raise() };
        }
    }

    /// Runs `f` on the engine (waiting for the lock); an error when the link is closed.
    fn with_engine<R>(&self, f: impl FnOnce(&mut Engine) -> R) -> Result<R> {
        match self.core.locked().as_mut() {
            Some(c) => Ok(f(&mut c.0)),
            None => Err(self.mailbox.failure().unwrap_or(Error::Aborted { reason: "the UCX link is closed".into() })),
        }
    }

    /// One round of progress from a waiting thread, unless another thread is driving the
    /// engine right now. Returns whether anything happened.
    fn progress_once(&self) -> bool {
        match self.core.try_lock() {
            Ok(mut g) => g.as_mut().is_some_and(|c| c.0.progress()),
            Err(_) => false,
        }
    }

    fn issue(&self, op: SendOp) -> Result<()> {
        // Without an engine the op is dropped here, which fails the caller's handle.
        self.with_engine(|e| e.issue_send(AM_DATA, op))
    }
}

/// How long the parked progress thread waits before it looks at the link again.
const PARK_CHECK: Duration = Duration::from_millis(20);

/// The progress driver on the link's mailbox: a waiting caller drives the engine itself, and
/// the progress thread stays parked while any caller does. Otherwise the thread, asleep on the
/// worker's event descriptor, wakes on every arrival and takes the engine from the caller that
/// was about to find the message itself (one more thread on the cores per message).
struct Driver {
    shared: std::sync::Weak<Shared>,
}

impl ironweave_transport::Progress for Driver {
    fn begin(&self) {
        if let Some(sh) = self.shared.upgrade() {
            sh.drivers.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        }
    }

    fn poll(&self) -> bool {
        self.shared.upgrade().is_some_and(|sh| sh.progress_once())
    }

    fn end(&self, to_sleep: bool) {
        if let Some(sh) = self.shared.upgrade() {
            let last = sh.drivers.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1;
            // One that got its message lets the thread notice by itself (the next wait usually
            // follows at once); one that goes to sleep needs it now.
            if last && to_sleep {
                let _g = sh.park.0.locked();
                sh.park.1.notify_all();
                drop(_g);
                sh.wake();
            }
        }
    }
}

/// One UCX link to every rank of the job.
#[derive(Debug)]
pub struct UcxLink {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    linger: Duration,
    /// The intra-host shared-memory path over this link's world, when the job is on one host.
    shm: std::sync::OnceLock<Arc<ironweave_transport::shm::ShmGroup>>,
}

fn header(src: usize, tag: Tag, seq: u64) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[..4].copy_from_slice(&(src as u32).to_le_bytes());
    h[4..12].copy_from_slice(&tag.0.to_le_bytes());
    h[12..20].copy_from_slice(&seq.to_le_bytes());
    h
}

fn parse_header(h: &[u8], size: usize) -> Result<(usize, Tag, u64)> {
    let bad = |d: String| Error::Protocol { from: "UCX peer".into(), detail: d };
    if h.len() != HDR {
        return Err(bad(format!("active-message header of {} bytes, expected {HDR}", h.len())));
    }
    let src = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    if src >= size {
        return Err(bad(format!("message from rank {src} in a world of {size}")));
    }
    let mut t = [0u8; 8];
    t.copy_from_slice(&h[4..12]);
    let mut s = [0u8; 8];
    s.copy_from_slice(&h[12..20]);
    Ok((src, Tag(u64::from_le_bytes(t)), u64::from_le_bytes(s)))
}

impl UcxLink {
    /// Starts the progress thread for `spec`: returns the half-built link and this worker's
    /// address; [`Wiring::finish`] completes it with every rank's address.
    pub(crate) fn start(spec: &UcxLinkSpec, rank: usize, size: usize, tuning: Tuning) -> Result<(UcxLink, Vec<u8>, Wiring)> {
        let info = LinkInfo {
            name: format!("ucx:{}", spec.name),
            backend: "ucx",
            // Placeholders until a probe measures the link.
            bandwidth_bytes_per_s: if spec.name == "shm" { 5e9 } else { 1.25e9 },
            latency_s: 5e-6,
            speed_source: ironweave_transport::SpeedSource::Unknown,
            memory: vec![ironweave_transport::MemKind::Host],
        };
        let shared = Arc::new(Shared {
            rank,
            size,
            info,
            mailbox: Arc::new(Mailbox::new(rank, size, 1, usize::MAX)),
            seq: SeqTable::default(),
            core: Mutex::new(None),
            closing: std::sync::atomic::AtomicBool::new(false),
            signal: Mutex::new(None),
            held: std::sync::atomic::AtomicUsize::new(0),
            drivers: std::sync::atomic::AtomicUsize::new(0),
            park: (Mutex::new(()), std::sync::Condvar::new()),
        });
        shared.mailbox.set_progress_driver(Box::new(Driver { shared: Arc::downgrade(&shared) }));
        let weak = Arc::downgrade(&shared);
        shared.mailbox.set_on_post(Box::new(move || {
            if let Some(sh) = weak.upgrade() {
                if sh.held.load(std::sync::atomic::Ordering::Acquire) > 0 {
                    sh.wake();
                }
            }
        }));
        let (addr_tx, addr_rx) = mpsc::sync_channel(1);
        let (peers_tx, peers_rx) = mpsc::sync_channel::<Vec<Vec<u8>>>(1);
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (sh, tls, linger) = (shared.clone(), spec.tls.clone(), tuning.linger);
        let thread = std::thread::Builder::new()
            .name(format!("iw-ucx-{}-{rank}", spec.name))
            .spawn(move || progress_thread(sh, tls, tuning, addr_tx, peers_rx, ready_tx))
            .map_err(|e| Error::io("spawn the UCX progress thread", &e))?;
        let link = UcxLink { shared, thread: Mutex::new(Some(thread)), linger, shm: std::sync::OnceLock::new() };
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| Error::Config("the UCX progress thread did not start within 60 s".into()))??;
        Ok((link, addr, Wiring { peers: peers_tx, ready: ready_rx }))
    }
}

/// The second half of link setup: peers' addresses in, readiness out.
#[derive(Debug)]
pub(crate) struct Wiring {
    peers: mpsc::SyncSender<Vec<Vec<u8>>>,
    ready: mpsc::Receiver<Result<()>>,
}

impl Wiring {
    /// Connects to every peer (addresses indexed by rank).
    pub(crate) fn finish(self, addrs: Vec<Vec<u8>>, timeout: Duration) -> Result<()> {
        self.peers.send(addrs).map_err(|_| Error::Config("the UCX progress thread exited during setup".into()))?;
        self.ready.recv_timeout(timeout).map_err(|_| Error::Config("UCX endpoints were not created in time".into()))?
    }
}

impl Link for UcxLink {
    fn info(&self) -> &LinkInfo {
        &self.shared.info
    }

    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn send(&self, peer: usize, tag: Tag, data: &[u8], deadline: Instant) -> Result<()> {
        let sh = &self.shared;
        self.shared.mailbox.check_peer(peer)?;
        let seq = sh.seq.next(peer, tag);
        if peer == sh.rank {
            return self.loopback(tag, seq, data.to_vec());
        }
        if data.len() <= IMMEDIATE_MAX {
            // Most small messages go out at once (UCX's short or eager protocols): without a
            // request, a completion callback or a handle to wait on.
            let hdr = header(sh.rank, tag, seq);
            match sh.with_engine(|e| e.send_now(peer, &hdr, data))? {
                Some(Err(e @ Error::PeerLost { .. })) => return Err(self.cause_of_lost_send(e)),
                Some(r) => return r,
                None => {}
            }
        }
        // SAFETY: we block below until the send completes or the link let go of `data`.
        let (send, h) = unsafe { PendingSend::borrowed(data) };
        sh.issue(SendOp { peer, header: header(sh.rank, tag, seq), hlen: HDR, send, mailbox: sh.mailbox.clone() })?;
        // Drive the engine while the send is in flight (MPI-style), then sleep on the handle.
        // A rendezvous send completes only once the peer has pulled the data, during which
        // nothing happens here: keep polling about as long as the copy takes (4 GB/s).
        let budget = PROGRESS_SPIN + Duration::from_nanos(data.len() as u64 / 4);
        if !h.is_done() {
            let mut last = Instant::now();
            while !h.is_done() && last.elapsed() < budget && Instant::now() < deadline {
                if sh.progress_once() {
                    last = Instant::now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        let r = wait_blocking_send(h, deadline, self.linger + Duration::from_secs(10), || {
            // UCX may still read `data`: cancel everything first.
            self.abort(&format!("a send to rank {peer} timed out"));
        });
        match r {
            Err(e @ Error::PeerLost { .. }) => Err(self.cause_of_lost_send(e)),
            r => r,
        }
    }

    fn isend(&self, peer: usize, tag: Tag, data: Vec<u8>) -> Result<SendHandle> {
        let sh = &self.shared;
        self.shared.mailbox.check_peer(peer)?;
        let seq = sh.seq.next(peer, tag);
        if peer == sh.rank {
            self.loopback(tag, seq, data.clone())?;
            return Ok(SendHandle::ready(Ok(data)));
        }
        let (send, h) = PendingSend::owned(data);
        sh.issue(SendOp { peer, header: header(sh.rank, tag, seq), hlen: HDR, send, mailbox: sh.mailbox.clone() })?;
        Ok(h)
    }

    fn irecv(&self, peer: usize, tag: Tag) -> Result<RecvHandle> {
        self.shared.mailbox.irecv(peer, tag)
    }

    unsafe fn irecv_into(&self, peer: usize, tag: Tag, dst: *mut u8, len: usize) -> Result<RecvHandle> {
        // SAFETY: forwarded from the caller (Link::irecv_into's contract).
        unsafe { self.shared.mailbox.irecv_into(peer, tag, dst, len) }
    }

    fn abort(&self, reason: &str) {
        if let Some(g) = self.shm.get() {
            g.abort(reason);
        }
        self.shared.mailbox.fail(Error::Aborted { reason: reason.to_string() });
        let _ = self.shared.with_engine(|e| e.abort(reason));
    }
}

impl UcxLink {
    /// The link's health for the shared-memory path's waiters: its first failure, if any.
    pub(crate) fn health(&self) -> ironweave_transport::shm::Health {
        ironweave_transport::shm::mailbox_health(self.shared.mailbox.clone())
    }

    /// Attaches the intra-host path (once): the link aborts it with its own failure.
    pub(crate) fn set_intra_host(&self, g: Arc<ironweave_transport::shm::ShmGroup>) {
        let _ = self.shm.set(g);
    }

    /// The intra-host path attached to this link, for the communicator built over it.
    pub fn intra_host(&self) -> Option<Arc<ironweave_transport::shm::ShmGroup>> {
        self.shm.get().cloned()
    }

    /// A peer that aborts on purpose sends the cause first, but our send to it can fail before
    /// that message is read: drive the worker briefly and prefer the cause (PeerAborted, or the
    /// endpoint error naming the rank that really died) over blaming the peer (as TCP does).
    fn cause_of_lost_send(&self, lost: Error) -> Error {
        let sh = &self.shared;
        let until = Instant::now() + Duration::from_millis(500);
        loop {
            if let Some(cause) = sh.mailbox.failure() {
                return cause;
            }
            if Instant::now() >= until {
                return lost;
            }
            if !sh.progress_once() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn loopback(&self, tag: Tag, seq: u64, data: Vec<u8>) -> Result<()> {
        self.shared.mailbox.deliver_whole(self.shared.rank, tag, seq, data)
    }
}

impl Drop for UcxLink {
    fn drop(&mut self) {
        self.shared.closing.store(true, std::sync::atomic::Ordering::Release);
        self.shared.wake();
        // The thread says goodbye, waits (bounded by the linger) for the peers', closes.
        let until = Instant::now() + self.linger + Duration::from_secs(15);
        if let Some(t) = self.thread.locked().take() {
            join_until(t, until);
        }
        self.shared.mailbox.fail(Error::Aborted { reason: "link closed".into() });
    }
}

// ------------------------------------------------------------------ the progress thread

/// A rendezvous message whose data UCX holds until we give it a destination.
struct Rndv {
    src: usize,
    tag: Tag,
    seq: u64,
    desc: *mut c_void,
    len: usize,
    since: Instant,
}

/// State the C callbacks reach through their `arg` pointer (boxed, so it never moves; only
/// the progress thread touches it).
struct CbState {
    shared: Arc<Shared>,
    size: usize,
    mailbox: Arc<Mailbox>,
    eps: RefCell<Vec<sys::ucp_ep_h>>,
    rndv: RefCell<Vec<Rndv>>,
    byes: RefCell<Vec<bool>>,
    in_flight: Cell<usize>,
    /// Sends whose completion callback has not run yet (UCX holds their requests).
    sends_in_flight: Cell<usize>,
    failed: Cell<bool>,
    /// Every endpoint reports peer failures (false when a transport cannot).
    peer_errors: Cell<bool>,
}

impl CbState {
    fn fail(&self, e: Error) {
        self.failed.set(true);
        self.mailbox.fail(e);
    }
}

enum RecvDst {
    Landed,
    Buffered(Vec<u8>),
}

/// A rendezvous receive in flight.
struct RecvOp {
    cb: *const CbState,
    src: usize,
    tag: Tag,
    seq: u64,
    len: usize,
    dst: RecvDst,
}

impl RecvOp {
    fn finish(self, status: sys::ucs_status_t) {
        // SAFETY: the CbState outlives every operation (the worker is destroyed, which ends
        // them all, before the CbState is dropped).
        let cb = unsafe { &*self.cb };
        cb.in_flight.set(cb.in_flight.get() - 1);
        let ok = status == sys::UCS_OK;
        let (src, tag, seq, len) = (self.src, self.tag, self.seq, self.len);
        match self.dst {
            RecvDst::Landed => cb.mailbox.land_done(src, tag, seq, len, ok),
            RecvDst::Buffered(buf) if ok => {
                if let Err(e) = cb.mailbox.deliver(src, tag, seq, len, 0, buf) {
                    cb.fail(e);
                }
            }
            RecvDst::Buffered(_) => {}
        }
        if !ok {
            cb.fail(Error::PeerLost { rank: src, detail: format!("UCX receive failed: {}", ucp::status_text(status)) });
        }
    }
}

fn free_request(req: *mut c_void) {
    if let Ok(l) = sys::load() {
        // SAFETY: called once per completed request, from its completion callback.
        unsafe { l.ucp_request_free(req) };
    }
}

/// A send UCX holds: the op and the state that counts it (see [`Engine::issue_send`]).
struct IssuedSend {
    op: SendOp,
    cb: *const CbState,
}

unsafe extern "C" fn send_done(req: *mut c_void, status: sys::ucs_status_t, user: *mut c_void) {
    // SAFETY: `user` is the IssuedSend leaked by `issue_send` for this request, reclaimed once.
    let issued = unsafe { Box::from_raw(user.cast::<IssuedSend>()) };
    // SAFETY: the CbState outlives every request (the worker is destroyed, or leaked with
    // it, before the CbState is dropped).
    let cb = unsafe { &*issued.cb };
    cb.sends_in_flight.set(cb.sends_in_flight.get() - 1);
    finish_send(issued.op, status);
    free_request(req);
}

unsafe extern "C" fn recv_done(req: *mut c_void, status: sys::ucs_status_t, _len: usize, user: *mut c_void) {
    // SAFETY: `user` is the RecvOp leaked by `start_rndv` for this request, reclaimed once.
    let op = unsafe { Box::from_raw(user.cast::<RecvOp>()) };
    (*op).finish(status);
    free_request(req);
}

fn finish_send(op: SendOp, status: sys::ucs_status_t) {
    let r = send_result(&op.mailbox, op.peer, status);
    op.send.finish(r);
}

/// A finished send's status as the caller's result.
fn send_result(mailbox: &Mailbox, peer: usize, status: sys::ucs_status_t) -> Result<()> {
    match status {
        sys::UCS_OK => Ok(()),
        // UCX cancels a send only once this link failed (an abort, a closed or failed
        // endpoint): report what failed it — a lost or aborting peer — not the cancellation.
        sys::UCS_ERR_CANCELED => Err(mailbox
            .failure()
            .unwrap_or_else(|| Error::Aborted { reason: "the UCX link was aborted while the send was in flight".into() })),
        s => Err(Error::PeerLost { rank: peer, detail: format!("UCX send failed: {}", ucp::status_text(s)) }),
    }
}

unsafe extern "C" fn on_data(
    arg: *mut c_void,
    hdr: *const c_void,
    hlen: usize,
    data: *mut c_void,
    len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the boxed CbState registered with the handler; it outlives the worker.
    let cb = unsafe { &*arg.cast::<CbState>() };
    // SAFETY: UCX passes `hlen` readable header bytes (or a null pointer with 0).
    let h = if hlen == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(hdr.cast::<u8>(), hlen) } };
    let (src, tag, seq) = match parse_header(h, cb.size) {
        Ok(x) => x,
        Err(e) => {
            cb.fail(e);
            return sys::UCS_OK;
        }
    };
    // SAFETY: UCX passes a valid parameter struct.
    let attr = unsafe { (*param).recv_attr };
    if attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 {
        // Keep the descriptor; the data is fetched after progress returns (outside the callback).
        cb.rndv.borrow_mut().push(Rndv { src, tag, seq, desc: data, len, since: Instant::now() });
        // Before anyone checks whether the receive is posted (see Engine::start_rndv).
        cb.shared.held.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        return sys::UCS_INPROGRESS;
    }
    // SAFETY: eager data: `len` bytes at `data`, valid during this callback.
    let bytes = if len == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) } };
    // Into the posted landing zone, or a buffer, under one mailbox lock.
    if let Err(e) = cb.mailbox.deliver_copy(src, tag, seq, bytes) {
        cb.fail(e);
    }
    sys::UCS_OK
}

fn src_of(hdr: *const c_void, hlen: usize, size: usize) -> Option<usize> {
    if hlen != 4 {
        return None;
    }
    let mut b = [0u8; 4];
    // SAFETY: UCX passes `hlen` (= 4) readable header bytes.
    b.copy_from_slice(unsafe { std::slice::from_raw_parts(hdr.cast::<u8>(), 4) });
    Some(u32::from_le_bytes(b) as usize).filter(|&s| s < size)
}

unsafe extern "C" fn on_bye(
    arg: *mut c_void,
    hdr: *const c_void,
    hlen: usize,
    _data: *mut c_void,
    _len: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: as in `on_data`.
    let cb = unsafe { &*arg.cast::<CbState>() };
    if let Some(src) = src_of(hdr, hlen, cb.size) {
        cb.byes.borrow_mut()[src] = true;
        cb.mailbox.goodbye(src);
    }
    sys::UCS_OK
}

unsafe extern "C" fn on_abort(
    arg: *mut c_void,
    hdr: *const c_void,
    hlen: usize,
    data: *mut c_void,
    len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: as in `on_data`.
    let cb = unsafe { &*arg.cast::<CbState>() };
    // SAFETY: valid parameter struct from UCX.
    let rndv = unsafe { (*param).recv_attr } & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let reason = if rndv || len == 0 {
        "no reason given".to_string()
    } else {
        // SAFETY: eager data of `len` bytes valid during the callback.
        String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len.min(4096)) }).into_owned()
    };
    let rank = src_of(hdr, hlen, cb.size).unwrap_or(usize::MAX);
    cb.fail(Error::PeerAborted { rank, reason });
    sys::UCS_OK
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the boxed CbState given at endpoint creation; it outlives the worker.
    let cb = unsafe { &*arg.cast::<CbState>() };
    let rank = cb.eps.borrow().iter().position(|&e| e == ep);
    if let Some(r) = rank {
        if !cb.byes.borrow()[r] {
            cb.fail(Error::PeerLost { rank: r, detail: format!("UCX endpoint failed: {}", ucp::status_text(status)) });
        }
    }
}

struct Engine {
    worker: Worker,
    eps: Vec<Option<Endpoint>>,
    cb: Box<CbState>,
    me: usize,
}

/// Sends up to this size first try to complete at once (see [`Engine::send_now`]).
const IMMEDIATE_MAX: usize = 8 << 10;

impl Engine {
    /// Sends a data message only if UCX can complete it at once (`FORCE_IMM_CMPL`): `None`
    /// when it cannot now (the caller takes the usual path), else the outcome.
    fn send_now(&self, peer: usize, hdr: &[u8; HDR], data: &[u8]) -> Option<Result<()>> {
        let ep = self.eps.get(peer).and_then(Option::as_ref)?;
        let param = sys::ucp_request_param_t { op_attr_mask: sys::UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL, ..Default::default() };
        // SAFETY: live endpoint; header and data are borrowed for the call only: with
        // FORCE_IMM_CMPL the operation completes before returning or is not started.
        let req = unsafe {
            self.worker.lib().ucp_am_send_nbx(
                ep.raw(),
                AM_DATA,
                hdr.as_ptr().cast(),
                HDR,
                data.as_ptr().cast(),
                data.len(),
                &param,
            )
        };
        if sys::ucs_ptr_is_ptr(req) {
            // Not expected with FORCE_IMM_CMPL; should it happen, finish it here (the data is
            // borrowed) before it is freed.
            let lib = self.worker.lib();
            // SAFETY: `req` is a live request of this worker; checked, progressed, freed once.
            let mut status = unsafe { lib.ucp_request_check_status(req) };
            while status == sys::UCS_INPROGRESS {
                self.worker.progress();
                // SAFETY: as above.
                status = unsafe { lib.ucp_request_check_status(req) };
            }
            // SAFETY: as above.
            unsafe { lib.ucp_request_free(req) };
            return Some(send_result(&self.cb.mailbox, peer, status));
        }
        match sys::ucs_ptr_status(req) {
            sys::UCS_ERR_NO_RESOURCE => None,
            s => Some(send_result(&self.cb.mailbox, peer, s)),
        }
    }

    fn issue_send(&self, id: u32, op: SendOp) {
        let Some(ep) = self.eps.get(op.peer).and_then(Option::as_ref) else {
            let e = self.cb.mailbox.failure().unwrap_or(Error::Aborted { reason: "the UCX endpoint is closed".into() });
            op.send.finish(Err(e));
            return;
        };
        let (ptr, len) = (op.send.bytes().as_ptr(), op.send.bytes().len());
        let raw = Box::into_raw(Box::new(IssuedSend { op, cb: &*self.cb }));
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
            cb: sys::ucp_request_param_t__bindgen_ty_1 { send: Some(send_done) },
            user_data: raw.cast(),
            ..Default::default()
        };
        // SAFETY: live endpoint; the header and data live in the leaked SendOp (or the blocked
        // caller's buffer) until the completion callback reclaims it.
        let req = unsafe {
            self.worker.lib().ucp_am_send_nbx(
                ep.raw(),
                id,
                (*raw).op.header.as_ptr().cast(),
                (*raw).op.hlen,
                ptr.cast(),
                len,
                &param,
            )
        };
        if sys::ucs_ptr_is_ptr(req) {
            self.cb.sends_in_flight.set(self.cb.sends_in_flight.get() + 1);
        } else {
            // Completed (or failed) at once: the callback will not run.
            // SAFETY: reclaim the IssuedSend leaked above; UCX holds no reference to it.
            finish_send(unsafe { Box::from_raw(raw) }.op, sys::ucs_ptr_status(req));
        }
    }

    /// Starts fetching the rendezvous messages whose destination is known: a posted landing
    /// zone (zero copy), a posted plain receive, or no receive after [`RNDV_GRACE`] (then into
    /// a buffer, so that a sender is never held hostage by a receiver that posts late).
    /// Returns whether any fetch started.
    fn start_rndv(&self) -> bool {
        let ready: Vec<Rndv> = {
            let mut pending = self.cb.rndv.borrow_mut();
            let mb = &self.cb.mailbox;
            let (go, wait): (Vec<Rndv>, Vec<Rndv>) =
                pending.drain(..).partition(|r| mb.posted(r.src, r.tag, r.seq).is_some() || r.since.elapsed() >= RNDV_GRACE);
            *pending = wait;
            self.cb.shared.held.store(pending.len(), std::sync::atomic::Ordering::Release);
            go
        };
        let started = !ready.is_empty();
        for r in ready {
            let mb = &self.cb.mailbox;
            let (dst, target) = match mb.land(r.src, r.tag, r.seq, r.len, 0, r.len) {
                Ok(Some(p)) => (RecvDst::Landed, p),
                Ok(None) => {
                    mb.reserve(r.len);
                    let mut buf = mb.buffer(r.len);
                    let p = buf.as_mut_ptr();
                    (RecvDst::Buffered(buf), p)
                }
                Err(e) => {
                    self.cb.fail(e);
                    // SAFETY: a descriptor we kept (returned UCS_INPROGRESS) and now drop.
                    unsafe { self.worker.lib().ucp_am_data_release(self.worker.raw(), r.desc) };
                    continue;
                }
            };
            let op = Box::new(RecvOp { cb: &*self.cb, src: r.src, tag: r.tag, seq: r.seq, len: r.len, dst });
            self.cb.in_flight.set(self.cb.in_flight.get() + 1);
            let raw = Box::into_raw(op);
            let param = sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
                cb: sys::ucp_request_param_t__bindgen_ty_1 { recv_am: Some(recv_done) },
                user_data: raw.cast(),
                ..Default::default()
            };
            // SAFETY: `desc` is a rendezvous descriptor we kept; `target` is `len` writable
            // bytes (a landing zone granted by the mailbox, or the buffer owned by the RecvOp)
            // that stay valid until the completion reclaims the RecvOp.
            let req = unsafe { self.worker.lib().ucp_am_recv_data_nbx(self.worker.raw(), r.desc, target.cast(), r.len, &param) };
            if !sys::ucs_ptr_is_ptr(req) {
                // SAFETY: completed at once; reclaim the RecvOp leaked above.
                (*unsafe { Box::from_raw(raw) }).finish(sys::ucs_ptr_status(req));
            }
        }
        started
    }

    fn progress(&self) -> bool {
        let mut any = false;
        while self.worker.progress() {
            any = true;
        }
        if !self.cb.rndv.borrow().is_empty() {
            any |= self.start_rndv();
        }
        any
    }

    fn control(&self, id: u32, peer: usize, payload: Vec<u8>) {
        let mut header = [0u8; HDR];
        header[..4].copy_from_slice(&(self.me as u32).to_le_bytes());
        let op = SendOp { peer, header, hlen: 4, send: PendingSend::detached(payload), mailbox: self.cb.mailbox.clone() };
        self.issue_send(id, op);
    }

    fn abort(&mut self, reason: &str) {
        for peer in 0..self.eps.len() {
            if self.eps[peer].is_some() {
                self.control(AM_ABORT, peer, reason.as_bytes().to_vec());
            }
        }
        self.cb.fail(Error::Aborted { reason: reason.to_string() });
        // Close with a flush (bounded, then by force): a forced close resets the connection,
        // and a peer could see the reset before the abort message and report PeerLost.
        self.close_all(false);
    }

    /// Closes every endpoint; whether every close completed.
    fn close_all(&mut self, force: bool) -> bool {
        let until = Instant::now() + Duration::from_secs(2);
        let mut closed = true;
        for ep in self.eps.iter_mut().filter_map(Option::take) {
            closed &= self.worker.close(ep, force, until);
        }
        closed
    }

    /// Drives the worker until UCX has completed every request we gave it (their callbacks
    /// ran), or `until` passes. Whether none is left.
    fn drain(&self, until: Instant) -> bool {
        loop {
            let idle = self.cb.in_flight.get() == 0 && self.cb.sends_in_flight.get() == 0;
            if idle || Instant::now() >= until {
                return idle;
            }
            if !self.worker.progress() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

fn progress_thread(
    shared: Arc<Shared>,
    tls: Option<String>,
    tuning: Tuning,
    addr_tx: mpsc::SyncSender<Result<Vec<u8>>>,
    peers_rx: mpsc::Receiver<Vec<Vec<u8>>>,
    ready_tx: mpsc::SyncSender<Result<()>>,
) {
    let (me, size) = (shared.rank, shared.size);
    let cb = Box::new(CbState {
        shared: shared.clone(),
        size,
        mailbox: shared.mailbox.clone(),
        eps: RefCell::new(vec![std::ptr::null_mut(); size]),
        rndv: RefCell::new(Vec::new()),
        byes: RefCell::new(vec![false; size]),
        in_flight: Cell::new(0),
        sends_in_flight: Cell::new(0),
        failed: Cell::new(false),
        // UCX 1.13's shared-memory transports have no peer-failure handler: asking for one
        // only makes endpoint creation fail (and log an error) before the fallback.
        peer_errors: Cell::new(shared.info.name != "ucx:shm"),
    });
    let setup = || -> Result<(Rc<Context>, Worker, Vec<u8>)> {
        let ctx = Context::new(tls.as_deref())?;
        let worker = Worker::new(&ctx)?;
        let arg = (&*cb as *const CbState).cast_mut().cast::<c_void>();
        type Handler = unsafe extern "C" fn(
            *mut c_void,
            *const c_void,
            usize,
            *mut c_void,
            usize,
            *const sys::ucp_am_recv_param_t,
        ) -> sys::ucs_status_t;
        for (id, f) in [(AM_DATA, on_data as Handler), (AM_BYE, on_bye as Handler), (AM_ABORT, on_abort as Handler)] {
            // SAFETY: `cb` (boxed) outlives the worker: it is dropped after the worker at the end
            // of this function, and the handlers only touch it on this thread.
            unsafe { worker.set_am_handler(id, Some(f), arg)? };
        }
        let addr = worker.address()?;
        Ok((ctx, worker, addr))
    };
    let (_ctx, worker, addr) = match setup() {
        Ok(x) => x,
        Err(e) => {
            let _ = addr_tx.send(Err(e));
            return;
        }
    };
    *shared.signal.locked() = Some(worker.signal());
    let _ = addr_tx.send(Ok(addr));
    let Ok(addrs) = peers_rx.recv() else {
        *shared.signal.locked() = None;
        return;
    };
    let mut eng = Engine { worker, eps: (0..size).map(|_| None).collect(), cb, me };
    let mut wired = Ok(());
    for (r, a) in addrs.iter().enumerate() {
        if r == me {
            continue;
        }
        let arg = (&*eng.cb as *const CbState).cast_mut().cast::<c_void>();
        // SAFETY: the CbState outlives the endpoint (closed before the engine is dropped).
        // Peer-failure detection where the transports support it; otherwise a dead peer
        // shows as a deadline (Timeout) instead of PeerLost.
        let first = if eng.cb.peer_errors.get() {
            // SAFETY: as below.
            unsafe { eng.worker.connect(a, true, Some(on_ep_error), arg) }
        } else {
            Err(Error::Config("peer-failure detection unsupported".into()))
        };
        let made = match first {
            Err(_) => {
                // SAFETY: as above.
                let made = unsafe { eng.worker.connect(a, false, Some(on_ep_error), arg) };
                if made.is_ok() {
                    eng.cb.peer_errors.set(false);
                }
                made
            }
            ok => ok,
        };
        match made {
            Ok(ep) => {
                eng.cb.eps.borrow_mut()[r] = ep.raw();
                eng.eps[r] = Some(ep);
            }
            Err(e) => {
                wired = Err(Error::Config(format!(
                    "link {:?} cannot reach rank {r}: {e} (shared-memory links only reach ranks on this host; \
                     set IRONWEAVE_UCX_LINKS=tcp for multi-host jobs)",
                    shared.info.name
                )));
                break;
            }
        }
    }
    let ok = wired.is_ok();
    let efd = eng.worker.efd();
    *shared.core.locked() = Some(Core(eng));
    let _ = ready_tx.send(wired);
    if ok {
        run(&shared, efd, &tuning);
    }
    let taken = shared.core.locked().take();
    *shared.signal.locked() = None;
    shared.mailbox.fail(Error::Aborted { reason: "link closed".into() });
    if let Some(Core(mut eng)) = taken {
        let closed = eng.close_all(eng.cb.failed.get() || !ok);
        let drained = eng.drain(Instant::now() + Duration::from_secs(2));
        let failed = eng.cb.failed.get();
        let Engine { worker, cb, .. } = eng;
        if closed && drained && !failed {
            drop(worker);
            drop(cb);
        } else {
            // UCX 1.13 aborts the process (an assertion in ucp_ep_destroy_base) when a worker
            // is destroyed while an endpoint still holds requests, its own included: seen in CI
            // after a peer died with a rendezvous in flight (the survivor had already reported
            // PeerLost, then died of SIGABRT instead of returning it). A typed error must reach
            // the caller: after a failure, or with a close or a request still pending, leave the
            // worker and the callback state it points to alive (never progressed again, so no
            // callback runs). One worker per failed link stays allocated until the process
            // exits (docs/INTERNALS.md, UCX backend).
            worker.leak();
            std::mem::forget(cb);
        }
    }
}

/// The progress thread's loop: drives the engine whenever no waiting caller does, sleeps on
/// the worker's event descriptor when idle, and on close says goodbye and waits (bounded by the
/// linger) for every peer's goodbye.
fn run(shared: &Shared, efd: i32, tuning: &Tuning) {
    let mut last_busy = Instant::now();
    let mut closing: Option<Instant> = None;
    loop {
        if closing.is_none()
            && !shared.closing.load(std::sync::atomic::Ordering::Acquire)
            && shared.drivers.load(std::sync::atomic::Ordering::Acquire) > 0
        {
            // Callers drive the engine while they wait: stay out of their way.
            let g = shared.park.0.locked();
            if shared.drivers.load(std::sync::atomic::Ordering::Acquire) > 0 {
                let _ = shared.park.1.wait_timeout(g, PARK_CHECK);
            }
            continue;
        }
        let mut g = shared.core.locked();
        let Some(Core(eng)) = g.as_mut() else { return };
        if closing.is_none() && shared.closing.load(std::sync::atomic::Ordering::Acquire) {
            closing = Some(Instant::now() + tuning.linger);
            if !eng.cb.failed.get() {
                for peer in 0..eng.eps.len() {
                    if eng.eps[peer].is_some() {
                        eng.control(AM_BYE, peer, Vec::new());
                    }
                }
            }
        }
        let busy = eng.progress();
        if let Some(until) = closing {
            let everyone_left = {
                let byes = eng.cb.byes.borrow();
                (0..byes.len()).all(|r| r == eng.me || byes[r])
            };
            if eng.cb.failed.get() || (everyone_left && eng.cb.in_flight.get() == 0) || Instant::now() >= until {
                return;
            }
        }
        let now = Instant::now();
        if busy {
            last_busy = now;
            continue;
        }
        let held_since = eng.cb.rndv.borrow().iter().map(|r| r.since).min();
        let until = match held_since {
            // Rendezvous messages wait for their receive: posting one wakes us (the mailbox's
            // post hook), else the grace period ends.
            Some(first) => (first + RNDV_GRACE).min(now + Duration::from_millis(100)),
            None if now.duration_since(last_busy) >= tuning.spin => {
                now + Duration::from_millis(if closing.is_some() { 1 } else { 100 })
            }
            None => continue,
        };
        // Arm under the lock, sleep without it (waiting callers may drive the engine meanwhile).
        let armed = eng.worker.arm();
        drop(g);
        if armed {
            crate::ucp::wait_fd(efd, until);
        } else {
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_are_rejected() {
        let h = header(3, Tag(0xdead_beef_0000_0001), 42);
        assert_eq!(parse_header(&h, 4).unwrap(), (3, Tag(0xdead_beef_0000_0001), 42));
        assert!(matches!(parse_header(&h, 3), Err(Error::Protocol { .. })));
        assert!(matches!(parse_header(&h[..19], 4), Err(Error::Protocol { .. })));
    }
}

//! The safe layer over `ucp`: context, worker, endpoints, active messages, progress, wake-up,
//! memory registration.
//!
//! Every type here holds raw UCX handles and is therefore neither `Send` nor `Sync`: a worker
//! and everything made from it live on the one thread that created them (the link's progress
//! thread). The only cross-thread entry is [`Signal`], which wraps `ucp_worker_signal`, the one
//! call UCX documents as safe from any thread.

use std::ffi::{c_void, CStr, CString};
use std::rc::Rc;
use std::time::Instant;

use ironweave_transport::{Error, Result};
use ironweave_ucx_sys as sys;

/// The loaded library, or a configuration error listing the names tried.
pub fn lib() -> Result<&'static sys::Ucp> {
    sys::load().map_err(|e| Error::Config(e.to_string()))
}

/// UCX's text for a status.
pub fn status_text(status: sys::ucs_status_t) -> String {
    match sys::load() {
        Ok(l) => {
            // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string for
            // every status value (unknown ones included).
            let p = unsafe { l.ucs_status_string(status) };
            if p.is_null() {
                format!("status {status}")
            } else {
                // SAFETY: non-null, static and NUL-terminated (see above).
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        }
        Err(_) => format!("status {status}"),
    }
}

fn check(what: &str, status: sys::ucs_status_t) -> Result<()> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(Error::Config(format!("UCX {what} failed: {}", status_text(status))))
    }
}

/// A UCP context (`ucp_init`) with active messages and wake-up, restricted to `tls` when given
/// (the same values as `UCX_TLS`; ours override the environment's).
#[derive(Debug)]
pub struct Context {
    lib: &'static sys::Ucp,
    h: sys::ucp_context_h,
}

impl Context {
    /// Initialises UCX with the transports `tls` (e.g. `posix,sysv,cma,self` or `tcp`).
    pub fn new(tls: Option<&str>) -> Result<Rc<Context>> {
        let lib = lib()?;
        let mut cfg: *mut sys::ucp_config_t = std::ptr::null_mut();
        // SAFETY: null prefix and file mean "read UCX_* from the environment"; `cfg` is written.
        check("config read", unsafe { lib.ucp_config_read(std::ptr::null(), std::ptr::null(), &mut cfg) })?;
        let modified = match tls {
            Some(t) => {
                let (k, v) = (c"TLS", CString::new(t).map_err(|_| Error::Config(format!("bad UCX TLS list {t:?}")))?);
                // SAFETY: `cfg` came from ucp_config_read; both strings are NUL-terminated.
                check(&format!("setting TLS={t}"), unsafe { lib.ucp_config_modify(cfg, k.as_ptr(), v.as_ptr()) })
            }
            None => Ok(()),
        };
        let params = sys::ucp_params_t {
            field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES),
            features: u64::from(sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP),
            ..Default::default()
        };
        let mut h: sys::ucp_context_h = std::ptr::null_mut();
        let status = match modified {
            // SAFETY: params and cfg are valid; `h` is written on success.
            Ok(()) => unsafe { sys::ucp_init(lib, &params, cfg, &mut h) },
            Err(_) => sys::UCS_OK,
        };
        // SAFETY: `cfg` came from ucp_config_read and is released exactly once.
        unsafe { lib.ucp_config_release(cfg) };
        modified?;
        check(&format!("init (TLS={})", tls.unwrap_or("default")), status)?;
        Ok(Rc::new(Context { lib, h }))
    }

    /// Registers `len` bytes at `addr` with every transport of the context (pins them for
    /// zero-copy protocols).
    pub fn map(self: &Rc<Self>, addr: *mut u8, len: usize) -> Result<MemRegion> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH),
            address: addr.cast(),
            length: len,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: the context is alive; params describe caller memory (the caller keeps it
        // alive while the region exists, see MemRegion); `memh` is written on success.
        check("mem_map", unsafe { self.lib.ucp_mem_map(self.h, &params, &mut memh) })?;
        Ok(MemRegion { ctx: self.clone(), memh, addr: addr as usize, len })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker holds an Rc of the context, so none is left when this runs.
        unsafe { self.lib.ucp_cleanup(self.h) };
    }
}

/// Memory registered with a context (`ucp_mem_map`); unregistered on drop.
#[derive(Debug)]
pub struct MemRegion {
    ctx: Rc<Context>,
    memh: sys::ucp_mem_h,
    addr: usize,
    len: usize,
}

impl MemRegion {
    /// Start address and length.
    pub fn range(&self) -> (usize, usize) {
        (self.addr, self.len)
    }

    /// The UCX handle, for request parameters.
    pub fn handle(&self) -> sys::ucp_mem_h {
        self.memh
    }
}

impl Drop for MemRegion {
    fn drop(&mut self) {
        // SAFETY: `memh` came from ucp_mem_map on this context and is unmapped once.
        unsafe { self.ctx.lib.ucp_mem_unmap(self.ctx.h, self.memh) };
    }
}

/// A UCP worker in serialized mode (callers guarantee one thread at a time), with its wake-up
/// descriptor.
#[derive(Debug)]
pub struct Worker {
    ctx: Rc<Context>,
    h: sys::ucp_worker_h,
    efd: i32,
}

/// A handle that wakes a worker blocked waiting on its event descriptor ([`wait_fd`] on [`Worker::efd`]) from any thread.
#[derive(Debug, Clone, Copy)]
pub struct Signal {
    lib: &'static sys::Ucp,
    h: usize,
}

impl Signal {
    /// Wakes the worker.
    ///
    /// # Safety
    /// The worker must still exist (callers clear their copy before destroying it).
    pub unsafe fn raise(&self) {
        // SAFETY: ucp_worker_signal is documented thread-safe; the worker exists (contract).
        unsafe { self.lib.ucp_worker_signal(self.h as sys::ucp_worker_h) };
    }
}

impl Worker {
    /// Creates a worker on `ctx`.
    pub fn new(ctx: &Rc<Context>) -> Result<Worker> {
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            // Serialized: any thread may drive the worker, one at a time (the link's lock).
            thread_mode: sys::UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut h: sys::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: the context is alive (held by the Rc we keep); `h` is written on success.
        check("worker create", unsafe { ctx.lib.ucp_worker_create(ctx.h, &params, &mut h) })?;
        let mut efd = -1;
        // SAFETY: `h` is a live worker; `efd` is written on success.
        let st = unsafe { ctx.lib.ucp_worker_get_efd(h, &mut efd) };
        if st != sys::UCS_OK {
            // SAFETY: destroy the worker we just made before reporting.
            unsafe { ctx.lib.ucp_worker_destroy(h) };
            check("worker wake-up fd", st)?;
        }
        Ok(Worker { ctx: ctx.clone(), h, efd })
    }

    /// The raw handle (for callbacks that need it).
    pub fn raw(&self) -> sys::ucp_worker_h {
        self.h
    }

    /// The library.
    pub fn lib(&self) -> &'static sys::Ucp {
        self.ctx.lib
    }

    /// The context this worker belongs to.
    pub fn context(&self) -> &Rc<Context> {
        &self.ctx
    }

    /// This worker's address, to be sent to peers.
    pub fn address(&self) -> Result<Vec<u8>> {
        let (mut a, mut len): (*mut sys::ucp_address_t, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: live worker; out-parameters are written on success.
        check("worker address", unsafe { self.lib().ucp_worker_get_address(self.h, &mut a, &mut len) })?;
        // SAFETY: UCX returned `len` readable bytes at `a`, released right after the copy.
        let v = unsafe { std::slice::from_raw_parts(a.cast::<u8>(), len) }.to_vec();
        // SAFETY: `a` came from ucp_worker_get_address on this worker.
        unsafe { self.lib().ucp_worker_release_address(self.h, a) };
        Ok(v)
    }

    /// Connects to the worker whose address is `addr`; with `peer_errors`, `err` is called (on
    /// this thread, from [`Worker::progress`]) if the peer fails. Not every transport supports
    /// peer-failure detection (UCX 1.13's shared-memory ones do not): then the call fails with
    /// "unreachable" and the caller may retry without it.
    ///
    /// # Safety
    /// `err_arg` must stay valid for as long as the endpoint exists.
    pub unsafe fn connect(
        &self,
        addr: &[u8],
        peer_errors: bool,
        err: sys::ucp_err_handler_cb_t,
        err_arg: *mut c_void,
    ) -> Result<Endpoint> {
        let params = sys::ucp_ep_params_t {
            field_mask: u64::from(
                sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            ),
            address: addr.as_ptr().cast(),
            err_mode: if peer_errors { sys::UCP_ERR_HANDLING_MODE_PEER } else { sys::UCP_ERR_HANDLING_MODE_NONE },
            err_handler: sys::ucp_err_handler { cb: err, arg: err_arg },
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: live worker; `addr` is a worker address from a peer (UCX validates it and
        // returns an error status for garbage); `ep` is written on success.
        check("endpoint create", unsafe { self.lib().ucp_ep_create(self.h, &params, &mut ep) })?;
        Ok(Endpoint { h: ep })
    }

    /// Installs the active-message handler for `id`.
    ///
    /// # Safety
    /// `arg` must stay valid, and `cb` sound to call with it, while the worker exists.
    pub unsafe fn set_am_handler(&self, id: u32, cb: sys::ucp_am_recv_callback_t, arg: *mut c_void) -> Result<()> {
        let p = sys::ucp_am_handler_param_t {
            field_mask: u64::from(
                sys::UCP_AM_HANDLER_PARAM_FIELD_ID | sys::UCP_AM_HANDLER_PARAM_FIELD_CB | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            ),
            id,
            cb,
            arg,
            ..Default::default()
        };
        // SAFETY: live worker; the handler contract is the caller's.
        check("set AM handler", unsafe { self.lib().ucp_worker_set_am_recv_handler(self.h, &p) })
    }

    /// Progresses communication once; returns whether anything happened.
    pub fn progress(&self) -> bool {
        // SAFETY: live worker, called from its own thread (single-thread mode).
        let n = unsafe { self.lib().ucp_worker_progress(self.h) };
        n != 0
    }

    /// A waker for other threads.
    pub fn signal(&self) -> Signal {
        Signal { lib: self.lib(), h: self.h as usize }
    }

    /// Arms the wake-up descriptor; `false` when events are already pending (progress again
    /// instead of sleeping).
    pub fn arm(&self) -> bool {
        // SAFETY: live worker, serialized by the caller.
        unsafe { self.lib().ucp_worker_arm(self.h) == sys::UCS_OK }
    }

    /// The wake-up descriptor (valid while the worker lives).
    pub fn efd(&self) -> i32 {
        self.efd
    }

    /// Runs `progress` until `req` completes or `until` passes; frees the request.
    /// Returns the final status (`UCS_ERR_TIMED_OUT` when the deadline passed).
    fn wait_request(&self, req: sys::ucs_status_ptr_t, until: Instant) -> sys::ucs_status_t {
        if !sys::ucs_ptr_is_ptr(req) {
            return sys::ucs_ptr_status(req);
        }
        loop {
            // SAFETY: `req` is a live request of this worker (not freed until below).
            let st = unsafe { self.lib().ucp_request_check_status(req) };
            if st != sys::UCS_INPROGRESS {
                // SAFETY: completed request, freed once.
                unsafe { self.lib().ucp_request_free(req) };
                return st;
            }
            if Instant::now() >= until {
                // SAFETY: as above; UCX finishes it internally after the free.
                unsafe { self.lib().ucp_request_free(req) };
                return sys::UCS_ERR_TIMED_OUT;
            }
            if !self.progress() {
                std::thread::yield_now();
            }
        }
    }

    /// Closes an endpoint: flushes it (or cancels everything on it when `force`), bounded by
    /// `until`, after which it is closed by force. Whether the close completed (if not, UCX
    /// still holds the endpoint: see [`Worker::leak`]).
    pub fn close(&self, ep: Endpoint, force: bool, until: Instant) -> bool {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: if force { sys::UCP_EP_CLOSE_FLAG_FORCE } else { 0 },
            ..Default::default()
        };
        // SAFETY: live endpoint of this worker, closed once (Endpoint is consumed).
        let req = unsafe { self.lib().ucp_ep_close_nbx(ep.h, &param) };
        let mut st = self.wait_request(req, until);
        if st == sys::UCS_ERR_TIMED_OUT && !force {
            // A flush that cannot finish (a dead peer): nothing more to deliver; drop by force.
            let param = sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
                flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
                ..Default::default()
            };
            // SAFETY: the endpoint is still being closed; a forced close of it completes that.
            let req = unsafe { self.lib().ucp_ep_close_nbx(ep.h, &param) };
            st = self.wait_request(req, Instant::now() + std::time::Duration::from_secs(5));
        }
        st != sys::UCS_ERR_TIMED_OUT
    }

    /// Gives up the worker without destroying it: for a worker whose endpoints still hold
    /// requests, which `ucp_worker_destroy` would abort the process on (UCX 1.13). The worker
    /// and its context stay allocated until the process exits.
    pub fn leak(self) {
        std::mem::forget(self);
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: live worker destroyed once; endpoints not closed yet are released by UCX.
        unsafe { self.lib().ucp_worker_destroy(self.h) };
    }
}

/// A connection to one peer worker. Closed through [`Worker::close`] (or released with the
/// worker).
#[derive(Debug)]
pub struct Endpoint {
    h: sys::ucp_ep_h,
}

impl Endpoint {
    /// The raw handle.
    pub fn raw(&self) -> sys::ucp_ep_h {
        self.h
    }
}

/// Sleeps until `fd` (an armed worker's wake-up descriptor) is readable or `until` (at most 1 s).
pub fn wait_fd(fd: i32, until: Instant) {
    let ms = until.saturating_duration_since(Instant::now()).as_millis().min(1000) as i32;
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd; the caller keeps the worker (and so the fd) alive.
    unsafe { libc::poll(&mut pfd, 1, ms) };
}

/// Which preset a link uses and which transports that means.
pub fn preset_tls(name: &str) -> Option<&'static str> {
    match name {
        "shm" => Some("posix,sysv,cma,self"),
        "tcp" => Some("tcp"),
        _ => None,
    }
}

//! The safe layer over verbs: device discovery, device context, protection domain,
//! completion queue, registered memory regions and RC queue pairs. Every object frees its
//! verbs resource on drop (queue pairs before regions before the domain before the context,
//! by holding `Arc`s to what they were made from).

use std::ffi::CStr;
use std::sync::Arc;

use ironweave_transport::{Error, Result};
use rdma_sys as v;

/// One RDMA device and what its first port says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// Ports in the ACTIVE state.
    pub active_ports: usize,
    /// Link layer of port 1 (`InfiniBand`, `Ethernet` for RoCE).
    pub link_layer: String,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}, {} active port(s))", self.name, self.link_layer, self.active_ports)
    }
}

fn os_err(what: &str) -> Error {
    Error::io(what, &std::io::Error::last_os_error())
}

/// The RDMA devices of this machine. An empty list is an error that says why (and how to get
/// soft-RoCE where the kernel allows it).
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let mut n = 0i32;
    // SAFETY: writes the count; the returned list is freed below.
    let list = unsafe { v::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        return Err(Error::Config(format!(
            "no RDMA device: ibv_get_device_list failed ({e}); the kernel has no RDMA support loaded (no /sys/class/infiniband)"
        )));
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: `list` holds `n` device pointers.
        let dev = unsafe { *list.add(i) };
        // SAFETY: a device from the list; the name is NUL-terminated and lives with the list.
        let name = unsafe { CStr::from_ptr(v::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
        let (mut active, mut layer) = (0, "unknown".to_string());
        // SAFETY: opening a listed device; closed below.
        let ctx = unsafe { v::ibv_open_device(dev) };
        if !ctx.is_null() {
            for port in 1..=2u8 {
                // SAFETY: zeroed plain-data attribute struct.
                let mut attr: v::ibv_port_attr = unsafe { std::mem::zeroed() };
                // SAFETY: live context; a port number that may not exist (then nonzero return).
                if unsafe { v::___ibv_query_port(ctx, port, &mut attr) } != 0 {
                    break;
                }
                if port == 1 {
                    layer = if attr.link_layer == 2 { "Ethernet (RoCE)" } else { "InfiniBand" }.to_string();
                }
                if attr.state == v::ibv_port_state::IBV_PORT_ACTIVE {
                    active += 1;
                }
            }
            // SAFETY: the context opened above, closed once.
            unsafe { v::ibv_close_device(ctx) };
        }
        out.push(DeviceInfo { name, active_ports: active, link_layer: layer });
    }
    // SAFETY: the list from ibv_get_device_list, freed once.
    unsafe { v::ibv_free_device_list(list) };
    Ok(out)
}

/// An open device context with one protection domain.
#[derive(Debug)]
pub struct Context {
    ctx: *mut v::ibv_context,
    pd: *mut v::ibv_pd,
    /// Port in use and its attributes.
    pub port: u8,
    pub port_attr: PortSummary,
}

/// What the queue-pair setup needs from the port.
#[derive(Debug, Clone, Copy)]
pub struct PortSummary {
    pub lid: u16,
    pub active_mtu: u32,
    pub link_layer: u8,
}

// SAFETY: verbs contexts and protection domains are thread-safe objects (libibverbs
// serialises internally); ironweave only uses them from the progress thread and at setup.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Opens `name` (or the first device with an active port) on `port`.
    pub fn open(name: Option<&str>, port: u8) -> Result<Arc<Context>> {
        let mut n = 0i32;
        // SAFETY: as in `devices`.
        let list = unsafe { v::ibv_get_device_list(&mut n) };
        if list.is_null() || n == 0 {
            if !list.is_null() {
                // SAFETY: free the empty list.
                unsafe { v::ibv_free_device_list(list) };
            }
            return Err(Error::Config("no RDMA device found (ibv_get_device_list returned none)".into()));
        }
        let mut chosen = None;
        for i in 0..n as usize {
            // SAFETY: `list` holds `n` devices.
            let dev = unsafe { *list.add(i) };
            // SAFETY: NUL-terminated name owned by the list.
            let dn = unsafe { CStr::from_ptr(v::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
            if name.is_none_or(|want| want == dn) {
                // SAFETY: a listed device.
                let ctx = unsafe { v::ibv_open_device(dev) };
                if ctx.is_null() {
                    continue;
                }
                // SAFETY: zeroed plain data.
                let mut attr: v::ibv_port_attr = unsafe { std::mem::zeroed() };
                // SAFETY: live context.
                let ok = unsafe { v::___ibv_query_port(ctx, port, &mut attr) } == 0
                    && attr.state == v::ibv_port_state::IBV_PORT_ACTIVE;
                if ok {
                    chosen = Some((ctx, attr));
                    break;
                }
                // SAFETY: close the context we opened but do not use.
                unsafe { v::ibv_close_device(ctx) };
            }
        }
        // SAFETY: free the list once; opened contexts stay valid.
        unsafe { v::ibv_free_device_list(list) };
        let (ctx, attr) = chosen.ok_or_else(|| {
            Error::Config(format!(
                "no RDMA device {} has port {port} ACTIVE (IRONWEAVE_VERBS_DEVICE, IRONWEAVE_VERBS_PORT)",
                name.map_or("at all".to_string(), |n| format!("named {n:?}"))
            ))
        })?;
        // SAFETY: live context.
        let pd = unsafe { v::ibv_alloc_pd(ctx) };
        if pd.is_null() {
            let e = os_err("ibv_alloc_pd");
            // SAFETY: close on the error path.
            unsafe { v::ibv_close_device(ctx) };
            return Err(e);
        }
        let port_attr = PortSummary { lid: attr.lid, active_mtu: attr.active_mtu, link_layer: attr.link_layer };
        Ok(Arc::new(Context { ctx, pd, port, port_attr }))
    }

    /// The port's GID at `index` (RoCE needs one; InfiniBand may use the LID alone).
    pub fn gid(&self, index: i32) -> Result<[u8; 16]> {
        // SAFETY: zeroed union of plain bytes.
        let mut gid: v::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: live context; `gid` is written on success.
        if unsafe { v::ibv_query_gid(self.ctx, self.port, index, &mut gid) } != 0 {
            return Err(os_err("ibv_query_gid"));
        }
        // SAFETY: every bit pattern is valid for the raw view.
        Ok(unsafe { gid.raw })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every QP, CQ and MR holds an Arc of this context, so none is left.
        unsafe {
            v::ibv_dealloc_pd(self.pd);
            v::ibv_close_device(self.ctx);
        }
    }
}

/// A completion queue.
#[derive(Debug)]
pub struct Cq {
    ctx: Arc<Context>,
    pub(crate) cq: *mut v::ibv_cq,
}

// SAFETY: CQs are polled only by the progress thread; moving the handle there is fine.
unsafe impl Send for Cq {}

impl Cq {
    /// A CQ with room for `entries` completions.
    pub fn new(ctx: &Arc<Context>, entries: i32) -> Result<Cq> {
        // SAFETY: live context; no completion channel.
        let cq = unsafe { v::ibv_create_cq(ctx.ctx, entries, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(os_err("ibv_create_cq"));
        }
        Ok(Cq { ctx: ctx.clone(), cq })
    }

    /// Polls up to `out.len()` completions; returns how many.
    pub fn poll(&self, out: &mut [v::ibv_wc]) -> Result<usize> {
        // SAFETY: live CQ; `out` has room for the entries asked for.
        let n = unsafe { v::ibv_poll_cq(self.cq, out.len() as i32, out.as_mut_ptr()) };
        if n < 0 {
            return Err(Error::Io { context: "ibv_poll_cq".into(), message: format!("returned {n}") });
        }
        Ok(n as usize)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        let _ = &self.ctx;
        // SAFETY: QPs using this CQ are destroyed first (the link drops them before the CQ).
        unsafe { v::ibv_destroy_cq(self.cq) };
    }
}

/// A registered memory region owning its bytes.
#[derive(Debug)]
pub struct Region {
    ctx: Arc<Context>,
    mr: *mut v::ibv_mr,
    buf: Vec<u8>,
}

// SAFETY: the region is owned by the progress thread after setup.
unsafe impl Send for Region {}

impl Region {
    /// Allocates and registers `len` bytes; `remote` also lets peers RDMA-write into it.
    pub fn new(ctx: &Arc<Context>, len: usize, remote: bool) -> Result<Region> {
        let mut buf = vec![0u8; len];
        let mut access = v::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if remote {
            access |= v::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        // SAFETY: live PD; `buf` stays allocated (never resized) until deregistration in drop.
        let mr = unsafe { v::ibv_reg_mr(ctx.pd, buf.as_mut_ptr().cast(), len, access as i32) };
        if mr.is_null() {
            return Err(os_err("ibv_reg_mr (is the memlock limit high enough? ulimit -l)"));
        }
        Ok(Region { ctx: ctx.clone(), mr, buf })
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).rkey }
    }

    pub fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }

    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let _ = &self.ctx;
        // SAFETY: registered once; QPs that could still access it were destroyed first.
        unsafe { v::ibv_dereg_mr(self.mr) };
    }
}

/// What a peer needs to connect its RC queue pair to ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAddr {
    pub lid: u16,
    pub qpn: u32,
    pub psn: u32,
    pub gid: [u8; 16],
}

/// A reliable-connected queue pair.
#[derive(Debug)]
pub struct Qp {
    ctx: Arc<Context>,
    pub(crate) qp: *mut v::ibv_qp,
}

// SAFETY: used by the progress thread only after setup.
unsafe impl Send for Qp {}

impl Qp {
    /// Creates an RC QP on `cq` (sends and receives) in the INIT state.
    pub fn new(ctx: &Arc<Context>, cq: &Cq, max_send: u32, max_recv: u32) -> Result<Qp> {
        // SAFETY: zeroed plain data, filled below.
        let mut init: v::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq;
        init.recv_cq = cq.cq;
        init.qp_type = v::ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = max_send;
        init.cap.max_recv_wr = max_recv;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: live PD and CQ.
        let qp = unsafe { v::ibv_create_qp(ctx.pd, &mut init) };
        if qp.is_null() {
            return Err(os_err("ibv_create_qp"));
        }
        let q = Qp { ctx: ctx.clone(), qp };
        // SAFETY: zeroed plain data.
        let mut a: v::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = v::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = ctx.port;
        a.qp_access_flags = v::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0 | v::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        let mask = v::ibv_qp_attr_mask::IBV_QP_STATE.0
            | v::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
            | v::ibv_qp_attr_mask::IBV_QP_PORT.0
            | v::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
        q.modify(&mut a, mask, "INIT")?;
        Ok(q)
    }

    /// This QP's number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: live QP.
        unsafe { (*self.qp).qp_num }
    }

    fn modify(&self, a: &mut v::ibv_qp_attr, mask: u32, state: &str) -> Result<()> {
        // SAFETY: live QP; `a` filled for the attributes in `mask`.
        let rc = unsafe { v::ibv_modify_qp(self.qp, a, mask as i32) };
        if rc != 0 {
            return Err(Error::Io {
                context: format!("moving the queue pair to {state}"),
                message: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }

    /// Connects to `remote` (INIT -> RTR -> RTS); `local_psn` is ours, `gid_index` the local
    /// GID used when the remote GID is set (RoCE).
    pub fn connect(&self, remote: &QpAddr, local_psn: u32, gid_index: u8) -> Result<()> {
        // SAFETY: zeroed plain data.
        let mut a: v::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = v::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = self.ctx.port_attr.active_mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = self.ctx.port;
        if remote.gid != [0; 16] {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = remote.gid;
            a.ah_attr.grh.sgid_index = gid_index;
            a.ah_attr.grh.hop_limit = 64;
        }
        let m = |x: v::ibv_qp_attr_mask| x.0;
        use v::ibv_qp_attr_mask as M;
        let mask = m(M::IBV_QP_STATE)
            | m(M::IBV_QP_AV)
            | m(M::IBV_QP_PATH_MTU)
            | m(M::IBV_QP_DEST_QPN)
            | m(M::IBV_QP_RQ_PSN)
            | m(M::IBV_QP_MAX_DEST_RD_ATOMIC)
            | m(M::IBV_QP_MIN_RNR_TIMER);
        self.modify(&mut a, mask, "RTR")?;
        // SAFETY: zeroed plain data.
        let mut a: v::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = v::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = local_psn;
        a.max_rd_atomic = 1;
        let mask = m(M::IBV_QP_STATE)
            | m(M::IBV_QP_TIMEOUT)
            | m(M::IBV_QP_RETRY_CNT)
            | m(M::IBV_QP_RNR_RETRY)
            | m(M::IBV_QP_SQ_PSN)
            | m(M::IBV_QP_MAX_QP_RD_ATOMIC);
        self.modify(&mut a, mask, "RTS")
    }

    /// Posts a receive without a buffer: it is consumed by an RDMA write with immediate or a
    /// zero-length send with immediate, which is all this backend receives.
    pub fn post_recv(&self, wr_id: u64) -> Result<()> {
        let mut wr = v::ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: std::ptr::null_mut(), num_sge: 0 };
        let mut bad = std::ptr::null_mut();
        // SAFETY: live QP; a WR without scatter entries.
        let rc = unsafe { v::ibv_post_recv(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(Error::Io {
                context: "ibv_post_recv".into(),
                message: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }

    /// Posts a signalled RDMA write with immediate of `len` bytes at `offset` in `region` to
    /// the remote address `remote_addr` with key `rkey`.
    pub fn write_imm(
        &self,
        wr_id: u64,
        region: &Region,
        (offset, len): (usize, usize),
        (remote_addr, rkey): (u64, u32),
        imm: u32,
    ) -> Result<()> {
        let mut sge = v::ibv_sge { addr: region.addr() + offset as u64, length: len as u32, lkey: region.lkey() };
        // SAFETY: zeroed plain data (unions of plain data included), filled below.
        let mut wr: v::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = v::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.send_flags = v::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        wr.wr.rdma = v::rdma_t { remote_addr, rkey };
        self.post_send(&mut wr)
    }

    /// Posts a signalled zero-length send with immediate (control messages).
    pub fn send_imm(&self, wr_id: u64, imm: u32) -> Result<()> {
        // SAFETY: zeroed plain data, filled below.
        let mut wr: v::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.num_sge = 0;
        wr.opcode = v::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
        wr.send_flags = v::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        self.post_send(&mut wr)
    }

    fn post_send(&self, wr: &mut v::ibv_send_wr) -> Result<()> {
        let mut bad = std::ptr::null_mut();
        // SAFETY: live QP; the WR and its SGE live across the call (the HCA copies them).
        let rc = unsafe { v::ibv_post_send(self.qp, wr, &mut bad) };
        if rc != 0 {
            return Err(Error::Io {
                context: "ibv_post_send".into(),
                message: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let _ = &self.ctx;
        // SAFETY: live QP destroyed once, before its CQ and regions (the link's field order).
        unsafe { v::ibv_destroy_qp(self.qp) };
    }
}

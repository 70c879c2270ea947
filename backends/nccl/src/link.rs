//! [`NcclLink`]: an NCCL communicator for device buffers beside a TCP link for the rest.

use ironweave_units::Locked;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::sys as nsys;
use ironweave_tcp::TcpLink;
use ironweave_transport::rendezvous::{JobEnv, Rendezvous};
use ironweave_transport::{
    Buf, BufMut, DType, DeviceSlice, Error, Link, LinkInfo, MemKind, NativeCollectives, RecvHandle, ReduceOp, Result, SendHandle,
    SpeedSource, Tag,
};

/// The raw communicator; NCCL calls on one communicator must not interleave across threads,
/// so every use holds the lock.
struct Comm(nsys::ncclComm_t);

// SAFETY: the handle is only used under `NcclLink::comm`'s mutex.
unsafe impl Send for Comm {}

/// One rank's NCCL communicator (on one CUDA device) plus a TCP link for host messages.
pub struct NcclLink {
    host: Arc<TcpLink>,
    info: LinkInfo,
    device: u32,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: Mutex<Option<Comm>>,
    timeout: Duration,
}

impl std::fmt::Debug for NcclLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLink").field("name", &self.info.name).field("device", &self.device).finish()
    }
}

fn nccl_err(what: &str, e: cudarc::nccl::result::NcclError) -> Error {
    Error::Io { context: format!("NCCL {what}"), message: format!("{e:?}") }
}

fn dtype(d: DType) -> nsys::ncclDataType_t {
    match d {
        DType::F32 => nsys::ncclDataType_t::ncclFloat32,
        DType::F64 => nsys::ncclDataType_t::ncclFloat64,
        DType::F16 => nsys::ncclDataType_t::ncclFloat16,
        DType::BF16 => nsys::ncclDataType_t::ncclBfloat16,
        DType::I32 => nsys::ncclDataType_t::ncclInt32,
        DType::I64 => nsys::ncclDataType_t::ncclInt64,
        DType::U8 => nsys::ncclDataType_t::ncclUint8,
    }
}

fn redop(op: ReduceOp) -> nsys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nsys::ncclRedOp_t::ncclSum,
        ReduceOp::Prod => nsys::ncclRedOp_t::ncclProd,
        ReduceOp::Min => nsys::ncclRedOp_t::ncclMin,
        ReduceOp::Max => nsys::ncclRedOp_t::ncclMax,
        ReduceOp::Avg => nsys::ncclRedOp_t::ncclAvg,
    }
}

impl NcclLink {
    /// Creates the communicator on CUDA device `device`: rank 0's unique id goes to everyone
    /// through `rv`; initialisation runs on a helper thread so that a missing rank becomes a
    /// timeout instead of a hang.
    pub fn connect(env: &JobEnv, rv: &mut Rendezvous, host: Arc<TcpLink>, device: u32, timeout: Duration) -> Result<NcclLink> {
        let ctx = CudaContext::new(device as usize).map_err(|e| Error::Config(format!("CUDA device {device}: {e:?}")))?;
        let stream = ctx.new_stream().map_err(|e| Error::Config(format!("CUDA stream on device {device}: {e:?}")))?;
        let id = if env.rank == 0 {
            let id = cudarc::nccl::result::get_uniqueid().map_err(|e| nccl_err("get unique id", e))?;
            id.internal.iter().map(|&c| c as u8).collect::<Vec<u8>>()
        } else {
            Vec::new()
        };
        let ids = rv.all_gather("nccl-id", &id)?;
        let id0 = ids
            .first()
            .filter(|b| b.len() == 128)
            .ok_or_else(|| Error::Protocol { from: "rank 0".into(), detail: "NCCL unique id is not 128 bytes".into() })?;
        let mut uid = nsys::ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(id0) {
            *d = *s as std::ffi::c_char;
        }
        let (rank, world) = (env.rank as i32, env.world_size as i32);
        let ctx2 = ctx.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = ctx2.bind_to_thread().map_err(|e| Error::Config(format!("binding CUDA context: {e:?}"))).and_then(|()| {
                let mut comm = std::mem::MaybeUninit::uninit();
                // SAFETY: `comm` is written on success; the id came from rank 0's ncclGetUniqueId.
                unsafe { cudarc::nccl::result::comm_init_rank(comm.as_mut_ptr(), world, uid, rank) }
                    .map_err(|e| nccl_err("comm init", e))?;
                // SAFETY: initialised by the successful call above.
                Ok(Comm(unsafe { comm.assume_init() }))
            });
            let _ = tx.send(r);
        });
        let comm =
            rx.recv_timeout(timeout).map_err(|_| Error::Timeout { what: "NCCL communicator init".into(), after: timeout })??;
        let info = LinkInfo {
            name: format!("nccl:cuda{device}"),
            backend: "nccl",
            bandwidth_bytes_per_s: 100e9,
            latency_s: 10e-6,
            speed_source: SpeedSource::Unknown,
            memory: vec![MemKind::Host, MemKind::Device(device)],
        };
        Ok(NcclLink { host, info, device, ctx, stream, comm: Mutex::new(Some(comm)), timeout })
    }

    fn dev(&self, d: DeviceSlice) -> Result<u64> {
        if d.device != self.device {
            return Err(Error::UnsupportedMemory { link: self.info.name.clone(), memory: format!("device {}", d.device) });
        }
        Ok(d.ptr)
    }

    /// Runs one NCCL call on the stream and waits for it with the link's deadline; on the
    /// deadline the communicator is aborted (NCCL's own way out of a stuck collective).
    fn run(&self, what: &str, f: impl FnOnce(nsys::ncclComm_t, nsys::cudaStream_t) -> Result<()>) -> Result<()> {
        let mut guard = self.comm.locked();
        let comm = guard.as_ref().ok_or_else(|| Error::Aborted { reason: "the NCCL communicator was aborted".into() })?.0;
        self.ctx.bind_to_thread().map_err(|e| Error::Config(format!("binding CUDA context: {e:?}")))?;
        let raw = self.stream.cu_stream();
        f(comm, raw as nsys::cudaStream_t)?;
        let start = Instant::now();
        loop {
            // SAFETY: a live stream of our context.
            let st = unsafe { cudarc::driver::sys::cuStreamQuery(raw) };
            match st {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(Error::Io { context: format!("NCCL {what}"), message: format!("stream error {e:?}") }),
            }
            if start.elapsed() >= self.timeout {
                if let Some(c) = guard.take() {
                    // SAFETY: aborting a live communicator (never used again: taken out).
                    let _ = unsafe { cudarc::nccl::result::comm_abort(c.0) };
                }
                return Err(Error::Timeout { what: format!("NCCL {what}"), after: start.elapsed() });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

impl NativeCollectives for NcclLink {
    fn all_reduce(&self, buf: BufMut<'_>, dt: DType, op: ReduceOp) -> Result<()> {
        let BufMut::Device(d) = buf else { return Err(Error::InvalidArgument("NCCL collectives take device buffers".into())) };
        let p = self.dev(d)? as *mut std::ffi::c_void;
        let count = d.len / dt.size();
        self.run("all_reduce", |c, s| {
            // SAFETY: `p` is a device buffer of `d.len` bytes on this link's device (checked).
            unsafe { cudarc::nccl::result::all_reduce(p, p, count, dtype(dt), redop(op), c, s) }
                .map(drop)
                .map_err(|e| nccl_err("all_reduce", e))
        })
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let BufMut::Device(d) = buf else { return Err(Error::InvalidArgument("NCCL collectives take device buffers".into())) };
        let p = self.dev(d)? as *mut std::ffi::c_void;
        self.run("broadcast", |c, s| {
            // SAFETY: in-place broadcast of `d.len` bytes on this link's device.
            unsafe { cudarc::nccl::result::broadcast(p, p, d.len, nsys::ncclDataType_t::ncclUint8, root as i32, c, s) }
                .map(drop)
                .map_err(|e| nccl_err("broadcast", e))
        })
    }

    fn all_gather(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()> {
        let (Buf::Device(i), BufMut::Device(o)) = (input, output) else {
            return Err(Error::InvalidArgument("NCCL collectives take device buffers".into()));
        };
        let (ip, op) = (self.dev(i)? as *const std::ffi::c_void, self.dev(o)? as *mut std::ffi::c_void);
        self.run("all_gather", |c, s| {
            // SAFETY: device buffers of this device; the communicator checked the sizes.
            unsafe { cudarc::nccl::result::all_gather(ip, op, i.len, nsys::ncclDataType_t::ncclUint8, c, s) }
                .map(drop)
                .map_err(|e| nccl_err("all_gather", e))
        })
    }

    fn reduce_scatter(&self, input: Buf<'_>, output: BufMut<'_>, dt: DType, op: ReduceOp) -> Result<()> {
        let (Buf::Device(i), BufMut::Device(o)) = (input, output) else {
            return Err(Error::InvalidArgument("NCCL collectives take device buffers".into()));
        };
        let (ip, outp) = (self.dev(i)? as *const std::ffi::c_void, self.dev(o)? as *mut std::ffi::c_void);
        let count = o.len / dt.size();
        self.run("reduce_scatter", |c, s| {
            // SAFETY: device buffers of this device; the communicator checked the sizes.
            unsafe { cudarc::nccl::result::reduce_scatter(ip, outp, count, dtype(dt), redop(op), c, s) }
                .map(drop)
                .map_err(|e| nccl_err("reduce_scatter", e))
        })
    }
}

impl Link for NcclLink {
    fn info(&self) -> &LinkInfo {
        &self.info
    }
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn size(&self) -> usize {
        self.host.size()
    }
    fn send(&self, peer: usize, tag: Tag, data: &[u8], deadline: Instant) -> Result<()> {
        self.host.send(peer, tag, data, deadline)
    }
    fn send_parts(&self, peer: usize, tag: Tag, parts: &[&[u8]], deadline: Instant) -> Result<bool> {
        self.host.send_parts(peer, tag, parts, deadline)
    }
    fn isend(&self, peer: usize, tag: Tag, data: Vec<u8>) -> Result<SendHandle> {
        self.host.isend(peer, tag, data)
    }
    fn irecv(&self, peer: usize, tag: Tag) -> Result<RecvHandle> {
        self.host.irecv(peer, tag)
    }
    unsafe fn irecv_into(&self, peer: usize, tag: Tag, dst: *mut u8, len: usize) -> Result<RecvHandle> {
        // SAFETY: forwarded from the caller.
        unsafe { self.host.irecv_into(peer, tag, dst, len) }
    }
    fn abort(&self, reason: &str) {
        if let Some(c) = self.comm.locked().take() {
            // SAFETY: a live communicator, taken out so it is never used again.
            let _ = unsafe { cudarc::nccl::result::comm_abort(c.0) };
        }
        self.host.abort(reason);
    }
    fn native_collectives(&self) -> Option<&dyn NativeCollectives> {
        Some(self)
    }
}

impl Drop for NcclLink {
    fn drop(&mut self) {
        if let Some(c) = self.comm.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: a live communicator destroyed once, after its stream's work (every call
            // above waited for completion).
            let _ = unsafe { cudarc::nccl::result::comm_destroy(c.0) };
        }
    }
}

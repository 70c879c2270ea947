//! The NCCL backend: the conformance suite (host buffers over the link's TCP path) and NCCL's
//! native collectives on device memory, one rank per CUDA device. Where there is no GPU, no
//! driver or no NCCL (this CI machine), every test prints `SKIPPED ...: reason` to stderr and
//! passes; the no-GPU test checks that the reason is a typed error, not a panic.

use std::io::Write;
use std::time::Duration;

use cudarc::driver::{CudaContext, DevicePtr};
use ironweave_transport::{BufMut, CommOptions, Communicator, DType, DeviceSlice, Error, ReduceOp};

fn skip(n: usize) -> Option<String> {
    match ironweave_nccl::available() {
        Err(e) => Some(e.to_string()),
        Ok(i) if i.devices < n => Some(format!("{n} ranks need {n} CUDA devices; {i}")),
        Ok(_) => None,
    }
}

fn make(n: usize) -> Vec<Communicator> {
    ironweave_nccl::local_world(n, CommOptions { timeout: Duration::from_secs(120), ..CommOptions::default() }).unwrap()
}

ironweave_transport::conformance_suite!(make, skip_if = skip);

/// Each rank fills a device buffer with `rank + 1 + i % 3`, runs the native collectives and
/// checks the results on the host.
fn device_collectives(n: usize) {
    if let Some(reason) = skip(n) {
        ironweave_transport::testing::skip(&format!("nccl device collectives on {n} rank(s)"), &reason);
        return;
    }
    let comms = make(n);
    std::thread::scope(|s| {
        for (r, c) in comms.iter().enumerate() {
            s.spawn(move || {
                let ctx = CudaContext::new(r).unwrap();
                let stream = ctx.default_stream();
                let count = (1 << 20) + 3;
                let host: Vec<f32> = (0..count).map(|i| (r + 1 + i % 3) as f32).collect();
                let dev = stream.clone_htod(&host).unwrap();
                stream.synchronize().unwrap();
                {
                    let (ptr, _sync) = dev.device_ptr(&stream);
                    let d = DeviceSlice { ptr, len: count * 4, device: r as u32 };
                    c.all_reduce_buf(BufMut::Device(d), DType::F32, ReduceOp::Sum).unwrap();
                }
                let back = stream.clone_dtoh(&dev).unwrap();
                let ranks: usize = (1..=n).sum();
                for (i, &v) in back.iter().enumerate() {
                    assert_eq!(v, (ranks + n * (i % 3)) as f32, "all_reduce element {i} on rank {r}");
                }
                {
                    let (ptr, _sync) = dev.device_ptr(&stream);
                    let d = DeviceSlice { ptr, len: count * 4, device: r as u32 };
                    c.broadcast_buf(BufMut::Device(d), 0).unwrap();
                }
                let back = stream.clone_dtoh(&dev).unwrap();
                let root: Vec<f32> = (0..count).map(|i| (ranks + n * (i % 3)) as f32).collect();
                assert_eq!(back, root, "broadcast on rank {r}");
                // A device buffer on another device is refused with a typed error.
                let wrong = DeviceSlice { ptr: 0, len: 4, device: 99 };
                assert!(matches!(
                    c.all_reduce_buf(BufMut::Device(wrong), DType::F32, ReduceOp::Sum),
                    Err(Error::UnsupportedMemory { .. })
                ));
            });
        }
    });
}

#[test]
fn native_collectives_on_device_memory_one_rank() {
    device_collectives(1);
}

#[test]
fn native_collectives_on_device_memory_two_ranks() {
    device_collectives(2);
}

#[test]
fn without_a_gpu_the_backend_says_why_instead_of_panicking() {
    match ironweave_nccl::available() {
        Ok(i) => {
            let _ = writeln!(std::io::stderr(), "nccl: usable here ({i}); the no-GPU check does not apply");
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "nccl: not usable here: {e}");
            assert!(matches!(e, Error::Config(_)));
            assert!(matches!(ironweave_nccl::local_world(1, CommOptions::default()), Err(Error::Config(_))));
        }
    }
}

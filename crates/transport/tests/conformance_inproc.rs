//! The conformance suite on the in-process backend.

use ironweave_transport::{inproc, CommOptions, Communicator};
use std::time::Duration;

fn make(n: usize) -> Vec<Communicator> {
    let opts = CommOptions { timeout: Duration::from_secs(60), ..CommOptions::default() };
    inproc::world(n).into_iter().map(|l| Communicator::new(vec![l], opts.clone()).unwrap()).collect()
}

ironweave_transport::conformance_suite!(make);

#[test]
fn device_buffers_need_a_backend_that_can_touch_them() {
    use ironweave_transport::{BufMut, DType, DeviceSlice, Error, ReduceOp};
    let c = make(1).pop().unwrap();
    let buf = BufMut::Device(DeviceSlice { ptr: 0x1000, len: 64, device: 0 });
    let err = c.all_reduce_buf(buf, DType::F32, ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, Error::UnsupportedMemory { .. }), "{err}");
}

//! Reduction kernels against memcpy of the same size, frame decoding, and an in-process
//! all-reduce (the algorithms without a network).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ironweave_transport::wire::{FrameHeader, FrameKind};
use ironweave_transport::{inproc, reduce_into, CommOptions, Communicator, DType, ReduceOp};

fn kernels(c: &mut Criterion) {
    let mut g = c.benchmark_group("reduce_into");
    let bytes = 4 << 20;
    g.throughput(Throughput::Bytes(bytes as u64));
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    g.bench_function("memcpy (ceiling)", |b| b.iter(|| dst.copy_from_slice(std::hint::black_box(&src))));
    for d in [DType::F32, DType::BF16, DType::I64, DType::U8] {
        g.bench_with_input(BenchmarkId::new("sum", d.name()), &d, |b, &d| {
            b.iter(|| reduce_into(d, &mut dst, std::hint::black_box(&src), ReduceOp::Sum))
        });
    }
    g.finish();
}

fn wire(c: &mut Criterion) {
    let h = FrameHeader { kind: FrameKind::Data, tag: 1, seq: 2, total: 1 << 20, offset: 0, len: 1 << 20 }.encode();
    c.bench_function("FrameHeader::decode", |b| b.iter(|| FrameHeader::decode(std::hint::black_box(&h), 1 << 30)));
}

fn inproc_all_reduce(c: &mut Criterion) {
    let mut g = c.benchmark_group("inproc all_reduce f32, 4 ranks");
    for bytes in [4usize << 10, 1 << 20] {
        g.throughput(Throughput::Bytes(bytes as u64));
        let comms: Vec<Communicator> =
            inproc::world(4).into_iter().map(|l| Communicator::new(vec![l], CommOptions::default()).unwrap()).collect();
        g.bench_function(BenchmarkId::from_parameter(bytes), |b| {
            b.iter(|| {
                std::thread::scope(|s| {
                    for comm in &comms {
                        s.spawn(move || {
                            let mut v = vec![1.0f32; bytes / 4];
                            comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                        });
                    }
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, kernels, wire, inproc_all_reduce);
criterion_main!(benches);

//! Cost of profiling itself: a layer timer and a communication record, on and off.

use criterion::{criterion_group, criterion_main, Criterion};
use ironweave_profile::{CommKind, MonotonicClock, Phase, Profiler};

fn overhead(c: &mut Criterion) {
    let p = Profiler::new(MonotonicClock::default(), 4);
    let mut g = c.benchmark_group("profile");
    for on in [true, false] {
        p.set_detailed(on);
        g.bench_function(format!("layer timer ({})", if on { "on" } else { "off" }), |b| {
            let mut i = 0u64;
            b.iter(|| {
                if i % 4096 == 0 {
                    p.begin_iteration(i);
                }
                i += 1;
                let _t = p.layer((i % 48) as u32, Phase::Forward);
            })
        });
        g.bench_function(format!("comm record ({})", if on { "on" } else { "off" }), |b| {
            let mut i = 0u64;
            b.iter(|| {
                if i % 4096 == 0 {
                    p.begin_iteration(i);
                }
                i += 1;
                let _t = p.comm(0, CommKind::Training, 1 << 20);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, overhead);
criterion_main!(benches);

//! Criterion micro-benchmarks of ironweave's hot paths; run with `cargo bench -p ironweave-benches`.
//! End-to-end numbers (collectives across processes, the OpenMPI side-by-side) come from
//! `cargo xtask bench collectives` instead.

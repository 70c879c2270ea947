//! `ironweave bench snapshot`: snapshot a state of mixed large and small buffers to host
//! memory with ironweave-ckpt, beside a plain memcpy into warm buffers (the ceiling), and
//! write it to the persistent tier beside a plain sequential write of the same bytes.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::error::{Context, Result};
use ironweave_ckpt::{persist, DType, Registry, SnapshotBuffers, TensorSpec};
use serde_json::json;

use crate::progress::{Mode, Progress};

/// The layout: 60% in 8 large buffers, 30% in 256 KiB buffers, 10% in 4 KiB buffers (f32).
pub fn layout(total: u64) -> Vec<TensorSpec> {
    let mut v = Vec::new();
    let large = total * 6 / 10 / 8 / 4;
    for i in 0..8 {
        v.push(TensorSpec::new(format!("large.{i}"), DType::F32, &[large]));
    }
    let mid = (total * 3 / 10) / (256 << 10);
    for i in 0..mid {
        v.push(TensorSpec::new(format!("mid.{i}"), DType::F32, &[(256 << 10) / 4]));
    }
    let used = large * 4 * 8 + mid * (256 << 10);
    let small = total.saturating_sub(used) / 4096;
    for i in 0..small {
        v.push(TensorSpec::new(format!("small.{i}"), DType::F32, &[1024]));
    }
    v
}

thread_local! {
    static HASH: std::cell::Cell<f64> = const { std::cell::Cell::new(f64::INFINITY) };
}

fn best(repeat: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut b = f64::INFINITY;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        f()?;
        b = b.min(t.elapsed().as_secs_f64());
    }
    Ok(b)
}

/// `ironweave bench snapshot`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct SnapshotArgs {
    /// State size (K/M/G suffixes).
    #[arg(long, default_value = "1G")]
    pub bytes: String,
    /// Timed repetitions (best is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Directory for the persistent writes.
    #[arg(long, default_value = "target/bench/snapshot")]
    pub dir: std::path::PathBuf,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// `ironweave bench snapshot`.
pub fn command(a: &SnapshotArgs) -> Result<i32> {
    run(ironweave_units::parse_size(&a.bytes)? as u64, a.repeat, &a.dir, a.json.as_deref())?;
    Ok(0)
}

pub fn run(bytes: u64, repeat: usize, dir: &Path, json_out: Option<&Path>) -> Result<()> {
    let reg = Arc::new(Registry::new(&layout(bytes))?);
    let total = reg.total;
    eprintln!("state: {} buffers, {:.3} GiB", reg.tensors.len(), total as f64 / (1u64 << 30) as f64);
    let pr = Progress::new("bench snapshot: step", 0, 6, Mode::detect());
    let srcs: Vec<Vec<u8>> = reg.tensors.iter().enumerate().map(|(i, t)| vec![(i % 251) as u8 + 1; t.len as usize]).collect();
    let refs: Vec<&[u8]> = srcs.iter().map(|v| v.as_slice()).collect();
    // ceiling: one memcpy per buffer into a warm contiguous buffer
    let mut dst = vec![0u8; total as usize];
    let memcpy = best(repeat + 1, || {
        let mut off = 0;
        for s in &refs {
            dst[off..off + s.len()].copy_from_slice(s);
            off += s.len();
        }
        Ok(())
    })?;
    pr.step(1, &format!("memcpy, 1 thread: {memcpy:.3} s"));
    // the same with as many threads as the snapshot uses
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let memcpy_par = best(repeat + 1, || {
        let per = (total as usize).div_ceil(threads);
        std::thread::scope(|s| {
            let mut rest: &mut [u8] = &mut dst;
            let mut base = 0usize;
            while !rest.is_empty() {
                let n = per.min(rest.len());
                let (d, r) = std::mem::take(&mut rest).split_at_mut(n);
                rest = r;
                let (b, refs) = (base, &refs);
                s.spawn(move || {
                    // copy the source bytes that fall in [b, b + d.len())
                    let mut off = 0usize;
                    for src in refs.iter() {
                        let (a, e) = (off.max(b), (off + src.len()).min(b + d.len()));
                        if a < e {
                            d[a - b..e - b].copy_from_slice(&src[a - off..e - off]);
                        }
                        off += src.len();
                    }
                });
                base += n;
            }
        });
        Ok(())
    })?;
    pr.step(2, &format!("memcpy, all threads: {memcpy_par:.3} s"));
    drop(dst);
    let _threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut sb = SnapshotBuffers::new(0, 256 << 10);
    // first take allocates and touches; time warm takes, alternating buffers like training
    // (the previous iteration kept, as if committed)
    sb.take(0, 0, &reg, &refs)?;
    sb.take(1, 0, &reg, &refs)?;
    let mut it = 2;
    let snap_s = best(repeat, || {
        sb.take(it, it - 1, &reg, &refs)?;
        it += 1;
        Ok(())
    })?;
    pr.step(3, &format!("ironweave snapshot: {snap_s:.3} s"));
    // checksums, off the critical path (the replication thread computes them)
    let hash_s = best(repeat, || {
        let snap = sb.take(it, it - 1, &reg, &refs)?;
        it += 1;
        let t = Instant::now();
        let _ = snap.sums();
        let e = t.elapsed();
        drop(snap);
        // report only the hashing: subtract nothing else
        HASH.with(|h| h.set(h.get().min(e.as_secs_f64())));
        Ok(())
    })
    .map(|_| HASH.with(|h| h.get()))?;
    pr.step(4, &format!("checksums: {hash_s:.3} s"));
    // persistent tier vs a plain sequential write + fsync of the same bytes
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let snap = sb.latest().cloned().context("a snapshot")?;
    let persist_s = best(1, || {
        persist::write(dir, &snap, 0, 1)?;
        Ok(())
    })?;
    pr.step(5, &format!("persistent write: {persist_s:.3} s"));
    let seq = dir.join("sequential.bin");
    let seq_s = best(1, || {
        let mut f = std::fs::File::create(&seq)?;
        for c in snap.data.chunks(4 << 20) {
            f.write_all(c)?;
        }
        f.sync_all()?;
        Ok(())
    })?;
    pr.step(6, &format!("sequential write: {seq_s:.3} s"));
    pr.finish();
    let _ = std::fs::remove_file(&seq);
    let _ = std::fs::remove_dir_all(dir.join(format!("iter-{:08}", snap.iter)));
    let gbs = |s: f64| total as f64 / s / 1e9;
    println!("{:<44} {:>9} {:>9}", "what", "seconds", "GB/s");
    println!("{:<44} {:>9.4} {:>9.2}", "memcpy into warm buffers (1 thread)", memcpy, gbs(memcpy));
    println!("{:<44} {:>9.4} {:>9.2}", format!("memcpy into warm buffers ({threads} threads)"), memcpy_par, gbs(memcpy_par));
    println!("{:<44} {:>9.4} {:>9.2}", format!("ironweave snapshot ({threads} threads)"), snap_s, gbs(snap_s));
    println!("{:<44} {:>9.4} {:>9.2}", "xxh3 checksums (background, 1 thread)", hash_s, gbs(hash_s));
    println!("{:<44} {:>9.4} {:>9.2}", "ironweave persistent write (safetensors+fsync)", persist_s, gbs(persist_s));
    println!("{:<44} {:>9.4} {:>9.2}", "sequential write + fsync (dd-style)", seq_s, gbs(seq_s));
    if let Some(p) = json_out {
        let v = json!({
            "bytes": total, "buffers": reg.tensors.len(), "threads": threads,
            "memcpy_s": memcpy, "memcpy_parallel_s": memcpy_par, "snapshot_s": snap_s, "checksum_s": hash_s, "persist_s": persist_s, "sequential_write_s": seq_s,
        });
        std::fs::write(p, serde_json::to_vec_pretty(&v)?).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

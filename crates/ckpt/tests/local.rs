//! Snapshots, partitioning and the persistent tier, without a network.

use std::sync::Arc;

use ironweave_ckpt::partition::{leftover, partition, partition_fixed};
use ironweave_ckpt::{persist, CkptError, DType, Registry, Snapshot, SnapshotBuffers, TensorSpec};

/// The workspace's generator, so the instances are the same on every run.
use ironweave_units::SplitMix64 as Rng;

fn state(seed: u64) -> (Arc<Registry>, Vec<Vec<u8>>) {
    let mut r = Rng(seed);
    let specs = vec![
        TensorSpec::new("embed", DType::BF16, &[1000, 64]),
        TensorSpec::new("layers.0.w", DType::F32, &[333, 17]),
        TensorSpec::new("layers.0.b", DType::F32, &[17]),
        TensorSpec::new("adam.m", DType::F32, &[40_000]),
        TensorSpec::new("step", DType::I64, &[]),
        TensorSpec::new("empty", DType::F16, &[0, 5]),
        TensorSpec::new("rng", DType::U8, &[33]),
    ];
    let reg = Arc::new(Registry::new(&specs).unwrap());
    let bufs = reg.tensors.iter().map(|t| (0..t.len).map(|_| r.next_u64() as u8).collect()).collect();
    (reg, bufs)
}

fn refs(b: &[Vec<u8>]) -> Vec<&[u8]> {
    b.iter().map(|v| v.as_slice()).collect()
}

#[test]
fn snapshots_copy_exactly_and_never_refill_an_iteration_to_keep() {
    let (reg, bufs) = state(1);
    let (_, bufs2) = state(2);
    for threads in [1, 2, 5] {
        let mut sb = SnapshotBuffers::new(threads, 4096);
        let s = sb.take(10, 0, &reg, &refs(&bufs)).unwrap();
        assert_eq!(s.data, bufs.concat());
        Snapshot::verify(&s.data, s.sums(), "test").unwrap();
        assert_eq!(s.tensor("layers.0.b").unwrap(), bufs[2].as_slice());
        drop(s);
        // keeping everything (nothing committed yet): each snapshot takes a new buffer until
        // all are used, then there is none
        sb.take(11, 0, &reg, &refs(&bufs2)).unwrap();
        sb.take(12, 0, &reg, &refs(&bufs)).unwrap();
        assert!(!sb.can_take(0) && !sb.can_take(10));
        let e = sb.take(13, 10, &reg, &refs(&bufs)).unwrap_err();
        assert!(e.to_string().contains("every buffer holds an iteration to keep"), "{e}");
        assert_eq!(sb.get(10).unwrap().data, bufs.concat());
        // 11 committed: 10 may go, and only 10
        sb.take(13, 11, &reg, &refs(&bufs)).unwrap();
        assert!(sb.get(10).is_none() && sb.get(11).is_some() && sb.get(12).is_some());
        assert_eq!(sb.latest().unwrap().iter, 13);
        // while someone (a replication thread) holds the buffer to refill, `take` waits
        let held = sb.get(11).unwrap().clone();
        sb.set_wait(std::time::Duration::from_millis(20));
        let e = sb.take(14, 12, &reg, &refs(&bufs)).unwrap_err();
        assert!(e.to_string().contains("still being replicated"), "{e}");
        drop(held);
        sb.take(14, 12, &reg, &refs(&bufs)).unwrap();
        assert_eq!(sb.get(12).unwrap().data, bufs.concat());
        // the storage strategies keep nothing: one buffer serves every snapshot
        let mut one = SnapshotBuffers::new(threads, 4096);
        for it in 0..5 {
            one.take(it, u64::MAX, &reg, &refs(&bufs)).unwrap();
        }
        assert_eq!(one.held().count(), 1);
        // prepared buffers serve the slots' first snapshots, and copy exactly like fresh ones
        let mut warm = SnapshotBuffers::new(threads, 4096);
        warm.prepare(5, reg.total).unwrap();
        assert_eq!(warm.spare_buffers(), 3, "never more than the slots");
        for k in 0..3u64 {
            let b = if k % 2 == 0 { &bufs } else { &bufs2 };
            let s = warm.take(20 + k, 0, &reg, &refs(b)).unwrap();
            assert_eq!(s.data, b.concat());
            Snapshot::verify(&s.data, s.sums(), "prepared").unwrap();
            assert_eq!(warm.spare_buffers(), 2 - k as usize, "the slot's first snapshot took a prepared buffer");
        }
        assert_eq!(warm.spare_buffers(), 0);
        // once the slots hold snapshots, preparing again adds nothing
        warm.prepare(3, reg.total).unwrap();
        assert_eq!(warm.spare_buffers(), 0);
        // a restore drops the held snapshots: their buffers stay warm, never more than the
        // empty slots, and the next snapshots still copy exactly
        let restored = warm.get(22).unwrap().clone();
        warm.adopt(restored);
        assert_eq!(warm.spare_buffers(), 2, "two of the three buffers kept for the empty slots");
        let s = warm.take(30, 22, &reg, &refs(&bufs2)).unwrap();
        assert_eq!(s.data, bufs2.concat());
        assert_eq!(warm.spare_buffers(), 1);
    }
}

#[test]
fn bad_registrations_and_buffers_are_rejected() {
    assert!(matches!(
        Registry::new(&[TensorSpec::new("a", DType::F32, &[1]), TensorSpec::new("a", DType::F32, &[1])]),
        Err(CkptError::Invalid(_))
    ));
    assert!(matches!(Registry::new(&[TensorSpec::new("__metadata__", DType::F32, &[1])]), Err(CkptError::Invalid(_))));
    assert!(Registry::new(&[TensorSpec::new("big", DType::F64, &[u64::MAX, 2])]).is_err());
    let (reg, mut bufs) = state(3);
    bufs[1].pop();
    let e = SnapshotBuffers::new(1, 4096).take(0, 0, &reg, &refs(&bufs)).unwrap_err();
    assert!(e.to_string().contains("layers.0.w"), "{e}");
}

#[test]
fn a_flipped_byte_is_detected() {
    let (reg, bufs) = state(4);
    let mut sb = SnapshotBuffers::new(2, 4096);
    let s = sb.take(1, 0, &reg, &refs(&bufs)).unwrap();
    let mut d = s.data.to_vec();
    d[5000] ^= 1;
    let e = Snapshot::verify(&d, s.sums(), "replica").unwrap_err();
    assert!(matches!(e, CkptError::Corrupt { .. }) && e.to_string().contains("chunk 1"), "{e}");
    assert!(Snapshot::verify(&s.data[..100], s.sums(), "short").is_err());
}

#[test]
fn partition_properties() {
    let mut r = Rng(9);
    for _ in 0..2000 {
        let total = r.next_u64() % 5000;
        let n = (r.next_u64() % 6) as usize;
        let caps: Vec<u64> = (0..n).map(|_| r.next_u64() % 1500).collect();
        let min_chunk = r.next_u64() % 200;
        let max_left = 1 + r.next_u64() % 700;
        let ch = partition(total, &caps, min_chunk, max_left);
        // cover [0, total) exactly, in order
        let mut end = 0;
        for c in &ch {
            assert_eq!(c.offset, end);
            assert!(c.len > 0);
            end += c.len;
            match c.window {
                Some(w) => assert!(c.len <= caps[w], "chunk {c:?} over capacity {}", caps[w]),
                None => assert!(c.len <= max_left),
            }
        }
        assert_eq!(end, total);
        // windows used in order, each at most once
        let used: Vec<usize> = ch.iter().filter_map(|c| c.window).collect();
        assert!(used.windows(2).all(|w| w[0] < w[1]));
        // leftover minimal: if anything is left over, every usable window was filled to capacity
        if leftover(&ch) > 0 {
            for (i, &cap) in caps.iter().enumerate() {
                if cap >= min_chunk && cap > 0 {
                    let got = ch.iter().find(|c| c.window == Some(i)).map(|c| c.len).unwrap_or(0);
                    assert_eq!(got, cap, "window {i} could take {cap} but got {got} while {} bytes are left over", leftover(&ch));
                }
            }
        }
        let fixed = partition_fixed(total, 1 + r.next_u64() % 400, &caps);
        let mut end = 0;
        for c in &fixed {
            assert_eq!(c.offset, end);
            end += c.len;
        }
        assert_eq!(end, total);
        for (i, &cap) in caps.iter().enumerate() {
            assert!(fixed.iter().filter(|c| c.window == Some(i)).map(|c| c.len).sum::<u64>() <= cap);
        }
    }
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ironweave-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn persistent_tier_round_trips_and_rejects_bad_files() {
    let dir = tmpdir("persist");
    let (reg, bufs) = state(5);
    let mut sb = SnapshotBuffers::new(2, 4096);
    let s = sb.take(42, 0, &reg, &refs(&bufs)).unwrap();
    let path = persist::write(&dir, &s, 3, 4).unwrap();
    assert!(path.ends_with("iter-00000042/rank-00003.safetensors"));
    let back = persist::load(&dir, 42, 3).unwrap();
    assert_eq!(back.data, s.data);
    assert_eq!(persist::iterations(&dir, 3), vec![42]);
    assert!(persist::iterations(&dir, 1).is_empty());
    // no temporary files remain
    let names: Vec<String> =
        std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
    assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");

    // a flipped byte in the data → Corrupt, naming the file
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 10;
    bytes[last] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(persist::load(&dir, 42, 3), Err(CkptError::Corrupt { .. })));
    // truncated → Format
    bytes.truncate(bytes.len() - 100);
    std::fs::write(&path, &bytes).unwrap();
    let e = persist::load(&dir, 42, 3).unwrap_err();
    assert!(matches!(e, CkptError::Format { .. }) && e.to_string().contains("truncated"), "{e}");
    // foreign files → Format, never a panic
    for junk in [
        &b""[..],
        b"abc",
        &[0xff; 8],
        &[8, 0, 0, 0, 0, 0, 0, 0, b'[', b']', b' ', b' ', b' ', b' ', b' ', b' '],
        &u64::MAX.to_le_bytes(),
    ] {
        std::fs::write(&path, junk).unwrap();
        let e = persist::read_safetensors(&path).unwrap_err();
        assert!(matches!(e, CkptError::Format { .. }), "{e}");
    }
    // a manifest for another rank → Format
    let (_, man) = persist::paths(&dir, 42, 3);
    let text = std::fs::read_to_string(&man).unwrap().replace("\"rank\": 3", "\"rank\": 2");
    std::fs::write(&man, text).unwrap();
    assert!(matches!(persist::load(&dir, 42, 3), Err(CkptError::Format { .. })));
    std::fs::remove_dir_all(&dir).ok();
}

/// Others can read what the persistent tier writes: Python's `safetensors` package loads the
/// file and sees the same tensors (`.ci/run` installs it; without it this test fails, naming it).
#[test]
fn python_safetensors_loads_the_file() {
    let dir = tmpdir("python");
    let (reg, bufs) = state(6);
    let s = SnapshotBuffers::new(1, 4096).take(7, 0, &reg, &refs(&bufs)).unwrap();
    let path = persist::write(&dir, &s, 0, 1).unwrap();
    let script = r#"
import sys, json, hashlib
from safetensors import safe_open
out = {}
with safe_open(sys.argv[1], framework="numpy") as f:
    meta = f.metadata()
    for k in f.keys():
        sl = f.get_slice(k)
        if sl.get_dtype() == "BF16":  # numpy has no bfloat16
            out[k] = ["BF16", list(sl.get_shape()), None]
            continue
        a = f.get_tensor(k)
        out[k] = [str(a.dtype), list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()]
print(json.dumps({"meta": meta, "tensors": out}))
"#;
    let py = std::env::var("IRONWEAVE_PYTHON").unwrap_or_else(|_| "python3".into());
    let o =
        std::process::Command::new(&py).arg("-c").arg(script).arg(&path).output().unwrap_or_else(|e| panic!("running {py}: {e}"));
    assert!(
        o.status.success(),
        "python safetensors could not load {}: {}\n(install with `pip install safetensors numpy`)",
        path.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["meta"]["iteration"], "7");
    let t = &v["tensors"];
    assert_eq!(t["embed"], serde_json::json!(["BF16", [1000, 64], null]));
    for (name, dtype) in
        [("layers.0.w", "float32"), ("adam.m", "float32"), ("step", "int64"), ("rng", "uint8"), ("empty", "float16")]
    {
        assert_eq!(t[name][0], dtype, "{name}");
        let m = reg.get(name).unwrap();
        assert_eq!(t[name][1], serde_json::json!(m.shape), "{name}");
        let want = {
            use std::fmt::Write;
            let h = sha256(s.tensor(name).unwrap());
            h.iter().fold(String::new(), |mut acc, b| {
                let _ = write!(acc, "{b:02x}");
                acc
            })
        };
        assert_eq!(t[name][2], want, "{name}: bytes differ");
    }
    std::fs::remove_dir_all(&dir).ok();
}

fn sha256(b: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(b).into()
}

/// Resharding through the persistent tier itself (issue 57, item 5): random tensors of every
/// rank the trainers write — 1-D flat shards of a flattened layer (the sharded trainer), scalars
/// every writer holds (the step; one owner), 2-D and 3-D blocks — cut by random writer grids,
/// written as files by `persist::write_layout`, and read back onto random reader grids by
/// `persist::load_global` — the real reader, file IO, checksums and its whole-slice shortcut
/// (a reader block equal to a writer block, forced in a third of the cases) included. Every
/// element of every tensor lands where the reader wants it.
#[test]
fn load_global_reshards_flat_shards_scalars_and_blocks_onto_any_layout() {
    use ironweave_ckpt::GlobalSlice;
    let mut rng = Rng(57);
    let value = |k: usize, i: u64| 1.0 + (k as f32) * 100_000.0 + i as f32;
    let dir = std::env::temp_dir().join(format!("iw-reshard-prop-{}", std::process::id()));
    // a tensor of `shape` cut into blocks, `parts[d]` pieces along dimension d (empty ones too)
    let grid = |shape: &[u64], parts: &[usize], rng: &mut Rng| -> Vec<(Vec<u64>, Vec<u64>)> {
        let mut blocks = vec![(Vec::new(), Vec::new())];
        for (&len, &p) in shape.iter().zip(parts) {
            let mut cuts: Vec<u64> = (1..p).map(|_| rng.below(len + 1)).collect();
            cuts.extend([0, len]);
            cuts.sort_unstable();
            let pieces: Vec<(u64, u64)> = cuts.windows(2).map(|w| (w[0], w[1] - w[0])).collect();
            blocks = blocks
                .into_iter()
                .flat_map(|(o, e): (Vec<u64>, Vec<u64>)| {
                    pieces.iter().map(move |&(at, n)| ([o.clone(), vec![at]].concat(), [e.clone(), vec![n]].concat()))
                })
                .collect();
        }
        blocks
    };
    let coords = |off: &[u64], ext: &[u64]| -> Vec<Vec<u64>> {
        let mut out = vec![Vec::new()];
        for (&o, &e) in off.iter().zip(ext) {
            out = out.into_iter().flat_map(|c| (o..o + e).map(move |i| [c.clone(), vec![i]].concat())).collect();
        }
        out
    };
    let linear = |shape: &[u64], at: &[u64]| shape.iter().zip(at).fold(0, |acc, (&n, &i)| acc * n + i);
    let mut whole_reads = 0;
    for case in 0..120u64 {
        let _ = std::fs::remove_dir_all(&dir);
        // the dimensionality of this case's sharded tensor: 1 (flat shards), 2 or 3
        let dims = 1 + rng.below(3) as usize;
        let shape: Vec<u64> = (0..dims).map(|_| 1 + rng.below(if dims == 1 { 40 } else { 6 })).collect();
        let wparts: Vec<usize> = (0..dims).map(|_| 1 + rng.below(4) as usize).collect();
        let writers = grid(&shape, &wparts, &mut rng);
        let same_grid = case % 3 == 0;
        let readers = if same_grid {
            writers.clone()
        } else {
            grid(&shape, &(0..dims).map(|_| 1 + rng.below(4) as usize).collect::<Vec<_>>(), &mut rng)
        };
        let names = ["layer0.p", "layer0.m"];
        let specs = |off: &[u64], ext: &[u64], owner_of_step: bool| -> Vec<TensorSpec> {
            let mut v: Vec<TensorSpec> = names
                .iter()
                .map(|nm| {
                    TensorSpec::new(format!("shard.{nm}"), DType::F32, ext).with_global(GlobalSlice {
                        tensor: nm.to_string(),
                        shape: shape.clone(),
                        offsets: off.to_vec(),
                        owner: true,
                    })
                })
                .collect();
            v.push(TensorSpec::new("step", DType::I64, &[]).with_global(GlobalSlice::whole("step", &[], owner_of_step)));
            v
        };
        let world = writers.len() as u32;
        for (w, (off, ext)) in writers.iter().enumerate() {
            let reg = Arc::new(Registry::new(&specs(off, ext, w == 0)).unwrap());
            let mut data = Vec::new();
            for k in 0..names.len() {
                for c in coords(off, ext) {
                    data.extend_from_slice(&value(k, linear(&shape, &c)).to_le_bytes());
                }
            }
            data.extend_from_slice(&(1000 + case as i64).to_le_bytes());
            assert_eq!(data.len() as u64, reg.total);
            persist::write_layout(&dir, &Snapshot::new(9, reg, data), w as u32, world, None, &persist::Written::default())
                .unwrap();
        }
        for (off, ext) in &readers {
            whole_reads += usize::from(writers.contains(&(off.clone(), ext.clone())) && ext.iter().product::<u64>() > 0);
            let want = Registry::new(&specs(off, ext, false)).unwrap();
            let got = persist::load_global(&dir, 9, &want)
                .unwrap_or_else(|e| panic!("case {case}: shape {shape:?} writers {wparts:?} reader {off:?}+{ext:?}: {e}"));
            for (k, t) in want.tensors.iter().take(names.len()).enumerate() {
                for (j, c) in coords(off, ext).iter().enumerate() {
                    let at = t.offset as usize + j * 4;
                    let v = f32::from_le_bytes(got.data[at..at + 4].try_into().unwrap());
                    assert_eq!(
                        v,
                        value(k, linear(&shape, c)),
                        "case {case}: shape {shape:?}, reader {off:?}+{ext:?}, {} at {c:?}",
                        t.name
                    );
                }
            }
            assert_eq!(got.tensor("step").unwrap(), (1000 + case as i64).to_le_bytes(), "case {case}: the scalar");
        }
    }
    assert!(whole_reads > 50, "the whole-slice shortcut ran {whole_reads} times");
    let _ = std::fs::remove_dir_all(&dir);
}

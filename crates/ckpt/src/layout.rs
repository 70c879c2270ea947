//! The global layout of a checkpoint: where each rank's tensors sit in the model all ranks
//! train together, so a checkpoint written by one parallel layout loads onto another (N ranks
//! onto M, another expert placement). Each registered tensor may name the slice of a global
//! tensor it holds ([`GlobalSlice`](crate::GlobalSlice), defined beside the registry it is
//! part of); the persistent tier writes it into every rank's manifest
//! beside a checksum per tensor. Pure: the checks that refuse a set of manifests ([`index`]),
//! the plan of which byte ranges of which files a rank reads ([`plan`]) and the layout-free
//! digest ([`global_digest`]). Reading the planned ranges is [`crate::persist::load_global`].
//!
//! Replicated tensors (the dense parameters of data parallelism) appear in every rank's file;
//! one copy is the *owner* a loader reads, the others are marked as copies. Owner slices must
//! cover every element of their global tensor exactly once.

use std::collections::BTreeMap;

use crate::error::{CkptError, Result};
use crate::registry::{DType, Registry};

/// One owner slice as the loader sees it: which file, where in it, what part of the tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// Index of the file (rank of the writer).
    pub file: usize,
    /// Byte offset of the slice in that file's data section.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Start of the slice per dimension.
    pub offsets: Vec<u64>,
    /// Extent per dimension.
    pub extent: Vec<u64>,
    /// xxh3 of the slice's bytes (None: the manifest predates per-tensor checksums).
    pub xxh3: Option<u64>,
}

/// One global tensor and the owner slices that make it up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalTensor {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Owner slices, in the order of their offsets.
    pub sources: Vec<Source>,
}

/// Every global tensor of a checkpoint, by name.
pub type GlobalIndex = BTreeMap<String, GlobalTensor>;

fn volume(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

fn layout_err(tensor: &str, file: Option<usize>, detail: impl Into<String>) -> CkptError {
    CkptError::Layout { tensor: tensor.to_string(), file: file.map(|f| format!("rank {f}'s file")), detail: detail.into() }
}

/// Builds the global index from every file's layout (`files[r]`: the registry rank `r` wrote,
/// and its per-tensor checksums if any), refusing what does not make a model: a tensor without
/// a global slice, two dtypes or shapes for one global tensor, a slice outside its tensor or of
/// another extent than its local shape, overlapping owner slices, elements no owner holds.
pub fn index(files: &[(&Registry, Option<&[u64]>)]) -> Result<GlobalIndex> {
    let mut out: GlobalIndex = BTreeMap::new();
    for (f, (reg, sums)) in files.iter().enumerate() {
        if let Some(s) = sums {
            if s.len() != reg.tensors.len() {
                return Err(layout_err(
                    "(all)",
                    Some(f),
                    format!("{} tensor checksums for {} tensors", s.len(), reg.tensors.len()),
                ));
            }
        }
        for (k, t) in reg.tensors.iter().enumerate() {
            let Some(g) = &t.global else {
                return Err(layout_err(&t.name, Some(f), "no global slice: the checkpoint was written without a global layout"));
            };
            if g.offsets.len() != g.shape.len() || t.shape.len() != g.shape.len() {
                return Err(layout_err(
                    &g.tensor,
                    Some(f),
                    format!("slice of rank {} offsets {:?} for a {}-dimensional tensor", t.shape.len(), g.offsets, g.shape.len()),
                ));
            }
            for d in 0..g.shape.len() {
                let end = g.offsets[d].checked_add(t.shape[d]);
                if end.is_none_or(|e| e > g.shape[d]) {
                    return Err(layout_err(
                        &g.tensor,
                        Some(f),
                        format!("slice at {:?} of extent {:?} reaches outside the shape {:?}", g.offsets, t.shape, g.shape),
                    ));
                }
            }
            let entry = out.entry(g.tensor.clone()).or_insert_with(|| GlobalTensor {
                dtype: t.dtype,
                shape: g.shape.clone(),
                sources: Vec::new(),
            });
            if entry.dtype != t.dtype || entry.shape != g.shape {
                return Err(layout_err(
                    &g.tensor,
                    Some(f),
                    format!("{} {:?} here, {} {:?} in another file", t.dtype.name(), g.shape, entry.dtype.name(), entry.shape),
                ));
            }
            if g.owner {
                entry.sources.push(Source {
                    file: f,
                    offset: t.offset,
                    len: t.len,
                    offsets: g.offsets.clone(),
                    extent: t.shape.clone(),
                    xxh3: sums.map(|s| s[k]),
                });
            }
        }
    }
    for (name, t) in &mut out {
        t.sources.sort_by(|a, b| a.offsets.cmp(&b.offsets));
        for (i, a) in t.sources.iter().enumerate() {
            for b in &t.sources[i + 1..] {
                if overlaps(a, b) {
                    return Err(layout_err(
                        name,
                        Some(b.file),
                        format!("its slice at {:?} overlaps rank {}'s at {:?}", b.offsets, a.file, a.offsets),
                    ));
                }
            }
        }
        let held: u64 = t.sources.iter().map(|s| volume(&s.extent).unwrap_or(u64::MAX)).fold(0u64, u64::saturating_add);
        let want = volume(&t.shape).ok_or_else(|| layout_err(name, None, "shape overflows"))?;
        if held != want {
            return Err(layout_err(
                name,
                None,
                format!(
                    "the owner slices hold {held} of its {want} elements ({}): a file is missing or the layout leaves a hole",
                    if t.sources.is_empty() { "no file owns it".to_string() } else { format!("{} slices", t.sources.len()) }
                ),
            ));
        }
    }
    Ok(out)
}

fn overlaps(a: &Source, b: &Source) -> bool {
    (0..a.offsets.len()).all(|d| a.offsets[d] < b.offsets[d] + b.extent[d] && b.offsets[d] < a.offsets[d] + a.extent[d])
}

/// A copy from a source slice into a target tensor: `rows` runs of `run` bytes, the `k`-th from
/// `src + k * src_stride` (bytes into the source slice) to `dst + k * dst_stride` (bytes into
/// the target tensor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    /// Byte offset in the source slice.
    pub src: u64,
    /// Byte offset in the target tensor.
    pub dst: u64,
    /// Bytes per run.
    pub run: u64,
}

/// How to fill one target tensor (a registered tensor of the loading rank): from which source
/// slices, and the byte runs to copy out of each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fill {
    /// Index of the tensor in the loading rank's registry.
    pub target: usize,
    /// (index into the global tensor's sources, the runs to copy).
    pub from: Vec<(usize, Vec<Copy>)>,
}

/// The plan of loading rank's registry `want` from `idx`: for each of its tensors, the source
/// slices that intersect its global slice and the byte runs to copy. Refuses a tensor the
/// checkpoint does not have, or has with another dtype or shape.
pub fn plan(idx: &GlobalIndex, want: &Registry) -> Result<Vec<Fill>> {
    let mut out = Vec::with_capacity(want.tensors.len());
    for (k, t) in want.tensors.iter().enumerate() {
        let Some(g) = &t.global else {
            return Err(layout_err(&t.name, None, "the loading layout gives this tensor no global slice"));
        };
        let Some(src) = idx.get(&g.tensor) else {
            return Err(layout_err(&g.tensor, None, "not in the checkpoint (a checkpoint of another model?)"));
        };
        if src.dtype != t.dtype || src.shape != g.shape {
            return Err(layout_err(
                &g.tensor,
                None,
                format!(
                    "the checkpoint has {} {:?}, this model wants {} {:?} (a checkpoint of another model?)",
                    src.dtype.name(),
                    src.shape,
                    t.dtype.name(),
                    g.shape
                ),
            ));
        }
        let es = t.dtype.size() as u64;
        let mut from = Vec::new();
        for (si, s) in src.sources.iter().enumerate() {
            let runs = intersect(&g.offsets, &t.shape, &s.offsets, &s.extent, es);
            if !runs.is_empty() {
                from.push((si, runs));
            }
        }
        out.push(Fill { target: k, from });
    }
    Ok(out)
}

/// Byte runs copying the intersection of box `(a_off, a_ext)` (the target) and box
/// `(b_off, b_ext)` (a source), both row-major with elements of `es` bytes.
fn intersect(a_off: &[u64], a_ext: &[u64], b_off: &[u64], b_ext: &[u64], es: u64) -> Vec<Copy> {
    let n = a_off.len();
    let mut lo = vec![0u64; n];
    let mut hi = vec![0u64; n];
    for d in 0..n {
        lo[d] = a_off[d].max(b_off[d]);
        hi[d] = (a_off[d] + a_ext[d]).min(b_off[d] + b_ext[d]);
        if lo[d] >= hi[d] {
            return Vec::new();
        }
    }
    if n == 0 {
        return vec![Copy { src: 0, dst: 0, run: es }];
    }
    // row-major strides (elements) of both boxes
    let strides = |ext: &[u64]| -> Vec<u64> {
        let mut s = vec![1u64; n];
        for d in (0..n.saturating_sub(1)).rev() {
            s[d] = s[d + 1] * ext[d + 1];
        }
        s
    };
    let (sa, sb) = (strides(a_ext), strides(b_ext));
    let run = (hi[n - 1] - lo[n - 1]) * es;
    let mut out = Vec::new();
    // every index of the leading dimensions inside the intersection
    let mut idx = lo.clone();
    loop {
        let (mut da, mut db) = (0u64, 0u64);
        for d in 0..n {
            da += (idx[d] - a_off[d]) * sa[d];
            db += (idx[d] - b_off[d]) * sb[d];
        }
        // merge with the previous run when both sides continue it
        match out.last_mut() {
            Some(Copy { src, dst, run: r }) if *src + *r == db * es && *dst + *r == da * es => *r += run,
            _ => out.push(Copy { src: db * es, dst: da * es, run }),
        }
        // next index over dimensions 0..n-1 (the last dimension is the run)
        let mut d = n - 1;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}

/// The layout-free digest of a model's state: SHA-256 over the global tensors sorted by name,
/// each contributing its name, a zero byte and the SHA-256 of its bytes in row-major order.
/// `per_tensor` maps each global tensor's name to that SHA-256; equal digests, equal states,
/// whatever layout held them.
pub fn global_digest(per_tensor: &BTreeMap<String, [u8; 32]>) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for (name, d) in per_tensor {
        h.update(name.as_bytes());
        h.update([0u8]);
        h.update(d);
    }
    h.finalize().into()
}

/// SHA-256 of one tensor's bytes.
pub fn tensor_sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes).into()
}

/// Hex of a digest.
pub fn hex(d: &[u8; 32]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::GlobalSlice;
    use crate::registry::TensorSpec;

    fn reg(specs: Vec<TensorSpec>) -> Registry {
        Registry::new(&specs).unwrap()
    }

    fn rows(name: &str, shape: &[u64], from: u64, to: u64, owner: bool) -> TensorSpec {
        let mut local = shape.to_vec();
        local[0] = to - from;
        let mut off = vec![0; shape.len()];
        off[0] = from;
        TensorSpec::new(name, DType::F32, &local).with_global(GlobalSlice {
            tensor: name.into(),
            shape: shape.to_vec(),
            offsets: off,
            owner,
        })
    }

    #[test]
    fn row_shards_cover_their_tensor_and_a_hole_or_an_overlap_is_refused() {
        let a = reg(vec![rows("w", &[4, 3], 0, 2, true)]);
        let b = reg(vec![rows("w", &[4, 3], 2, 4, true)]);
        let idx = index(&[(&a, None), (&b, None)]).unwrap();
        assert_eq!(idx["w"].sources.len(), 2);
        // a hole: rows 2..3 only
        let c = reg(vec![rows("w", &[4, 3], 2, 3, true)]);
        let e = index(&[(&a, None), (&c, None)]).unwrap_err().to_string();
        assert!(e.contains("`w`") && e.contains("hole"), "{e}");
        // an overlap: rows 1..4
        let d = reg(vec![rows("w", &[4, 3], 1, 4, true)]);
        let e = index(&[(&a, None), (&d, None)]).unwrap_err().to_string();
        assert!(e.contains("overlaps") && e.contains("rank 1"), "{e}");
        // a copy (not an owner) may overlap: it is not read
        let copy = reg(vec![rows("w", &[4, 3], 0, 4, false)]);
        assert!(index(&[(&a, None), (&b, None), (&copy, None)]).is_ok());
        // outside the shape
        let big = reg(vec![rows("w", &[4, 3], 3, 5, true)]);
        assert!(index(&[(&a, None), (&big, None)]).unwrap_err().to_string().contains("outside"));
    }

    #[test]
    fn a_target_slice_across_two_sources_is_copied_run_by_run() {
        // global 4x3 in two row shards; the target wants columns 1..3 of rows 1..3
        let a = reg(vec![rows("w", &[4, 3], 0, 2, true)]);
        let b = reg(vec![rows("w", &[4, 3], 2, 4, true)]);
        let idx = index(&[(&a, None), (&b, None)]).unwrap();
        let want = reg(vec![TensorSpec::new("w", DType::F32, &[2, 2]).with_global(GlobalSlice {
            tensor: "w".into(),
            shape: vec![4, 3],
            offsets: vec![1, 1],
            owner: true,
        })]);
        let p = plan(&idx, &want).unwrap();
        // row 1 from the first source (its element (1,1): byte 16), row 2 from the second
        // (its element (0,1): byte 4); 2 floats each, into rows 0 and 1 of the target
        assert_eq!(p[0].from, vec![(0, vec![Copy { src: 16, dst: 0, run: 8 }]), (1, vec![Copy { src: 4, dst: 8, run: 8 }])]);
        // whole rows merge into one run
        let whole = reg(vec![rows("w", &[4, 3], 0, 4, true)]);
        let p = plan(&idx, &whole).unwrap();
        assert_eq!(p[0].from, vec![(0, vec![Copy { src: 0, dst: 0, run: 24 }]), (1, vec![Copy { src: 0, dst: 24, run: 24 }])]);
        // another model's tensor is refused by name
        let other = reg(vec![rows("v", &[4, 3], 0, 4, true)]);
        assert!(plan(&idx, &other).unwrap_err().to_string().contains("another model"));
        let shape = reg(vec![rows("w", &[5, 3], 0, 5, true)]);
        assert!(plan(&idx, &shape).unwrap_err().to_string().contains("another model"));
    }

    /// A tensor of `shape` cut into blocks along every dimension (`parts[d]` pieces along
    /// dimension `d` at random cut points from `rng`, empty pieces included): each block's
    /// offsets and extent.
    fn random_grid(shape: &[u64], parts: &[usize], rng: &mut ironweave_units::SplitMix64) -> Vec<(Vec<u64>, Vec<u64>)> {
        let per_dim: Vec<Vec<(u64, u64)>> = shape
            .iter()
            .zip(parts)
            .map(|(&len, &p)| {
                let mut cuts: Vec<u64> = (1..p).map(|_| rng.below(len + 1)).collect();
                cuts.push(0);
                cuts.push(len);
                cuts.sort_unstable();
                cuts.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
            })
            .collect();
        let mut blocks = vec![(Vec::new(), Vec::new())];
        for pieces in &per_dim {
            blocks = blocks
                .into_iter()
                .flat_map(|(o, e)| {
                    pieces.iter().map(move |&(at, n)| {
                        let (mut o, mut e) = (o.clone(), e.clone());
                        o.push(at);
                        e.push(n);
                        (o, e)
                    })
                })
                .collect();
        }
        blocks
    }

    /// Row-major index of global coordinate `at` in `shape`.
    fn linear(shape: &[u64], at: &[u64]) -> u64 {
        shape.iter().zip(at).fold(0, |acc, (&n, &i)| acc * n + i)
    }

    /// Every coordinate of a block, in row-major order.
    fn coords(off: &[u64], ext: &[u64]) -> Vec<Vec<u64>> {
        let mut out = vec![Vec::new()];
        for (&o, &e) in off.iter().zip(ext) {
            out = out.into_iter().flat_map(|c| (o..o + e).map(move |i| [c.clone(), vec![i]].concat())).collect();
        }
        out
    }

    #[test]
    fn random_layouts_n_to_m_move_every_element_and_moment_to_its_place() {
        // property: for random 2-d and 3-d tensors (weights and both moments) cut by random
        // writer and reader grids along every dimension (empty pieces included), the planned
        // copies put every element of every tensor where the reader wants it. Values are never
        // 0 and the reader's buffer starts as a sentinel no value has, so a copy left out shows.
        const SENTINEL: u8 = 0xA5;
        let mut rng = ironweave_units::SplitMix64(7);
        let names = ["w", "adam.m.w", "adam.v.w"];
        // element i of tensor k: never 0, never the sentinel's pattern
        let value = |k: usize, i: u64| 1.0 + (k as f32) * 100_000.0 + i as f32;
        for case in 0..300 {
            let dims = 2 + rng.below(2) as usize;
            let shape: Vec<u64> = (0..dims).map(|_| 1 + rng.below(if dims == 2 { 9 } else { 5 })).collect();
            let wparts: Vec<usize> = (0..dims).map(|_| 1 + rng.below(3) as usize).collect();
            let rparts: Vec<usize> = (0..dims).map(|_| 1 + rng.below(3) as usize).collect();
            let slice = |nm: &str, off: &[u64], ext: &[u64]| {
                TensorSpec::new(nm, DType::F32, ext).with_global(GlobalSlice {
                    tensor: nm.to_string(),
                    shape: shape.clone(),
                    offsets: off.to_vec(),
                    owner: true,
                })
            };
            let mut files: Vec<(Registry, Vec<u8>)> = Vec::new();
            for (off, ext) in random_grid(&shape, &wparts, &mut rng) {
                let r = reg(names.iter().map(|nm| slice(nm, &off, &ext)).collect());
                let mut data = Vec::new();
                for k in 0..names.len() {
                    for c in coords(&off, &ext) {
                        data.extend_from_slice(&value(k, linear(&shape, &c)).to_le_bytes());
                    }
                }
                assert_eq!(data.len() as u64, r.total);
                files.push((r, data));
            }
            let idx = index(&files.iter().map(|(r, _)| (r, None)).collect::<Vec<_>>()).unwrap();
            for (off, ext) in random_grid(&shape, &rparts, &mut rng) {
                let want = reg(names.iter().map(|nm| slice(nm, &off, &ext)).collect());
                let mut got = vec![SENTINEL; want.total as usize];
                for f in plan(&idx, &want).unwrap() {
                    let t = &want.tensors[f.target];
                    let src = &idx[&t.global.as_ref().unwrap().tensor];
                    for (si, runs) in &f.from {
                        let s = &src.sources[*si];
                        let data = &files[s.file].1[s.offset as usize..(s.offset + s.len) as usize];
                        for c in runs {
                            let at = (t.offset + c.dst) as usize;
                            got[at..at + c.run as usize].copy_from_slice(&data[c.src as usize..(c.src + c.run) as usize]);
                        }
                    }
                }
                for (k, t) in want.tensors.iter().enumerate() {
                    for (j, c) in coords(&off, &ext).iter().enumerate() {
                        let at = t.offset as usize + j * 4;
                        let v = f32::from_le_bytes(got[at..at + 4].try_into().unwrap());
                        assert_eq!(
                            v,
                            value(k, linear(&shape, c)),
                            "case {case}: shape {shape:?}, writers {wparts:?}, reader block {off:?}+{ext:?}, tensor {}, element {c:?}",
                            t.name
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_digest_does_not_depend_on_order_of_insertion() {
        let mut a = BTreeMap::new();
        a.insert("b".to_string(), tensor_sha256(b"2"));
        a.insert("a".to_string(), tensor_sha256(b"1"));
        let mut b = BTreeMap::new();
        b.insert("a".to_string(), tensor_sha256(b"1"));
        b.insert("b".to_string(), tensor_sha256(b"2"));
        assert_eq!(global_digest(&a), global_digest(&b));
        b.insert("b".to_string(), tensor_sha256(b"3"));
        assert_ne!(global_digest(&a), global_digest(&b));
    }
}

//! `ironweave ckpt inspect DIR`: what a persistent tier holds — its iterations, the newest one
//! every rank finished writing, the layout that wrote it, every global tensor with its owner
//! slices — with every file verified (each tensor against its checksum, the owner slices
//! against the model: no overlap, no hole) and the layout-free digest of the global state.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ironweave::ckpt::{layout, persist};
use serde::Serialize;

use crate::error::{Context, Result};

/// What `inspect` found.
#[derive(Debug, Clone, Serialize)]
pub struct Inspection {
    /// The directory.
    pub dir: PathBuf,
    /// Iterations with rank 0's manifest, newest first.
    pub iterations: Vec<u64>,
    /// The iteration inspected (the newest complete one unless asked).
    pub iter: u64,
    /// Newer iterations passed over, and why.
    pub incomplete: Vec<String>,
    /// World size that wrote it.
    pub world: u32,
    /// The writer's parallel layout (rank 0's manifest).
    pub layout: BTreeMap<String, String>,
    /// Global tensors: name → (dtype, shape, owner slices as (rank, offsets, extent)).
    pub tensors: BTreeMap<String, TensorInfo>,
    /// Bytes of the global state (each element once).
    pub global_bytes: u64,
    /// Bytes in the files (replicated tensors counted on every rank).
    pub file_bytes: u64,
    /// The layout-free digest (`ironweave_ckpt::layout::global_digest`), as `report.json`'s
    /// `global_state_sha256`.
    pub global_state_sha256: String,
}

/// One global tensor.
#[derive(Debug, Clone, Serialize)]
pub struct TensorInfo {
    pub dtype: String,
    pub shape: Vec<u64>,
    /// (rank whose file holds it, offsets, extent).
    pub slices: Vec<(usize, Vec<u64>, Vec<u64>)>,
}

/// Inspects `dir` at `iter` (None: the newest complete iteration), reading every file and
/// verifying it.
pub fn inspect(dir: &Path, iter: Option<u64>) -> Result<Inspection> {
    let iterations = persist::iterations(dir, 0);
    let (iter, incomplete) = match iter {
        Some(i) => (i, Vec::new()),
        None => persist::newest_complete(dir).with_context(|| format!("inspecting {}", dir.display()))?,
    };
    let mans = persist::read_manifests(dir, iter)?;
    let files: Vec<(&ironweave::ckpt::Registry, Option<&[u64]>)> =
        mans.iter().map(|m| (&m.registry, (!m.tensor_xxh3.is_empty()).then_some(m.tensor_xxh3.as_slice()))).collect();
    let idx = layout::index(&files)?;
    let mut file_bytes = 0u64;
    let mut per_tensor: BTreeMap<String, [u8; 32]> = BTreeMap::new();
    for (r, m) in mans.iter().enumerate() {
        // the whole file against the manifest's chunk checksums, then each tensor against its own
        let snap = persist::load(dir, iter, r as u32)?;
        file_bytes += snap.data.len() as u64;
        for (k, t) in m.registry.tensors.iter().enumerate() {
            let b = &snap.data[t.offset as usize..(t.offset + t.len) as usize];
            if let Some(&x) = m.tensor_xxh3.get(k) {
                if xxhash_rust::xxh3::xxh3_64(b) != x {
                    crate::error::bail!(
                        "tensor `{}` in rank {r}'s file of iteration {iter}: its bytes do not match its checksum",
                        t.name
                    );
                }
            }
            if let Some(g) = t.global.as_ref().filter(|g| g.owner && g.shape == t.shape) {
                per_tensor.insert(g.tensor.clone(), layout::tensor_sha256(b));
            }
        }
    }
    // global tensors split over several owners are assembled to be hashed
    for (name, t) in &idx {
        if per_tensor.contains_key(name) {
            continue;
        }
        let bytes = t.shape.iter().product::<u64>() * t.dtype.size();
        let want = ironweave::ckpt::Registry::new(&[ironweave::ckpt::TensorSpec::new(name.clone(), t.dtype, &t.shape)
            .with_global(ironweave::ckpt::GlobalSlice::whole(name.clone(), &t.shape, true))])?;
        let s = persist::load_global(dir, iter, &want)?;
        debug_assert_eq!(s.data.len() as u64, bytes);
        per_tensor.insert(name.clone(), layout::tensor_sha256(&s.data));
    }
    let tensors = idx
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                TensorInfo {
                    dtype: t.dtype.name().into(),
                    shape: t.shape.clone(),
                    slices: t.sources.iter().map(|s| (s.file, s.offsets.clone(), s.extent.clone())).collect(),
                },
            )
        })
        .collect();
    Ok(Inspection {
        dir: dir.to_path_buf(),
        iterations,
        iter,
        incomplete,
        world: mans[0].world,
        layout: mans[0].layout.clone(),
        global_bytes: idx.values().map(|t| t.shape.iter().product::<u64>() * t.dtype.size()).sum(),
        file_bytes,
        tensors,
        global_state_sha256: layout::hex(&layout::global_digest(&per_tensor)),
    })
}

/// The human summary of an inspection.
pub fn summary(i: &Inspection) -> String {
    let mut s = format!(
        "{}: iteration {} of {:?} (newest every rank finished), written by {} ranks\n",
        i.dir.display(),
        i.iter,
        i.iterations,
        i.world
    );
    for x in &i.incomplete {
        s.push_str(&format!("  passed over: {x}\n"));
    }
    for (k, v) in &i.layout {
        s.push_str(&format!("  layout {k}: {v}\n"));
    }
    let split = i.tensors.values().filter(|t| t.slices.len() > 1).count();
    s.push_str(&format!(
        "  {} global tensors ({} split over several ranks), {:.1} MB of global state, {:.1} MB in the files; every tensor verified against its checksum\n",
        i.tensors.len(),
        split,
        i.global_bytes as f64 / 1e6,
        i.file_bytes as f64 / 1e6
    ));
    s.push_str(&format!("  global_state_sha256 {}\n", i.global_state_sha256));
    s
}

//! The state registry: named buffers (dtype, shape, bytes) of parameters and optimizer state,
//! laid out back to back in one snapshot buffer. No tensor library: the trainer hands over
//! bytes.

use serde::{Deserialize, Serialize};

use crate::error::{CkptError, Result};

/// Element type (the workspace's one dtype; manifests name it as safetensors does).
pub use ironweave_units::DType;

/// The part of a global tensor one registered tensor holds: the local tensor's shape is the
/// slice's extent in every dimension.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalSlice {
    /// Name of the global tensor (`l1.e5.w1`, `adam.m.l1.e5.w1`, `step`).
    pub tensor: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Where the slice starts in each dimension.
    pub offsets: Vec<u64>,
    /// This copy is the one a loader reads (a replicated tensor has one owner; the other
    /// ranks' copies are equal and not read).
    pub owner: bool,
}

impl GlobalSlice {
    /// The whole of global tensor `tensor` of `shape`.
    pub fn whole(tensor: impl Into<String>, shape: &[u64], owner: bool) -> Self {
        GlobalSlice { tensor: tensor.into(), shape: shape.to_vec(), offsets: vec![0; shape.len()], owner }
    }
}

/// One registered buffer and where it sits in the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Unique name (`layers.3.mlp.w1`, `adam.m.layers.3.mlp.w1`, `rng`, `data_position`).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Offset in the snapshot buffer.
    pub offset: u64,
    /// Length in bytes (`product(shape) × dtype size`).
    pub len: u64,
    /// The slice of a global tensor this buffer holds (None: a rank-local buffer; a checkpoint
    /// without global slices loads only onto the layout that wrote it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global: Option<GlobalSlice>,
}

impl TensorMeta {
    /// Whether two metas describe the same bytes (name, type, shape, place), whatever their
    /// global slices say.
    pub fn same_bytes(&self, o: &TensorMeta) -> bool {
        self.name == o.name && self.dtype == o.dtype && self.shape == o.shape && self.offset == o.offset && self.len == o.len
    }
}

/// What the trainer registers: a name, a type, a shape, and optionally the slice of a global
/// tensor it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// The slice of a global tensor it holds ([`crate::layout`]).
    pub global: Option<GlobalSlice>,
}

impl TensorSpec {
    /// Convenience constructor.
    pub fn new(name: impl Into<String>, dtype: DType, shape: &[u64]) -> Self {
        TensorSpec { name: name.into(), dtype, shape: shape.to_vec(), global: None }
    }

    /// The same tensor as slice `g` of a global tensor.
    pub fn with_global(mut self, g: GlobalSlice) -> Self {
        self.global = Some(g);
        self
    }
}

/// The layout of one rank's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registry {
    /// Buffers, in registration order, back to back.
    pub tensors: Vec<TensorMeta>,
    /// Total bytes.
    pub total: u64,
}

impl Registry {
    /// Lay out `specs`; names must be unique and non-empty.
    pub fn new(specs: &[TensorSpec]) -> Result<Self> {
        let mut seen = std::collections::HashSet::new();
        let mut offset = 0u64;
        let mut tensors = Vec::with_capacity(specs.len());
        for s in specs {
            if s.name.is_empty() || s.name.starts_with("__") {
                return Err(CkptError::Invalid(format!("tensor name `{}` is empty or reserved (starts with __)", s.name)));
            }
            if !seen.insert(s.name.clone()) {
                return Err(CkptError::Invalid(format!("tensor `{}` registered twice", s.name)));
            }
            let elems = s.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let len = elems.and_then(|e| e.checked_mul(s.dtype.size() as u64));
            let Some(len) = len else {
                return Err(CkptError::Invalid(format!("tensor `{}`: shape {:?} overflows", s.name, s.shape)));
            };
            tensors.push(TensorMeta {
                name: s.name.clone(),
                dtype: s.dtype,
                shape: s.shape.clone(),
                offset,
                len,
                global: s.global.clone(),
            });
            offset = offset.checked_add(len).ok_or_else(|| CkptError::Invalid("state larger than 2^64 bytes".into()))?;
        }
        Ok(Registry { tensors, total: offset })
    }

    /// Find a tensor by name.
    pub fn get(&self, name: &str) -> Option<&TensorMeta> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The first tensor whose presence, dtype or shape differs from `other`'s, as (name, here,
    /// in `other`), each side `dtype [shape]` or `missing`; `(order)` when the tensors are the
    /// same but the layouts still differ (order, offsets, global slices). None: equal layouts.
    pub fn first_difference(&self, other: &Registry) -> Option<(String, String, String)> {
        if self == other {
            return None;
        }
        let desc = |t: &TensorMeta| format!("{:?} {:?}", t.dtype, t.shape);
        for t in &self.tensors {
            match other.get(&t.name) {
                None => return Some((t.name.clone(), desc(t), "missing".into())),
                Some(o) if o.dtype != t.dtype || o.shape != t.shape => return Some((t.name.clone(), desc(t), desc(o))),
                Some(_) => {}
            }
        }
        Some(match other.tensors.iter().find(|o| self.get(&o.name).is_none()) {
            Some(o) => (o.name.clone(), "missing".into(), desc(o)),
            None => ("(order)".into(), "another order or offsets".into(), "this one".into()),
        })
    }

    /// [`Registry::first_difference`] of the local layouts only (names, dtypes, shapes, order):
    /// where each tensor sits in a global one is left out — ranks of one data-parallel job hold
    /// the same local layout while one of them owns each replicated tensor.
    pub fn first_local_difference(&self, other: &Registry) -> Option<(String, String, String)> {
        let local = |r: &Registry| {
            let mut r = r.clone();
            r.tensors.iter_mut().for_each(|t| t.global = None);
            r
        };
        local(self).first_difference(&local(other))
    }

    /// Check that `bufs` match the registry, in order.
    pub fn check(&self, bufs: &[&[u8]]) -> Result<()> {
        if bufs.len() != self.tensors.len() {
            return Err(CkptError::Invalid(format!("{} buffers for {} registered tensors", bufs.len(), self.tensors.len())));
        }
        for (t, b) in self.tensors.iter().zip(bufs) {
            if b.len() as u64 != t.len {
                return Err(CkptError::Invalid(format!("tensor `{}`: {} bytes given, {} registered", t.name, b.len(), t.len)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_difference_names_the_key_and_both_sides() {
        let reg = |specs: &[(&str, DType, &[u64])]| {
            Registry::new(&specs.iter().map(|(n, d, s)| TensorSpec::new(*n, *d, s)).collect::<Vec<_>>()).unwrap()
        };
        let a = reg(&[("w", DType::F32, &[4]), ("b", DType::F32, &[2])]);
        assert_eq!(a.first_difference(&a), None);
        let shape = reg(&[("w", DType::F32, &[5]), ("b", DType::F32, &[2])]);
        assert_eq!(a.first_difference(&shape), Some(("w".into(), "F32 [4]".into(), "F32 [5]".into())));
        let fewer = reg(&[("w", DType::F32, &[4])]);
        assert_eq!(a.first_difference(&fewer), Some(("b".into(), "F32 [2]".into(), "missing".into())));
        let extra = reg(&[("w", DType::F32, &[4]), ("b", DType::F32, &[2]), ("c", DType::I64, &[])]);
        assert_eq!(a.first_difference(&extra), Some(("c".into(), "missing".into(), "I64 []".into())));
        let reordered = reg(&[("b", DType::F32, &[2]), ("w", DType::F32, &[4])]);
        assert_eq!(a.first_difference(&reordered).map(|d| d.0), Some("(order)".into()));
    }
}

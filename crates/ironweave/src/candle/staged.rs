//! Models as chains of stages, the staged backward that lets gradients leave while earlier
//! stages compute, and a seeded initialisation.

use ironweave_units::Locked;
use std::time::Instant;

use candle_core::{DType, Module, Tensor, Var};
use candle_nn::VarMap;

use super::{Error, Result};

/// One parameter of the model.
#[derive(Debug, Clone)]
pub(super) struct Param {
    pub(super) name: String,
    pub(super) var: Var,
    pub(super) shape: Vec<usize>,
    pub(super) len: usize,
}

/// A model whose forward is a chain of stages: stage `k` maps stage `k - 1`'s output (the
/// input for stage 0) to its own; the last stage's output goes to the loss. Parameters may be
/// shared between stages.
pub trait Staged {
    /// Stages in forward order (at least 1).
    fn stages(&self) -> usize;
    /// Stage `k`'s forward.
    fn forward_stage(&self, k: usize, x: &Tensor) -> candle_core::Result<Tensor>;
}

/// Any candle [`Module`] as a one-stage model (gradients averaged after the whole backward).
#[derive(Debug, Clone, Copy)]
pub struct Whole<'a, M>(pub &'a M);

impl<M: Module> Staged for Whole<'_, M> {
    fn stages(&self) -> usize {
        1
    }
    fn forward_stage(&self, _k: usize, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)
    }
}

pub(super) fn to_host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// Sets every variable of `varmap` (in name order) to values drawn from a generator seeded
/// with `seed`, uniform in `±1/sqrt(fan_in)` (`fan_in`: the elements of one row of the first
/// dimension; a vector's own length): a deterministic stand-in for candle's CPU
/// initialisation, which cannot be seeded, so that two runs of a job start from the same
/// state (and a recovered run can end bit-identical to an uninterrupted one).
pub fn init_uniform(varmap: &VarMap, seed: u64) -> Result<()> {
    let mut named: Vec<(String, Var)> = varmap.data().locked().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut rng = ironweave_units::SplitMix64::new(seed);
    for (name, var) in named {
        fill_uniform(&name, &var, &mut rng)?;
    }
    Ok(())
}

/// [`init_uniform`] with each variable drawn from its own generator, `rng_of(name)`: a
/// variable's initial values then do not depend on which other variables exist (models that
/// differ in one head start from the same weights everywhere else).
pub fn init_uniform_per_variable(varmap: &VarMap, mut rng_of: impl FnMut(&str) -> ironweave_units::SplitMix64) -> Result<()> {
    let named: Vec<(String, Var)> = varmap.data().locked().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    for (name, var) in named {
        fill_uniform(&name, &var, &mut rng_of(&name))?;
    }
    Ok(())
}

/// Sets `var` uniform in `±1/sqrt(fan_in)` from `rng`.
fn fill_uniform(name: &str, var: &Var, rng: &mut ironweave_units::SplitMix64) -> Result<()> {
    let t = var.as_tensor();
    if t.dtype() != DType::F32 {
        return Err(Error::Invalid(format!("`{name}` is {:?}: init_uniform sets f32 variables", t.dtype())));
    }
    let dims = t.dims().to_vec();
    let n = t.elem_count();
    let fan_in = if dims.len() >= 2 { n / dims[0].max(1) } else { n };
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    let vals: Vec<f32> = (0..n).map(|_| ((2.0 * rng.unit() - 1.0) * bound) as f32).collect();
    var.set(&Tensor::from_vec(vals, dims.as_slice(), t.device())?)?;
    Ok(())
}

/// The staged forward and backward of one step: fills `grads` (summed over the stages that
/// touch each parameter), records in `seen` the backward stage after which each parameter's
/// gradient is final, and calls `after(stage, grads, started)` after each backward stage
/// (stage 0: the model's last). Returns this rank's loss.
pub(super) fn staged_backward<M: Staged>(
    model: &M,
    input: &Tensor,
    loss: &impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    params: &[Param],
    grads: &mut [Vec<f32>],
    seen: &mut [usize],
    mut after: impl FnMut(usize, &[Vec<f32>], Instant) -> Result<()>,
) -> Result<f32> {
    let k = model.stages();
    // forward: each later stage's input is a leaf of its own, so its backward stops there
    let mut leaves: Vec<Option<Var>> = Vec::with_capacity(k);
    let mut outs: Vec<Tensor> = Vec::with_capacity(k);
    let mut x = input.clone();
    for s in 0..k {
        let (leaf, xin) = if s == 0 {
            (None, x.clone())
        } else {
            let v = Var::from_tensor(&x.detach())?;
            let t = v.as_tensor().clone();
            (Some(v), t)
        };
        let out = model.forward_stage(s, &xin)?;
        leaves.push(leaf);
        outs.push(out.clone());
        x = out;
    }
    let l = loss(&x)?;
    let lv = l.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    let mut upstream: Option<Tensor> = None;
    for s in (0..k).rev() {
        let t0 = Instant::now();
        let target = match &upstream {
            None => l.clone(),
            // d sum(out * g) / d out = g exactly: the same gradient the whole backward gives
            Some(g) => (&outs[s] * g.detach())?.sum_all()?,
        };
        let gs = target.backward()?;
        let stage = k - 1 - s;
        for (i, p) in params.iter().enumerate() {
            if let Some(g) = gs.get(p.var.as_tensor()) {
                let g = to_host(g)?;
                if g.len() != p.len {
                    return Err(Error::Invalid(format!("`{}`: a gradient of {} for {} elements", p.name, g.len(), p.len)));
                }
                grads[i].iter_mut().zip(&g).for_each(|(a, b)| *a += b);
                seen[i] = stage;
            }
        }
        upstream = match &leaves[s] {
            Some(v) => Some(gs.get(v.as_tensor()).cloned().ok_or_else(|| {
                Error::Invalid(format!("stage {s}'s output does not depend on its input: stages must form a chain"))
            })?),
            None => None,
        };
        after(stage, grads, t0)?;
    }
    Ok(lv)
}

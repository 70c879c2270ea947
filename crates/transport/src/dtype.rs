//! Element types and reduction kernels.
//!
//! Collectives move bytes; reductions need to know what the bytes are. [`DType`] names the
//! element type at run time (so a backend with native collectives can map it, as NCCL does),
//! [`Element`] ties a Rust type to it at compile time.

use half::{bf16, f16};

/// The element types collectives understand: the workspace's one dtype.
pub use ironweave_units::DType;

/// Reduction operators of `all_reduce` and `reduce_scatter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Prod,
    Min,
    Max,
    /// Sum divided by the group size (integer division for integer types).
    Avg,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];
}

/// A Rust type that collectives can carry.
pub trait Element: bytemuck::Pod + PartialOrd + std::fmt::Debug + Send + Sync + 'static {
    /// The run-time name of this type.
    const DTYPE: DType;
    /// `a + b` (wrapping for integers).
    fn add(a: Self, b: Self) -> Self;
    /// `a * b` (wrapping for integers).
    fn mul(a: Self, b: Self) -> Self;
    /// The smaller of the two (`a` when they are equal or unordered).
    #[inline(always)]
    fn min(a: Self, b: Self) -> Self {
        smaller(a, b)
    }
    /// The larger of the two (`a` when they are equal or unordered).
    #[inline(always)]
    fn max(a: Self, b: Self) -> Self {
        larger(a, b)
    }
    /// `a / n`, used by [`ReduceOp::Avg`].
    fn div_count(a: Self, n: usize) -> Self;
    /// Converts a small integer (tests and benchmarks build data from these).
    fn from_i64(v: i64) -> Self;
}

/// The smaller of two values; `a` when they are equal or unordered (NaN stays where it was).
#[inline(always)]
fn smaller<T: PartialOrd>(a: T, b: T) -> T {
    if b < a {
        b
    } else {
        a
    }
}

/// The larger of two values; `a` when they are equal or unordered.
#[inline(always)]
fn larger<T: PartialOrd>(a: T, b: T) -> T {
    if b > a {
        b
    } else {
        a
    }
}

/// f32, f64 and the integers: arithmetic on the type itself (integers wrap on overflow).
macro_rules! plain_element {
    ($t:ty, $d:expr, $add:path, $mul:path) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                $add(a, b)
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                $mul(a, b)
            }
            fn div_count(a: Self, n: usize) -> Self {
                a / (n as $t)
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
plain_element!(f32, DType::F32, std::ops::Add::add, std::ops::Mul::mul);
plain_element!(f64, DType::F64, std::ops::Add::add, std::ops::Mul::mul);
plain_element!(i32, DType::I32, i32::wrapping_add, i32::wrapping_mul);
plain_element!(i64, DType::I64, i64::wrapping_add, i64::wrapping_mul);
plain_element!(u8, DType::U8, u8::wrapping_add, u8::wrapping_mul);

macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() + b.to_f32())
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() * b.to_f32())
            }
            fn div_count(a: Self, n: usize) -> Self {
                <$t>::from_f32(a.to_f32() / n as f32)
            }
            fn from_i64(v: i64) -> Self {
                <$t>::from_f32(v as f32)
            }
        }
    };
}
half_element!(f16, DType::F16);
half_element!(bf16, DType::BF16);

#[inline(always)]
fn zip_apply<T: Element>(dst: &mut [T], src: &[u8], f: impl Fn(T, T) -> T) {
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(src) => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = f(*d, *s);
            }
        }
        // Received buffers are normally aligned; fall back to unaligned reads if not.
        Err(_) => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(std::mem::size_of::<T>())) {
                *d = f(*d, bytemuck::pod_read_unaligned(s));
            }
        }
    }
}

fn reduce_typed<T: Element>(dst: &mut [T], src: &[u8], op: ReduceOp) {
    // One loop per operator, each monomorphized with the operator inlined, so the compiler
    // vectorizes it (a function pointer here costs 5x).
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip_apply(dst, src, T::add),
        ReduceOp::Prod => zip_apply(dst, src, T::mul),
        ReduceOp::Min => zip_apply(dst, src, T::min),
        ReduceOp::Max => zip_apply(dst, src, T::max),
    }
}

fn with_typed<T: Element>(dst: &mut [u8], f: impl FnOnce(&mut [T])) {
    match bytemuck::try_cast_slice_mut::<u8, T>(dst) {
        Ok(d) => f(d),
        Err(_) => {
            // Unaligned destination: reduce into an aligned copy and write it back.
            let mut tmp: Vec<T> = dst.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect();
            f(&mut tmp);
            dst.copy_from_slice(bytemuck::cast_slice(&tmp));
        }
    }
}

/// `dst[i] = op(dst[i], src[i])` over bytes holding `dtype` elements. Both slices must have
/// the same length, a multiple of the element size (callers check; this asserts in debug).
/// `Avg` sums here; the division happens once at the end ([`finish_avg`]).
pub fn reduce_into(dtype: DType, dst: &mut [u8], src: &[u8], op: ReduceOp) {
    debug_assert_eq!(dst.len(), src.len());
    match dtype {
        DType::F32 => with_typed::<f32>(dst, |d| reduce_typed(d, src, op)),
        DType::F64 => with_typed::<f64>(dst, |d| reduce_typed(d, src, op)),
        DType::F16 => with_typed::<f16>(dst, |d| reduce_typed(d, src, op)),
        DType::BF16 => with_typed::<bf16>(dst, |d| reduce_typed(d, src, op)),
        DType::I32 => with_typed::<i32>(dst, |d| reduce_typed(d, src, op)),
        DType::I64 => with_typed::<i64>(dst, |d| reduce_typed(d, src, op)),
        DType::U8 => with_typed::<u8>(dst, |d| reduce_typed(d, src, op)),
    }
}

fn div_typed<T: Element>(d: &mut [T], n: usize) {
    for x in d {
        *x = T::div_count(*x, n);
    }
}

/// Divides every element by `n` (the last step of [`ReduceOp::Avg`]).
pub fn finish_avg(dtype: DType, buf: &mut [u8], n: usize) {
    match dtype {
        DType::F32 => with_typed::<f32>(buf, |d| div_typed(d, n)),
        DType::F64 => with_typed::<f64>(buf, |d| div_typed(d, n)),
        DType::F16 => with_typed::<f16>(buf, |d| div_typed(d, n)),
        DType::BF16 => with_typed::<bf16>(buf, |d| div_typed(d, n)),
        DType::I32 => with_typed::<i32>(buf, |d| div_typed(d, n)),
        DType::I64 => with_typed::<i64>(buf, |d| div_typed(d, n)),
        DType::U8 => with_typed::<u8>(buf, |d| div_typed(d, n)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_ops_on_bytes() {
        let mut a: Vec<i32> = vec![1, -5, 7];
        let b: Vec<i32> = vec![2, 3, -7];
        let bytes = bytemuck::cast_slice::<i32, u8>(&b).to_vec();
        reduce_into(DType::I32, bytemuck::cast_slice_mut(&mut a), &bytes, ReduceOp::Max);
        assert_eq!(a, vec![2, 3, 7]);
        reduce_into(DType::I32, bytemuck::cast_slice_mut(&mut a), &bytes, ReduceOp::Prod);
        assert_eq!(a, vec![4, 9, -49]);
        finish_avg(DType::I32, bytemuck::cast_slice_mut(&mut a), 2);
        assert_eq!(a, vec![2, 4, -24]);
    }

    #[test]
    fn unaligned_source_is_handled() {
        let mut a = vec![1.0f64, 2.0];
        let mut raw = [0u8; 17];
        raw[1..].copy_from_slice(bytemuck::cast_slice(&[0.5f64, 0.25]));
        reduce_into(DType::F64, bytemuck::cast_slice_mut(&mut a), &raw[1..], ReduceOp::Sum);
        assert_eq!(a, vec![1.5, 2.25]);
    }

    #[test]
    fn half_types_reduce_through_f32() {
        let mut a = vec![bf16::from_f32(1.5), bf16::from_f32(-2.0)];
        let b = [bf16::from_f32(0.5), bf16::from_f32(8.0)];
        reduce_into(DType::BF16, bytemuck::cast_slice_mut(&mut a), bytemuck::cast_slice(&b), ReduceOp::Min);
        assert_eq!(a, vec![bf16::from_f32(0.5), bf16::from_f32(-2.0)]);
        assert_eq!(DType::parse("bf16"), Some(DType::BF16));
    }
}

//! ironweave-units: the few definitions that the planner, the command line and the benchmark
//! helper (xtask) must agree on — byte sizes as people write them (`4K`, `16M`, `1G`) and the
//! collectives' bus-bandwidth factors (nccl-tests' definition) — with no dependencies, so that
//! even xtask can use them without building the workspace.
//!
//! ```
//! use ironweave_units::{human_bytes, parse_size, SplitMix64};
//! assert_eq!(parse_size("16M").unwrap(), 16 << 20);
//! assert!(parse_size("16Q").is_err());
//! println!("{}", human_bytes(3 << 30));
//! // the same numbers on every machine
//! assert_eq!(SplitMix64::new(7).next_u64(), SplitMix64::new(7).next_u64());
//! ```

use std::fmt;
use std::str::FromStr;

/// A device's speed as the roofline model sees it: an operation takes as long as its FLOPs at
/// the device's rate or its bytes through device memory, whichever is longer. What the planner
/// costs a layer with (`ironweave_plan::DeviceDesc::roofline`) and what emulated compute
/// occupies the device for (`ironweave_train::device`): one formula for both.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roofline {
    /// Floating-point operations per second a large kernel reaches.
    pub flops_per_s: f64,
    /// Device memory bytes per second; `None`: only the FLOPs count.
    pub bytes_per_s: Option<f64>,
}

impl Roofline {
    /// Seconds an operation of `flops` that moves `bytes` through device memory takes.
    pub fn seconds(&self, flops: f64, bytes: f64) -> f64 {
        let compute = flops / self.flops_per_s;
        match self.bytes_per_s {
            Some(bw) => compute.max(bytes / bw),
            None => compute,
        }
    }
}

/// A size or collective name that could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(pub String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParseError {}

/// Parses `4K`, `1M`, `64M`, `1G` (binary multiples, either case) or a plain byte count.
pub fn parse_size(s: &str) -> Result<u64, ParseError> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1u64 << 10),
        Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let n: u64 =
        num.parse().map_err(|_| ParseError(format!("size {s:?}: expected a number with an optional K, M or G suffix")))?;
    n.checked_mul(mul).ok_or_else(|| ParseError(format!("size {s:?} is too large")))
}

/// `16 MiB`, `4 KiB`, `1 GiB` when exact, else bytes.
pub fn human_bytes(b: u64) -> String {
    if b >= 1 << 30 && b % (1 << 30) == 0 {
        format!("{} GiB", b >> 30)
    } else if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

/// A collective, as the cost model and the benchmarks name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Coll {
    /// Sum everywhere.
    AllReduce,
    /// Concatenate shards.
    AllGather,
    /// Sum and scatter shards.
    ReduceScatter,
    /// Personalised exchange.
    AllToAll,
    /// One root's buffer everywhere.
    Broadcast,
}

impl Coll {
    /// Its name in benchmark rows and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "allreduce",
            Coll::AllGather => "allgather",
            Coll::ReduceScatter => "reducescatter",
            Coll::AllToAll => "alltoall",
            Coll::Broadcast => "broadcast",
        }
    }

    /// Bytes each rank moves per byte of buffer in a group of `n` (nccl-tests' bus factor:
    /// busbw = algbw × factor); 0 for a group of one.
    pub fn bus_factor(self, n: u32) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let n = f64::from(n);
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll => (n - 1.0) / n,
            Coll::Broadcast => 1.0,
        }
    }

    /// Latency terms (ring steps) for a group of `n`.
    pub fn steps(self, n: u32) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let n = f64::from(n - 1);
        match self {
            Coll::AllReduce => 2.0 * n,
            _ => n,
        }
    }
}

impl FromStr for Coll {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Coll, ParseError> {
        [Coll::AllReduce, Coll::AllGather, Coll::ReduceScatter, Coll::AllToAll, Coll::Broadcast]
            .into_iter()
            .find(|c| c.name() == s.trim())
            .ok_or_else(|| {
                ParseError(format!("unknown collective {s:?}: allreduce, allgather, reducescatter, alltoall, broadcast"))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_in_bits_and_bytes_per_second() {
        assert_eq!(parse_rate("200mbit").unwrap(), 25_000_000);
        assert_eq!(parse_rate("10Gbit").unwrap(), 1_250_000_000);
        assert_eq!(parse_rate("125mbps").unwrap(), 125_000_000);
        assert_eq!(parse_rate("800").unwrap(), 100);
        assert!(parse_rate("fast").unwrap_err().to_string().contains("expected a number"));
        assert!(parse_rate("3furlongs").unwrap_err().to_string().contains("expected a number"));
        assert!(parse_rate("0mbit").unwrap_err().to_string().contains("positive"));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size(" 16m ").unwrap(), 16 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("123").unwrap(), 123);
        assert!(parse_size("1.5M").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
        assert!(parse_size("17179869184G").unwrap_err().to_string().contains("too large"));
        assert_eq!(human_bytes(16 << 20), "16 MiB");
        assert_eq!(human_bytes(1000), "1000 B");
    }

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(Coll::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Coll::AllGather.bus_factor(4), 0.75);
        assert_eq!(Coll::AllToAll.bus_factor(2), 0.5);
        assert_eq!(Coll::Broadcast.bus_factor(8), 1.0);
        assert_eq!(Coll::AllReduce.bus_factor(1), 0.0);
        for c in ["allreduce", "allgather", "reducescatter", "alltoall", "broadcast"] {
            assert_eq!(c.parse::<Coll>().unwrap().name(), c);
        }
        assert!("gather".parse::<Coll>().is_err());
    }
}

/// Parses a link rate as `tc` writes it — bits per second as `1gbit`, `300mbit`, `64kbit`,
/// `2500bit` or a bare number, bytes per second as `125mbps`, `1gbps`, `64kbps`, `500bps`
/// (either case) — into bytes per second.
pub fn parse_rate(s: &str) -> Result<u64, ParseError> {
    let t = s.trim().to_ascii_lowercase();
    let units =
        [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0), ("gbps", 8e9), ("mbps", 8e6), ("kbps", 8e3), ("bps", 8.0)];
    let (num, bits) = match units.iter().find_map(|(suf, m)| t.strip_suffix(suf).map(|n| (n.to_string(), *m))) {
        Some(x) => x,
        None if t.chars().next().is_some_and(|c| c.is_ascii_digit()) && !t.chars().any(|c| c.is_ascii_alphabetic()) => {
            (t.clone(), 1.0)
        }
        None => {
            return Err(ParseError(format!(
                "rate {s:?}: expected a number with gbit, mbit, kbit, bit (bits/s) or gbps, mbps, kbps, bps (bytes/s)"
            )))
        }
    };
    let v: f64 = num.trim().parse().map_err(|_| ParseError(format!("rate {s:?}: {num:?} is not a number")))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(ParseError(format!("rate {s:?} must be positive")));
    }
    Ok((v * bits / 8.0) as u64)
}

/// An element type: the workspace's one dtype — what collectives reduce, what a checkpoint's
/// tensors hold (safetensors names), what a model description trains in (`fp16`, `bf16`,
/// `fp32` in its TOML).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum DType {
    /// IEEE double.
    #[cfg_attr(feature = "serde", serde(rename = "F64", alias = "f64", alias = "fp64"))]
    F64,
    /// IEEE single.
    #[cfg_attr(feature = "serde", serde(rename = "F32", alias = "f32", alias = "fp32"))]
    F32,
    /// IEEE half.
    #[cfg_attr(feature = "serde", serde(rename = "F16", alias = "f16", alias = "fp16"))]
    F16,
    /// bfloat16.
    #[cfg_attr(feature = "serde", serde(rename = "BF16", alias = "bf16"))]
    BF16,
    /// 64-bit signed integer.
    #[cfg_attr(feature = "serde", serde(rename = "I64", alias = "i64"))]
    I64,
    /// 32-bit signed integer.
    #[cfg_attr(feature = "serde", serde(rename = "I32", alias = "i32"))]
    I32,
    /// Byte.
    #[cfg_attr(feature = "serde", serde(rename = "U8", alias = "u8"))]
    U8,
}

impl DType {
    /// Every dtype, for tests and benchmarks.
    pub const ALL: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Lower-case name (`f32`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// The name safetensors files use (`F32`, `BF16`, ...).
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::U8 => "U8",
        }
    }

    /// Whether it is a floating-point type (what a model can train in).
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
    }

    /// Parses a name as [`DType::name`] prints it.
    pub fn parse(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }

    /// Parses a safetensors name ([`DType::safetensors_name`]).
    pub fn parse_safetensors(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.safetensors_name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A mutex's guard whether or not a thread panicked while holding it: the workspace's one way
/// to lock. A panic in a thread that held one of our locks has already failed the operation it
/// was part of (its error reaches the caller by another path: a join, a closed channel, a lost
/// peer), and the data behind the lock are plain values that stay usable; a second panic in
/// every thread that locks after it would only hide the first one's message.
pub trait Locked<T: ?Sized> {
    /// Locks, taking the guard of a poisoned lock as is.
    fn locked(&self) -> std::sync::MutexGuard<'_, T>;
}

impl<T: ?Sized> Locked<T> for std::sync::Mutex<T> {
    fn locked(&self) -> std::sync::MutexGuard<'_, T> {
        self.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// SplitMix64: a tiny, well-mixed, seedable generator — the same numbers on every machine, no
/// dependency. The one generator of the workspace (workloads, simulator, chaos campaigns, the
/// candle adapter's seeded initialisation). `SplitMix64(state)` starts from a raw state;
/// [`SplitMix64::new`] mixes a seed first.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// A generator for `seed` (mixed, so that small seeds do not start close together).
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)` (`n = 0` is taken as 1).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// One of `v`, uniformly (panics on an empty slice).
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.unit().max(1e-300);
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

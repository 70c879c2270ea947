//! The conformance suite every backend must pass, and the data generators it uses.
//!
//! [`conformance_suite!`](crate::conformance_suite) expands to one `#[test]` per collective and
//! world size; each test runs every dtype × size (× reduction operator) in one set of ranks,
//! checked element by element against a sequential reference. Inputs are built so that the
//! reference of each element costs O(1) (a per-element pattern plus a per-rank offset), which
//! keeps the 64 MiB cases cheap to verify, and so that every reduction is exact in every dtype.

use crate::{Communicator, DType, Element, Error, ReduceOp, Result};
use half::{bf16, f16};

/// The collectives the suite covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    AllReduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    AllToAll,
    AllToAllV,
    Barrier,
    /// Every collective again on sub-groups made by `split` (two levels deep).
    Split,
    /// `iall_reduce`, `iall_gather`, `ireduce_scatter` and `ibroadcast` in flight together,
    /// beside blocking collectives on the same communicator, waited on in reverse order.
    NonBlocking,
    /// A message sent in parts (`send_bytes_parts`: a header and a payload lying apart) from
    /// each rank to the next, small and large enough to be striped: the receiver gets their
    /// concatenation as one message.
    Parts,
}

/// Element counts tested for `dtype`: 0, 1, 7, 1 MiB + 3 elements' worth, 64 MiB.
pub fn sizes(dtype: DType) -> Vec<usize> {
    vec![0, 1, 7, (1 << 20) / dtype.size() + 3, (64 << 20) / dtype.size()]
}

fn mixh(i: usize, salt: u64) -> u64 {
    ((i as u64) ^ salt.wrapping_mul(0x2545_f491_4f6c_dd1d)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40
}

fn signed(d: DType) -> bool {
    d != DType::U8
}

/// Input element `i` of world rank `r` for a case with `salt`, as an integer.
pub fn gen(d: DType, op: ReduceOp, r: usize, i: usize, salt: u64) -> i64 {
    let h = mixh(i, salt);
    if op == ReduceOp::Prod {
        let a = [1, 2, if signed(d) { -1 } else { 3 }][(h % 3) as usize];
        let b = if r % 2 == 0 {
            1
        } else if signed(d) {
            -1
        } else {
            3
        };
        return a * b;
    }
    let a = (h % 5) as i64 - if signed(d) { 2 } else { 0 };
    a + (r % 2) as i64
}

/// The reduction of element `i` over world ranks `ranks`.
pub fn reduced<T: Element>(op: ReduceOp, ranks: &[usize], i: usize, salt: u64) -> T {
    let d = T::DTYPE;
    let vals = ranks.iter().map(|&r| gen(d, op, r, i, salt));
    let v = match op {
        ReduceOp::Sum | ReduceOp::Avg => vals.sum::<i64>(),
        ReduceOp::Prod => vals.fold(1i64, |a, b| a.wrapping_mul(b)),
        ReduceOp::Min => vals.min().unwrap_or(0),
        ReduceOp::Max => vals.max().unwrap_or(0),
    };
    let t = T::from_i64(v);
    if op == ReduceOp::Avg {
        T::div_count(t, ranks.len())
    } else {
        t
    }
}

fn fill<T: Element>(op: ReduceOp, r: usize, len: usize, off: usize, salt: u64) -> Vec<T> {
    (0..len).map(|i| T::from_i64(gen(T::DTYPE, op, r, off + i, salt))).collect()
}

fn check<T: Element>(what: &str, got: &[T], want: impl Fn(usize) -> T) -> Result<()> {
    for (i, g) in got.iter().enumerate() {
        let w = want(i);
        if *g != w {
            return Err(Error::InvalidArgument(format!("{what}: element {i} of {} is {g:?}, expected {w:?}", got.len())));
        }
    }
    Ok(())
}

/// Runs `case` on every dtype and size, on this rank's communicator. All ranks call it.
pub fn run_case(c: &Communicator, case: Case) -> Result<()> {
    if case == Case::Parts {
        return parts_case(c);
    }
    if case == Case::NonBlocking {
        // small (latency path), odd, and 1 MiB + (ring path) buffers; two element types
        for count in [1, 7, (1 << 18) + 3] {
            nonblocking_case::<f32>(c, count)?;
            nonblocking_case::<i64>(c, count)?;
        }
        return Ok(());
    }
    for d in DType::ALL {
        match d {
            DType::F32 => run_typed::<f32>(c, case)?,
            DType::F64 => run_typed::<f64>(c, case)?,
            DType::F16 => run_typed::<f16>(c, case)?,
            DType::BF16 => run_typed::<bf16>(c, case)?,
            DType::I32 => run_typed::<i32>(c, case)?,
            DType::I64 => run_typed::<i64>(c, case)?,
            DType::U8 => run_typed::<u8>(c, case)?,
        }
    }
    Ok(())
}

fn members(c: &Communicator) -> Vec<usize> {
    (0..c.size()).map(|g| c.world_rank(g)).collect()
}

fn run_typed<T: Element>(c: &Communicator, case: Case) -> Result<()> {
    let d = T::DTYPE;
    let sz = sizes(d);
    for (si, &count) in sz.iter().enumerate() {
        // The largest size runs once (Sum) per collective; the operators run on the rest.
        let ops: &[ReduceOp] = if si + 1 == sz.len() { &[ReduceOp::Sum] } else { &ReduceOp::ALL };
        let salt = (si as u64) << 8 | d.size() as u64;
        match case {
            Case::Split => {
                if si + 1 < sz.len() {
                    split_case::<T>(c, count, salt)?;
                }
            }
            Case::AllReduce | Case::ReduceScatter => {
                for &op in ops {
                    check_collective::<T>(c, case, count, op, salt ^ (op as u64) << 16, si + 1 == sz.len())?;
                }
            }
            _ => check_collective::<T>(c, case, count, ReduceOp::Sum, salt, si + 1 == sz.len())?,
        }
    }
    Ok(())
}

/// Each rank sends the next one a message in three parts (a 17-byte header, an empty part, a
/// payload of 5 bytes or 5 MiB + 3: past the TCP backend's striping threshold) and checks the
/// one it receives from the previous rank byte for byte.
fn parts_case(c: &Communicator) -> Result<()> {
    let (n, me) = (c.size(), c.rank());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let body =
        |r: usize, len: usize| -> Vec<u8> { (0..len).map(|i| (i as u64 * 31 + r as u64 * 7 + (i >> 12) as u64) as u8).collect() };
    for (k, len) in [5usize, (5 << 20) + 3].into_iter().enumerate() {
        let tag = 700 + k as u32;
        let head: Vec<u8> = (0..17).map(|i| (i * 3 + me) as u8).collect();
        let payload = body(me, len);
        let h = c.irecv_bytes(prev, tag)?;
        c.send_bytes_parts(next, tag, &[&head, &[], &payload])?;
        let got = h.wait(c.deadline_from_now())?.into_vec();
        let want: Vec<u8> = (0..17).map(|i| (i * 3 + prev) as u8).chain(body(prev, len)).collect();
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b);
            return Err(Error::InvalidArgument(format!(
                "parts from rank {prev}: {} bytes, expected {}; first difference at {at:?}",
                got.len(),
                want.len()
            )));
        }
    }
    Ok(())
}

/// Four non-blocking collectives issued back to back, a blocking all-reduce on the same
/// communicator while they are in flight, then the handles waited on in reverse order: every
/// result checked; and since they run in issue order, the last one finished means all did.
fn nonblocking_case<T: Element>(c: &Communicator, count: usize) -> Result<()> {
    let (n, me) = (c.size(), c.rank());
    let wr = c.world_rank(me);
    let ranks = members(c);
    let salt = 0x6e62 ^ count as u64;
    let op = ReduceOp::Sum;
    let tag = |what: &str| format!("non-blocking {what} {} count={count} n={n} rank={me}", T::DTYPE);
    let root = n - 1;
    let h_ar = c.iall_reduce(fill::<T>(op, wr, count, 0, salt), op)?;
    let h_ag = c.iall_gather(fill::<T>(op, wr, count, 0, salt ^ 1))?;
    let h_rs = c.ireduce_scatter(fill::<T>(op, wr, count * n, 0, salt ^ 2), op)?;
    let bc = if me == root { fill::<T>(op, wr, count, 0, salt ^ 3) } else { vec![T::zeroed(); count] };
    let h_bc = c.ibroadcast(bc, root)?;
    // a blocking collective on the same communicator while those are in flight
    let mut v = fill::<T>(op, wr, count, 0, salt ^ 4);
    c.all_reduce(&mut v, op)?;
    check(&tag("blocking all_reduce beside them"), &v, |i| reduced::<T>(op, &ranks, i, salt ^ 4))?;
    let bc = h_bc.wait()?;
    check(&tag("ibroadcast"), &bc, |i| T::from_i64(gen(T::DTYPE, op, ranks[root], i, salt ^ 3)))?;
    if !(h_ar.test() && h_ag.test() && h_rs.test()) {
        return Err(Error::InvalidArgument(format!("{}: a later operation finished before an earlier one", tag("order"))));
    }
    let rs = h_rs.wait()?;
    check(&tag("ireduce_scatter"), &rs, |i| reduced::<T>(op, &ranks, me * count + i, salt ^ 2))?;
    let ag = h_ag.wait()?;
    check(&tag("iall_gather"), &ag, |i| T::from_i64(gen(T::DTYPE, op, ranks[i / count], i % count, salt ^ 1)))?;
    let ar = h_ar.wait_until(std::time::Instant::now() + std::time::Duration::from_secs(60))?;
    check(&tag("iall_reduce"), &ar, |i| reduced::<T>(op, &ranks, i, salt))?;
    // bad input is refused at once, not in the thread
    if n > 1 && c.ireduce_scatter(vec![T::zeroed(); n + 1], op).is_ok() {
        return Err(Error::InvalidArgument(format!("{}: an uneven ireduce_scatter was accepted", tag("check"))));
    }
    Ok(())
}

/// One collective call, checked element by element. `big` sizes are totals (split among ranks where a
/// collective multiplies by the group size); other sizes are per rank.
pub fn check_collective<T: Element>(
    c: &Communicator,
    case: Case,
    count: usize,
    op: ReduceOp,
    salt: u64,
    big: bool,
) -> Result<()> {
    let (n, me) = (c.size(), c.rank());
    let wr = c.world_rank(me);
    let ranks = members(c);
    let per = if big { count / n } else { count };
    let tag = format!("{case:?} {} count={count} op={op:?} n={n} rank={me}", T::DTYPE);
    match case {
        Case::AllReduce => {
            let mut v = fill::<T>(op, wr, count, 0, salt);
            c.all_reduce(&mut v, op)?;
            check(&tag, &v, |i| reduced::<T>(op, &ranks, i, salt))
        }
        Case::Broadcast => {
            let root = (salt as usize >> 8) % n;
            let mut v = if me == root { fill::<T>(op, wr, count, 0, salt) } else { vec![T::zeroed(); count] };
            c.broadcast(&mut v, root)?;
            check(&tag, &v, |i| T::from_i64(gen(T::DTYPE, op, ranks[root], i, salt)))
        }
        Case::AllGather => {
            let input = fill::<T>(op, wr, per, 0, salt);
            let mut out = vec![T::zeroed(); per * n];
            c.all_gather(&input, &mut out)?;
            check(&tag, &out, |i| T::from_i64(gen(T::DTYPE, op, ranks[i / per.max(1)], i % per.max(1), salt)))
        }
        Case::ReduceScatter => {
            let input = fill::<T>(op, wr, per * n, 0, salt);
            let mut out = vec![T::zeroed(); per];
            c.reduce_scatter(&input, &mut out, op)?;
            check(&tag, &out, |i| reduced::<T>(op, &ranks, me * per + i, salt))
        }
        Case::AllToAll => {
            // Block j of rank r holds elements starting at j*per of r's pattern.
            let input = fill::<T>(op, wr, per * n, 0, salt);
            let mut out = vec![T::zeroed(); per * n];
            c.all_to_all(&input, &mut out)?;
            check(&tag, &out, |i| T::from_i64(gen(T::DTYPE, op, ranks[i / per.max(1)], me * per + i % per.max(1), salt)))
        }
        Case::AllToAllV => {
            // Rank r sends cnt(r, j) elements to rank j, from offset 1000*j of its pattern.
            let cnt = |r: usize, j: usize| (per * ((r + 2 * j) % 3)) / 2;
            let sc: Vec<usize> = (0..n).map(|j| cnt(me, j)).collect();
            let rc: Vec<usize> = (0..n).map(|j| cnt(j, me)).collect();
            let send: Vec<T> = (0..n).flat_map(|j| fill::<T>(op, wr, sc[j], 1000 * j, salt)).collect();
            let expected: Vec<T> = (0..n).flat_map(|j| fill::<T>(op, ranks[j], rc[j], 1000 * me, salt)).collect();
            let out = if salt & 0x100 == 0 {
                let mut out = vec![T::zeroed(); rc.iter().sum()];
                c.all_to_all_v(&send, &sc, &mut out, &rc)?;
                out
            } else {
                let (out, got) = c.all_to_all_v_exchange(&send, &sc)?;
                if got != rc {
                    return Err(Error::InvalidArgument(format!("{tag}: received counts {got:?}, expected {rc:?}")));
                }
                out
            };
            check(&tag, &out, |i| expected[i])
        }
        Case::Barrier => Ok(()),
        Case::Split => unreachable!("handled by split_case"),
        Case::NonBlocking | Case::Parts => unreachable!("handled by nonblocking_case and parts_case"),
    }
}

fn split_case<T: Element>(c: &Communicator, count: usize, salt: u64) -> Result<()> {
    let n = c.size();
    let me = c.rank();
    // Two colours, members ordered in reverse; then split each half again.
    let sub = c.split((me % 2) as u32, (n - me) as u32)?;
    let want: Vec<usize> = {
        let mut v: Vec<usize> = (0..n).filter(|r| r % 2 == me % 2).collect();
        v.reverse();
        v.into_iter().map(|g| c.world_rank(g)).collect()
    };
    if members(&sub) != want {
        return Err(Error::InvalidArgument(format!("split made group {:?}, expected {want:?}", members(&sub))));
    }
    let subsub = sub.split((sub.rank() / 2) as u32, sub.rank() as u32)?;
    for g in [&sub, &subsub] {
        for case in [Case::AllReduce, Case::Broadcast, Case::AllGather, Case::ReduceScatter, Case::AllToAll, Case::AllToAllV] {
            check_collective::<T>(g, case, count, ReduceOp::Sum, salt, false)?;
        }
        check_collective::<T>(g, Case::AllReduce, count, ReduceOp::Max, salt ^ 0x77, false)?;
        g.barrier()?;
    }
    // The parent still works after children were made and used.
    check_collective::<T>(c, Case::AllReduce, count, ReduceOp::Min, salt ^ 0x99, false)
}

/// Barrier semantics with a shared counter (ranks are threads of one process here): after
/// round k's barrier, every rank must see all n arrivals of that round.
pub fn barrier_case(c: &Communicator, arrivals: &std::sync::atomic::AtomicUsize, rounds: usize) -> Result<()> {
    use std::sync::atomic::Ordering;
    for k in 0..rounds {
        if c.rank() == k % c.size() {
            // One rank dawdles, so a barrier that does not wait shows.
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        arrivals.fetch_add(1, Ordering::SeqCst);
        c.barrier()?;
        let seen = arrivals.load(Ordering::SeqCst);
        if seen < (k + 1) * c.size() {
            return Err(Error::InvalidArgument(format!(
                "barrier round {k}: rank {} passed after only {seen} arrivals",
                c.rank()
            )));
        }
        c.barrier()?;
    }
    Ok(())
}

/// Runs `case` with one thread per communicator and panics with every rank's error.
pub fn run_world(comms: Vec<Communicator>, case: Case) {
    let arrivals = std::sync::atomic::AtomicUsize::new(0);
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let arrivals = &arrivals;
                // Each rank closes its communicator on its own thread, as separate processes would.
                s.spawn(move || if case == Case::Barrier { barrier_case(&c, arrivals, 6) } else { run_case(&c, case) })
            })
            .collect();
        hs.into_iter()
            .enumerate()
            .filter_map(|(r, h)| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("rank {r}: {e}")),
                Err(_) => Some(format!("rank {r}: panicked")),
            })
            .collect()
    });
    assert!(errs.is_empty(), "{case:?} failed:\n{}", errs.join("\n"));
}

/// The environment variable naming the file every skipped test appends a line to
/// (`scripts/test.sh` sets it and counts the lines at the end: a skip is reported as a skip,
/// never as a pass).
pub const SKIP_LOG_VAR: &str = "IRONWEAVE_SKIP_LOG";

/// Reports that `test` did not run, and why: `SKIPPED test: reason` straight to the standard
/// error (libtest's capture does not hide it) and a line `test<TAB>reason` appended to the
/// file in [`SKIP_LOG_VAR`], when set.
pub fn skip(test: &str, reason: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {reason}");
    if let Some(p) = std::env::var_os(SKIP_LOG_VAR) {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(p) {
            // one write per line: lines of tests running in parallel do not interleave
            let _ = f.write_all(format!("{test}\t{}\n", reason.replace('\n', " ")).as_bytes());
        }
    }
}

/// Expands to the conformance tests for a backend. `$make` is an expression of type
/// `fn(usize) -> Vec<Communicator>` building an n-rank world (one communicator per rank).
///
/// With `skip_if = f` (`f: fn(usize) -> Option<String>`, given the world size), every test
/// first asks `f`; a reason means the hardware is missing: the test reports the skip
/// ([`testing::skip`](crate::testing::skip): on stderr, and counted in the skip log) and returns.
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr) => {
        $crate::conformance_suite!($make, skip_if = |_| None);
    };
    ($make:expr, skip_if = $skip:expr) => {
        $crate::conformance_suite!(@cases $make; $skip;
            all_reduce AllReduce, broadcast Broadcast, all_gather AllGather, reduce_scatter ReduceScatter,
            all_to_all AllToAll, all_to_all_v AllToAllV, barrier Barrier, split Split,
            nonblocking NonBlocking, send_parts Parts);
    };
    (@cases $make:expr; $skip:expr; $($name:ident $case:ident),*) => {
        $(
            mod $name {
                #[allow(unused_imports)]
                use super::*;
                fn go(n: usize) {
                    let skip: fn(usize) -> Option<String> = $skip;
                    if let Some(reason) = skip(n) {
                        $crate::testing::skip(&format!("{}::world_{n}", module_path!()), &reason);
                        return;
                    }
                    let make: fn(usize) -> Vec<$crate::Communicator> = $make;
                    $crate::testing::run_world(make(n), $crate::testing::Case::$case);
                }
                #[test] fn world_1() { go(1) }
                #[test] fn world_2() { go(2) }
                #[test] fn world_3() { go(3) }
                #[test] fn world_4() { go(4) }
                #[test] fn world_8() { go(8) }
            }
        )*
    };
}

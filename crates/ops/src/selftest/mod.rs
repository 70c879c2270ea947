//! `ironweave selftest SCENARIO`: small rank programs the fault tests start as real processes.

pub mod ckpt;

use crate::error::{bail, Result};
use ironweave_transport::{Communicator, ReduceOp};

/// `ironweave selftest`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct SelftestArgs {
    /// ok, loop, iloop, sloop, mismatch, stream, idle-wait, or ckpt (the
    /// checkpoint recovery rank program).
    pub scenario: String,
    #[arg(long, default_value = "tcp")]
    pub backend: String,
}

/// `ironweave selftest SCENARIO`: this rank's scenario.
pub fn command(a: &SelftestArgs) -> Result<i32> {
    if a.scenario == "ckpt" {
        ckpt::run()?;
    } else {
        run(&a.scenario, &a.backend)?;
    }
    Ok(0)
}

/// Runs one scenario on this rank; a transport error is printed with its `Debug` form (the tests
/// look for the variant) and ends the run with exit status 3 ([`crate::Error::Exit`]); a wrong
/// sum with 4.
pub fn run(scenario: &str, backend: &str) -> Result<()> {
    let comm = match crate::backend::connect(backend) {
        Ok(c) => c,
        Err(e) => return Err(fail(&e)),
    };
    // Which path the world's collectives take, for the fault tests to check they test it.
    eprintln!("selftest path {}", if comm.uses_shared_memory() { "shm" } else { "link" });
    let r = match scenario {
        "ok" => ok(&comm),
        "loop" => looping(&comm).map(|()| true),
        "mismatch" => mismatch(&comm).map(|()| true),
        "stream" => stream(&comm).map(|()| true),
        "idle-wait" => idle_wait(&comm).map(|()| true),
        "iloop" => nonblocking_loop(&comm).map(|()| true),
        "sloop" => striped_loop(&comm).map(|()| true),
        other => bail!("unknown selftest scenario {other:?} (ok, loop, iloop, sloop, mismatch, stream, idle-wait)"),
    };
    match r {
        Ok(true) => Ok(()),
        Ok(false) => Err(crate::Error::Exit(4)),
        Err(e) => Err(fail(&e)),
    }
}

fn fail(e: &ironweave_transport::Error) -> crate::Error {
    eprintln!("selftest error: {e:?}\nselftest error message: {e}");
    crate::Error::Exit(3)
}

/// Whether the sum came out right.
fn ok(c: &Communicator) -> ironweave_transport::Result<bool> {
    let mut v = vec![1i64; 1000];
    c.all_reduce(&mut v, ReduceOp::Sum)?;
    c.barrier()?;
    let good = v.iter().all(|&x| x == c.size() as i64);
    println!("selftest ok rank {} of {} sum-correct={good}", c.rank(), c.size());
    Ok(good)
}

fn looping(c: &Communicator) -> ironweave_transport::Result<()> {
    let mut v = vec![1.0f32; 4 << 20];
    for i in 0.. {
        c.all_reduce(&mut v, ReduceOp::Avg)?;
        println!("iter {i}");
    }
    Ok(())
}

/// All-gathers and reduce-scatters on a communicator striped over every link (over two links
/// they balance dynamically, segment by segment).
fn striped_loop(c: &Communicator) -> ironweave_transport::Result<()> {
    let s = c.striped(None)?;
    eprintln!("selftest striped over {} links, dynamic {}", s.links().len(), s.stripe_is_dynamic());
    let input = vec![1.0f32; 1 << 20];
    let mut all = vec![0.0f32; s.size() << 20];
    let mut mine = vec![0.0f32; 1 << 20];
    for i in 0.. {
        s.all_gather(&input, &mut all)?;
        s.reduce_scatter(&all, &mut mine, ReduceOp::Sum)?;
        println!("iter {i}");
    }
    Ok(())
}

/// CPU seconds this process has used (user + system).
fn cpu_s() -> f64 {
    // SAFETY: getrusage writes one `rusage` into the zeroed struct we own; RUSAGE_SELF is valid.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Rank 0 waits in a barrier while the others compute for a second: prints the CPU time each
/// used meanwhile, so a transport that spins while its peer on the same host computes shows.
fn idle_wait(c: &Communicator) -> ironweave_transport::Result<()> {
    c.barrier()?;
    let (t0, c0) = (std::time::Instant::now(), cpu_s());
    if c.rank() != 0 {
        let mut x = 0u64;
        while t0.elapsed() < std::time::Duration::from_secs(1) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
    c.barrier()?;
    println!("idle-wait rank {}: wall {:.3} s, cpu {:.3} s", c.rank(), t0.elapsed().as_secs_f64(), cpu_s() - c0);
    Ok(())
}

/// `loop` with two non-blocking all-reduces in flight at a time, computing meanwhile.
fn nonblocking_loop(c: &Communicator) -> ironweave_transport::Result<()> {
    let (mut a, mut b) = (vec![1.0f32; 1 << 20], vec![2.0f32; 1 << 20]);
    for i in 0.. {
        let (ha, hb) = (c.iall_reduce(a, ReduceOp::Avg)?, c.iall_reduce(b, ReduceOp::Avg)?);
        let mut x = 0u64;
        for k in 0..100_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(k));
        }
        b = hb.wait()?;
        a = ha.wait()?;
        println!("iter {i}");
    }
    Ok(())
}

fn mismatch(c: &Communicator) -> ironweave_transport::Result<()> {
    // Rank 1 passes a longer buffer than everybody else.
    let n = 300_000 + if c.rank() == 1 { 17 } else { 0 };
    let mut v = vec![1.0f32; n];
    c.all_reduce(&mut v, ReduceOp::Sum)?;
    println!("mismatch went unnoticed on rank {}", c.rank());
    Ok(())
}

/// Point-to-point streaming between ranks 0 and 1 (one way, then both ways at once).
fn stream(c: &Communicator) -> ironweave_transport::Result<()> {
    let msg = vec![7u8; 16 << 20];
    let reps = 32;
    for both in [false, true] {
        c.barrier()?;
        let t = std::time::Instant::now();
        std::thread::scope(|s| -> ironweave_transport::Result<()> {
            let sender = (c.rank() == 0 || both) && c.rank() < 2;
            let msg = &msg;
            let h = s.spawn(move || -> ironweave_transport::Result<()> {
                if sender {
                    for _ in 0..reps {
                        c.send_bytes(1 - c.rank(), 5, msg)?;
                    }
                }
                Ok(())
            });
            if (c.rank() == 1 || both) && c.rank() < 2 {
                for _ in 0..reps {
                    c.recv_bytes(1 - c.rank(), 5)?;
                }
            }
            h.join().unwrap_or(Ok(()))
        })?;
        c.barrier()?;
        let gbps = (reps * msg.len()) as f64 / t.elapsed().as_secs_f64() / 1e9;
        if c.rank() == 0 {
            println!("stream {}: {gbps:.2} GB/s per direction", if both { "both ways" } else { "one way" });
        }
    }
    Ok(())
}

//! The elastic runtime through its public API, ranks as threads of this process over TCP
//! (`Job::new`): a resume checks the worker's state after its restore against what it loaded,
//! and a job that resumed and fails before its first commit loads that checkpoint again.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ironweave::ckpt::{DType, EngineConfig, GlobalSlice, Snapshot, TensorSpec};
use ironweave::elastic::{BoxError, Config, Error, Generation, Job, RestoreSource, Step, StepContext, Worker};
use ironweave::{Backend, JobEnv, ReduceOp};
use ironweave_testkit::tmpdir;

const N: usize = 256;

/// A data-parallel fit of one vector: `w` and an Adam-like moment `m`, both replicated (rank 0
/// owns the global tensors), plus the step.
struct Fit {
    rank: usize,
    w: Vec<f32>,
    m: Vec<f32>,
    step: [u8; 8],
    /// A broken restore: leaves `m` as it was.
    skip_m_on_restore: bool,
    /// Fail this rank's step of this iteration once (a generation failure, as a lost peer is).
    fail_at: Option<u64>,
    failed: Arc<AtomicBool>,
    /// Fail this rank's first step of each of its first generations, this many in all.
    fail_generations: u32,
    failures: Arc<std::sync::atomic::AtomicU32>,
}

impl Fit {
    fn new(rank: usize) -> Fit {
        Fit {
            rank,
            w: vec![0.5; N],
            m: vec![0.0; N],
            step: [0; 8],
            skip_m_on_restore: false,
            fail_at: None,
            failed: Arc::new(AtomicBool::new(false)),
            fail_generations: 0,
            failures: Arc::new(std::sync::atomic::AtomicU32::new(0)),
        }
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

impl Worker for Fit {
    type Output = ();
    fn join(&mut self, _g: &Generation<'_>) -> Result<(), BoxError> {
        Ok(())
    }
    fn state_specs(&self) -> Vec<TensorSpec> {
        let own = self.rank == 0;
        vec![
            TensorSpec::new("w", DType::F32, &[N as u64]).with_global(GlobalSlice::whole("w", &[N as u64], own)),
            TensorSpec::new("m", DType::F32, &[N as u64]).with_global(GlobalSlice::whole("m", &[N as u64], own)),
            TensorSpec::new("step", DType::I64, &[]).with_global(GlobalSlice::whole("step", &[], own)),
        ]
    }
    fn state(&self) -> Vec<&[u8]> {
        vec![bytemuck::cast_slice(&self.w), bytemuck::cast_slice(&self.m), &self.step]
    }
    fn restore(&mut self, s: &Snapshot) -> Result<(), BoxError> {
        self.w = f32s(s.tensor("w").ok_or("no w")?);
        if !self.skip_m_on_restore {
            self.m = f32s(s.tensor("m").ok_or("no m")?);
        }
        self.step.copy_from_slice(s.tensor("step").ok_or("no step")?);
        Ok(())
    }
    fn start_over(&mut self) -> Result<(), BoxError> {
        *self = Fit {
            skip_m_on_restore: self.skip_m_on_restore,
            fail_at: self.fail_at,
            failed: self.failed.clone(),
            fail_generations: self.fail_generations,
            failures: self.failures.clone(),
            ..Fit::new(self.rank)
        };
        Ok(())
    }
    fn step(&mut self, it: u64, cx: &StepContext<'_>) -> Result<Step<()>, BoxError> {
        if self.failures.load(Ordering::SeqCst) < self.fail_generations {
            let n = self.failures.fetch_add(1, Ordering::SeqCst) + 1;
            return Err(format!("rank {}: injected failure {n} of {}", self.rank, self.fail_generations).into());
        }
        if self.fail_at == Some(it) && !self.failed.swap(true, Ordering::SeqCst) {
            return Err(format!("rank {}: injected failure in iteration {it}", self.rank).into());
        }
        // each rank's gradient differs; the average is the same everywhere
        let mut g: Vec<f32> =
            self.w.iter().enumerate().map(|(i, w)| w - ((i * 7 + self.rank * 3 + it as usize) % 11) as f32 / 11.0).collect();
        cx.comm.all_reduce(&mut g, ReduceOp::Avg)?;
        for ((w, m), g) in self.w.iter_mut().zip(self.m.iter_mut()).zip(&g) {
            *m = 0.9 * *m + 0.1 * g;
            *w -= 0.05 * *m;
        }
        self.step = (it as i64).to_le_bytes();
        Ok(Step::new(()))
    }
}

/// What a rank ended with.
struct Ended {
    state: Vec<u8>,
    resumed_iter: Option<u64>,
    resumed_digest: Option<String>,
    sources: Vec<Option<RestoreSource>>,
}

/// Runs a 2-rank job of `iters` iterations, each rank's worker made by `make`; the engine
/// persists every iteration into `persist` (when given) and the job resumes from `resume`.
fn job(
    iters: u64,
    persist: Option<&Path>,
    resume: Option<&Path>,
    make: impl Fn(usize) -> Fit + Send + Sync + 'static,
) -> Vec<Result<Ended, Error>> {
    // a failure re-forms the job as generation 1, on `port + 1`
    let resume: Option<PathBuf> = resume.map(Into::into);
    job_on(ironweave_testkit::master_port(4), 8, iters, persist, move |_| resume.clone(), make)
}

/// [`job`] on rendezvous port `port`, re-forming up to `reformations` times.
fn job_on(
    port: u16,
    reformations: u32,
    iters: u64,
    persist: Option<&Path>,
    resume: impl Fn(usize) -> Option<PathBuf> + Send + Sync + 'static,
    make: impl Fn(usize) -> Fit + Send + Sync + 'static,
) -> Vec<Result<Ended, Error>> {
    let make = Arc::new(make);
    let (persist, resume): (Option<PathBuf>, _) = (persist.map(Into::into), Arc::new(resume));
    let hs: Vec<_> = (0..2)
        .map(|rank| {
            let (make, persist, resume) = (make.clone(), persist.clone(), resume.clone());
            std::thread::spawn(move || -> Result<Ended, Error> {
                let engine =
                    EngineConfig { persist_every: u64::from(persist.is_some()), persist_dir: persist, ..Default::default() };
                let mut cfg = Config::new(iters, engine);
                cfg.timeout = Duration::from_secs(30);
                cfg.engine.timeout = cfg.timeout;
                cfg.backend = Some(Backend::Tcp);
                cfg.set_threads = false;
                cfg.resume_from = resume(rank);
                cfg.max_reformations = reformations;
                let env = JobEnv::loopback(rank, 2, port, format!("elastic-test-{port}"));
                let mut w = make(rank);
                let done = Job::new(cfg, env)?.run(&mut w)?;
                let sources = done.restore_sources()?;
                let ended = Ended {
                    state: w.state().concat(),
                    resumed_iter: done.resumed().map(|r| r.iter),
                    resumed_digest: done.resumed().and_then(|r| r.global_sha256.clone()),
                    sources,
                };
                done.shutdown()?;
                Ok(ended)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_restore_that_leaves_a_tensor_out_is_refused_naming_it() {
    let base = tmpdir("elastic-bad-restore");
    let persist = base.join("persist");
    let written: Vec<Ended> = job(4, Some(&persist), None, Fit::new).into_iter().map(Result::unwrap).collect();
    // the worker's restore forgets `m`: the resume is refused on every rank, naming it
    let out = job(6, None, Some(&persist), |rank| Fit { skip_m_on_restore: true, ..Fit::new(rank) });
    for r in out {
        match r {
            Err(e @ Error::Resume { .. }) => assert!(e.to_string().contains("`m`"), "{e}"),
            Err(e) => panic!("expected a refused resume, got {e}"),
            Ok(_) => panic!("a restore that left `m` out was taken as a resume"),
        }
    }
    // a correct restore: the digest of the state after it is the writer's final state's,
    // computed here from that state's own bytes (w, m, step: every rank holds them alike)
    let out: Vec<Ended> = job(4, None, Some(&persist), Fit::new).into_iter().map(Result::unwrap).collect();
    assert_eq!(out[0].resumed_iter, Some(4));
    use ironweave::ckpt::layout::{global_digest, hex, tensor_sha256};
    let st = &written[0].state;
    let per: std::collections::BTreeMap<String, [u8; 32]> =
        [("w", tensor_sha256(&st[..N * 4])), ("m", tensor_sha256(&st[N * 4..N * 8])), ("step", tensor_sha256(&st[N * 8..]))]
            .into_iter()
            .map(|(k, d)| (k.to_string(), d))
            .collect();
    assert_eq!(out[0].resumed_digest.as_deref(), Some(hex(&global_digest(&per)).as_str()));
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn a_resumed_job_that_fails_before_its_first_commit_loads_the_checkpoint_again() {
    let base = tmpdir("elastic-resume-fail");
    let persist = base.join("persist");
    for r in job(4, Some(&persist), None, Fit::new) {
        r.unwrap();
    }
    let clean: Vec<Ended> = job(9, None, Some(&persist), Fit::new).into_iter().map(Result::unwrap).collect();
    // rank 1 fails in iteration 5, the first after the resumed 4: nothing of this job is
    // committed yet
    let failed: Vec<Ended> = job(9, None, Some(&persist), |rank| Fit { fail_at: (rank == 1).then_some(5), ..Fit::new(rank) })
        .into_iter()
        .map(Result::unwrap)
        .collect();
    for r in 0..2 {
        assert_eq!(failed[r].sources[r], Some(RestoreSource::Resumed), "rank {r} restored from {:?}", failed[r].sources);
        assert_eq!(failed[r].resumed_iter, Some(4));
        assert!(failed[r].state == clean[r].state, "rank {r} ended in another state than the uninterrupted resumed run");
    }
    std::fs::remove_dir_all(&base).ok();
}

/// Issue 57, item 2: the ranks of a resumed job see the directory differently — rank 0 read it
/// before iteration 5's files were there (a live job's tier, a node's copy that lags); rank 1
/// sees 5. Rank 0 chooses and every rank loads that iteration: the same state everywhere (each
/// rank picking its own newest loaded 4 and 5, and the job trained on from two states).
#[test]
fn the_ranks_of_a_resumed_job_load_the_iteration_rank_0_chose() {
    let base = tmpdir("elastic-resume-agree");
    let (newer, older) = (base.join("newer"), base.join("older"));
    for r in job(5, Some(&newer), None, Fit::new) {
        r.unwrap();
    }
    // the view without iteration 5
    std::fs::create_dir_all(&older).unwrap();
    for e in std::fs::read_dir(&newer).unwrap().flatten() {
        if e.path().is_dir() && e.file_name() != "iter-00000005" {
            let to = older.join(e.file_name());
            std::fs::create_dir_all(&to).unwrap();
            for f in std::fs::read_dir(e.path()).unwrap().flatten() {
                std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
            }
        }
    }
    let (o, n) = (older.clone(), newer.clone());
    let resume = move |r: usize| Some(if r == 0 { o.clone() } else { n.clone() });
    let out: Vec<Ended> =
        job_on(ironweave_testkit::master_port(4), 8, 8, None, resume, Fit::new).into_iter().map(Result::unwrap).collect();
    assert_eq!((out[0].resumed_iter, out[1].resumed_iter), (Some(4), Some(4)));
    assert!(out[0].state == out[1].state, "the ranks of one data-parallel job ended in different states");
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn two_hundred_re_formations_stay_inside_the_launcher_s_port_span() {
    use ironweave::transport::rendezvous::RENDEZVOUS_SPAN;
    let port = ironweave_testkit::master_port(RENDEZVOUS_SPAN + 1);
    // the port just past the span is someone else's: a generation that walked out of the span
    // (`port + 128`) could not listen there
    let _taken = std::net::TcpListener::bind(("0.0.0.0", port + RENDEZVOUS_SPAN)).unwrap();
    let out =
        job_on(port, 210, 3, None, |_| None, |rank| Fit { fail_generations: if rank == 1 { 200 } else { 0 }, ..Fit::new(rank) });
    let clean: Vec<Ended> = job(3, None, None, Fit::new).into_iter().map(Result::unwrap).collect();
    for (r, o) in out.into_iter().enumerate() {
        let e = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        // every failure came before a commit: each generation started over, and the job
        // ended where an uninterrupted one does
        assert_eq!(e.sources[r], Some(RestoreSource::InitialState), "rank {r}");
        assert!(e.state == clean[r].state, "rank {r}");
    }
}

#[test]
fn joining_waits_for_the_job_s_timeout_not_the_transport_s_default() {
    // rank 1 of a 2-rank job whose rank 0 never comes: the rendezvous gives up at the job's
    // `Config::timeout` (1 s here), as every later wait does, and says so
    let env = JobEnv::loopback(1, 2, ironweave_testkit::master_port(1), "elastic-lonely");
    let mut cfg = Config::new(3, EngineConfig::default());
    cfg.timeout = Duration::from_secs(1);
    cfg.engine.timeout = cfg.timeout;
    cfg.backend = Some(Backend::Tcp);
    cfg.set_threads = false;
    let r = Job::new(cfg, env).and_then(|j| j.run(&mut Fit::new(1)));
    match r {
        Err(Error::Transport(ironweave::transport::Error::Timeout { what, after })) => {
            assert!(what.contains("connecting to"), "{what}");
            // the deadline the rendezvous had: the job's, not the transport's 300 s default
            assert!(after <= Duration::from_secs(1), "waited under a deadline of {after:?}");
        }
        Err(e) => panic!("expected the rendezvous to time out, got {e}"),
        Ok(_) => panic!("a job without its rank 0 ran"),
    }
}

/// One launch of a 2-rank job (ranks as threads of this process) that no launcher named: its
/// id is derived. Run by [`two_launches_without_an_id_never_take_each_other_s_files`] in a
/// process of its own under its own `sh` (each launch its own launcher, as two torchrun or
/// mpirun runs are). Prints each rank's restore source.
#[test]
#[ignore = "run in its own process by two_launches_without_an_id_never_take_each_other_s_files"]
fn derived_id_launch() {
    let (Ok(port), Ok(persist), Ok(fail)) =
        (std::env::var("IW_TEST_PORT"), std::env::var("IW_TEST_PERSIST"), std::env::var("IW_TEST_FAIL"))
    else {
        return;
    };
    let hs: Vec<_> = (0..2)
        .map(|rank| {
            let (port, persist, fail) = (port.clone(), persist.clone(), fail == "1");
            std::thread::spawn(move || {
                let vars = [
                    ("IRONWEAVE_RANK", rank.to_string()),
                    ("IRONWEAVE_WORLD_SIZE", "2".to_string()),
                    ("IRONWEAVE_MASTER_ADDR", "127.0.0.1".to_string()),
                    ("IRONWEAVE_MASTER_PORT", port),
                ];
                let env = JobEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())).unwrap();
                assert!(env.job_id_is_derived(), "{}", env.job_id);
                let engine = EngineConfig { persist_every: 1, persist_dir: Some(persist.into()), ..Default::default() };
                let mut cfg = Config::new(4, engine);
                cfg.timeout = Duration::from_secs(30);
                cfg.engine.timeout = cfg.timeout;
                cfg.backend = Some(Backend::Tcp);
                cfg.set_threads = false;
                let mut w = Fit { fail_at: (fail && rank == 1).then_some(1), ..Fit::new(rank) };
                let done = Job::new(cfg, env).unwrap().run(&mut w).unwrap();
                let sources = done.restore_sources().unwrap();
                let id = done.engine().job_id().to_string();
                done.shutdown().unwrap();
                (sources, id)
            })
        })
        .collect();
    for h in hs {
        let (sources, id) = h.join().unwrap();
        println!("sources {sources:?} job {id}");
    }
}

/// Issue 57, item 3: two launches of the same program on the same endpoint, neither named by a
/// launcher, write to one persistent directory. The second fails before its first commit: it
/// starts over from its initial state — it never restores the first launch's files as its own
/// (with the old shared id `default` it restored the first launch's iteration 4).
#[test]
fn two_launches_without_an_id_never_take_each_other_s_files() {
    let base = tmpdir("elastic-derived-id");
    let port = ironweave_testkit::master_port(4);
    let exe = std::env::current_exe().unwrap();
    let launch = |fail: &str| -> String {
        // `sh` stays the ranks' parent (no exec): each launch has a launcher of its own
        let o = std::process::Command::new("sh")
            .args(["-c", "\"$0\" \"$@\"; exit $?"])
            .arg(&exe)
            .args(["--exact", "derived_id_launch", "--ignored", "--nocapture", "--test-threads", "1"])
            .env("IW_TEST_PORT", port.to_string())
            .env("IW_TEST_PERSIST", base.join("persist"))
            .env("IW_TEST_FAIL", fail)
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
        out
    };
    let first = launch("0");
    assert!(first.matches("sources [None, None]").count() == 2, "{first}");
    let second = launch("1");
    assert_eq!(second.matches("sources [Some(InitialState), Some(InitialState)]").count(), 2, "{second}");
    let ids =
        |out: &str| -> Vec<String> { out.lines().filter_map(|l| l.split_once(" job ")).map(|(_, id)| id.to_string()).collect() };
    let (a, b) = (ids(&first), ids(&second));
    assert!(a.len() == 2 && a[0] == a[1] && b[0] == b[1] && a[0] != b[0], "{a:?} {b:?}");
    std::fs::remove_dir_all(&base).ok();
}

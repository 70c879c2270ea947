//! `ironweave._native`: the Python package's native part, a thin layer over
//! [`ironweave::checkpointer::Checkpointer`] (the engine, the transport and the runtime are the
//! library's; nothing of them lives here). Buffers cross without a copy through the buffer
//! protocol (the Python side passes each tensor as a flat `uint8` view of its memory), and the
//! GIL is released while the engine works.
//!
//! Where it sits: above the facade crate `ironweave`; below the pure-Python modules
//! `ironweave.torch` (state dicts of modules and optimizers as named tensors) in
//! `crates/py/python`.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use ironweave::checkpointer::{self, Checkpointer, JoinOptions, Restore};
use ironweave::ckpt::engine::Strategy;
use ironweave::ckpt::{CkptError, DType, EngineConfig, GlobalSlice, TensorSpec};
use ironweave::elastic::Error;
use ironweave::profile::Phase;
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

create_exception!(_native, IronweaveError, PyException, "Every error of ironweave derives from this one.");

/// The package's errors below [`IronweaveError`], each also deriving from the builtin it means
/// (so `except ValueError` catches a bad argument, as Python users expect): (name, builtin,
/// doc).
const ERRORS: [(&str, &str, &str); 5] = [
    ("ConfigurationError", "ValueError", "A setting, an environment or an argument ironweave cannot use."),
    (
        "StateMismatchError",
        "ValueError",
        "A rank's state differs from the registered one (a key, a dtype or a shape), or from rank 0's.",
    ),
    (
        "NothingToRestoreError",
        "RuntimeError",
        "Copies exist, but no step has a whole copy of every rank's state; the message lists what was found.",
    ),
    ("ClosedError", "RuntimeError", "The checkpointer was closed."),
    ("CheckpointTimeoutError", "TimeoutError", "A wait of ironweave passed its deadline (a peer that does not answer)."),
];

static ERROR_TYPES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// The error classes of [`ERRORS`], made once: `type(name, (IronweaveError, builtin), ...)`.
fn error_types(py: Python<'_>) -> PyResult<&Vec<Py<PyType>>> {
    ERROR_TYPES.get_or_try_init(py, || {
        let builtins = py.import("builtins")?;
        let base = py.get_type::<IronweaveError>();
        ERRORS
            .iter()
            .map(|(name, builtin, doc)| {
                let ns = PyDict::new(py);
                ns.set_item("__module__", "ironweave._native")?;
                ns.set_item("__doc__", *doc)?;
                let bases = PyTuple::new(py, [base.clone().into_any(), builtins.getattr(*builtin)?])?;
                let ty = builtins.getattr("type")?.call1((*name, bases, ns))?;
                Ok(ty.cast_into::<PyType>()?.unbind())
            })
            .collect()
    })
}

/// An error of class `ERRORS[i]` with `msg`.
fn error(i: usize, msg: String) -> PyErr {
    Python::attach(|py| match error_types(py) {
        Ok(t) => PyErr::from_type(t[i].bind(py).clone(), msg),
        Err(e) => e,
    })
}

const CONFIGURATION: usize = 0;
const MISMATCH: usize = 1;
const NOTHING: usize = 2;
const CLOSED: usize = 3;
const TIMEOUT: usize = 4;

fn config_err(msg: String) -> PyErr {
    error(CONFIGURATION, msg)
}

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::StateMismatch { .. } => error(MISMATCH, msg),
        Error::Ckpt(CkptError::NothingToRestore { .. }) => error(NOTHING, msg),
        Error::Ckpt(CkptError::Invalid(_))
        | Error::Transport(ironweave::Error::Config(_))
        | Error::Transport(ironweave::Error::Board { .. }) => error(CONFIGURATION, msg),
        Error::Transport(ironweave::Error::Timeout { .. })
        | Error::Ckpt(CkptError::Transport(ironweave::Error::Timeout { .. })) => error(TIMEOUT, msg),
        _ => IronweaveError::new_err(msg),
    }
}

/// A refusal Python found in this rank's state, as it passes it: ("config", message, "", "")
/// or ("mismatch", key, expected, actual).
type PyRefusal = (String, String, String, String);

fn refusal(r: Option<PyRefusal>, rank: usize) -> Option<Error> {
    r.map(|(kind, a, b, c)| match kind.as_str() {
        "mismatch" => Error::StateMismatch { rank, key: a, expected: b, actual: c },
        _ => Error::Ckpt(CkptError::Invalid(a)),
    })
}

/// A buffer's bytes as a slice (C-contiguous, one byte per item: the Python side passes
/// `tensor.view(torch.uint8)` as a NumPy array).
struct Bytes {
    buf: PyBuffer<u8>,
}

impl Bytes {
    fn get(obj: &Bound<'_, PyAny>, writable: bool, what: usize) -> PyResult<Self> {
        let buf = PyBuffer::<u8>::get(obj).map_err(|e| config_err(format!("buffer {what}: not a byte buffer ({e})")))?;
        if !buf.is_c_contiguous() {
            return Err(config_err(format!("buffer {what}: not contiguous")));
        }
        if writable && buf.readonly() {
            return Err(config_err(format!("buffer {what}: read-only, cannot restore into it")));
        }
        Ok(Bytes { buf })
    }

    fn ptr_len(&self) -> (usize, usize) {
        (self.buf.buf_ptr() as usize, self.buf.len_bytes())
    }
}

/// A tensor as Python describes it: (name, dtype, shape) or (name, dtype, shape, (global
/// name, global shape, offsets[, owner])) for the slice of a global tensor it holds; `owner`
/// (default true) false marks a copy of a slice another rank owns (replicated state: one rank
/// owns it, the loader reads that one).
type Spec = (String, String, Vec<u64>, Option<Py<PyAny>>);

fn to_spec(py: Python<'_>, (name, dtype, shape, global): Spec) -> PyResult<TensorSpec> {
    let d = DType::parse(&dtype)
        .ok_or_else(|| config_err(format!("`{name}`: dtype {dtype:?} is not one of f32 f64 f16 bf16 i64 i32 u8")))?;
    let spec = TensorSpec::new(&name, d, &shape);
    let Some(global) = global.map(|g| g.into_bound(py)).filter(|g| !g.is_none()) else { return Ok(spec) };
    let (tensor, gshape, offsets, owner): (String, Vec<u64>, Vec<u64>, bool) = match global.extract() {
        Ok(t) => t,
        Err(_) => {
            let (t, g, o): (String, Vec<u64>, Vec<u64>) = global
                .extract()
                .map_err(|e| config_err(format!("`{name}`: the global place is (name, shape, offsets[, owner]): {e}")))?;
            (t, g, o, true)
        }
    };
    if gshape.len() != shape.len() || offsets.len() != shape.len() {
        return Err(config_err(format!(
            "`{name}`: shape {shape:?}, global shape {gshape:?} and offsets {offsets:?} must have one entry per dimension"
        )));
    }
    Ok(spec.with_global(GlobalSlice { tensor, shape: gshape, offsets, owner }))
}

/// Each buffer's (address, length).
type Spans = Vec<(usize, usize)>;

/// `buffers` as byte buffers (writable ones checked) and each one's (address, length); the
/// views keep the memory in place until they are dropped.
fn views(buffers: &[Bound<'_, PyAny>], writable: bool) -> PyResult<(Vec<Bytes>, Spans)> {
    let held = buffers.iter().enumerate().map(|(i, b)| Bytes::get(b, writable, i)).collect::<PyResult<Vec<_>>>()?;
    let spans = held.iter().map(Bytes::ptr_len).collect();
    Ok((held, spans))
}

/// The spans of writable [`views`] as slices to fill.
///
/// # Safety
/// Each span must be a writable, C-contiguous buffer that a live view holds, no two spans may
/// overlap, and nothing else may touch the memory while the slices live.
unsafe fn slices_mut<'a>(spans: &[(usize, usize)]) -> Vec<&'a mut [u8]> {
    // SAFETY: the caller's contract above.
    spans.iter().map(|&(p, n)| unsafe { std::slice::from_raw_parts_mut(p as *mut u8, n) }).collect()
}

/// One rank's checkpointer (`ironweave.torch.Checkpointer` builds it from a state dict).
#[pyclass(module = "ironweave._native")]
struct Engine {
    inner: Mutex<Option<Checkpointer>>,
    rank: usize,
    world_size: usize,
    job_id: String,
    keep_dir: Option<String>,
}

impl Engine {
    fn with<T>(&self, f: impl FnOnce(&mut Checkpointer) -> Result<T, Error>) -> PyResult<T> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let ck = g.as_mut().ok_or_else(|| error(CLOSED, "the checkpointer was closed: make a new one".into()))?;
        f(ck).map_err(to_py)
    }
}

fn restore_dict<'py>(py: Python<'py>, r: &Restore) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", r.step)?;
    let (source, peer) = match r.source {
        ironweave::elastic::RestoreSource::Peer(p) => ("peer", Some(p)),
        s => (s.name(), None),
    };
    d.set_item("source", source)?;
    d.set_item("peer", peer)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("seconds", r.seconds)?;
    Ok(d)
}

#[pymethods]
impl Engine {
    /// Joins the job in the environment (torchrun, SLURM, OpenMPI, `ironweave launch`) on the
    /// checkpointer's own port and starts the engine for `specs`: (name, dtype, shape) per
    /// tensor, dtype one of f32 f64 f16 bf16 i64 i32 u8 (collective).
    #[new]
    #[pyo3(signature = (specs, *, strategy="capricorn", replicas=2, keep_dir=None, persist_dir=None, persist_every=0, timeout_s=300.0, job_id=None, same_layout=true, keep_name=None, refusal=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        specs: Vec<Spec>,
        strategy: &str,
        replicas: u32,
        keep_dir: Option<PathBuf>,
        persist_dir: Option<PathBuf>,
        persist_every: u64,
        timeout_s: f64,
        job_id: Option<String>,
        same_layout: bool,
        keep_name: Option<String>,
        refusal: Option<PyRefusal>,
    ) -> PyResult<Self> {
        // a spec that does not parse is this rank's refusal, agreed with the others once joined
        let mut refused = refusal;
        let specs = match specs.into_iter().map(|s| to_spec(py, s)).collect::<PyResult<Vec<_>>>() {
            Ok(s) => s,
            Err(e) => {
                refused.get_or_insert((String::from("config"), e.to_string(), String::new(), String::new()));
                Vec::new()
            }
        };
        let strategy = Strategy::parse(strategy).map_err(|e| config_err(e.to_string()))?;
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            return Err(config_err(format!("timeout_s {timeout_s}: give a positive number of seconds")));
        }
        let cfg = EngineConfig {
            strategy,
            replicas,
            keep_dir,
            persist_dir,
            persist_every,
            timeout: Duration::from_secs_f64(timeout_s),
            job_id,
            ..EngineConfig::default()
        };
        // the rank is filled in when the ranks agree
        let refusal = self::refusal(refused, 0);
        let opts = JoinOptions { same_layout, auto_keep: keep_name, refusal };
        let ck = py.detach(|| Checkpointer::join_with(&specs, cfg, opts)).map_err(to_py)?;
        Ok(Engine {
            rank: ck.rank(),
            world_size: ck.world_size(),
            job_id: ck.job_id().to_string(),
            keep_dir: ck.keep_dir().map(|p| p.to_string_lossy().into_owned()),
            inner: Mutex::new(Some(ck)),
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    #[getter]
    fn world_size(&self) -> usize {
        self.world_size
    }

    /// The job's id: the launcher's, or one derived for this launch (kept copies of another
    /// job are never adopted).
    #[getter]
    fn job_id(&self) -> &str {
        &self.job_id
    }

    /// Where this rank's copies outlive the process (None: memory only).
    #[getter]
    fn keep_dir(&self) -> Option<&str> {
        self.keep_dir.as_deref()
    }

    /// Snapshots `step`'s state (one buffer per registered tensor, in order) and agrees on the
    /// newest committed step (collective); replication goes on in the background.
    #[pyo3(signature = (step, buffers, refusal=None))]
    fn save(&self, py: Python<'_>, step: u64, buffers: Vec<Bound<'_, PyAny>>, refusal: Option<PyRefusal>) -> PyResult<u64> {
        let refusal = self::refusal(refusal, self.rank);
        let (bufs, spans) = views(&buffers, false)?;
        let r = py.detach(|| {
            // SAFETY: each (pointer, length) is a C-contiguous buffer that `bufs` holds a view
            // of (PyBuffer keeps the exporter alive and its memory in place until released);
            // the engine only reads it during this call, and the caller's contract is that
            // the state is not changed while `save` runs.
            let slices: Vec<&[u8]> =
                spans.iter().map(|&(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) }).collect();
            self.with(|ck| ck.save_or_refuse(step, &slices, refusal))
        });
        drop(bufs);
        r
    }

    /// Restores the newest step every rank has a whole copy of into `buffers`, in place, all
    /// or nothing (collective). None: no rank holds any copy (a fresh start).
    #[pyo3(signature = (buffers, refusal=None))]
    fn restore<'py>(
        &self,
        py: Python<'py>,
        buffers: Vec<Bound<'py, PyAny>>,
        refusal: Option<PyRefusal>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let refusal = self::refusal(refusal, self.rank);
        let (bufs, spans) = views(&buffers, true)?;
        let r = py.detach(|| {
            // SAFETY: writable views (checked) that `bufs` holds until after this call, of
            // distinct tensors' memory, written only inside this call.
            let mut slices = unsafe { slices_mut(&spans) };
            self.with(|ck| ck.restore_or_refuse(&mut slices, refusal))
        });
        drop(bufs);
        r?.map(|r| restore_dict(py, &r)).transpose()
    }

    /// Now on the clock of the engine's profiler, ns (what `record_layer` and `record_comm` take).
    fn now_ns(&self) -> PyResult<u64> {
        self.with(|ck| Ok(ck.now_ns()))
    }

    /// Records one layer phase ("forward" | "backward" | "optimizer") of the step being
    /// trained, timed by module hooks.
    fn record_layer(&self, layer: u32, phase: &str, start_ns: u64, end_ns: u64) -> PyResult<()> {
        let phase = match phase {
            "forward" => Phase::Forward,
            "backward" => Phase::Backward,
            "optimizer" => Phase::Optimizer,
            other => return Err(config_err(format!("phase {other:?}: one of \"forward\", \"backward\", \"optimizer\""))),
        };
        self.with(|ck| {
            ck.record_layer(layer, phase, start_ns, end_ns);
            Ok(())
        })
    }

    /// Records one training communication of the step being trained that ran on torch's
    /// process group (timed by a DDP communication hook): `bytes` moved from `start_ns` to
    /// `end_ns`.
    fn record_comm(&self, bytes: u64, start_ns: u64, end_ns: u64) -> PyResult<()> {
        self.with(|ck| {
            ck.record_comm(bytes, start_ns, end_ns);
            Ok(())
        })
    }

    /// The newest step every rank's state of is replicated, as last agreed (None: none yet).
    fn committed(&self) -> PyResult<Option<u64>> {
        self.with(|ck| Ok(ck.committed()))
    }

    /// The counters: saves, exposed seconds, state and replica bytes, committed and kept steps.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.with(|ck| ck.stats()))?;
        let d = PyDict::new(py);
        d.set_item("saves", s.saves)?;
        d.set_item("last_exposed_s", s.last_exposed_s)?;
        d.set_item("exposed_s", s.exposed_s)?;
        d.set_item("state_bytes", s.state_bytes)?;
        d.set_item("replica_bytes_sent", s.replica_bytes_sent)?;
        d.set_item("replica_bytes_inter_host", s.replica_bytes_inter_host)?;
        d.set_item("memory_passes_send", s.memory_passes_send)?;
        d.set_item("memory_passes_recv", s.memory_passes_recv)?;
        d.set_item("kept_bytes_mapped", s.kept_bytes_mapped)?;
        d.set_item("kept_bytes_copied", s.kept_bytes_copied)?;
        d.set_item("committed", s.committed)?;
        d.set_item("kept", s.kept)?;
        d.set_item("failures", s.failures)?;
        d.set_item("profiled_steps", s.profiled_steps)?;
        d.set_item("training_comms", s.training_comms)?;
        d.set_item("chunks", s.chunks)?;
        d.set_item("chunks_in_window", s.chunks_in_window)?;
        Ok(d)
    }

    /// Replicates the last snapshot, waits for it (bounded) and stops (collective);
    /// `remove_kept`: the job is over, every rank's kept copies are removed. Later calls raise
    /// ClosedError.
    #[pyo3(signature = (remove_kept=true))]
    fn close(&self, py: Python<'_>, remove_kept: bool) -> PyResult<()> {
        let ck = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        match ck {
            Some(ck) => py.detach(|| ck.close(remove_kept)).map_err(to_py),
            None => Err(error(CLOSED, "the checkpointer was already closed".into())),
        }
    }
}

/// A saved global tensor as Python sees it: (name, dtype, shape).
type SavedTensor = (String, &'static str, Vec<u64>);

/// The newest iteration of the checkpoint under `dir` (a keep directory that outlived its job,
/// or a persistent tier) that every rank left whole, and its global tensors:
/// `(iteration, [(name, dtype, shape)])`.
/// A keep directory with its writer's key (`mac-key`) has every rank's file of that iteration
/// checked against its MAC first (before anything of it is used or unpickled).
#[pyfunction]
fn saved(py: Python<'_>, dir: PathBuf) -> PyResult<(u64, Vec<SavedTensor>)> {
    let (iter, tensors) = py
        .detach(|| {
            let r = checkpointer::saved(&dir)?;
            if dir.join(checkpointer::MAC_KEY_FILE).exists() {
                checkpointer::check_macs(&dir, r.0, &checkpointer::mac_key_in(&dir)?)?;
            }
            Ok(r)
        })
        .map_err(to_py)?;
    Ok((iter, tensors.into_iter().map(|t| (t.name, t.dtype.name(), t.shape)).collect()))
}

/// Loads iteration `iteration` of the checkpoint under `dir` into `buffers`, one per spec
/// (each a 4-tuple naming the global slice it wants), whatever world size and layout wrote it;
/// all or nothing. Returns the bytes filled.
#[pyfunction]
fn load_saved(py: Python<'_>, dir: PathBuf, iteration: u64, specs: Vec<Spec>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<u64> {
    let specs = specs.into_iter().map(|s| to_spec(py, s)).collect::<PyResult<Vec<_>>>()?;
    let (bufs, spans) = views(&buffers, true)?;
    let r = py.detach(|| {
        // SAFETY: as in `Engine::restore`: writable views that `bufs` holds until after this
        // call, of distinct buffers, written only inside this call.
        let mut slices = unsafe { slices_mut(&spans) };
        checkpointer::load_saved(&dir, iteration, &specs, &mut slices)
    });
    drop(bufs);
    r.map_err(to_py)
}

/// A port for a rendezvous, free now and below the kernel's ephemeral range, so none of the
/// job's own outgoing connections can be handed it before the server listens there
/// (`ironweave::transport::rendezvous::free_base_port`, as `ironweave launch` picks its own).
#[pyfunction]
fn free_port() -> PyResult<u16> {
    ironweave::transport::rendezvous::free_base_port(1).map_err(|e| to_py(Error::Transport(e)))
}

/// A job directory as Python sees it: (dir, bytes, [(launcher, alive)], orphan).
type KeptJob = (String, u64, Vec<(String, bool)>, bool);

/// This user's job directories under `base` (default `/dev/shm`) that hold kept copies:
/// `[(dir, bytes, [(launcher, alive)], orphan)]` — orphan: no launcher that recorded itself
/// there still runs, so no process of the job can restore from them
/// (`ironweave::checkpointer::kept_jobs`; `python -m ironweave clean` lists and removes them).
#[pyfunction]
#[pyo3(signature = (base=None))]
fn kept_jobs(base: Option<PathBuf>) -> Vec<KeptJob> {
    checkpointer::kept_jobs(base.as_deref().unwrap_or(std::path::Path::new("/dev/shm")))
        .into_iter()
        .map(|k| (k.dir.to_string_lossy().into_owned(), k.bytes, k.launchers, k.orphan))
        .collect()
}

/// `name` as a path component, as the keep directories are named
/// (`ironweave::checkpointer::safe_name`).
#[pyfunction]
fn safe_name(name: &str) -> String {
    checkpointer::safe_name(name)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Engine>()?;
    m.add_function(wrap_pyfunction!(saved, m)?)?;
    m.add_function(wrap_pyfunction!(load_saved, m)?)?;
    m.add_function(wrap_pyfunction!(free_port, m)?)?;
    m.add("IronweaveError", py.get_type::<IronweaveError>())?;
    for ((name, _, _), ty) in ERRORS.iter().zip(error_types(py)?) {
        m.add(*name, ty.bind(py))?;
    }
    m.add_function(wrap_pyfunction!(kept_jobs, m)?)?;
    m.add_function(wrap_pyfunction!(safe_name, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

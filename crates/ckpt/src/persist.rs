//! The persistent tier: a rank's snapshot as a `safetensors` file plus a JSON manifest,
//! written atomically (temporary file, fsync, rename, fsync of the directory). The manifest is
//! written last, so its presence means the data file is complete. Files live in
//! `DIR/iter-XXXXXXXX/rank-XXXXX.{safetensors,json}`.

use ironweave_units::Locked;
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{CkptError, Result};
use crate::registry::{DType, Registry, TensorMeta};
use crate::snapshot::{ChunkSum, Snapshot};

/// Format tag of manifests.
pub const FORMAT: &str = "ironweave-ckpt/1";
/// Largest safetensors header accepted (the format's own readers use 100 MB).
pub const MAX_HEADER: u64 = 100 << 20;

/// What describes one rank's checkpoint of one iteration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Rank.
    pub rank: u32,
    /// World size.
    pub world: u32,
    /// Iteration.
    pub iter: u64,
    /// Layout.
    pub registry: Registry,
    /// Chunk checksums.
    pub sums: Vec<ChunkSum>,
    /// xxh3 of each tensor's bytes, in registry order (files of the persistent tier: a loader
    /// that reads single tensors verifies each one it reads; empty in replication messages).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensor_xxh3: Vec<u64>,
    /// The parallel layout that wrote it (`world`, `kind`, degrees, experts per rank: free-form
    /// names the writer chose, shown by `ironweave ckpt inspect`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub layout: BTreeMap<String, String>,
    /// The job that wrote it (files of the persistent tier; empty in replication messages and
    /// in files written before job ids): a job restores only its own files unless told to
    /// continue another's ([`crate::EngineConfig::restore_other_jobs`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub job: String,
    /// HMAC-SHA256 (hex) of this manifest (with `mac` empty) and the data, keyed by the job's
    /// key ([`MacKey`]): written when the writer has a key; a reader with the key refuses a
    /// file without a valid one (a copy planted by someone who could write the directory but
    /// does not know the secret; xxh3 sums alone can be forged).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    /// A kept copy in a segment ([`crate::segment::Segment`]): the file, in the holder
    /// directory above the manifest's iteration directory, holding the state's bytes as the
    /// registry lays them out (no header). Empty: a `safetensors` file beside the manifest.
    /// The MAC of such a manifest covers the manifest alone, whose checksums cover the bytes.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub segment: String,
}

impl Manifest {
    /// Checks a manifest that came from rank `src` before anything is allocated for it: its
    /// format and rank, a layout consistent with its shapes (offsets back to back, lengths =
    /// elements x dtype size, the total their sum), and a total of at most `limit` bytes. A peer
    /// cannot make this rank allocate what it merely claims.
    pub fn check_from(&self, src: usize, limit: u64) -> Result<()> {
        let bad = |why: String| CkptError::Corrupt { what: format!("manifest from rank {src}"), detail: why };
        if self.format != FORMAT {
            return Err(bad(format!("format {:?}, expected {FORMAT:?}", self.format)));
        }
        if self.rank as usize != src {
            return Err(bad(format!("it says it is rank {}'s", self.rank)));
        }
        let specs: Vec<crate::registry::TensorSpec> = self
            .registry
            .tensors
            .iter()
            .map(|t| crate::registry::TensorSpec {
                global: t.global.clone(),
                ..crate::registry::TensorSpec::new(t.name.clone(), t.dtype, &t.shape)
            })
            .collect();
        let laid = Registry::new(&specs).map_err(|e| bad(format!("layout: {e}")))?;
        if laid != self.registry {
            return Err(bad("offsets, lengths or total do not follow from the shapes".into()));
        }
        if self.registry.total > limit {
            return Err(bad(format!(
                "{} bytes of state, over this holder's limit of {limit} bytes per replica (16x its own state, at least 1 GiB)",
                self.registry.total
            )));
        }
        Ok(())
    }

    /// The manifest of `snap` for `rank` of `world`.
    pub fn of(snap: &Snapshot, rank: u32, world: u32) -> Self {
        Manifest {
            format: FORMAT.into(),
            rank,
            world,
            iter: snap.iter,
            registry: (*snap.registry).clone(),
            sums: snap.sums().to_vec(),
            tensor_xxh3: Vec::new(),
            layout: BTreeMap::new(),
            job: String::new(),
            mac: String::new(),
            segment: String::new(),
        }
    }

    /// The segment file of a kept copy whose manifest is `man_path` (`HOLDER/iter-N/rank-R.json`
    /// names `HOLDER/SEGMENT`); none for a `safetensors` copy. A name that is not a plain file
    /// name of the holder directory is refused.
    pub fn segment_path(&self, man_path: &Path) -> Result<Option<PathBuf>> {
        if self.segment.is_empty() {
            return Ok(None);
        }
        let plain = !self.segment.contains('/') && !self.segment.starts_with('.') && self.segment.ends_with(".seg");
        match man_path.parent().and_then(Path::parent) {
            Some(holder) if plain => Ok(Some(holder.join(&self.segment))),
            _ => Err(CkptError::Format {
                path: man_path.to_path_buf(),
                why: format!("segment {:?} is not a file name of the holder directory", self.segment),
            }),
        }
    }
}

/// The directory of an iteration's files (every rank's).
pub fn iteration_dir(dir: &Path, iter: u64) -> PathBuf {
    dir.join(format!("iter-{iter:08}"))
}

/// Paths of a rank's files for an iteration.
pub fn paths(dir: &Path, iter: u64, rank: u32) -> (PathBuf, PathBuf) {
    let d = iteration_dir(dir, iter);
    (d.join(format!("rank-{rank:05}.safetensors")), d.join(format!("rank-{rank:05}.json")))
}

/// How the directories of a keep directory's holders begin (`holder-00003/`: the copies rank 3
/// keeps, its own and its peers').
pub const HOLDER_PREFIX: &str = "holder-";

/// The directories a checkpoint under `dir` is read from: `dir` itself, or, for a job's keep
/// directory ([`crate::EngineConfig::keep_dir`]), each holder's directory in rank order. Why:
/// the readers below then read a keep directory as one checkpoint (each rank's files from the
/// first holder that has them, its own or a peer's copy), so the files that outlived a job load
/// onto another layout like the persistent tier's.
fn roots(dir: &Path) -> Vec<PathBuf> {
    let mut holders: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with(HOLDER_PREFIX)) && e.path().is_dir())
        .map(|e| e.path())
        .collect();
    holders.sort();
    if holders.is_empty() {
        vec![dir.to_path_buf()]
    } else {
        holders
    }
}

/// Where rank `rank`'s files of iteration `iter` are read from under `dir` ([`roots`]): the
/// first root with its manifest, else the first root's path (the error then names it).
fn located(dir: &Path, iter: u64, rank: u32) -> (PathBuf, PathBuf) {
    let roots = roots(dir);
    roots.iter().map(|r| paths(r, iter, rank)).find(|p| p.1.exists()).unwrap_or_else(|| paths(&roots[0], iter, rank))
}

/// A token bucket: `rate` bytes per second, at most `burst` bytes at once. The persistent
/// tier's writer takes tokens before each block, so its long-run rate is `rate` (emulated
/// remote storage: a host's share of a parallel file system).
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(bytes_per_s: f64, burst: u64) -> Self {
        TokenBucket { rate: bytes_per_s.max(1.0), burst: burst.max(1) as f64, tokens: burst.max(1) as f64, last: Instant::now() }
    }

    /// How long to wait before `n` bytes may go, taking their tokens (pure given `now`).
    pub fn take_at(&mut self, n: u64, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = self.last.max(now);
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.tokens -= n as f64;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

/// Block size of paced writes.
pub const PACE_BLOCK: usize = 1 << 20;

/// Writes `parts` to `path` through a temporary file renamed into place; a failed write
/// (a full disk) removes the temporary file, so it leaves no space taken. `fault`: the (rank,
/// iteration) a campaign's `persist` fault point is checked against after the first block.
fn write_atomic(path: &Path, parts: &[&[u8]], bucket: Option<&Mutex<TokenBucket>>, fault: Option<(usize, u64)>) -> Result<()> {
    let tmp = path.with_extension(format!("{}.tmp", path.extension().and_then(|e| e.to_str()).unwrap_or("")));
    let r = (|| -> Result<()> {
        // readable by this user only: a checkpoint is the job's data, and what is read back is
        // trusted
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| CkptError::io(&tmp, e))?;
        let mut first = true;
        for p in parts {
            for block in p.chunks(PACE_BLOCK) {
                if let Some(b) = bucket {
                    let wait = b.locked().take_at(block.len() as u64, Instant::now());
                    std::thread::sleep(wait);
                }
                f.write_all(block).map_err(|e| CkptError::io(&tmp, e))?;
                if let (true, Some((rank, iter))) = (first, fault) {
                    crate::fault::hit("persist", rank, iter);
                }
                first = false;
            }
        }
        f.sync_all().map_err(|e| CkptError::io(&tmp, e))?;
        drop(f);
        fs::rename(&tmp, path).map_err(|e| CkptError::io(path, e))
    })();
    if r.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    r
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| CkptError::io(dir, e))
}

/// The safetensors header of a registry, padded to a multiple of 8 bytes.
fn header(reg: &Registry, meta: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let mut h = serde_json::Map::new();
    h.insert("__metadata__".into(), serde_json::to_value(meta).map_err(|e| CkptError::Invalid(e.to_string()))?);
    for t in &reg.tensors {
        h.insert(
            t.name.clone(),
            serde_json::json!({"dtype": t.dtype.safetensors_name(), "shape": t.shape, "data_offsets": [t.offset, t.offset + t.len]}),
        );
    }
    let mut bytes = serde_json::to_vec(&h).map_err(|e| CkptError::Invalid(e.to_string()))?;
    while bytes.len() % 8 != 0 {
        bytes.push(b' ');
    }
    Ok(bytes)
}

/// Write `snap` of `rank` (of `world`) under `dir`. Returns the data file's path.
pub fn write(dir: &Path, snap: &Snapshot, rank: u32, world: u32) -> Result<PathBuf> {
    write_with(dir, snap, rank, world, None)
}

/// [`write()`], the data paced by `bucket` when given.
pub fn write_with(dir: &Path, snap: &Snapshot, rank: u32, world: u32, bucket: Option<&Mutex<TokenBucket>>) -> Result<PathBuf> {
    write_layout(dir, snap, rank, world, bucket, &Written::default())
}

/// Who wrote a file of the persistent tier, as its manifest says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Written {
    /// The parallel layout that wrote it (free-form names).
    pub layout: BTreeMap<String, String>,
    /// The job that wrote it.
    pub job: String,
    /// The key each manifest's MAC is computed with (none: no MAC).
    pub key: Option<MacKey>,
}

/// The key that authenticates kept copies (`ironweave::checkpointer::mac_key_in`: random, kept
/// 0600 beside them). Never printed.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct MacKey(Vec<u8>);

impl std::fmt::Debug for MacKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MacKey(..)")
    }
}

impl MacKey {
    /// The key of `secret`; None for an empty secret (nothing to key with).
    pub fn new(secret: &[u8]) -> Option<MacKey> {
        (!secret.is_empty()).then(|| MacKey(secret.to_vec()))
    }

    /// HMAC-SHA256 of `parts` (RFC 2104).
    fn hmac(&self, parts: &[&[u8]]) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut k = [0u8; 64];
        if self.0.len() > 64 {
            k[..32].copy_from_slice(&Sha256::digest(&self.0));
        } else {
            k[..self.0.len()].copy_from_slice(&self.0);
        }
        let mut inner = Sha256::new();
        inner.update(k.map(|b| b ^ 0x36));
        for p in parts {
            inner.update(p);
        }
        let mut outer = Sha256::new();
        outer.update(k.map(|b| b ^ 0x5c));
        outer.update(inner.finalize());
        outer.finalize().into()
    }

    /// HMAC under `domain` of a manifest (its `mac` field left out, length-prefixed) and
    /// `data`, hex.
    fn mac_of(&self, domain: &[u8], man: &Manifest, data: &[u8]) -> Result<String> {
        let mut m = man.clone();
        m.mac.clear();
        let head = serde_json::to_vec(&m).map_err(|e| CkptError::Invalid(e.to_string()))?;
        let d = self.hmac(&[domain, &(head.len() as u64).to_le_bytes(), &head, data]);
        Ok(d.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The MAC of a manifest (its `mac` field left out) and the data it describes, hex.
    pub fn mac(&self, man: &Manifest, data: &[u8]) -> Result<String> {
        self.mac_of(b"ironweave-kept-copy-v1\0", man, data)
    }

    /// The MAC of a segment's manifest (its `mac` field left out), hex: the manifest alone,
    /// whose chunk checksums bind the bytes. Why not the bytes too: an HMAC pass over every
    /// byte costs more than the copy it guards, and it guards nothing more here — whoever can
    /// write a segment (this user, in a 0700 directory) can read the key beside it; what the
    /// MAC refuses is a copy another job or key wrote.
    pub fn mac_manifest(&self, man: &Manifest) -> Result<String> {
        self.mac_of(b"ironweave-kept-segment-v1\0", man, &[])
    }

    /// Checks `man`'s MAC over `data` (`what` names the file in the error); a segment's
    /// manifest over itself ([`MacKey::mac_manifest`]).
    pub fn check(&self, man: &Manifest, data: &[u8], what: &str) -> Result<()> {
        if man.mac.is_empty() {
            return Err(CkptError::Corrupt {
                what: what.to_string(),
                detail: "it carries no MAC: not written by this job (the job has a key, so its own copies carry one)".into(),
            });
        }
        let want = if man.segment.is_empty() { self.mac(man, data)? } else { self.mac_manifest(man)? };
        // compared in time independent of where they differ
        let diff = want.bytes().zip(man.mac.bytes()).fold(want.len() ^ man.mac.len(), |a, (x, y)| a | usize::from(x ^ y));
        if diff != 0 {
            return Err(CkptError::Corrupt {
                what: what.to_string(),
                detail: "its MAC does not match under this job's key: planted, altered, or written by another job".into(),
            });
        }
        Ok(())
    }
}

/// [`write_with`], the manifest naming the parallel layout and the job that wrote it.
pub fn write_layout(
    dir: &Path,
    snap: &Snapshot,
    rank: u32,
    world: u32,
    bucket: Option<&Mutex<TokenBucket>>,
    by: &Written,
) -> Result<PathBuf> {
    let (data_path, man_path) = paths(dir, snap.iter, rank);
    let d = data_path.parent().expect("has a parent");
    fs::create_dir_all(d).map_err(|e| CkptError::io(d, e))?;
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert("iteration".to_string(), snap.iter.to_string());
    meta.insert("rank".to_string(), rank.to_string());
    meta.insert("world".to_string(), world.to_string());
    let h = header(&snap.registry, &meta)?;
    let n = (h.len() as u64).to_le_bytes();
    write_atomic(&data_path, &[&n, &h, &snap.data], bucket, Some((rank as usize, snap.iter)))?;
    let mut man = Manifest::of(snap, rank, world);
    man.tensor_xxh3 = snap
        .registry
        .tensors
        .iter()
        .map(|t| xxhash_rust::xxh3::xxh3_64(&snap.data[t.offset as usize..(t.offset + t.len) as usize]))
        .collect();
    man.layout = by.layout.clone();
    man.job = by.job.clone();
    if let Some(k) = &by.key {
        man.mac = k.mac(&man, &snap.data)?;
    }
    let m = serde_json::to_vec_pretty(&man).map_err(|e| CkptError::Invalid(e.to_string()))?;
    write_atomic(&man_path, &[&m], None, None)?;
    sync_dir(d)?;
    sync_dir(dir)?;
    Ok(data_path)
}

/// Writes the manifest of a kept copy held in the segment `seg` of the holder directory
/// `holder`: `man` (its rank, iteration, layout and checksums) as `by` wrote it, naming the
/// segment, with a MAC over the manifest when `by` has a key; through a temporary file renamed
/// into place, so a reader sees the whole manifest or none. No byte of the state is written:
/// the segment already holds it. Returns the manifest's path.
pub fn write_segment_manifest(holder: &Path, man: &mut Manifest, seg: &crate::segment::Segment, by: &Written) -> Result<PathBuf> {
    let Some(name) = seg.path().filter(|p| p.parent() == Some(holder)).and_then(|p| p.file_name()).and_then(|n| n.to_str())
    else {
        return Err(CkptError::Invalid(format!("{seg:?} is not a segment of {}", holder.display())));
    };
    man.segment = name.to_string();
    man.layout = by.layout.clone();
    man.job = by.job.clone();
    man.tensor_xxh3.clear();
    man.mac.clear();
    if let Some(k) = &by.key {
        man.mac = k.mac_manifest(man)?;
    }
    let (_, man_path) = paths(holder, man.iter, man.rank);
    let d = man_path.parent().expect("has a parent");
    fs::create_dir_all(d).map_err(|e| CkptError::io(d, e))?;
    let m = serde_json::to_vec(man).map_err(|e| CkptError::Invalid(e.to_string()))?;
    write_atomic(&man_path, &[&m], None, None)?;
    Ok(man_path)
}

/// Checks the segment `seg` (`len` bytes) against its manifest `man`: with `key` the
/// manifest's MAC, then the length its layout gives. The checksums over the bytes are the
/// caller's next step.
pub fn check_segment(man: &Manifest, seg: &Path, len: usize, key: Option<&MacKey>) -> Result<()> {
    let what = seg.display().to_string();
    if let Some(k) = key {
        k.check(man, &[], &what)?;
    }
    if len as u64 != man.registry.total {
        return Err(CkptError::Corrupt { what, detail: format!("{len} bytes, the manifest says {}", man.registry.total) });
    }
    Ok(())
}

/// The bytes of a kept copy: its segment (`man.segment`) or its `safetensors` file, checked
/// against the manifest's layout (and with `key`, its MAC) before anything is verified.
fn read_data(data_path: &Path, man_path: &Path, man: &Manifest, key: Option<&MacKey>) -> Result<(PathBuf, Vec<u8>)> {
    if let Some(seg) = man.segment_path(man_path)? {
        // the MAC before the bytes are read: a planted manifest costs no read
        if let Some(k) = key {
            k.check(man, &[], &seg.display().to_string())?;
        }
        let data = fs::read(&seg).map_err(|e| CkptError::io(&seg, e))?;
        check_segment(man, &seg, data.len(), None)?;
        return Ok((seg, data));
    }
    let (reg, data) = read_safetensors(data_path)?;
    if let Some(k) = key {
        k.check(man, &data, &data_path.display().to_string())?;
    }
    let mut want = man.registry.tensors.clone();
    want.sort_by_key(|t| (t.offset, t.len));
    if reg.tensors.len() != want.len() || reg.tensors.iter().zip(&want).any(|(a, b)| !a.same_bytes(b)) {
        return Err(CkptError::Corrupt {
            what: data_path.display().to_string(),
            detail: "tensors differ from the manifest's".into(),
        });
    }
    Ok((data_path.to_path_buf(), data))
}

/// Parse a safetensors file into a layout and its data, checking every length and offset.
pub fn read_safetensors(path: &Path) -> Result<(Registry, Vec<u8>)> {
    let bytes = fs::read(path).map_err(|e| CkptError::io(path, e))?;
    let (reg, data) = parse_safetensors(&bytes, path)?;
    Ok((reg, data.to_vec()))
}

/// Parse the bytes of a safetensors file (named `path` in errors) into a layout and its data,
/// checking every length and offset before it is used.
pub fn parse_safetensors<'a>(bytes: &'a [u8], path: &Path) -> Result<(Registry, &'a [u8])> {
    let bad = |why: String| CkptError::Format { path: path.to_path_buf(), why };
    if bytes.len() < 8 {
        return Err(bad(format!("{} bytes: shorter than the 8-byte header length", bytes.len())));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER || n > bytes.len() as u64 - 8 {
        return Err(bad(format!("header length {n} exceeds the file ({} bytes) or the {MAX_HEADER}-byte limit", bytes.len())));
    }
    let head: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n as usize]).map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    let data = &bytes[8 + n as usize..];
    let mut tensors = Vec::new();
    for (name, v) in &head {
        if name == "__metadata__" {
            continue;
        }
        let dtype = v
            .get("dtype")
            .and_then(|d| d.as_str())
            .and_then(DType::parse_safetensors)
            .ok_or_else(|| bad(format!("tensor `{name}`: unknown or missing dtype")))?;
        let shape: Vec<u64> = v
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect())
            .ok_or_else(|| bad(format!("tensor `{name}`: missing or invalid shape")))?;
        let offs: Vec<u64> = v
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect())
            .filter(|o: &Vec<u64>| o.len() == 2 && o[0] <= o[1])
            .ok_or_else(|| bad(format!("tensor `{name}`: invalid data_offsets")))?;
        let want = shape
            .iter()
            .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad(format!("tensor `{name}`: shape overflows")))?;
        if offs[1] - offs[0] != want {
            return Err(bad(format!("tensor `{name}`: {} bytes for shape {shape:?} of {}", offs[1] - offs[0], dtype.name())));
        }
        tensors.push(TensorMeta { name: name.clone(), dtype, shape, offset: offs[0], len: want, global: None });
    }
    tensors.sort_by_key(|t| (t.offset, t.len));
    let mut end = 0;
    for t in &tensors {
        if t.offset != end {
            return Err(bad(format!("tensor `{}` starts at {} instead of {end} (holes or overlaps)", t.name, t.offset)));
        }
        end = end.checked_add(t.len).ok_or_else(|| bad(format!("tensor `{}`: lengths overflow", t.name)))?;
    }
    if end != data.len() as u64 {
        return Err(bad(format!("tensors cover {end} bytes, the file holds {} (truncated?)", data.len())));
    }
    Ok((Registry { tensors, total: end }, data))
}

/// Load and verify a rank's checkpoint of one iteration.
pub fn load(dir: &Path, iter: u64, rank: u32) -> Result<Snapshot> {
    load_keyed(dir, iter, rank, None)
}

/// [`load`], and with `key` the file's MAC checked too (before its bytes are used).
pub fn load_keyed(dir: &Path, iter: u64, rank: u32, key: Option<&MacKey>) -> Result<Snapshot> {
    let (data_path, man_path) = located(dir, iter, rank);
    let man = read_manifest(dir, iter, rank)?;
    let (path, data) = read_data(&data_path, &man_path, &man, key)?;
    Snapshot::verify(&data, &man.sums, &path.display().to_string())?;
    Ok(Snapshot::with_sums(iter, Arc::new(man.registry), data, man.sums))
}

/// Reads and checks rank `rank`'s manifest of iteration `iter` under `dir`.
pub fn read_manifest(dir: &Path, iter: u64, rank: u32) -> Result<Manifest> {
    let (_, man_path) = located(dir, iter, rank);
    let text = fs::read(&man_path).map_err(|e| CkptError::io(&man_path, e))?;
    let man: Manifest = serde_json::from_slice(&text)
        .map_err(|e| CkptError::Format { path: man_path.clone(), why: format!("manifest is not valid: {e}") })?;
    if man.format != FORMAT || man.iter != iter || man.rank != rank {
        return Err(CkptError::Format {
            path: man_path,
            why: format!(
                "manifest says format {}, iteration {}, rank {}; expected {FORMAT}, {iter}, {rank}",
                man.format, man.iter, man.rank
            ),
        });
    }
    // the layout must follow from the shapes (a hand-edited or foreign manifest)
    man.check_from(rank as usize, u64::MAX)
        .map_err(|e| CkptError::Format { path: located(dir, iter, rank).1, why: e.to_string() })?;
    Ok(man)
}

/// The global index of a checkpoint from every rank's manifest ([`crate::layout::index`], with
/// each manifest's per-tensor checksums where it has them): refused when the files do not make
/// one model.
pub fn global_index(mans: &[Manifest]) -> Result<crate::layout::GlobalIndex> {
    let files: Vec<(&Registry, Option<&[u64]>)> =
        mans.iter().map(|m| (&m.registry, (!m.tensor_xxh3.is_empty()).then_some(m.tensor_xxh3.as_slice()))).collect();
    crate::layout::index(&files)
}

/// Every rank's manifest of iteration `iter` under `dir` (the world size from rank 0's): a
/// missing one is an error naming the file (a checkpoint whose write did not finish on every
/// rank).
pub fn read_manifests(dir: &Path, iter: u64) -> Result<Vec<Manifest>> {
    let first = read_manifest(dir, iter, 0)?;
    let world = first.world;
    let mut out = vec![first];
    for r in 1..world {
        let m = read_manifest(dir, iter, r)?;
        if m.world != world {
            return Err(CkptError::Format {
                path: located(dir, iter, r).1,
                why: format!("world {} here, {world} in rank 0's manifest", m.world),
            });
        }
        if m.job != out[0].job {
            // two jobs wrote into one directory: their files of one iteration are not one state
            return Err(CkptError::Format {
                path: located(dir, iter, r).1,
                why: format!("written by job {:?}, rank 0's by job {:?}", m.job, out[0].job),
            });
        }
        out.push(m);
    }
    Ok(out)
}

/// The newest iteration under `dir` every rank of which wrote its files completely (all
/// `world` manifests present; a manifest is written after its data file), with the reasons
/// newer ones were passed over.
pub fn newest_complete(dir: &Path) -> Result<(u64, Vec<String>)> {
    let mut skipped = Vec::new();
    for it in iterations(dir, 0) {
        match read_manifests(dir, it) {
            Ok(_) => return Ok((it, skipped)),
            Err(e) => skipped.push(format!("iteration {it}: {e}")),
        }
    }
    Err(CkptError::NothingToRestore {
        tried: format!(
            "{}: {}",
            dir.display(),
            if skipped.is_empty() { "no iteration with rank 0's manifest".to_string() } else { skipped.join("; ") }
        ),
        hint:
            "give the directory a job's persistent tier wrote (`<report dir>/persist`), with every rank's files of one iteration"
                .into(),
    })
}

/// Start of the data section of a safetensors file (after its 8-byte length and header),
/// checked against the file's size.
fn data_start(f: &mut File, path: &Path) -> Result<u64> {
    use std::io::Read;
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|e| CkptError::io(path, e))?;
    let n = u64::from_le_bytes(n);
    let size = f.metadata().map_err(|e| CkptError::io(path, e))?.len();
    if n > MAX_HEADER || n.saturating_add(8) > size {
        return Err(CkptError::Format {
            path: path.to_path_buf(),
            why: format!("header length {n} exceeds the file ({size} bytes)"),
        });
    }
    Ok(8 + n)
}

/// Loads iteration `iter` of the checkpoint under `dir` into the layout `want` (a registry whose
/// tensors name their global slices), whatever layout wrote it: the manifests are indexed
/// ([`crate::layout::index`]: refused when they do not make one model), each owner slice this
/// rank needs is read by range from its file and checked against its checksum, and the parts
/// of it this rank's tensors cover are copied in. Reads only the slices it needs.
pub fn load_global(dir: &Path, iter: u64, want: &Registry) -> Result<Snapshot> {
    use std::io::{Read, Seek, SeekFrom};
    let mans = read_manifests(dir, iter)?;
    let idx = global_index(&mans)?;
    let fills = crate::layout::plan(&idx, want)?;
    let mut data = vec![0u8; want.total as usize];
    // per file: the open file, where its data starts, its path, and a segment's whole bytes
    // (read once to check its checksums, then sliced)
    type Opened = (File, u64, PathBuf, Option<Vec<u8>>);
    let mut open: BTreeMap<usize, Opened> = BTreeMap::new();
    // every (target tensor, source slice) read in file order, so each file is read front to
    // back (the kernel's read-ahead works) whatever order the target registers its tensors in
    let mut reads: Vec<(&crate::registry::TensorMeta, &str, &crate::layout::Source, &Vec<crate::layout::Copy>)> = Vec::new();
    for f in &fills {
        let t = &want.tensors[f.target];
        let g = t.global.as_ref().expect("planned tensors have a global slice");
        for (si, runs) in &f.from {
            reads.push((t, g.tensor.as_str(), &idx[&g.tensor].sources[*si], runs));
        }
    }
    reads.sort_by_key(|r| (r.2.file, r.2.offset));
    for (t, gname, s, runs) in reads {
        {
            let (fh, start, p, whole_seg) = match open.entry(s.file) {
                std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => {
                    let (p, man_path) = located(dir, iter, s.file as u32);
                    // a segment has no header and no per-tensor checksums: its chunk checksums
                    // are checked over the whole file before any slice of it is used
                    let seg = mans[s.file].segment_path(&man_path)?;
                    let p = seg.clone().unwrap_or(p);
                    let mut fh = File::open(&p).map_err(|e| CkptError::io(&p, e))?;
                    let (start, all) = match seg {
                        Some(_) => {
                            let mut all = Vec::new();
                            fh.read_to_end(&mut all).map_err(|e| CkptError::io(&p, e))?;
                            Snapshot::verify(&all, &mans[s.file].sums, &p.display().to_string())?;
                            (0, Some(all))
                        }
                        None => (data_start(&mut fh, &p)?, None),
                    };
                    v.insert((fh, start, p, all))
                }
            };
            // a slice that lands whole in the tensor is read straight into place; a part of
            // one is read whole (its checksum covers all of it) and the runs copied out
            let whole = matches!(runs.as_slice(), [c] if c.src == 0 && c.run == s.len);
            let mut buf = Vec::new();
            let into: &mut [u8] = if whole {
                let at = (t.offset + runs[0].dst) as usize;
                &mut data[at..at + s.len as usize]
            } else {
                buf.resize(s.len as usize, 0);
                &mut buf
            };
            let truncated = |e: String| CkptError::Layout {
                tensor: gname.to_string(),
                file: Some(p.display().to_string()),
                detail: format!("{} bytes at {} cannot be read ({e}): the file is truncated", s.len, *start + s.offset),
            };
            match whole_seg {
                Some(all) => {
                    let from = usize::try_from(s.offset).ok().and_then(|a| all.get(a..a.checked_add(into.len())?));
                    into.copy_from_slice(from.ok_or_else(|| truncated(format!("the segment has {} bytes", all.len())))?);
                }
                None => {
                    fh.seek(SeekFrom::Start(*start + s.offset)).map_err(|e| CkptError::io(&*p, e))?;
                    fh.read_exact(into).map_err(|e| truncated(e.to_string()))?;
                }
            }
            if let Some(x) = s.xxh3 {
                if xxhash_rust::xxh3::xxh3_64(into) != x {
                    return Err(CkptError::Layout {
                        tensor: gname.to_string(),
                        file: Some(p.display().to_string()),
                        detail: "its bytes do not match the manifest's checksum".into(),
                    });
                }
            }
            if !whole {
                for c in runs {
                    let (src, dst, n) = (c.src as usize, (t.offset + c.dst) as usize, c.run as usize);
                    data[dst..dst + n].copy_from_slice(&buf[src..src + n]);
                }
            }
        }
    }
    Ok(Snapshot::new(iter, Arc::new(want.clone()), data))
}

/// Iterations that have a directory under `dir` (whoever's files are in it; in any holder's
/// directory of a keep directory), newest first.
pub fn iteration_dirs(dir: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = roots(dir)
        .iter()
        .flat_map(|r| fs::read_dir(r).into_iter().flatten().flatten())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_prefix("iter-")).and_then(|n| n.parse().ok()))
        .collect();
    v.sort_unstable_by(|a, b| b.cmp(a));
    v.dedup();
    v
}

/// Iterations that have a manifest for `rank` under `dir`, newest first.
pub fn iterations(dir: &Path, rank: u32) -> Vec<u64> {
    iteration_dirs(dir).into_iter().filter(|&it| located(dir, it, rank).1.exists()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_lets_a_burst_through_then_paces_at_its_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket { rate: 1e6, burst: 2e6, tokens: 2e6, last: t0 };
        // 2 MB at once: the burst
        assert_eq!(b.take_at(2_000_000, t0), Duration::ZERO);
        // 1 MB more right away: a second at 1 MB/s
        assert_eq!(b.take_at(1_000_000, t0), Duration::from_secs(1));
        // after that second plus half a second: 0.5 MB in the bucket, 1 MB wants half a second
        let later = t0 + Duration::from_millis(1500);
        assert_eq!(b.take_at(1_000_000, later), Duration::from_millis(500));
        // a long pause refills at most the burst
        let much_later = later + Duration::from_secs(100);
        assert_eq!(b.take_at(2_000_000, much_later + Duration::from_millis(500)), Duration::ZERO);
    }
}

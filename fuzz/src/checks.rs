//! What each fuzz target checks, shared by the libFuzzer targets (`fuzz_targets/`) and the
//! corpus replay that runs under `cargo test` (`crates/cli/tests/fuzz_corpus.rs`, which
//! includes this file). Every function takes bytes a peer, a file or a user chose; none may
//! panic, hang or allocate what the bytes merely claim, and whatever decodes must satisfy the
//! invariants its users rely on.

use std::path::Path;

use ironweave_ckpt::persist::{parse_safetensors, Manifest};
use ironweave_ckpt::wire::{chunk_range, decode_restore_manifest, Ack, ReplicaMsg};
use ironweave_ckpt::Snapshot;
use ironweave_transport::wire::{FrameHeader, Handshake, MAX_HANDSHAKE};

/// The most bytes a replica may claim in these checks.
const LIMIT: u64 = 1 << 20;

/// The transport's data-frame header and handshake messages.
pub fn frame_decoder(data: &[u8]) {
    if let Ok(h) = FrameHeader::decode(data, 1 << 30) {
        assert!(h.offset.checked_add(h.len).is_some_and(|end| end <= h.total));
        assert!(h.total <= 1 << 30);
        assert_eq!(FrameHeader::decode(&h.encode(), 1 << 30), Ok(h));
    }
    if data.len() >= 4 {
        if let Ok(n) = Handshake::check_len([data[0], data[1], data[2], data[3]]) {
            assert!(n <= MAX_HANDSHAKE);
        }
    }
    if let Ok(m) = Handshake::decode(data) {
        let enc = m.encode();
        assert_eq!(Handshake::decode(&enc[4..]).as_ref(), Ok(&m));
    }
}

/// The checkpoint engine's peer messages: replica `Begin`/`Chunk`/`End`, acknowledgements and
/// a restore's manifest.
pub fn ckpt_wire(data: &[u8]) {
    if let Ok(m) = ReplicaMsg::decode(1, data, LIMIT) {
        let again = match &m {
            ReplicaMsg::Begin { manifest: man, keep_from } => {
                assert_eq!(man.rank, 1);
                assert!(man.registry.total <= LIMIT);
                ReplicaMsg::encode_begin(man, *keep_from).expect("a decoded manifest encodes")
            }
            ReplicaMsg::Chunk { iter, offset, bytes } => {
                if let Some(r) = chunk_range(*offset, bytes.len(), LIMIT as usize) {
                    assert!(r.end <= LIMIT as usize && r.len() == bytes.len());
                }
                ReplicaMsg::encode_chunk(*iter, *offset, bytes)
            }
            ReplicaMsg::End { iter } => ReplicaMsg::encode_end(*iter),
        };
        assert_eq!(ReplicaMsg::decode(1, &again, LIMIT).ok(), Some(m));
    }
    if let Ok(a) = Ack::decode(1, data) {
        assert_eq!(a.encode().as_slice(), data);
    }
    if let Ok(man) = decode_restore_manifest(0, 1, 3, data, LIMIT) {
        assert!(man.rank == 1 && man.iter == 3 && man.registry.total <= LIMIT);
    }
}

/// The persistent tier's files: a safetensors data file and a JSON manifest (with its chunk
/// checksums walked over a small buffer, as a restore does).
pub fn ckpt_files(data: &[u8]) {
    if let Ok((reg, bytes)) = parse_safetensors(data, Path::new("fuzz.safetensors")) {
        assert_eq!(reg.total, bytes.len() as u64);
        let mut end = 0;
        for t in &reg.tensors {
            assert_eq!(t.offset, end);
            end += t.len;
        }
        assert_eq!(end, reg.total);
    }
    if let Ok(man) = serde_json::from_slice::<Manifest>(data) {
        if man.check_from(man.rank as usize, LIMIT).is_ok() {
            assert!(man.registry.total <= LIMIT);
        }
        let _ = Snapshot::verify(&data[..data.len().min(4096)], &man.sums, "fuzz");
        // the global layout: indexed (or refused) without a panic, and a plan onto the same
        // layout copies each target byte at most once
        let sums = (!man.tensor_xxh3.is_empty()).then_some(man.tensor_xxh3.as_slice());
        if man.check_from(man.rank as usize, LIMIT).is_ok() {
            if let Ok(idx) = ironweave_ckpt::layout::index(&[(&man.registry, sums)]) {
                if let Ok(plan) = ironweave_ckpt::layout::plan(&idx, &man.registry) {
                    for f in &plan {
                        let t = &man.registry.tensors[f.target];
                        let copied: u64 = f.from.iter().flat_map(|(_, r)| r.iter()).map(|c| c.run).sum();
                        assert!(copied <= t.len, "{copied} bytes planned into a {}-byte tensor", t.len);
                    }
                }
            }
        }
    }
}

/// Every TOML the CLI reads; the first byte picks the parser: 0 a training config, 1 a model
/// description, 2 a cluster description, 3 an emulated-cluster topology, 4 a device profile.
pub fn configs(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    match which % 5 {
        0 => {
            if let Ok(c) = ironweave_train::config::TrainConfig::from_toml_str(text) {
                assert!(c.model.layers >= 1 && c.model.hidden % c.model.heads == 0);
            }
        }
        1 => {
            if let Ok(m) = ironweave_plan::desc::ModelDesc::from_toml_str(text) {
                assert!(m.layers >= 1);
            }
        }
        2 => {
            if let Ok(c) = ironweave_plan::desc::ClusterDesc::from_toml_str(text) {
                assert!(c.devices() >= 1);
            }
        }
        4 => {
            if let Ok(d) = ironweave_plan::desc::DeviceDesc::from_toml_str(text) {
                let s = d.roofline().seconds(1e12, 1e9);
                assert!(s.is_finite() && s > 0.0, "{d:?}: {s}");
            }
        }
        _ => {
            if let Ok(t) = ironweave_ops::cluster::Topology::from_toml_str(text) {
                for h in 0..t.hosts {
                    assert!(!t.tcp_links_env(h).is_empty());
                }
            }
        }
    }
}

/// Every JSON the CLI reads; the first byte picks the reader: 0 a TMP plan, 1 an SDP plan, 2 a
/// recorded expert-load trace, 3 link probe results.
pub fn plans(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else { return };
    match which % 5 {
        0 => {
            let _ = ironweave_plan::tp::TpPlan::from_json(rest);
        }
        1 => {
            if let Ok(f) = ironweave_plan::sdp::part_fractions_from_json(rest, 4) {
                assert!(f.len() >= 4 && f.iter().all(|x| (0.0..=1.0).contains(x)));
            }
        }
        2 => {
            if let Ok(t) = serde_json::from_slice::<ironweave_sim::load::LoadTrace>(rest) {
                let _ = t.validate(2, t.experts);
            }
        }
        _ => {
            let _ = serde_json::from_slice::<Vec<ironweave_transport::probe::LinkProbe>>(rest);
        }
    }
}

/// R data files (crates/airq's reader): any bytes, as an `.rda` file, as a bare serialized
/// stream and as the AirBase data set; errors are fine, panics and huge allocations are not,
/// and a stream that parses parses the same again.
pub fn rdata(data: &[u8]) {
    use ironweave_airq::rdata::{parse_rda, parse_serialized};
    let _ = parse_rda(data);
    let _ = ironweave_airq::data::AirData::parse(data);
    if let Ok(o) = parse_serialized(data) {
        let again = parse_serialized(data).map(|x| format!("{x:?}"));
        assert_eq!(again.ok(), Some(format!("{o:?}")), "a second parse differs");
    }
}

/// OrthoNets' loaders (crates/orthonets): any bytes as a file, read as a pair list and a
/// network (TSV, CSV, STRING's spaces, PSI-MITAB, gzip), as an ortholog table between two
/// small networks and as each annotation table. Errors are fine, panics are not; a network
/// that loads has each edge once, no self-loop and scores in [0, 1].
pub fn orthonets(data: &[u8]) {
    use ironweave_orthonets::annot::{Annotations, Sources};
    use ironweave_orthonets::edges::{self, Columns};
    use ironweave_orthonets::graph::{Interner, Network};
    use ironweave_orthonets::ortho;
    let dir = std::env::temp_dir().join(format!("ironweave-fuzz-orthonets-{}", std::process::id()));
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let p = dir.join("input");
    if std::fs::write(&p, data).is_err() {
        return;
    }
    if let Ok(l) = edges::read_pairs(&p, &Columns::Auto) {
        assert!(l.pairs.iter().all(|x| !x.a.is_empty() && !x.b.is_empty() && x.score.is_none_or(|s| (0.0..=1.0).contains(&s))));
    }
    if let Ok(n) = edges::load(&p, &Columns::Auto) {
        let e: Vec<(u32, u32, f32)> = n.net.edges().collect();
        assert_eq!(e.len(), n.net.edge_count());
        assert!(e.iter().all(|&(a, b, s)| a < b && (0.0..=1.0).contains(&s) && n.net.edge(b, a) == Some(s)));
    }
    let net = |names: &[&str]| {
        let mut ids = Interner::default();
        let v: Vec<u32> = names.iter().map(|n| ids.intern(n)).collect();
        Network::build(ids, vec![(v[0], v[1], 1.0), (v[1], v[2], 0.5)]).0
    };
    let (h, m) = (net(&["TP53", "MDM2", "EGFR"]), net(&["Trp53", "Mdm2", "Egfr"]));
    if let Ok(o) = ortho::load(&p, &h, &m) {
        assert!(o.orthology.relations.iter().all(|r| r.weight > 0.0 && r.weight <= 1.0));
    }
    let one = |f: fn(&mut Sources, std::path::PathBuf)| {
        let mut s = Sources::default();
        f(&mut s, p.clone());
        let _ = Annotations::load(&s);
    };
    one(|s, p| s.genes = Some(p));
    one(|s, p| s.go = Some(p));
    one(|s, p| s.go_terms = Some(p));
    one(|s, p| s.hpo_genes = Some(p));
    one(|s, p| s.hpo_diseases = Some(p));
}

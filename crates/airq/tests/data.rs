//! The reader on the real file Debian's r-cran-spacetime installs (scripts/deps.sh installs
//! it), checked against what R itself reads from it; and the errors for a missing or corrupt
//! file, which name the package to install.

use ironweave_airq::data::{AirData, PACKAGE};
use ironweave_airq::pipeline::{windows, Split, WindowSpec};

#[test]
fn the_airbase_file_reads_as_r_reads_it() {
    let d = AirData::load(None).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((d.stations.len(), d.days), (70, 4383));
    assert_eq!((d.date(0).as_str(), d.date(d.days - 1).as_str()), ("1998-01-01", "2009-12-31"));
    assert_eq!(d.states.len(), 16);
    // values R prints for the first station: `stations@coords[1, ]`, `rownames(air)[1]`
    let s0 = &d.stations[0];
    assert_eq!(s0.code, "DESH001");
    assert!((s0.lon - 9.585911).abs() < 1e-6 && (s0.lat - 53.67057).abs() < 1e-5, "{s0:?}");
    assert_eq!(d.states[s0.state].name, "Schleswig-Holstein");
    // `sum(!is.na(air))`
    assert_eq!(d.pm10.iter().filter(|v| v.is_finite()).count(), 149_151);
    // stations per state as sp::over() assigns them (plus one border station outside every
    // polygon, given to the nearest state: Sachsen 7 + 1)
    let count = |n: &str| d.stations.iter().filter(|s| d.states[s.state].name == n).count();
    for (n, c) in
        [("Niedersachsen", 8), ("Berlin", 3), ("Brandenburg", 7), ("Rheinland-Pfalz", 6), ("Saarland", 1), ("Bremen", 0)]
    {
        assert_eq!(count(n), c, "{n}");
    }
    assert_eq!(d.states_with_stations().len(), 13);
    // the default split is chronological and the windows of its periods do not overlap
    let sp = Split::by_years(d.days).unwrap();
    assert_eq!((d.date(sp.train.end - 1).as_str(), d.date(sp.val.end - 1).as_str()), ("2005-12-31", "2007-12-31"));
    let st: Vec<usize> = (0..70).collect();
    let spec = WindowSpec::default();
    let last_train_target =
        windows(&d, &st, sp.train.clone(), &spec).iter().map(|w| w.day as usize + spec.horizon).max().unwrap();
    let first_test_target = windows(&d, &st, sp.test.clone(), &spec).iter().map(|w| w.day as usize + 1).min().unwrap();
    assert!(last_train_target < sp.val.start && first_test_target >= sp.test.start);
}

#[test]
fn a_missing_or_corrupt_file_names_the_package_to_install() {
    let e = AirData::load(Some(std::path::Path::new("/no/such/air.rda"))).unwrap_err().to_string();
    assert!(e.contains(PACKAGE) && e.contains("/no/such/air.rda"), "{e}");
    let real = ironweave_airq::data::DEFAULT_PATHS.iter().find(|p| std::path::Path::new(p).exists()).expect("r-cran-spacetime");
    let bytes = std::fs::read(real).unwrap();
    let dir = std::env::temp_dir().join(format!("airq-corrupt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, b) in [("truncated.rda", bytes[..bytes.len() / 2].to_vec()), ("garbage.rda", b"RDX2\nX\n\x00\x00".to_vec())] {
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        let e = AirData::load(Some(&p)).unwrap_err().to_string();
        assert!(e.contains(PACKAGE) && e.contains(name), "{e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Mutations of the real file's serialized stream (cut short, bits flipped, lengths
/// overwritten) are errors or other objects, never panics.
#[test]
fn mutated_streams_are_errors_not_panics() {
    use ironweave_airq::rdata::{decompress, parse_serialized};
    let real = ironweave_airq::data::DEFAULT_PATHS.iter().find(|p| std::path::Path::new(p).exists()).expect("r-cran-spacetime");
    let raw = decompress(&std::fs::read(real).unwrap()).unwrap();
    let body = &raw[5..]; // after "RDX2\n"
    assert!(parse_serialized(body).is_ok());
    let mut rng = ironweave_airq::Rng::new(&[7]);
    let mut errors = 0;
    for k in 0..240 {
        let mut m = body.to_vec();
        match k % 3 {
            0 => m.truncate(rng.below(body.len())),
            1 => {
                for _ in 0..4 {
                    let i = rng.below(m.len());
                    m[i] ^= 1 << rng.below(8);
                }
            }
            _ => {
                // a word (flags, a length, a reference) overwritten with something large
                let i = rng.below(m.len() / 4) * 4;
                m[i..i + 4].copy_from_slice(&[0x7f, 0xff, rng.below(256) as u8, 0xff]);
            }
        }
        let r = std::panic::catch_unwind(|| parse_serialized(&m)).expect("the reader panicked");
        if k % 3 == 0 {
            assert!(r.is_err(), "a stream cut at {} of {} bytes parsed", m.len(), body.len());
            errors += 1;
        }
    }
    assert_eq!(errors, 80);
}

#[test]
fn every_method_sees_the_same_target_days_and_draws_the_same_windows() {
    use ironweave_airq::train::{FitConfig, Method, Prepared, Task};
    use std::sync::Arc;
    let d = Arc::new(AirData::load(None).unwrap_or_else(|e| panic!("{e}")));
    let split = Split::by_years(d.days).unwrap();
    let prep = |m: Method| {
        let mut t = Task::nearest(&d, "Niedersachsen", Some(2), Some("Rheinland-Pfalz"), split.clone()).unwrap();
        t.target_days = 90;
        Prepared::new(d.clone(), t, m).unwrap()
    };
    let (plain, adv, per) = (prep(Method::NoClassifier), prep(Method::MultiClass), prep(Method::PerSource));
    // the adversaries' unlabelled target windows are those of the labelled days (by default)
    assert!(!adv.target_unlabelled.is_empty());
    assert!(
        adv.target_unlabelled == adv.target_labelled,
        "the domain classifier sees target days the plain network does not: {} unlabelled windows, {} labelled",
        adv.target_unlabelled.len(),
        adv.target_labelled.len()
    );
    // one normalisation for every method that learns from the sources
    assert_eq!(plain.norm, adv.norm);
    assert_eq!(plain.norm, per.norm);
    // the same labelled windows in every batch; the adversaries' unlabelled ones come after
    let fit = FitConfig { batch: 16, ..FitConfig::default() };
    for (it, rank) in [(1, 0), (7, 3)] {
        let (a, b) = (plain.batch(&fit, it, rank), adv.batch(&fit, it, rank));
        assert_eq!((a.n, b.n), (16, 24));
        assert_eq!(a.x[..], b.x[..a.x.len()]);
        assert_eq!(a.y[..], b.y[..a.y.len()]);
        assert!(b.mask[a.mask.len()..].iter().all(|&m| m == 0.0), "unlabelled windows are masked");
    }
    // more unlabelled days on request (the unsupervised-adaptation setting)
    let mut t = Task::nearest(&d, "Niedersachsen", Some(2), Some("Rheinland-Pfalz"), split.clone()).unwrap();
    t.target_days = 90;
    t.unlabelled_days = 730;
    let wide = Prepared::new(d.clone(), t, Method::MultiClass).unwrap();
    assert!(wide.target_unlabelled.len() > 4 * wide.target_labelled.len());
}

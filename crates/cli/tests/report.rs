//! `ironweave train --backend ucx` end to end, and the HTML report it leaves, opened in headless
//! Chromium: the screenshot is not blank and the charts' elements are in the page.

use std::process::Command;

use ironweave_testkit::chromium;

const BIN: &str = env!("CARGO_BIN_EXE_ironweave");

fn root() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../..")
}

#[test]
#[cfg(feature = "ucx")]
fn train_over_ucx_writes_a_report_that_renders_in_chromium() {
    let dir = std::env::temp_dir().join(format!("iw-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(BIN)
        .current_dir(root())
        .args(["train", "--config", "configs/moe-tiny.toml", "--ranks", "2", "--backend", "ucx", "--iters", "6"])
        .arg("--report-dir")
        .arg(&dir)
        .env("IRONWEAVE_TIMEOUT_S", "60")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("over ucx"), "{stderr}");
    let html_path = dir.join("report.html");
    assert!(stdout.contains(&format!("report: {}", html_path.display())), "{stdout}");
    // the summary speaks plainly: tokens/s, no Rust Option syntax
    assert!(stdout.contains("tokens/s") && stdout.contains("last committed iteration 6"), "{stdout}");
    assert!(!stdout.contains("Some("), "{stdout}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["last_committed_iter"], 6);

    let html = std::fs::read_to_string(&html_path).unwrap();
    for id in ["summary", "loss", "iteration-time", "timeline"] {
        assert!(html.contains(&format!("id=\"{id}\"")), "report lacks #{id}");
    }
    // a rendered DOM with the charts' drawn elements (plotters draws series as polylines)
    let profile = dir.join("chromium-profile");
    let dom = chromium(&profile).arg("--dump-dom").arg(format!("file://{}", html_path.display())).output().unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert!(dom.matches("<svg").count() >= 3, "expected the loss, time and timeline charts: {}", &dom[..dom.len().min(2000)]);
    assert!(dom.contains("<polyline") && dom.contains("Training loss"), "no drawn series in the page");

    let shot = dir.join("shot.png");
    let o = chromium(&profile)
        .arg(format!("--screenshot={}", shot.display()))
        .arg("--window-size=900,1400")
        .arg(format!("file://{}", html_path.display()))
        .output()
        .unwrap();
    assert!(shot.exists(), "no screenshot: {}", String::from_utf8_lossy(&o.stderr));
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let px = info.color_type.samples();
    let pixels = &buf[..info.buffer_size()];
    let inked = pixels.chunks(px).filter(|p| p.iter().take(3).any(|&c| c < 200)).count();
    let total = pixels.len() / px;
    // charts, axes and text cover a visible share of the page; a blank page has none
    assert!(inked * 100 > total, "screenshot looks blank: {inked} of {total} pixels inked");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn report_of_nothing_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("iw-report-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let o = Command::new(BIN).arg("report").arg(&dir).output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing to report"));
    let o = Command::new(BIN).args(["report", "/no/such/dir"]).output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("is not a directory"));
    std::fs::remove_dir_all(&dir).ok();
}

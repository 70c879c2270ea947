//! The report of an `airq train` run opened in headless Chromium: the three figures are drawn
//! (loss curves, forecast against observed, the station map with one marker per station) and
//! the screenshot is not blank.

mod common;

use common::{launch, train_args};
use ironweave_testkit::chromium;

#[test]
fn the_training_report_renders_in_chromium() {
    let dir = std::env::temp_dir().join(format!("airq-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.join("run");
    let lines = launch(&train_args(2, 0, &out, 12), 300, |_| {});
    assert!(lines.iter().any(|l| l.starts_with("report: ")), "{lines:?}");
    let page = out.join("report.html");
    let profile = dir.join("chromium-profile");
    let dom = chromium(&profile).arg("--dump-dom").arg(format!("file://{}", page.display())).output().unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout);
    for id in ["summary", "loss", "forecast", "map"] {
        assert!(dom.contains(&format!("id=\"{id}\"")), "the rendered page lacks #{id}");
    }
    assert_eq!(dom.matches("<svg").count(), 3, "three figures");
    assert_eq!(dom.matches("class=\"station\"").count(), 70, "one marker per station");
    assert!(dom.matches("class=\"state\"").count() >= 16, "every state drawn");
    assert!(dom.contains("<polyline") && dom.contains("Niedersachsen"), "drawn series and the target's name");

    let shot = dir.join("shot.png");
    let o = chromium(&profile)
        .arg(format!("--screenshot={}", shot.display()))
        .arg("--window-size=900,1600")
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap();
    let png = std::fs::read(&shot).unwrap_or_else(|_| panic!("no screenshot: {}", String::from_utf8_lossy(&o.stderr)));
    assert!(png.starts_with(b"\x89PNG") && png.len() > 20_000, "a screenshot of {} bytes", png.len());
    // `airq report` renders the same page again from report.json
    let st = std::process::Command::new(common::AIRQ).arg("report").arg(&out).output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let again = std::fs::read_to_string(&page).unwrap();
    assert!(again.contains("id=\"map\""));
    std::fs::remove_dir_all(&dir).ok();
}

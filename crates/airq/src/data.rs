//! The AirBase PM10 data set of Debian's `r-cran-spacetime` (`spacetime/data/air.rda`): daily
//! PM10 of 70 German rural-background stations, 1998–2009, their coordinates, and the 16
//! German states (NUTS-1 polygons), which group the stations into domains.

use std::path::{Path, PathBuf};

use crate::rdata::{parse_rda, RObject, RValue};
use crate::{Error, Result};

/// Where Debian's `r-cran-spacetime` puts the file.
pub const DEFAULT_PATHS: &[&str] =
    &["/usr/lib/R/site-library/spacetime/data/air.rda", "/usr/local/lib/R/site-library/spacetime/data/air.rda"];

/// The Debian package that ships the file.
pub const PACKAGE: &str = "r-cran-spacetime";

/// One monitoring station.
#[derive(Debug, Clone, PartialEq)]
pub struct Station {
    /// AirBase code (`DESH001`).
    pub code: String,
    /// Longitude, degrees east.
    pub lon: f64,
    /// Latitude, degrees north.
    pub lat: f64,
    /// Index into [`AirData::states`] of the state the station lies in (the nearest one for a
    /// station just outside every polygon: DEUB031 near Zittau, on the border).
    pub state: usize,
}

/// A German state: a domain.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// Its name as in the file (`Niedersachsen`).
    pub name: String,
    /// Its polygon rings (lon, lat), for the map.
    pub rings: Vec<Vec<(f64, f64)>>,
}

/// The whole data set.
#[derive(Debug, Clone)]
pub struct AirData {
    /// Stations, in the file's order (rows of [`AirData::pm10`]).
    pub stations: Vec<Station>,
    /// The 16 states.
    pub states: Vec<State>,
    /// First day, days since 1970-01-01.
    pub first_day: i64,
    /// Days of the series (4383).
    pub days: usize,
    /// PM10 in µg/m³, station-major: `pm10[s * days + d]`; NaN where missing.
    pub pm10: Vec<f32>,
}

impl AirData {
    /// Reads the file at `path`, or at [`DEFAULT_PATHS`] when `None`.
    pub fn load(path: Option<&Path>) -> Result<AirData> {
        let path: PathBuf = match path {
            Some(p) => p.to_path_buf(),
            None => DEFAULT_PATHS.iter().map(PathBuf::from).find(|p| p.exists()).ok_or_else(|| {
                Error::Data(format!(
                    "the AirBase PM10 data is not installed (looked for {}): install the Debian package {PACKAGE} \
                     (`apt-get install {PACKAGE}`; scripts/deps.sh does) or pass --data PATH/air.rda",
                    DEFAULT_PATHS.join(", ")
                ))
            })?,
        };
        let bytes = std::fs::read(&path).map_err(|e| {
            Error::Data(format!("cannot read {}: {e} (the file comes with the Debian package {PACKAGE})", path.display()))
        })?;
        AirData::parse(&bytes).map_err(|e| {
            Error::Data(format!(
                "{} is not the spacetime AirBase data ({e}); reinstall the Debian package {PACKAGE} \
                 (`apt-get install --reinstall {PACKAGE}`)",
                path.display()
            ))
        })
    }

    /// Parses the bytes of `air.rda`.
    pub fn parse(bytes: &[u8]) -> Result<AirData> {
        let objs = parse_rda(bytes)?;
        let get =
            |n: &str| objs.iter().find(|(k, _)| k == n).map(|(_, v)| v).ok_or_else(|| Error::Format(format!("no object `{n}`")));
        let air = get("air")?;
        let dim = air.dim()?;
        let [ns, days] = dim[..] else { return Err(Error::Format(format!("`air` has dim {dim:?}, not 2"))) };
        let vals = air.reals()?;
        if vals.len() != ns * days {
            return Err(Error::Format(format!("`air` holds {} values for dim {ns} x {days}", vals.len())));
        }
        // R matrices are column-major: value (s, d) at d * ns + s
        let mut pm10 = vec![f32::NAN; ns * days];
        for d in 0..days {
            for s in 0..ns {
                let v = vals[d * ns + s];
                pm10[s * days + d] = if v.is_finite() && v >= 0.0 { v as f32 } else { f32::NAN };
            }
        }
        let codes: Vec<String> = match air.attr("dimnames").map(RObject::list) {
            Some(Ok(l)) if !l.is_empty() => l[0].strings()?.iter().map(|s| s.clone().unwrap_or_default()).collect(),
            _ => (0..ns).map(|i| format!("station{i}")).collect(),
        };
        if codes.len() != ns {
            return Err(Error::Format(format!("{} station names for {ns} stations", codes.len())));
        }
        let dates = get("dates")?.reals()?;
        if dates.len() != days || dates.windows(2).any(|w| w[1] - w[0] != 1.0) {
            return Err(Error::Format(format!("`dates`: {} entries, expected {days} consecutive days", dates.len())));
        }
        let first_day = dates[0] as i64;
        let coords = get("stations")?.slot("coords")?;
        let cd = coords.dim()?;
        let xy = coords.reals()?;
        if cd != [ns, 2] || xy.len() != 2 * ns {
            return Err(Error::Format(format!("station coordinates have dim {cd:?}, expected [{ns}, 2]")));
        }
        let states = states(get("DE_NUTS1")?)?;
        let stations = (0..ns)
            .map(|s| {
                let (lon, lat) = (xy[s], xy[ns + s]);
                Station { code: codes[s].clone(), lon, lat, state: locate(&states, lon, lat) }
            })
            .collect();
        Ok(AirData { stations, states, first_day, days, pm10 })
    }

    /// The last `n` days only (a small slice for tests; the first years are mostly empty).
    pub fn last_days(mut self, n: usize) -> Result<AirData> {
        if n < 60 || n > self.days {
            return Err(Error::Config(format!("--last-days {n}: between 60 and {} days", self.days)));
        }
        let days = self.days;
        self.pm10 = self.pm10.chunks(days).flat_map(|s| s[days - n..].iter().copied()).collect();
        self.first_day += (days - n) as i64;
        self.days = n;
        Ok(self)
    }

    /// Station `s`'s series.
    pub fn series(&self, s: usize) -> &[f32] {
        &self.pm10[s * self.days..(s + 1) * self.days]
    }

    /// The state index named `name` (case-insensitive), or an error listing the names.
    pub fn state_index(&self, name: &str) -> Result<usize> {
        self.states.iter().position(|s| s.name.eq_ignore_ascii_case(name)).ok_or_else(|| {
            Error::Data(format!(
                "no state `{name}`; the states with stations are: {}",
                self.states_with_stations().iter().map(|&i| self.states[i].name.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })
    }

    /// States that hold at least one station, in index order.
    pub fn states_with_stations(&self) -> Vec<usize> {
        (0..self.states.len()).filter(|&i| self.stations.iter().any(|s| s.state == i)).collect()
    }

    /// The date of day `d` of the series as `YYYY-MM-DD`.
    pub fn date(&self, d: usize) -> String {
        civil(self.first_day + d as i64)
    }
}

/// `YYYY-MM-DD` of a day since 1970-01-01 (Howard Hinnant's civil-from-days).
pub fn civil(z: i64) -> String {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The states of a `SpatialPolygonsDataFrame`: names from its data's `NAME_1`, rings from its
/// polygons (in the same order, as sp keeps them).
fn states(spdf: &RObject) -> Result<Vec<State>> {
    let names = spdf.slot("data")?.member("NAME_1")?.strings()?.to_vec();
    let polys = spdf.slot("polygons")?.list()?;
    if polys.len() != names.len() {
        return Err(Error::Format(format!("{} polygons for {} states", polys.len(), names.len())));
    }
    polys
        .iter()
        .zip(names)
        .map(|(p, n)| {
            let mut rings = Vec::new();
            for ring in p.slot("Polygons")?.list()? {
                if matches!(ring.attr("hole").map(|h| &h.value), Some(RValue::Logical(v)) if v.first() == Some(&Some(true))) {
                    continue; // a hole; none of the states has one a station could fall into
                }
                let c = ring.slot("coords")?;
                let d = c.dim()?;
                let v = c.reals()?;
                if d.len() != 2 || d[1] != 2 || v.len() != 2 * d[0] {
                    return Err(Error::Format(format!("a polygon ring with dim {d:?}")));
                }
                rings.push((0..d[0]).map(|i| (v[i], v[d[0] + i])).collect());
            }
            Ok(State { name: n.unwrap_or_default(), rings })
        })
        .collect()
}

fn inside(ring: &[(f64, f64)], x: f64, y: f64) -> bool {
    let mut c = false;
    let mut j = ring.len().wrapping_sub(1);
    for i in 0..ring.len() {
        let ((xi, yi), (xj, yj)) = (ring[i], ring[j]);
        if (yi > y) != (yj > y) && x < (xj - xi) * (y - yi) / (yj - yi) + xi {
            c = !c;
        }
        j = i;
    }
    c
}

fn seg_dist2(p: (f64, f64), a: (f64, f64), b: (f64, f64)) -> f64 {
    let (dx, dy) = (b.0 - a.0, b.1 - a.1);
    let l = dx * dx + dy * dy;
    let t = if l > 0.0 { (((p.0 - a.0) * dx + (p.1 - a.1) * dy) / l).clamp(0.0, 1.0) } else { 0.0 };
    let (qx, qy) = (a.0 + t * dx - p.0, a.1 + t * dy - p.1);
    qx * qx + qy * qy
}

/// The state containing (lon, lat), else the one with the nearest boundary.
fn locate(states: &[State], lon: f64, lat: f64) -> usize {
    if let Some(i) = states.iter().position(|s| s.rings.iter().any(|r| inside(r, lon, lat))) {
        return i;
    }
    let dist = |s: &State| {
        s.rings.iter().flat_map(|r| r.windows(2).map(|w| seg_dist2((lon, lat), w[0], w[1]))).fold(f64::INFINITY, f64::min)
    };
    (0..states.len()).min_by(|&a, &b| dist(&states[a]).total_cmp(&dist(&states[b]))).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil(0), "1970-01-01");
        assert_eq!(civil(10227), "1998-01-01");
        assert_eq!(civil(14609), "2009-12-31");
    }

    #[test]
    fn point_in_polygon_and_nearest() {
        let sq = |x0: f64| State {
            name: format!("{x0}"),
            rings: vec![vec![(x0, 0.0), (x0 + 1.0, 0.0), (x0 + 1.0, 1.0), (x0, 1.0), (x0, 0.0)]],
        };
        let s = [sq(0.0), sq(2.0)];
        assert_eq!(locate(&s, 0.5, 0.5), 0);
        assert_eq!(locate(&s, 2.5, 0.5), 1);
        assert_eq!(locate(&s, 3.2, 0.5), 1); // outside both, nearer the second
    }
}

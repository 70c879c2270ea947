//! Delimited text, plain or gzip: one record per line, `#` comments and blank lines skipped,
//! the delimiter found on the first record (tab, else comma, else runs of spaces), fields
//! unquoted the CSV way (`"a ""b"""` is `a "b"`). Non-UTF-8 text, a truncated `.gz` and an
//! unterminated quote are errors that name the file and the line.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// How the fields of a line are separated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delimiter {
    /// `\t`
    Tab,
    /// `,`
    Comma,
    /// One or more spaces (STRING's `protein.links`).
    Spaces,
}

impl Delimiter {
    /// The delimiter of a record: tab if it has one, else comma, else spaces.
    pub fn detect(line: &str) -> Delimiter {
        if line.contains('\t') {
            Delimiter::Tab
        } else if line.contains(',') {
            Delimiter::Comma
        } else {
            Delimiter::Spaces
        }
    }
}

/// The records of one file.
pub struct Records {
    path: PathBuf,
    src: Box<dyn BufRead>,
    buf: Vec<u8>,
    line: usize,
    delimiter: Option<Delimiter>,
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records").field("path", &self.path).field("line", &self.line).finish()
    }
}

/// Opens `path` (gzip when it starts with gzip's magic bytes, whatever its name).
pub fn records(path: &Path) -> Result<Records> {
    let io = |e: std::io::Error| Error::Io { path: path.to_path_buf(), detail: e.to_string() };
    let mut f = BufReader::new(File::open(path).map_err(io)?);
    let gz = f.fill_buf().map_err(io)?.starts_with(&[0x1f, 0x8b]);
    let src: Box<dyn BufRead> = if gz { Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(f))) } else { Box::new(f) };
    Ok(Records { path: path.to_path_buf(), src, buf: Vec::new(), line: 0, delimiter: None })
}

impl Records {
    /// The file being read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The line number of the record last returned (1-based, comments counted).
    pub fn line(&self) -> usize {
        self.line
    }

    /// The delimiter found on the first record (`None` before it).
    pub fn delimiter(&self) -> Option<Delimiter> {
        self.delimiter
    }

    /// An error at the current line.
    pub fn error(&self, detail: impl Into<String>) -> Error {
        Error::Parse { path: self.path.clone(), line: self.line, detail: detail.into() }
    }

    /// The first record into `out`: an error if the file has none, or if it has one column
    /// (`needs` says what a line must hold, e.g. "two proteins per line (a, b[, score])").
    pub fn first_into(&mut self, out: &mut Vec<String>, needs: &str) -> Result<()> {
        if !self.next_into(out)? {
            return Err(Error::Format {
                path: self.path.clone(),
                detail: "no records: the file is empty or only comments".into(),
            });
        }
        if out.len() < 2 {
            return Err(Error::Format {
                path: self.path.clone(),
                detail: format!(
                    "one column on line {} ({:?}): {needs}, separated by tabs, commas or spaces",
                    self.line,
                    out.first().map(String::as_str).unwrap_or("")
                ),
            });
        }
        Ok(())
    }

    /// The next record's fields into `out` (cleared first); `false` at the end of the file.
    pub fn next_into(&mut self, out: &mut Vec<String>) -> Result<bool> {
        out.clear();
        loop {
            self.buf.clear();
            let n = self.src.read_until(b'\n', &mut self.buf).map_err(|e| Error::Io {
                path: self.path.clone(),
                detail: format!("reading after line {}: {e} (a truncated or corrupt .gz reads like this)", self.line),
            })?;
            if n == 0 {
                return Ok(false);
            }
            self.line += 1;
            let text = match std::str::from_utf8(&self.buf) {
                Ok(t) => t,
                Err(e) => {
                    return Err(self.error(format!(
                        "not UTF-8 text (byte {} of the line); convert the file to UTF-8 (e.g. iconv -t UTF-8)",
                        e.valid_up_to()
                    )))
                }
            };
            let text = text.trim_end_matches(['\n', '\r']);
            if text.trim().is_empty() || text.starts_with('#') {
                continue;
            }
            let d = *self.delimiter.get_or_insert_with(|| Delimiter::detect(text));
            match d {
                Delimiter::Spaces => out.extend(text.split_whitespace().map(str::to_owned)),
                Delimiter::Tab => split_quoted(text, '\t', out).map_err(|e| self.error(e))?,
                Delimiter::Comma => split_quoted(text, ',', out).map_err(|e| self.error(e))?,
            }
            return Ok(true);
        }
    }
}

/// Splits `line` at `sep` outside double quotes, unquoting quoted fields.
fn split_quoted(line: &str, sep: char, out: &mut Vec<String>) -> std::result::Result<(), String> {
    let mut field = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    let mut at_start = true;
    while let Some(c) = chars.next() {
        if quoted {
            if c == '"' {
                if chars.peek() == Some(&'"') {
                    chars.next();
                    field.push('"');
                } else {
                    quoted = false;
                }
            } else {
                field.push(c);
            }
        } else if c == sep {
            out.push(std::mem::take(&mut field).trim().to_owned());
            at_start = true;
            continue;
        } else if c == '"' && at_start && field.trim().is_empty() {
            field.clear();
            quoted = true;
        } else {
            field.push(c);
        }
        at_start = false;
    }
    if quoted {
        return Err("a quoted field is not closed on this line".into());
    }
    out.push(field.trim().to_owned());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(line: &str, sep: char) -> Vec<String> {
        let mut v = Vec::new();
        split_quoted(line, sep, &mut v).unwrap();
        v
    }

    #[test]
    fn quoted_fields_are_unquoted_and_separators_inside_them_kept() {
        assert_eq!(split(r#""","score","a,b""c""#, ','), ["", "score", r#"a,b"c"#]);
        assert_eq!(split("x\t\"y\"\t", '\t'), ["x", "y", ""]);
        let mut v = Vec::new();
        assert!(split_quoted(r#"a,"b"#, ',', &mut v).is_err());
    }

    #[test]
    fn the_delimiter_is_found_on_the_first_record() {
        assert_eq!(Delimiter::detect("a\tb,c"), Delimiter::Tab);
        assert_eq!(Delimiter::detect("a,b"), Delimiter::Comma);
        assert_eq!(Delimiter::detect("a b  c"), Delimiter::Spaces);
    }
}

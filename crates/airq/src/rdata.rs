//! A reader of R's serialization format (XDR, versions 2 and 3) for the subset `.rda` data
//! files use: vectors (logical, integer, double, string, list), pairlists, symbols, S4 objects,
//! attributes, references and the environments a saved object may point to. Files are gzip or
//! xz compressed (R's `save(compress = ...)`); bzip2 and closures/byte code are refused with
//! [`Error::Format`]. Every length is checked against what is left of the file: a truncated or
//! corrupt file is an error, never a panic or a huge allocation.

use std::io::Read;

use crate::{Error, Result};

/// One R object: its value and its attributes (`dim`, `names`, `class`, S4 slots, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct RObject {
    /// The value.
    pub value: RValue,
    /// Attributes in file order.
    pub attrs: Vec<(String, RObject)>,
}

/// The value of an [`RObject`].
#[derive(Debug, Clone, PartialEq)]
pub enum RValue {
    /// `NULL` (and the environments and other references this reader does not keep).
    Null,
    /// A symbol (a name).
    Symbol(String),
    /// Logical vector (`None`: `NA`).
    Logical(Vec<Option<bool>>),
    /// Integer vector (`None`: `NA`).
    Int(Vec<Option<i32>>),
    /// Double vector (`NA` and `NaN` as NaN).
    Real(Vec<f64>),
    /// Character vector (`None`: `NA`).
    Str(Vec<Option<String>>),
    /// Generic vector (`list()`).
    List(Vec<RObject>),
    /// Pairlist: (tag, value) pairs.
    Pairs(Vec<(Option<String>, RObject)>),
    /// An S4 object: everything is in its attributes (slots).
    S4,
    /// An environment (its contents are not kept).
    Env,
}

impl RObject {
    fn new(value: RValue) -> RObject {
        RObject { value, attrs: Vec::new() }
    }

    /// Attribute (or S4 slot) `name`.
    pub fn attr(&self, name: &str) -> Option<&RObject> {
        self.attrs.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// Attribute `name`, or an error naming what was looked for.
    pub fn slot(&self, name: &str) -> Result<&RObject> {
        self.attr(name).ok_or_else(|| Error::Format(format!("no attribute or slot `{name}`")))
    }

    /// The doubles of a double vector (integers widened).
    pub fn reals(&self) -> Result<Vec<f64>> {
        match &self.value {
            RValue::Real(v) => Ok(v.clone()),
            RValue::Int(v) => Ok(v.iter().map(|x| x.map_or(f64::NAN, f64::from)).collect()),
            other => Err(Error::Format(format!("expected a numeric vector, found {}", other.kind()))),
        }
    }

    /// The strings of a character vector.
    pub fn strings(&self) -> Result<&[Option<String>]> {
        match &self.value {
            RValue::Str(v) => Ok(v),
            other => Err(Error::Format(format!("expected a character vector, found {}", other.kind()))),
        }
    }

    /// The elements of a list.
    pub fn list(&self) -> Result<&[RObject]> {
        match &self.value {
            RValue::List(v) => Ok(v),
            other => Err(Error::Format(format!("expected a list, found {}", other.kind()))),
        }
    }

    /// The `dim` attribute.
    pub fn dim(&self) -> Result<Vec<usize>> {
        let d = self.slot("dim")?.reals()?;
        d.iter()
            .map(|&x| if x >= 0.0 && x.fract() == 0.0 { Ok(x as usize) } else { Err(Error::Format(format!("bad dim {d:?}"))) })
            .collect()
    }

    /// Element `name` of a named list (a data frame's column).
    pub fn member(&self, name: &str) -> Result<&RObject> {
        let names = self.slot("names")?.strings()?;
        let i =
            names.iter().position(|n| n.as_deref() == Some(name)).ok_or_else(|| Error::Format(format!("no element `{name}`")))?;
        self.list()?.get(i).ok_or_else(|| Error::Format(format!("element `{name}` is missing")))
    }
}

impl RValue {
    fn kind(&self) -> &'static str {
        match self {
            RValue::Null => "NULL",
            RValue::Symbol(_) => "a symbol",
            RValue::Logical(_) => "a logical vector",
            RValue::Int(_) => "an integer vector",
            RValue::Real(_) => "a double vector",
            RValue::Str(_) => "a character vector",
            RValue::List(_) => "a list",
            RValue::Pairs(_) => "a pairlist",
            RValue::S4 => "an S4 object",
            RValue::Env => "an environment",
        }
    }
}

/// Reads the objects saved in an `.rda` file's bytes (compressed or not): `(name, object)` in
/// file order.
pub fn parse_rda(bytes: &[u8]) -> Result<Vec<(String, RObject)>> {
    let raw = decompress(bytes)?;
    let body = raw
        .strip_prefix(b"RDX2\n")
        .or_else(|| raw.strip_prefix(b"RDX3\n"))
        .ok_or_else(|| Error::Format("not an R data file (no RDX2/RDX3 header)".into()))?;
    let top = parse_serialized(body)?;
    match top.value {
        RValue::Pairs(p) => {
            p.into_iter().map(|(n, v)| Ok((n.ok_or_else(|| Error::Format("an object without a name".into()))?, v))).collect()
        }
        RValue::Null => Ok(Vec::new()),
        other => Err(Error::Format(format!("the file holds {} instead of named objects", other.kind()))),
    }
}

/// Decompresses gzip or xz (by magic; at most 1 GiB out); anything else is taken as
/// uncompressed.
pub fn decompress(bytes: &[u8]) -> Result<Vec<u8>> {
    // an .rda file is small; a bomb would still stop at this bound
    const MAX: u64 = 1 << 30;
    let mut out = Vec::new();
    if bytes.starts_with(&[0x1f, 0x8b]) {
        flate2::read::MultiGzDecoder::new(bytes)
            .take(MAX)
            .read_to_end(&mut out)
            .map_err(|e| Error::Format(format!("gzip: {e}")))?;
    } else if bytes.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        let mut w = Capped { out: &mut out, max: MAX as usize };
        lzma_rs::xz_decompress(&mut std::io::BufReader::new(bytes), &mut w).map_err(|e| Error::Format(format!("xz: {e:?}")))?;
    } else if bytes.starts_with(b"BZh") {
        return Err(Error::Format("bzip2-compressed R data is not supported (re-save with gzip or xz)".into()));
    } else {
        out = bytes.to_vec();
    }
    Ok(out)
}

/// A writer that refuses to grow past `max` bytes (a decompression bomb is an error).
struct Capped<'a> {
    out: &'a mut Vec<u8>,
    max: usize,
}

impl std::io::Write for Capped<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.max {
            return Err(std::io::Error::other(format!("decompresses to more than {} bytes", self.max)));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Parses one serialized object stream (`X\n`, versions, then the object).
pub fn parse_serialized(body: &[u8]) -> Result<RObject> {
    let mut r = Reader { buf: body, pos: 0, refs: Vec::new(), depth: 0 };
    let fmt = r.bytes(2)?;
    if fmt != b"X\n" {
        return Err(Error::Format(format!("serialization format {:?}: only XDR (`X`) is read", String::from_utf8_lossy(fmt))));
    }
    let version = r.int()?;
    let _writer = r.int()?;
    let _min_reader = r.int()?;
    match version {
        2 => {}
        3 => {
            let n = r.len()?;
            r.bytes(n)?; // native encoding name
        }
        v => return Err(Error::Format(format!("serialization version {v}: versions 2 and 3 are read"))),
    }
    r.item()
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    refs: Vec<RObject>,
    depth: usize,
}

// SEXP types and the special codes of R's serialize.c.
const NILSXP: u32 = 0;
const SYMSXP: u32 = 1;
const LISTSXP: u32 = 2;
const CLOSXP: u32 = 3;
const ENVSXP: u32 = 4;
const PROMSXP: u32 = 5;
const LANGSXP: u32 = 6;
const CHARSXP: u32 = 9;
const LGLSXP: u32 = 10;
const INTSXP: u32 = 13;
const REALSXP: u32 = 14;
const STRSXP: u32 = 16;
const DOTSXP: u32 = 17;
const VECSXP: u32 = 19;
const EXPRSXP: u32 = 20;
const RAWSXP: u32 = 24;
const S4SXP: u32 = 25;
const REFSXP: u32 = 255;
const NILVALUE: u32 = 254;
const GLOBALENV: u32 = 253;
const UNBOUNDVALUE: u32 = 252;
const MISSINGARG: u32 = 251;
const BASENAMESPACE: u32 = 250;
const NAMESPACESXP: u32 = 249;
const PACKAGESXP: u32 = 248;
const PERSISTSXP: u32 = 247;
const EMPTYENV: u32 = 242;
const BASEENV: u32 = 241;

const MAX_DEPTH: usize = 512;

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            Error::Format(format!("truncated: {n} bytes wanted at offset {}, {} left", self.pos, self.buf.len() - self.pos))
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn int(&mut self) -> Result<i32> {
        let b = self.bytes(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A vector length (R's long vectors: -1 then two words), checked against the bytes left
    /// at `min_elem` bytes per element.
    fn vec_len(&mut self, min_elem: usize) -> Result<usize> {
        let n = self.int()?;
        let n = if n == -1 {
            let hi = self.int()? as u32 as u64;
            let lo = self.int()? as u32 as u64;
            (hi << 32) | lo
        } else if n < 0 {
            return Err(Error::Format(format!("negative length {n}")));
        } else {
            n as u64
        };
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_elem as u64) > left {
            return Err(Error::Format(format!("a vector of {n} elements in the {left} bytes left")));
        }
        Ok(n as usize)
    }

    fn len(&mut self) -> Result<usize> {
        self.vec_len(1)
    }

    fn item(&mut self) -> Result<RObject> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Error::Format(format!("objects nested deeper than {MAX_DEPTH}")));
        }
        let r = self.item_inner();
        self.depth -= 1;
        r
    }

    fn item_inner(&mut self) -> Result<RObject> {
        let flags = self.int()? as u32;
        let ty = flags & 0xff;
        let has_attr = flags & (1 << 9) != 0;
        let has_tag = flags & (1 << 10) != 0;
        match ty {
            NILVALUE | NILSXP | UNBOUNDVALUE | MISSINGARG => return Ok(RObject::new(RValue::Null)),
            GLOBALENV | EMPTYENV | BASEENV | BASENAMESPACE => return Ok(RObject::new(RValue::Env)),
            REFSXP => {
                let i = match flags >> 8 {
                    0 => self.int()? as usize,
                    i => i as usize,
                };
                return self
                    .refs
                    .get(i.wrapping_sub(1))
                    .cloned()
                    .ok_or_else(|| Error::Format(format!("reference {i} of {} read so far", self.refs.len())));
            }
            PERSISTSXP | NAMESPACESXP | PACKAGESXP => {
                // a string vector naming it: read, then kept as a reference
                if self.int()? != 0 {
                    return Err(Error::Format("a persistent name with a non-zero tag".into()));
                }
                let n = self.vec_len(4)?;
                for _ in 0..n {
                    self.item()?;
                }
                let o = RObject::new(RValue::Env);
                self.refs.push(o.clone());
                return Ok(o);
            }
            SYMSXP => {
                let name = self.item()?;
                let s = match name.value {
                    RValue::Str(mut v) if v.len() == 1 => v.pop().flatten().unwrap_or_default(),
                    _ => return Err(Error::Format("a symbol without a name".into())),
                };
                let o = RObject::new(RValue::Symbol(s));
                self.refs.push(o.clone());
                return Ok(o);
            }
            ENVSXP => {
                // registered before its contents, which may refer to it
                let idx = self.refs.len();
                self.refs.push(RObject::new(RValue::Env));
                let _locked = self.int()?;
                self.item()?; // enclosure
                self.item()?; // frame
                self.item()?; // hash table
                let attrs = self.item()?;
                let mut o = RObject::new(RValue::Env);
                o.attrs = pairs_to_attrs(attrs)?;
                self.refs[idx] = o.clone();
                return Ok(o);
            }
            LISTSXP | LANGSXP | DOTSXP | PROMSXP | CLOSXP => {
                return self.pairlist(flags);
            }
            _ => {}
        }
        let _ = has_tag;
        let value = match ty {
            CHARSXP => {
                let n = self.int()?;
                if n == -1 {
                    RValue::Str(vec![None])
                } else {
                    let n = usize::try_from(n).map_err(|_| Error::Format(format!("string length {n}")))?;
                    let b = self.bytes(n)?;
                    RValue::Str(vec![Some(String::from_utf8_lossy(b).into_owned())])
                }
            }
            LGLSXP => {
                let n = self.vec_len(4)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(match self.int()? {
                        i32::MIN => None,
                        0 => Some(false),
                        _ => Some(true),
                    });
                }
                RValue::Logical(v)
            }
            INTSXP => {
                let n = self.vec_len(4)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let x = self.int()?;
                    v.push((x != i32::MIN).then_some(x));
                }
                RValue::Int(v)
            }
            REALSXP => {
                let n = self.vec_len(8)?;
                let b = self.bytes(n * 8)?;
                RValue::Real(b.chunks_exact(8).map(|c| f64::from_be_bytes(c.try_into().unwrap_or([0; 8]))).collect())
            }
            STRSXP => {
                let n = self.vec_len(4)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    match self.item()?.value {
                        RValue::Str(mut s) if s.len() == 1 => v.push(s.pop().flatten()),
                        other => return Err(Error::Format(format!("a string vector holding {}", other.kind()))),
                    }
                }
                RValue::Str(v)
            }
            VECSXP | EXPRSXP => {
                let n = self.vec_len(4)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.item()?);
                }
                RValue::List(v)
            }
            RAWSXP => {
                let n = self.vec_len(1)?;
                let b = self.bytes(n)?;
                RValue::Int(b.iter().map(|&x| Some(i32::from(x))).collect())
            }
            S4SXP => RValue::S4,
            other => return Err(Error::Format(format!("R object type {other} is not read by this reader (code or byte code?)"))),
        };
        let mut o = RObject::new(value);
        if has_attr {
            let a = self.item()?;
            o.attrs = pairs_to_attrs(a)?;
        }
        Ok(o)
    }

    /// A pairlist (and language objects, read the same way), iteratively along its CDR.
    fn pairlist(&mut self, first_flags: u32) -> Result<RObject> {
        let mut flags = first_flags;
        let mut out = Vec::new();
        let mut attrs = Vec::new();
        loop {
            let ty = flags & 0xff;
            if !matches!(ty, LISTSXP | LANGSXP | DOTSXP | PROMSXP | CLOSXP) {
                // the end of the chain: NULL (anything else is an improper list)
                if !matches!(ty, NILVALUE | NILSXP) {
                    return Err(Error::Format(format!("a pairlist ending in type {ty}")));
                }
                break;
            }
            if flags & (1 << 9) != 0 {
                let a = self.item()?;
                if out.is_empty() {
                    attrs = pairs_to_attrs(a)?;
                }
            }
            let tag = if flags & (1 << 10) != 0 {
                match self.item()?.value {
                    RValue::Symbol(s) => Some(s),
                    RValue::Str(mut s) if s.len() == 1 => s.pop().flatten(),
                    _ => None,
                }
            } else {
                None
            };
            let car = self.item()?;
            out.push((tag, car));
            flags = self.int()? as u32;
        }
        Ok(RObject { value: RValue::Pairs(out), attrs })
    }
}

fn pairs_to_attrs(o: RObject) -> Result<Vec<(String, RObject)>> {
    match o.value {
        RValue::Pairs(p) => Ok(p.into_iter().map(|(n, v)| (n.unwrap_or_default(), v)).collect()),
        RValue::Null => Ok(Vec::new()),
        other => Err(Error::Format(format!("attributes given as {}", other.kind()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes R's XDR stream by hand (what `serialize(x, NULL, xdr = TRUE, version = 2)` writes).
    fn head() -> Vec<u8> {
        let mut b = b"X\n".to_vec();
        for x in [2i32, 0x0004_0200, 0x0002_0300] {
            b.extend(x.to_be_bytes());
        }
        b
    }
    fn int(b: &mut Vec<u8>, x: i32) {
        b.extend(x.to_be_bytes());
    }
    fn chars(b: &mut Vec<u8>, s: &str) {
        int(b, CHARSXP as i32 | (64 << 12));
        int(b, s.len() as i32);
        b.extend(s.as_bytes());
    }

    #[test]
    fn a_named_double_matrix_reads_with_its_dim_and_na() {
        let mut b = head();
        int(&mut b, (REALSXP | (1 << 9)) as i32);
        int(&mut b, 4);
        for x in [1.5f64, f64::NAN, -2.0, 7.0] {
            b.extend(x.to_be_bytes());
        }
        // attributes: pairlist dim = c(2L, 2L)
        int(&mut b, (LISTSXP | (1 << 10)) as i32);
        int(&mut b, SYMSXP as i32);
        chars(&mut b, "dim");
        int(&mut b, INTSXP as i32);
        int(&mut b, 2);
        int(&mut b, 2);
        int(&mut b, 2);
        int(&mut b, NILVALUE as i32);
        let o = parse_serialized(&b).unwrap();
        assert_eq!(o.dim().unwrap(), vec![2, 2]);
        let v = o.reals().unwrap();
        assert_eq!((v[0], v[2], v[3]), (1.5, -2.0, 7.0));
        assert!(v[1].is_nan());
    }

    #[test]
    fn a_symbol_read_twice_comes_back_by_reference() {
        let mut b = head();
        int(&mut b, (LISTSXP | (1 << 10)) as i32);
        int(&mut b, SYMSXP as i32);
        chars(&mut b, "x");
        int(&mut b, LGLSXP as i32);
        int(&mut b, 2);
        int(&mut b, 1);
        int(&mut b, i32::MIN);
        int(&mut b, (LISTSXP | (1 << 10)) as i32);
        int(&mut b, (1 << 8) | REFSXP as i32); // reference 1: the symbol `x`
        int(&mut b, STRSXP as i32);
        int(&mut b, 1);
        chars(&mut b, "hi");
        int(&mut b, NILVALUE as i32);
        let o = parse_serialized(&b).unwrap();
        let RValue::Pairs(p) = o.value else { panic!("{o:?}") };
        assert_eq!(p[0].0.as_deref(), Some("x"));
        assert_eq!(p[1].0.as_deref(), Some("x"));
        assert_eq!(p[0].1.value, RValue::Logical(vec![Some(true), None]));
        assert_eq!(p[1].1.value, RValue::Str(vec![Some("hi".into())]));
    }

    #[test]
    fn truncations_and_lies_are_errors_not_panics() {
        let mut b = head();
        int(&mut b, REALSXP as i32);
        int(&mut b, 1_000_000_000); // far more than the bytes left
        assert!(matches!(parse_serialized(&b), Err(Error::Format(_))));
        let mut ok = head();
        int(&mut ok, INTSXP as i32);
        int(&mut ok, 3);
        for x in [1, 2, 3] {
            int(&mut ok, x);
        }
        for cut in 0..ok.len() {
            assert!(parse_serialized(&ok[..cut]).is_err(), "cut at {cut}");
        }
        assert!(parse_serialized(&ok).is_ok());
        let mut refs = head();
        int(&mut refs, (9 << 8) | REFSXP as i32);
        assert!(parse_serialized(&refs).is_err());
        assert!(parse_rda(b"RDX9\nX\n").is_err());
    }
}

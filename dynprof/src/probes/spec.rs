//! The marker grammar (`--marker SPEC`).
//!
//! ```text
//! SPEC     := auto
//!           | python:FUNC                      a Python function (USDT function__return)
//!           | [usdt:]OBJECT:LOCATION[,OPTION]...
//! OBJECT   := exe | /path/in/the/target | library-name-fragment (libtorch_cpu)
//! LOCATION := SYMBOL[+OFFSET]                  mangled or demangled, e.g. torch::autograd::Engine::execute
//!           | PROVIDER:NAME                    with the usdt: prefix
//! OPTION   := role=step|aux                    step (default): each hit is one step boundary
//!           | arg=N:cstr|str                   read argument N (0-based register argument, or
//!                                              USDT argument) as a C string or a std::string*
//!           | prefix=TEXT | eq=TEXT            keep only hits whose argument starts with / equals TEXT
//!           | name=LABEL                       label used in output (default: the symbol)
//! ```
//! Options are split at `,KEY=` so demangled names may contain commas.
use std::fmt;

use anyhow::{Result, anyhow, bail};
use dynprof_common::PREFIX_LEN;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Step,
    Aux,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Step => "step",
            Role::Aux => "aux",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ObjectRef {
    /// The main executable.
    Exe,
    /// An absolute path in the target's mount namespace.
    Path(String),
    /// A library whose file name contains this fragment.
    Lib(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    Symbol { name: String, offset: u64 },
    Usdt { provider: String, name: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrKind {
    /// `const char*`
    CStr,
    /// libstdc++ `std::string*` (or `const std::string&`).
    StdString,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StrFilter {
    pub arg: u32,
    pub kind: StrKind,
    pub text: String,
    /// Whole-string equality rather than a prefix.
    pub exact: bool,
}

/// A marker as the user wrote it, before /proc and ELF are consulted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkerSpec {
    pub raw: String,
    pub object: ObjectRef,
    pub location: Location,
    pub role: Role,
    pub filter: Option<StrFilter>,
    pub label: Option<String>,
}

/// What `--marker` accepts: explicit markers or `auto`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MarkerArg {
    Auto,
    Spec(MarkerSpec),
}

impl MarkerSpec {
    /// Name used in events and summaries.
    pub fn label(&self) -> String {
        if let Some(l) = &self.label {
            return l.clone();
        }
        match &self.location {
            Location::Symbol { name, .. } => name.clone(),
            Location::Usdt { provider, name } => match &self.filter {
                Some(f) => format!("{provider}:{name}({})", f.text),
                None => format!("{provider}:{name}"),
            },
        }
    }
}

const KEYS: [&str; 5] = ["role", "arg", "prefix", "eq", "name"];

/// Error pointing at the offending part of a SPEC.
fn bad(raw: &str, at: usize, what: &str) -> anyhow::Error {
    anyhow!(
        "malformed --marker `{raw}`: {what}\n  {raw}\n  {caret:>width$}\n\
         hint: SPEC is OBJECT:SYMBOL[+OFF][,role=aux][,arg=N:cstr|str,prefix=TEXT], \
         usdt:OBJECT:PROVIDER:NAME[...], python:FUNC or auto (see `dynprof attach --help`)",
        caret = "^",
        width = at + 1
    )
}

/// The longest SPEC accepted: room for long demangled C++ signatures, and a
/// bound on what a typo (or a script) can make dynprof echo and search for.
pub const SPEC_MAX: usize = 4096;

/// The longest `name=LABEL`: it is printed on every step line.
pub const LABEL_MAX: usize = 256;

pub fn parse(raw: &str) -> Result<MarkerArg> {
    if raw.len() > SPEC_MAX {
        bail!(
            "--marker SPEC is {} bytes; at most {SPEC_MAX} are accepted",
            raw.len()
        );
    }
    let s = raw.trim();
    if s.is_empty() {
        bail!("empty --marker (hint: use `auto` or OBJECT:SYMBOL)");
    }
    if s == "auto" {
        return Ok(MarkerArg::Auto);
    }
    if let Some(func) = s.strip_prefix("python:") {
        if func.is_empty()
            || !func
                .chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == '.')
        {
            return Err(bad(
                raw,
                7,
                "expected a Python function name after `python:`",
            ));
        }
        // The kernel compares the name and its NUL in a PREFIX_LEN buffer.
        if func.len() > PREFIX_LEN - 1 {
            return Err(bad(
                raw,
                7,
                &format!(
                    "the Python function name is {} bytes; at most {} fit (UTF-8 bytes, not characters)",
                    func.len(),
                    PREFIX_LEN - 1
                ),
            ));
        }
        return Ok(MarkerArg::Spec(MarkerSpec {
            raw: raw.to_string(),
            object: ObjectRef::Lib("python".into()),
            location: Location::Usdt {
                provider: "python".into(),
                name: "function__return".into(),
            },
            role: Role::Step,
            filter: Some(StrFilter {
                arg: 1,
                kind: StrKind::CStr,
                text: func.to_string(),
                exact: true,
            }),
            label: Some(format!("python:{func}")),
        }));
    }

    // Split off `,key=value` options; values run to the next `,key=`.
    let mut cuts: Vec<usize> = Vec::new();
    for (i, _) in s.match_indices(',') {
        let rest = &s[i + 1..];
        if KEYS
            .iter()
            .any(|k| rest.starts_with(k) && rest[k.len()..].starts_with('='))
        {
            cuts.push(i);
        }
    }
    let head_end = cuts.first().copied().unwrap_or(s.len());
    let head = &s[..head_end];

    let (usdt, head_body, head_off) = match head.strip_prefix("usdt:") {
        Some(b) => (true, b, 5),
        None => (false, head, 0),
    };
    let Some((obj, loc)) = head_body.split_once(':') else {
        return Err(bad(raw, head_off, "expected OBJECT:SYMBOL (no `:` found)"));
    };
    if obj.is_empty() {
        return Err(bad(raw, head_off, "missing OBJECT before `:`"));
    }
    let object = if obj == "exe" {
        ObjectRef::Exe
    } else if obj.starts_with('/') {
        ObjectRef::Path(obj.to_string())
    } else {
        ObjectRef::Lib(obj.to_string())
    };
    let loc_at = head_off + obj.len() + 1;
    let location = if usdt {
        let Some((provider, name)) = loc.split_once(':') else {
            return Err(bad(
                raw,
                loc_at,
                "expected PROVIDER:NAME after the USDT object",
            ));
        };
        if provider.is_empty() || name.is_empty() {
            return Err(bad(raw, loc_at, "empty USDT provider or probe name"));
        }
        Location::Usdt {
            provider: provider.into(),
            name: name.into(),
        }
    } else {
        if loc.is_empty() {
            return Err(bad(raw, loc_at, "missing SYMBOL after `:`"));
        }
        // `+OFFSET` only after the symbol's closing parenthesis, if any.
        let tail_start = loc.rfind(')').map(|p| p + 1).unwrap_or(0);
        match loc[tail_start..].rfind('+') {
            Some(p) => {
                let p = tail_start + p;
                let off_str = &loc[p + 1..];
                let offset = parse_int(off_str).ok_or_else(|| {
                    bad(
                        raw,
                        loc_at + p + 1,
                        "OFFSET must be a number (decimal or 0x hex)",
                    )
                })?;
                Location::Symbol {
                    name: loc[..p].to_string(),
                    offset,
                }
            }
            None => Location::Symbol {
                name: loc.to_string(),
                offset: 0,
            },
        }
    };

    let mut spec = MarkerSpec {
        raw: raw.to_string(),
        object,
        location,
        role: Role::Step,
        filter: None,
        label: None,
    };
    let mut arg: Option<(u32, StrKind)> = None;
    let mut text: Option<(String, bool, usize)> = None;
    for (n, &start) in cuts.iter().enumerate() {
        let end = cuts.get(n + 1).copied().unwrap_or(s.len());
        let opt = &s[start + 1..end];
        let (key, value) = opt.split_once('=').expect("cut at key=");
        let vat = start + 1 + key.len() + 1;
        match key {
            "role" => {
                spec.role = match value {
                    "step" => Role::Step,
                    "aux" => Role::Aux,
                    _ => return Err(bad(raw, vat, "role must be `step` or `aux`")),
                }
            }
            "arg" => {
                let (n, kind) = value.split_once(':').unwrap_or((value, "cstr"));
                let n: u32 = n
                    .parse()
                    .map_err(|_| bad(raw, vat, "arg=N:KIND needs a number N"))?;
                if !usdt && n > 5 {
                    return Err(bad(raw, vat, "only register arguments 0..=5 can be read"));
                }
                let kind = match kind {
                    "cstr" => StrKind::CStr,
                    "str" | "stdstring" => StrKind::StdString,
                    _ => {
                        return Err(bad(
                            raw,
                            vat + value.find(':').unwrap_or(0) + 1,
                            "KIND must be `cstr` or `str`",
                        ));
                    }
                };
                arg = Some((n, kind));
            }
            "prefix" | "eq" => {
                let limit = if key == "eq" {
                    PREFIX_LEN - 1
                } else {
                    PREFIX_LEN
                };
                if value.is_empty() || value.len() > limit {
                    return Err(bad(raw, vat, &format!("{key}= needs 1..={limit} bytes")));
                }
                text = Some((value.to_string(), key == "eq", vat));
            }
            "name" => {
                if value.is_empty() || value.len() > LABEL_MAX {
                    return Err(bad(raw, vat, &format!("name= needs 1..={LABEL_MAX} bytes")));
                }
                spec.label = Some(value.to_string())
            }
            _ => unreachable!(),
        }
    }
    match (arg, text) {
        (Some((arg, kind)), Some((text, exact, _))) => {
            spec.filter = Some(StrFilter {
                arg,
                kind,
                text,
                exact,
            })
        }
        (None, Some((_, _, at))) => {
            return Err(bad(
                raw,
                at,
                "prefix=/eq= needs arg=N:cstr|str to say which argument",
            ));
        }
        (Some(_), None) => return Err(bad(raw, head_end, "arg= needs prefix=TEXT or eq=TEXT")),
        (None, None) => {}
    }
    Ok(MarkerArg::Spec(spec))
}

fn parse_int(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> MarkerSpec {
        match parse(s).unwrap() {
            MarkerArg::Spec(m) => m,
            MarkerArg::Auto => panic!("auto"),
        }
    }

    #[test]
    fn plain_symbol_in_exe() {
        let m = spec("exe:optimizer_step");
        assert_eq!(m.object, ObjectRef::Exe);
        assert_eq!(
            m.location,
            Location::Symbol {
                name: "optimizer_step".into(),
                offset: 0
            }
        );
        assert_eq!(m.role, Role::Step);
    }

    #[test]
    fn demangled_with_commas_offset_and_filter() {
        let m = spec(
            "libtorch_cpu:f(int, long)+0x10,role=aux,arg=1:str,prefix=Optimizer.step#,name=opt",
        );
        assert_eq!(m.object, ObjectRef::Lib("libtorch_cpu".into()));
        assert_eq!(
            m.location,
            Location::Symbol {
                name: "f(int, long)".into(),
                offset: 16
            }
        );
        assert_eq!(m.role, Role::Aux);
        assert_eq!(
            m.filter,
            Some(StrFilter {
                arg: 1,
                kind: StrKind::StdString,
                text: "Optimizer.step#".into(),
                exact: false
            })
        );
        assert_eq!(m.label(), "opt");
    }

    #[test]
    fn usdt_and_python_shorthand() {
        let m = spec("usdt:/usr/bin/python3.11:python:function__return,arg=1:cstr,eq=train_step");
        assert_eq!(m.object, ObjectRef::Path("/usr/bin/python3.11".into()));
        assert_eq!(
            m.location,
            Location::Usdt {
                provider: "python".into(),
                name: "function__return".into()
            }
        );
        assert!(m.filter.unwrap().exact);
        let p = spec("python:train_step");
        assert_eq!(p.filter.unwrap().text, "train_step");
    }

    #[test]
    fn over_long_names_are_refused_not_truncated() {
        // 63 bytes fit with the NUL the kernel compares; 64 do not.
        assert!(parse(&format!("python:{}", "a".repeat(63))).is_ok());
        let e = parse(&format!("python:{}", "a".repeat(64)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("64 bytes; at most 63"), "{e}");
        // 32 two-byte characters are 64 bytes.
        assert!(parse(&format!("python:{}", "é".repeat(32))).is_err());
        assert!(parse(&format!("python:{}", "é".repeat(31))).is_ok());
        assert!(parse(&format!("exe:f,name={}", "n".repeat(257))).is_err());
        assert!(parse(&format!("exe:{}", "f".repeat(SPEC_MAX))).is_err());
    }

    #[test]
    fn errors_point_at_the_bad_part() {
        let e = parse("exe:foo,role=bogus").unwrap_err().to_string();
        assert!(e.contains("role must be"), "{e}");
        assert!(e.contains("             ^"), "{e}");
        assert!(
            parse("nosymbol")
                .unwrap_err()
                .to_string()
                .contains("no `:` found")
        );
        assert!(
            parse("exe:foo+zz")
                .unwrap_err()
                .to_string()
                .contains("OFFSET")
        );
        assert!(
            parse("exe:foo,prefix=x")
                .unwrap_err()
                .to_string()
                .contains("needs arg=")
        );
        assert!(
            parse("exe:foo,arg=7:cstr,prefix=x")
                .unwrap_err()
                .to_string()
                .contains("0..=5")
        );
        assert!(parse("usdt:python3:justone").is_err());
        assert_eq!(parse("auto").unwrap(), MarkerArg::Auto);
    }
}

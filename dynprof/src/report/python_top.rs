//! The report's top Python functions: the `[py]` frames of the cpu
//! window's stacks (docs/stacks.md), per function (lines merged).
//!
//! A function's self count is the samples in which it is the innermost
//! Python frame: it was running, itself or native code it called (an op,
//! a C extension), as py-spy counts "own" time. Inclusive: the samples in
//! which it is anywhere on the Python stack.
use crate::output::tables::{FrameCount, top_frames};
use crate::symbols::python::PY_PREFIX;

/// `[py] qualname (file.py:LINE)` → `[py] qualname (file.py)`.
pub(super) fn function_of(frame: &str) -> Option<String> {
    if !frame.starts_with(PY_PREFIX) {
        return None;
    }
    let Some(body) = frame.strip_suffix(')') else {
        return Some(frame.to_string());
    };
    match body.rsplit_once(':') {
        Some((head, line)) if !line.is_empty() && line.bytes().all(|b| b.is_ascii_digit()) => {
            Some(format!("{head})"))
        }
        _ => Some(frame.to_string()),
    }
}

/// Up to `n` Python functions, by self then inclusive samples; empty when
/// no stack has Python frames.
pub(super) fn top_python<'a>(
    stacks: impl IntoIterator<Item = (&'a [String], u64)>,
    n: usize,
) -> Vec<FrameCount> {
    let projected: Vec<(Vec<String>, u64)> = stacks
        .into_iter()
        .map(|(s, c)| {
            (
                s.iter().filter_map(|f| function_of(f)).collect::<Vec<_>>(),
                c,
            )
        })
        .filter(|(s, _)| !s.is_empty())
        .collect();
    let (by_self, by_incl) = top_frames(projected.iter().map(|(s, c)| (s.as_slice(), *c)), n);
    let mut all = by_self;
    for f in by_incl {
        if !all.iter().any(|g| g.frame == f.frame) {
            all.push(f);
        }
    }
    all.sort_by(|a, b| {
        b.self_samples
            .cmp(&a.self_samples)
            .then(b.inclusive_samples.cmp(&a.inclusive_samples))
            .then_with(|| a.frame.cmp(&b.frame))
    });
    all.truncate(n);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn functions_self_and_inclusive() {
        let stacks = [
            (
                st(&[
                    "main",
                    "_PyEval_EvalFrameDefault",
                    "[py] step (t.py:5)",
                    "[py] hot (t.py:10)",
                    "PyNumber_Add",
                ]),
                6,
            ),
            (st(&["[py] step (t.py:5)", "[py] hot (t.py:11)"]), 2),
            (st(&["[py] step (t.py:6)", "[py] cold (t.py:20)"]), 2),
            (st(&["main", "native_only"]), 5),
        ];
        let top = top_python(stacks.iter().map(|(s, c)| (s.as_slice(), *c)), 10);
        let got: Vec<(&str, u64, u64)> = top
            .iter()
            .map(|f| (f.frame.as_str(), f.self_samples, f.inclusive_samples))
            .collect();
        assert_eq!(
            got,
            vec![
                ("[py] hot (t.py)", 8, 8),
                ("[py] cold (t.py)", 2, 2),
                ("[py] step (t.py)", 0, 10),
            ]
        );
        assert!(top_python(std::iter::once((&st(&["a"])[..], 1)), 10).is_empty());
        assert_eq!(
            function_of("[py] f (a:b.py:12)").as_deref(),
            Some("[py] f (a:b.py)")
        );
        assert_eq!(function_of("[py] ?").as_deref(), Some("[py] ?"));
        assert_eq!(function_of("main"), None);
    }
}

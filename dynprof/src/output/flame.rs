//! Folded stacks (`root;...;leaf count`, the input format of every
//! flamegraph tool) and their SVGs rendered by inferno.
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use inferno::flamegraph::{
    self, Options, Palette,
    color::{BasicPalette, PaletteMap},
};

use super::model::{CpuSample, OffCpuSpan, Stack};
use super::write_atomic;
use crate::symbols::python::PY_PREFIX;

pub const CPU_FOLDED: &str = "cpu.folded";
pub const CPU_SVG: &str = "flamegraph.svg";
pub const OFFCPU_FOLDED: &str = "offcpu.folded";
pub const OFFCPU_SVG: &str = "offcpu.svg";

/// One folded-stack key. `;` separates frames and the last space separates
/// the count, so a frame must not contain `;` (C++ operator names can) and
/// newlines would break the line format; an empty stack still counts.
pub fn fold_key(stack: &[String]) -> String {
    if stack.is_empty() {
        return "[unknown]".to_string();
    }
    let mut key = String::new();
    for (i, f) in stack.iter().enumerate() {
        if i > 0 {
            key.push(';');
        }
        if f.is_empty() {
            key.push_str("[unknown]");
        } else {
            key.extend(f.chars().map(|c| match c {
                ';' => ':',
                '\n' | '\r' => ' ',
                c => c,
            }));
        }
    }
    key
}

/// Sums `weight` per folded stack. Events share their stack (one `Arc` per
/// distinct stack), so they are summed per shared stack first and each
/// distinct stack is folded into its key once, not once per event.
fn fold<'a>(events: impl Iterator<Item = (&'a Stack, u64)>) -> BTreeMap<String, u64> {
    let mut by_ptr: HashMap<*const [String], (&'a Stack, u64)> = HashMap::new();
    for (stack, w) in events {
        by_ptr.entry(Arc::as_ptr(stack)).or_insert((stack, 0)).1 += w;
    }
    let mut m = BTreeMap::new();
    for (stack, w) in by_ptr.into_values() {
        *m.entry(fold_key(stack)).or_insert(0) += w;
    }
    m
}

/// Stack → number of samples.
pub fn fold_cpu(samples: &[CpuSample]) -> BTreeMap<String, u64> {
    fold(samples.iter().map(|s| (&s.stack, 1)))
}

/// Stack → microseconds off-CPU. Summed in ns before converting so many
/// short waits on one stack are not each rounded away; stacks that total
/// under 1 µs are dropped (a 0 count is meaningless to flamegraph tools).
pub fn fold_offcpu(spans: &[OffCpuSpan]) -> BTreeMap<String, u64> {
    fold(spans.iter().map(|s| (&s.stack, s.dur_ns)))
        .into_iter()
        .map(|(k, v)| (k, v / 1000))
        .filter(|(_, v)| *v > 0)
        .collect()
}

pub fn folded_lines(folded: &BTreeMap<String, u64>) -> Vec<String> {
    folded.iter().map(|(k, v)| format!("{k} {v}")).collect()
}

/// Parses a folded file back (used by `report`); malformed lines are errors
/// naming the line, since silently skipping them would skew the numbers.
pub fn parse_folded(text: &str) -> Result<Vec<(Vec<String>, u64)>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let (stack, count) = line
            .rsplit_once(' ')
            .with_context(|| format!("line {}: no count", i + 1))?;
        let count: u64 = count
            .trim()
            .parse()
            .with_context(|| format!("line {}: bad count {count:?}", i + 1))?;
        out.push((stack.split(';').map(str::to_string).collect(), count));
    }
    Ok(out)
}

/// Renders folded lines to an SVG. inferno refuses empty input, and an
/// absent SVG would read as "collector did not run", so an empty profile
/// gets a small placeholder SVG that says so.
pub fn render_svg(
    lines: &[String],
    title: &str,
    count_name: &str,
    palette: BasicPalette,
) -> Result<Vec<u8>> {
    if lines.is_empty() {
        return Ok(empty_svg(title).into_bytes());
    }
    let mut opts = Options::default();
    opts.title = title.to_string();
    opts.count_name = count_name.to_string();
    opts.colors = Palette::Basic(palette);
    // Python frames in one colour of their own, off both palettes used.
    let mut py_colours = PaletteMap::default();
    for line in lines {
        let stack = line.rsplit_once(' ').map_or(line.as_str(), |(s, _)| s);
        for frame in stack.split(';') {
            if frame.starts_with(PY_PREFIX) && py_colours.get(frame).is_none() {
                py_colours.insert(frame, PY_COLOUR);
            }
        }
    }
    opts.palette_map = Some(&mut py_colours);
    let mut out = Vec::new();
    flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut out)
        .with_context(|| format!("rendering flamegraph {title:?}"))?;
    Ok(out)
}

/// The fill of `[py]` frames in flame graphs.
pub const PY_COLOUR: inferno::flamegraph::color::Color = inferno::flamegraph::color::Color {
    r: 80,
    g: 180,
    b: 90,
};

fn empty_svg(title: &str) -> String {
    let esc = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    format!(
        r#"<?xml version="1.0" standalone="no"?>
<svg version="1.1" width="1200" height="120" xmlns="http://www.w3.org/2000/svg">
<rect x="0" y="0" width="100%" height="100%" fill="rgb(240,240,240)"/>
<text x="600" y="40" font-size="17" font-family="Verdana" text-anchor="middle">{}</text>
<text x="600" y="80" font-size="14" font-family="Verdana" text-anchor="middle">No samples were collected in this window.</text>
</svg>
"#,
        esc(title)
    )
}

fn write_pair(
    dir: &Path,
    folded: &BTreeMap<String, u64>,
    folded_name: &str,
    svg_name: &str,
    title: &str,
    count_name: &str,
    palette: BasicPalette,
) -> Result<Vec<PathBuf>> {
    let lines = folded_lines(folded);
    let folded_path = dir.join(folded_name);
    let mut text = lines.join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    write_atomic(&folded_path, text.as_bytes())?;
    let svg_path = dir.join(svg_name);
    let svg = render_svg(&lines, title, count_name, palette)
        .with_context(|| format!("writing {}", svg_path.display()))?;
    write_atomic(&svg_path, &svg)?;
    Ok(vec![folded_path, svg_path])
}

/// Writes `cpu.folded` (count = samples) and `flamegraph.svg`.
pub fn write_cpu(dir: &Path, samples: &[CpuSample]) -> Result<Vec<PathBuf>> {
    write_cpu_folded(dir, &fold_cpu(samples))
}

/// Writes `offcpu.folded` (count = µs off-CPU) and `offcpu.svg`.
pub fn write_offcpu(dir: &Path, spans: &[OffCpuSpan]) -> Result<Vec<PathBuf>> {
    write_offcpu_folded(dir, &fold_offcpu(spans))
}

/// `cpu.folded` and `flamegraph.svg` from folded stacks (also what
/// `report --symbolize` writes back).
pub fn write_cpu_folded(dir: &Path, folded: &BTreeMap<String, u64>) -> Result<Vec<PathBuf>> {
    write_pair(
        dir,
        folded,
        CPU_FOLDED,
        CPU_SVG,
        "CPU",
        "samples",
        BasicPalette::Hot,
    )
}

/// `offcpu.folded` and `offcpu.svg` from folded stacks.
pub fn write_offcpu_folded(dir: &Path, folded: &BTreeMap<String, u64>) -> Result<Vec<PathBuf>> {
    write_pair(
        dir,
        folded,
        OFFCPU_FOLDED,
        OFFCPU_SVG,
        "Off-CPU time (µs)",
        "us",
        BasicPalette::Blue,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(v: &[&str]) -> Stack {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn python_frames_have_their_own_colour() {
        let lines = vec![
            "main;_PyEval_EvalFrameDefault;[py] caller (a.py:3);[py] hot (a.py:9) 5".to_string(),
            "main;other 1".to_string(),
        ];
        let fill = format!("rgb({},{},{})", PY_COLOUR.r, PY_COLOUR.g, PY_COLOUR.b);
        for palette in [BasicPalette::Hot, BasicPalette::Blue] {
            let svg =
                String::from_utf8(render_svg(&lines, "t", "samples", palette).unwrap()).unwrap();
            // Two Python frames, each drawn in the Python colour; no other
            // frame is.
            assert_eq!(svg.matches(&fill).count(), 2, "{svg}");
        }
    }

    #[test]
    fn folds_and_renders() {
        let dir = crate::output::tests_support::tempdir("flame");
        let samples = vec![
            CpuSample {
                tid: 1,
                ts_ns: 1,
                stack: st(&["main", "hot_cpu_work"]),
            },
            CpuSample {
                tid: 1,
                ts_ns: 2,
                stack: st(&["main", "hot_cpu_work"]),
            },
            CpuSample {
                tid: 1,
                ts_ns: 3,
                stack: st(&["main", "operator;"]),
            },
            CpuSample {
                tid: 1,
                ts_ns: 4,
                stack: Stack::from([]),
            },
        ];
        let files = write_cpu(&dir, &samples).unwrap();
        assert_eq!(files.len(), 2);
        let folded = std::fs::read_to_string(dir.join(CPU_FOLDED)).unwrap();
        assert_eq!(
            folded,
            "[unknown] 1\nmain;hot_cpu_work 2\nmain;operator: 1\n"
        );
        let parsed = parse_folded(&folded).unwrap();
        assert_eq!(parsed[1], (st(&["main", "hot_cpu_work"]).to_vec(), 2));
        let svg = std::fs::read_to_string(dir.join(CPU_SVG)).unwrap();
        assert!(svg.contains("hot_cpu_work"));
        assert!(svg.contains("<svg"));

        let spans = vec![
            OffCpuSpan {
                runnable: false,
                tid: 1,
                ts_ns: 0,
                dur_ns: 1500,
                stack: st(&["main", "sync"]),
            },
            OffCpuSpan {
                runnable: false,
                tid: 1,
                ts_ns: 0,
                dur_ns: 600,
                stack: st(&["main", "sync"]),
            },
            OffCpuSpan {
                runnable: false,
                tid: 1,
                ts_ns: 0,
                dur_ns: 999,
                stack: st(&["main", "tiny"]),
            },
        ];
        write_offcpu(&dir, &spans).unwrap();
        let folded = std::fs::read_to_string(dir.join(OFFCPU_FOLDED)).unwrap();
        assert_eq!(folded, "main;sync 2\n");
        let svg = std::fs::read_to_string(dir.join(OFFCPU_SVG)).unwrap();
        assert!(svg.contains("Off-CPU time"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn empty_input_still_writes_files() {
        let dir = crate::output::tests_support::tempdir("flame-empty");
        write_cpu(&dir, &[]).unwrap();
        write_offcpu(&dir, &[]).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join(CPU_FOLDED)).unwrap(), "");
        let svg = std::fs::read_to_string(dir.join(CPU_SVG)).unwrap();
        assert!(svg.contains("No samples"));
        assert!(
            std::fs::read_to_string(dir.join(OFFCPU_SVG))
                .unwrap()
                .contains("No samples")
        );
        assert!(parse_folded("").unwrap().is_empty());
        assert!(parse_folded("a;b x\n").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

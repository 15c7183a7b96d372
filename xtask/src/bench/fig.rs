//! One reported figure: its samples, its summary, its target, and the table.

use super::{
    json::Json,
    stats::{self, Summary},
};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Goal {
    AtLeast(f64),
    AtMost(f64),
    /// Reported for comparison; no target.
    Info,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Ratio,
    Ms,
    Ns,
    Us,
    MiB,
    /// Percent of one core.
    PctCore,
    Count,
    PerSec,
    Steps,
}

impl Unit {
    fn fmt(self, x: f64) -> String {
        match self {
            Unit::Ratio => format!("{x:.4}"),
            Unit::Ms => format!("{x:.3} ms"),
            Unit::Ns => format!("{x:.0} ns"),
            Unit::Us => format!("{x:.2} µs"),
            Unit::MiB => format!("{x:.1} MiB"),
            Unit::PctCore => format!("{x:.3}%"),
            Unit::Count => format!("{x:.0}"),
            Unit::PerSec => si(x) + "/s",
            Unit::Steps => format!("{x:.1} steps"),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Unit::Ratio => "ratio",
            Unit::Ms => "ms",
            Unit::Ns => "ns",
            Unit::Us => "us",
            Unit::MiB => "MiB",
            Unit::PctCore => "percent_of_one_core",
            Unit::Count => "count",
            Unit::PerSec => "per_second",
            Unit::Steps => "steps",
        }
    }
}

fn si(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.1}")
    }
}

#[derive(Clone, Debug)]
pub struct Figure {
    pub key: String,
    pub name: String,
    pub unit: Unit,
    pub goal: Goal,
    /// How the target reads in the table, e.g. "≥ 0.999".
    pub goal_text: String,
    pub samples: Vec<f64>,
    /// Set when the figure is not a median of samples (a percentile, a
    /// count, a computed value): this is what the table shows.
    pub value: Option<f64>,
    pub note: String,
    /// "measured", "computed", or "not measured".
    pub kind: &'static str,
    /// The samples' spread is wider than the target's margin: the
    /// measurement cannot say met or missed (status "noisy").
    pub unresolved: bool,
    /// Standard error of `value` when it is a mean of samples.
    pub se: Option<f64>,
}

impl Figure {
    pub fn new(key: &str, name: &str, unit: Unit, goal: Goal, goal_text: &str) -> Figure {
        Figure {
            key: key.into(),
            name: name.into(),
            unit,
            goal,
            goal_text: goal_text.into(),
            samples: Vec::new(),
            value: None,
            note: String::new(),
            kind: "measured",
            unresolved: false,
            se: None,
        }
    }
    pub fn samples(mut self, s: Vec<f64>) -> Self {
        self.samples = s;
        self
    }
    pub fn value(mut self, v: f64) -> Self {
        self.value = Some(v);
        self
    }
    pub fn note(mut self, n: impl Into<String>) -> Self {
        self.note = n.into();
        self
    }
    /// Marks the figure "noisy" when min..max of its samples straddles the
    /// target by more than `margin` (relative) on both sides.
    pub fn resolve(mut self, margin: f64) -> Self {
        if let (Some(s), Goal::AtLeast(t) | Goal::AtMost(t)) = (self.summary(), self.goal)
            && s.n > 1
            && s.min < t * (1.0 - margin)
            && s.max > t * (1.0 + margin)
        {
            self.unresolved = true;
        }
        self
    }
    /// The headline is the mean of the samples, shown with its standard
    /// error; "noisy" when the target lies within two standard errors.
    pub fn mean_se(mut self, samples: Vec<f64>) -> Self {
        if let Some((m, se)) = stats::mean_se(&samples) {
            self.value = Some(m);
            self.se = Some(se);
            if let Goal::AtLeast(t) | Goal::AtMost(t) = self.goal
                && (m - t).abs() < 2.0 * se
            {
                self.unresolved = true;
            }
        }
        self.samples = samples;
        self
    }
    pub fn computed(mut self) -> Self {
        self.kind = "computed";
        self
    }
    pub fn missing(mut self, why: impl Into<String>) -> Self {
        self.kind = "not measured";
        self.note = why.into();
        self
    }

    pub fn summary(&self) -> Option<Summary> {
        stats::summary(&self.samples)
    }

    /// The value compared with the target.
    pub fn headline(&self) -> Option<f64> {
        self.value.or_else(|| self.summary().map(|s| s.median))
    }

    pub fn status(&self) -> &'static str {
        match (self.headline(), self.goal) {
            (None, _) => "n/a",
            (Some(_), Goal::AtLeast(_) | Goal::AtMost(_)) if self.unresolved => "noisy",
            (_, Goal::Info) => "",
            (Some(v), Goal::AtLeast(t)) => {
                if v >= t {
                    "ok"
                } else {
                    "MISS"
                }
            }
            (Some(v), Goal::AtMost(t)) => {
                if v <= t {
                    "ok"
                } else {
                    "MISS"
                }
            }
        }
    }

    pub fn shown(&self) -> String {
        if self.kind == "not measured" {
            return "not measured".into();
        }
        let mut s = match (self.value, self.summary()) {
            (Some(v), _) if self.se.is_some() => format!(
                "{} ± {} (mean ± SE, n={})",
                self.unit.fmt(v),
                self.unit.fmt(self.se.unwrap_or(0.0)),
                self.samples.len()
            ),
            (Some(v), _) => self.unit.fmt(v),
            (None, Some(s)) if s.n > 1 => {
                format!(
                    "{} [{} … {}]",
                    self.unit.fmt(s.median),
                    self.unit.fmt(s.min),
                    self.unit.fmt(s.max)
                )
            }
            (None, Some(s)) => self.unit.fmt(s.median),
            (None, None) => "no data".into(),
        };
        if self.kind == "computed" {
            s.push_str(" (computed)");
        }
        s
    }

    pub fn to_json(&self) -> Json {
        let mut o = Json::obj(vec![
            ("key", Json::s(&self.key)),
            ("name", Json::s(&self.name)),
            ("kind", Json::s(self.kind)),
            ("unit", Json::s(self.unit.name())),
            ("target", Json::s(&self.goal_text)),
            ("status", Json::s(self.status())),
            ("unresolved", Json::Bool(self.unresolved)),
        ]);
        match self.headline() {
            Some(v) => o.push("value", Json::num(v)),
            None => o.push("value", Json::Null),
        }
        if let Some(se) = self.se {
            o.push("standard_error", Json::num(se));
        }
        if let Some(s) = self.summary() {
            o.push("median", Json::num(s.median));
            o.push("min", Json::num(s.min));
            o.push("max", Json::num(s.max));
            o.push("n", Json::int(s.n as u64));
        }
        o.push("samples", Json::nums(&self.samples));
        if !self.note.is_empty() {
            o.push("note", Json::s(&self.note));
        }
        o
    }
}

/// The one table: figure, measured (median [min … max]), target, status;
/// notes are numbered under it.
pub fn table(sections: &[(String, Vec<Figure>)]) -> String {
    let mut rows: Vec<[String; 4]> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    for (title, figs) in sections {
        rows.push([
            format!("── {title}"),
            String::new(),
            String::new(),
            String::new(),
        ]);
        for f in figs {
            let mut name = format!("  {}", f.name);
            if !f.note.is_empty() {
                notes.push(f.note.clone());
                name.push_str(&format!(" [{}]", notes.len()));
            }
            let status = match f.status() {
                "MISS" => "✗ MISS".to_string(),
                "ok" => "✓".to_string(),
                "noisy" => "~ noisy".to_string(),
                s => s.to_string(),
            };
            rows.push([name, f.shown(), f.goal_text.clone(), status]);
        }
    }
    let head = [
        "figure".to_string(),
        "measured: median [min … max]".into(),
        "target".into(),
        "".into(),
    ];
    let w: Vec<usize> = (0..4)
        .map(|i| {
            rows.iter()
                .chain(std::iter::once(&head))
                .map(|r| r[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let pad = |s: &str, n: usize| format!("{s}{}", " ".repeat(n.saturating_sub(s.chars().count())));
    let mut out = String::new();
    let line = |r: &[String; 4]| {
        format!(
            "{} │ {} │ {} │ {}\n",
            pad(&r[0], w[0]),
            pad(&r[1], w[1]),
            pad(&r[2], w[2]),
            r[3]
        )
    };
    out.push_str(&line(&head));
    out.push_str(&format!("{}\n", "─".repeat(w[0] + w[1] + w[2] + 12)));
    for r in &rows {
        out.push_str(&line(r));
    }
    if !notes.is_empty() {
        out.push('\n');
        for (i, n) in notes.iter().enumerate() {
            out.push_str(&format!("[{}] {}\n", i + 1, n));
        }
    }
    out
}

/// The same table in Markdown, for docs/performance.md.
pub fn markdown(sections: &[(String, Vec<Figure>)]) -> String {
    let mut out =
        String::from("| figure | measured: median [min … max] | target | |\n|---|---|---|---|\n");
    let mut notes = Vec::new();
    for (title, figs) in sections {
        out.push_str(&format!("| **{title}** | | | |\n"));
        for f in figs {
            let mut name = f.name.clone();
            if !f.note.is_empty() {
                notes.push(f.note.clone());
                name.push_str(&format!(" [{}]", notes.len()));
            }
            let status = match f.status() {
                "MISS" => "**MISS**",
                "ok" => "ok",
                "noisy" => "noisy",
                s => s,
            };
            out.push_str(&format!(
                "| {} | {} | {} | {} |\n",
                name,
                f.shown(),
                f.goal_text,
                status
            ));
        }
    }
    if !notes.is_empty() {
        out.push('\n');
        for (i, n) in notes.iter().enumerate() {
            out.push_str(&format!("{}. {}\n", i + 1, n));
        }
    }
    out
}

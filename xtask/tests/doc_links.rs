//! No dangling documentation links: every relative link in README.md and
//! docs/*.md points at a file that exists (and, with `#anchor`, at a heading
//! of it), and every `docs/….md` that the code names (`--help` texts,
//! comments, test messages) exists.

use std::{
    collections::BTreeSet,
    path::{Component, Path, PathBuf},
};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent")
        .to_path_buf()
}

fn pages(root: &Path) -> Vec<PathBuf> {
    let mut v = vec![root.join("README.md")];
    // No docs/ at all: README's links into it are then reported one by one.
    let Ok(dir) = std::fs::read_dir(root.join("docs")) else {
        return v;
    };
    let mut docs: Vec<PathBuf> = dir
        .map(|e| e.expect("readdir").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    v.extend(docs);
    v
}

/// Lines outside fenced code blocks, with inline code spans blanked out
/// (so that `[a](b)` inside backticks is not taken as a link).
fn prose_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fence = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            continue;
        }
        if fence {
            continue;
        }
        let mut s = String::with_capacity(line.len());
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
                s.push(' ');
            } else {
                s.push(if in_code { ' ' } else { c });
            }
        }
        out.push((i + 1, s));
    }
    out
}

/// Targets of `[text](target)` and `![alt](target)` links on one line.
fn link_targets(line: &str) -> Vec<String> {
    let mut v = Vec::new();
    let b = line.as_bytes();
    let mut i = 0;
    while let Some(off) = line[i..].find("](") {
        let start = i + off + 2;
        let mut depth = 1;
        let mut j = start;
        while j < b.len() {
            match b[j] {
                b'(' => depth += 1,
                b')' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        let target = line[start..j.min(b.len())].trim();
        // `[text](url "title")`
        let target = target.split_whitespace().next().unwrap_or("");
        v.push(target.trim_matches(['<', '>']).to_string());
        i = j.min(b.len());
    }
    v
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-`
/// and `_` dropped, spaces to `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut out = BTreeSet::new();
    let mut fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            continue;
        }
        if fence || !line.starts_with('#') {
            continue;
        }
        let h = line.trim_start_matches('#');
        if !h.starts_with(' ') {
            continue;
        }
        let base = slug(&h.replace('`', ""));
        // Repeated headings get -1, -2, … as on GitHub.
        let mut s = base.clone();
        let mut n = 0;
        while !seen.insert(s.clone()) {
            n += 1;
            s = format!("{base}-{n}");
        }
        out.insert(s);
    }
    out
}

/// `a/b/../c` → `a/c`, without touching the filesystem.
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// Every problem in the Markdown pages, one line each.
fn dangling_links(root: &Path) -> Vec<String> {
    let mut bad = Vec::new();
    for page in pages(root) {
        let text = std::fs::read_to_string(&page).expect("reading a page");
        let rel_page = page
            .strip_prefix(root)
            .unwrap_or(&page)
            .display()
            .to_string();
        for (lineno, line) in prose_lines(&text) {
            for target in link_targets(&line) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target.as_str(), None),
                };
                let file = if path.is_empty() {
                    page.clone()
                } else if let Some(abs) = path.strip_prefix('/') {
                    root.join(abs)
                } else {
                    page.parent().expect("a page has a directory").join(path)
                };
                let file = normalize(&file);
                if !file.exists() {
                    bad.push(format!("{rel_page}:{lineno}: `{target}`: no such file"));
                    continue;
                }
                if let Some(a) = anchor
                    && file.extension().is_some_and(|e| e == "md")
                {
                    let t = std::fs::read_to_string(&file).expect("reading a linked page");
                    if !anchors(&t).contains(a) {
                        bad.push(format!(
                            "{rel_page}:{lineno}: `{target}`: no heading with anchor #{a} in {}",
                            file.strip_prefix(root).unwrap_or(&file).display()
                        ));
                    }
                }
            }
        }
    }
    bad
}

/// Every `docs/NAME.md` named in Rust sources under `dir`, with where.
fn docs_named_in_code(dir: &Path, out: &mut Vec<(String, PathBuf, usize)>) {
    for e in std::fs::read_dir(dir).expect("readdir") {
        let p = e.expect("readdir").path();
        if p.is_dir() {
            if p.file_name()
                .is_some_and(|n| n != "target" && n != "fixtures")
            {
                docs_named_in_code(&p, out);
            }
            continue;
        }
        if p.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&p).expect("reading a source");
        for (i, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("docs/") {
                let tail = &rest[at..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_alphanumeric() || "/._-".contains(c)))
                    .unwrap_or(tail.len());
                let name = tail[..end].trim_end_matches('.');
                if name.ends_with(".md") {
                    out.push((name.to_string(), p.clone(), i + 1));
                }
                rest = &tail[end.max(5)..];
            }
        }
    }
}

fn dangling_docs_in_code(root: &Path) -> Vec<String> {
    let mut named = Vec::new();
    for dir in ["dynprof/src", "xtask/src", "tests"] {
        docs_named_in_code(&root.join(dir), &mut named);
    }
    named
        .into_iter()
        .filter(|(name, _, _)| {
            let f = root.join(name);
            !f.exists()
        })
        .map(|(name, file, line)| {
            format!(
                "{}:{line}: names {name}, which does not exist",
                file.strip_prefix(root).unwrap_or(&file).display()
            )
        })
        .collect()
}

#[test]
fn readme_and_docs_have_no_dangling_relative_links() {
    let bad = dangling_links(&root());
    assert!(bad.is_empty(), "dangling links:\n{}", bad.join("\n"));
}

#[test]
fn docs_named_in_the_code_exist() {
    let bad = dangling_docs_in_code(&root());
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn readme_stays_a_readme() {
    let text = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = text.lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines; the manual goes in docs/"
    );
    for cmd in ["cargo xtask demo", "cargo xtask test"] {
        assert!(text.contains(cmd), "README.md must show `{cmd}`");
    }
}

/// setup/venvs.rs installs the venv where tests/torch2_util.rs looks for
/// it.
#[test]
fn torch2_venv_default_agrees_between_setup_and_test() {
    let r = root();
    let setup = std::fs::read_to_string(r.join("xtask/src/setup/venvs.rs")).unwrap();
    let test = std::fs::read_to_string(r.join("tests/torch2_util.rs")).unwrap();
    let default_of = |text: &str, file: &str| -> String {
        let line = text
            .lines()
            .find(|l| l.contains("const TORCH2_VENV_DEFAULT: &str ="))
            .unwrap_or_else(|| panic!("{file} has no TORCH2_VENV_DEFAULT"));
        line.split('"')
            .nth(1)
            .expect("a string literal")
            .to_string()
    };
    assert_eq!(
        default_of(&setup, "setup/venvs.rs"),
        default_of(&test, "torch2_util.rs")
    );
}

// The checker's own parts, on made-up pages, so that a checker that finds
// nothing cannot pass unnoticed.
#[test]
fn checker_finds_what_it_should() {
    let dir = std::env::temp_dir().join(format!("doc_links_selftest_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("docs")).unwrap();
    std::fs::write(
        dir.join("README.md"),
        "# Top\n[ok](docs/a.md) [gone](docs/missing.md) [anchor](docs/a.md#the---b-flag)\n\
         [bad anchor](docs/a.md#nope) [web](https://example.com/x.md)\n\
         `[in code](docs/nothere.md)`\n```\n[in fence](docs/nothere2.md)\n```\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("docs/a.md"),
        "# A\n## The `--b` flag\n[up](../README.md#top) [self](#a) [missing self](#zzz)\n",
    )
    .unwrap();
    let bad = dangling_links(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    let want = [
        "README.md:2: `docs/missing.md`: no such file",
        "README.md:3: `docs/a.md#nope`: no heading with anchor #nope in docs/a.md",
        "docs/a.md:3: `#zzz`: no heading with anchor #zzz in docs/a.md",
    ];
    assert_eq!(bad, want);
}

#[test]
fn slugs_match_github() {
    assert_eq!(slug("`--marker auto`"), "--marker-auto");
    assert_eq!(
        slug(
            "Hooks: `--on-window-start CMD`, `--on-window-end CMD`"
                .replace('`', "")
                .as_str()
        ),
        "hooks---on-window-start-cmd---on-window-end-cmd"
    );
    assert_eq!(
        slug("JSON output (`--json`)".replace('`', "").as_str()),
        "json-output---json"
    );
}

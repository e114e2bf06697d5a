//! The code stays readable at a glance: no function of the crate over 100 lines, and no
//! module over 800 lines before its tests. Read from the
//! sources (comments, strings and character literals masked first, so a brace in a message
//! or a doc comment counts for nothing), so a function or module that grows past the line
//! fails here, naming it — split it into steps, or by concern, rather than raise the limit.

use std::path::{Path, PathBuf};

/// The longest a function of `src/` may be (outside its tests), its signature and closing
/// brace included.
const FUNCTION_LINES: usize = 100;
/// The longest a module (one file) may be, not counting its `#[cfg(test)] mod tests { … }`.
const MODULE_LINES: usize = 800;

pub(crate) fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        for entry in std::fs::read_dir(path).unwrap() {
            rust_files(&entry.unwrap().path(), out);
        }
    } else if path.extension().is_some_and(|e| e == "rs")
        // A module of tests of its own (`#[cfg(test)] mod tests;`).
        && path.file_stem().is_some_and(|s| s != "tests")
    {
        out.push(path.to_path_buf());
    }
}

pub(crate) fn ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `src` with every character of its comments, string literals and character literals (but
/// newlines) replaced by a space: what is left is the code's structure.
pub(crate) fn mask(src: &str) -> String {
    let s: Vec<char> = src.chars().collect();
    let mut out: Vec<char> = Vec::with_capacity(s.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        let next = s.get(i + 1).copied();
        let prev = i.checked_sub(1).map(|p| s[p]);
        if c == '/' && next == Some('/') {
            while i < s.len() && s[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < s.len() {
                if s[i] == '/' && s.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.extend([' ', ' ']);
                    i += 2;
                } else if s[i] == '*' && s.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.extend([' ', ' ']);
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(s[i]));
                    i += 1;
                }
            }
        } else if c == 'r'
            && !prev.is_some_and(|p| ident_char(p) && p != 'b')
            && matches!(next, Some('"' | '#'))
        {
            // A raw string: r"…", r#"…"#, br"…".
            let hashes = s[i + 1..].iter().take_while(|&&h| h == '#').count();
            if s.get(i + 1 + hashes) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            out.extend(std::iter::repeat_n(' ', 2 + hashes));
            i += 2 + hashes;
            while i < s.len() {
                if s[i] == '"'
                    && s[i + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == '#')
                        .count()
                        == hashes
                {
                    out.extend(std::iter::repeat_n(' ', 1 + hashes));
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(s[i]));
                i += 1;
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < s.len() && s[i] != '"' {
                let n = if s[i] == '\\' { 2 } else { 1 };
                for k in 0..n {
                    if let Some(&ch) = s.get(i + k) {
                        out.push(blank(ch));
                    }
                }
                i += n;
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' && (next == Some('\\') || s.get(i + 2) == Some(&'\'')) {
            // A character literal ('x', '\n', '\u{7f}'), not a lifetime ('a).
            out.push(' ');
            i += 1;
            if s.get(i) == Some(&'\\') {
                out.push(' ');
                i += 1;
            }
            while i < s.len() && s[i] != '\'' {
                out.push(' ');
                i += 1;
            }
            out.push(' ');
            i += 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out.into_iter().collect()
}

/// The index of the `}` closing the `{` at `open`.
pub(crate) fn closing(code: &[char], open: usize) -> usize {
    let mut depth = 0;
    for (i, &c) in code.iter().enumerate().skip(open) {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    code.len() - 1
}

pub(crate) fn line_of(code: &[char], at: usize) -> usize {
    code[..at].iter().filter(|&&c| c == '\n').count() + 1
}

/// `#[cfg(test)] mod … { … }` blocks in masked `code`, as character ranges.
pub(crate) fn test_modules(code: &[char]) -> Vec<(usize, usize)> {
    let text: String = code.iter().collect();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = text[from..].find("#[cfg(test)]") {
        let at = from + i;
        from = at + 1;
        let after = text[at + "#[cfg(test)]".len()..].trim_start();
        if !after.starts_with("mod ") {
            continue;
        }
        let rest = &text[text.len() - after.len()..];
        let (brace, semi) = (rest.find('{'), rest.find(';'));
        if let Some(b) = brace.filter(|&b| semi.is_none_or(|s| b < s)) {
            // Character offsets: the masked code is the same characters as `text`.
            let open = text[..text.len() - rest.len() + b].chars().count();
            let start = text[..at].chars().count();
            out.push((start, closing(code, open)));
        }
    }
    out
}

/// The functions with a body in masked `code` outside `skip`: (name, first line, lines).
pub(crate) fn functions(code: &[char], skip: &[(usize, usize)]) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for i in 0..code.len().saturating_sub(3) {
        if code[i..i + 3] != ['f', 'n', ' ']
            || i.checked_sub(1).is_some_and(|p| ident_char(code[p]))
            || skip.iter().any(|&(a, b)| (a..=b).contains(&i))
        {
            continue;
        }
        let name: String = code[i + 3..]
            .iter()
            .skip_while(|c| c.is_whitespace())
            .take_while(|&&c| ident_char(c))
            .collect();
        if name.is_empty() {
            continue; // `fn(…)`: a function pointer type
        }
        let Some(body) = code[i..].iter().position(|&c| c == '{' || c == ';') else {
            continue;
        };
        if code[i + body] == ';' {
            continue; // a declaration without a body (a trait's)
        }
        let end = closing(code, i + body);
        let first = line_of(code, i);
        out.push((name, first, line_of(code, end) - first + 1));
    }
    out
}

/// `src/` and its Rust files (more than a hundred: a wrong path must not pass for a tidy one).
pub(crate) fn sources() -> (PathBuf, Vec<PathBuf>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(files.len() > 100, "found only {} files", files.len());
    (root, files)
}

pub(crate) fn masked(path: &Path) -> Vec<char> {
    mask(&std::fs::read_to_string(path).unwrap())
        .chars()
        .collect()
}

#[test]
fn the_mask_leaves_code_and_blanks_comments_strings_and_characters() {
    let code =
        "fn a<'x>(s: &'x str) -> char { let _ = \"}{\"; let _ = r#\"}\"#; '{' } // }\n/* { */";
    let m = mask(code);
    assert_eq!(m.chars().count(), code.chars().count());
    assert_eq!(m.matches('{').count(), 1, "{m}");
    assert_eq!(m.matches('}').count(), 1, "{m}");
    assert!(m.contains("fn a<'x>(s: &'x str)"), "{m}");
    let f = functions(&m.chars().collect::<Vec<_>>(), &[]);
    assert_eq!(f, vec![("a".to_string(), 1, 1)]);
}

#[test]
fn no_function_is_over_100_lines() {
    let (root, files) = sources();
    let mut long = Vec::new();
    for path in &files {
        let code = masked(path);
        let tests = test_modules(&code);
        for (name, line, lines) in functions(&code, &tests) {
            if lines > FUNCTION_LINES {
                let file = path.strip_prefix(&root).unwrap().display();
                long.push(format!("src/{file}:{line} {name}: {lines} lines"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "over {FUNCTION_LINES} lines (split into named steps):\n{}",
        long.join("\n")
    );
}

#[test]
fn no_module_is_over_800_lines_before_its_tests() {
    let (root, files) = sources();
    let mut long = Vec::new();
    for path in &files {
        let code = masked(path);
        let tests: usize = test_modules(&code)
            .iter()
            .map(|&(a, b)| line_of(&code, b) - line_of(&code, a) + 1)
            .sum();
        let lines = line_of(&code, code.len()) - 1 - tests;
        if lines > MODULE_LINES {
            let file = path.strip_prefix(&root).unwrap().display();
            long.push(format!("src/{file}: {lines} lines"));
        }
    }
    assert!(
        long.is_empty(),
        "over {MODULE_LINES} lines besides tests (split by concern):\n{}",
        long.join("\n")
    );
}

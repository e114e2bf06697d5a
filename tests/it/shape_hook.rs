//! Ordered retries stay a hook (issue 38): the partition's event path and the retry path
//! call the lines module through its one interface, `LineHook`, and the core event path reads
//! in one screen again. Read from the sources with comments and strings masked (as `sizes.rs`
//! does), so a regression fails here naming the file and line:
//!
//! - `partition/event.rs` and `retry/steps.rs` name nothing of `pipeline::lines` but the
//!   hook's items (and `Known`, the partition's knowledge the hook is given), nor the line
//!   steps' own types (`KeyState`, `Park`, `Open`);
//! - no function of the event path (`partition/event.rs`, `lines/hook.rs`) takes more than
//!   four parameters (a receiver, `self`, not counted): a context struct, not a list;
//! - the event path's `process` is at most 40 lines, and `partition/event.rs` at most 320;
//! - `src/pipeline` holds no `Option<Result<` and no `(bool, bool)` (whitespace and line
//!   breaks aside): named types instead.

use std::path::{Path, PathBuf};

use super::sizes::{ident_char, mask, rust_files};

/// What the event and retry paths may name of `pipeline::lines`.
const HOOK: &[&str] = &[
    "LineHook",
    "LineStep",
    "Place",
    "Advanced",
    "UntilDone",
    "StepFuture",
    "Known",
];
/// The line steps' own types, which only the hook names.
const LINE_INTERNALS: &[&str] = &["KeyState", "Park", "Open"];
/// The most parameters a function of the event path takes, its receiver aside.
const MAX_PARAMETERS: usize = 4;
/// The longest the event path's `process` may be, its signature and closing brace included.
const PROCESS_LINES: usize = 40;
/// The longest `partition/event.rs` may be.
const EVENT_MODULE_LINES: usize = 320;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn masked(relative: &str) -> String {
    let path = src().join(relative);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("src/{relative} cannot be read: {e}"));
    mask(&text)
}

fn line_of(code: &str, at: usize) -> usize {
    code[..at].matches('\n').count() + 1
}

/// The names a piece of masked code takes from `lines::` (`lines::X`, or each item of a
/// `lines::{X, Y::Z}` group), with the line each is on.
fn names_from_lines(code: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = code[from..].find("lines::") {
        let at = from + i;
        from = at + "lines::".len();
        if code[..at].chars().next_back().is_some_and(ident_char) {
            continue; // `guidelines::`, say: not the module
        }
        let rest = &code[from..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            let mut offset = from + 1;
            for item in group[..end].split(',') {
                let name: String = item
                    .trim_start()
                    .chars()
                    .take_while(|&c| ident_char(c))
                    .collect();
                if !name.is_empty() {
                    out.push((name, line_of(code, offset)));
                }
                offset += item.len() + 1;
            }
        } else {
            let name: String = rest.chars().take_while(|&c| ident_char(c)).collect();
            out.push((name, line_of(code, at)));
        }
    }
    out
}

/// Whole-word occurrences of `word` in masked code: the line of each.
fn words(code: &str, word: &str) -> Vec<usize> {
    code.match_indices(word)
        .filter(|&(i, _)| {
            !code[..i].chars().next_back().is_some_and(ident_char)
                && !code[i + word.len()..]
                    .chars()
                    .next()
                    .is_some_and(ident_char)
        })
        .map(|(i, _)| line_of(code, i))
        .collect()
}

/// The index just past the bracket closing the one at `open` (`(`, `<` or `{`), counting
/// brackets of that kind only; a `>` of `->` is no bracket.
fn past_closing(code: &[char], open: usize) -> usize {
    let (opening, closing) = match code[open] {
        '(' => ('(', ')'),
        '<' => ('<', '>'),
        _ => ('{', '}'),
    };
    let mut depth = 0i32;
    for i in open..code.len() {
        if code[i] == opening {
            depth += 1;
        } else if code[i] == closing && !(closing == '>' && i > 0 && code[i - 1] == '-') {
            depth -= 1;
            if depth == 0 {
                return i + 1;
            }
        }
    }
    code.len()
}

/// The parameters of each function in masked code, its receiver aside: (name, line, count).
fn parameters(code: &str) -> Vec<(String, usize, usize)> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    for i in 0..chars.len().saturating_sub(3) {
        if chars[i..i + 3] != ['f', 'n', ' ']
            || i.checked_sub(1).is_some_and(|p| ident_char(chars[p]))
        {
            continue;
        }
        let mut j = i + 3;
        while chars.get(j).is_some_and(|c| c.is_whitespace()) {
            j += 1;
        }
        let name: String = chars[j..].iter().take_while(|&&c| ident_char(c)).collect();
        if name.is_empty() {
            continue; // `fn(…)`: a function pointer type
        }
        j += name.chars().count();
        if chars.get(j) == Some(&'<') {
            j = past_closing(&chars, j);
        }
        if chars.get(j) != Some(&'(') {
            continue;
        }
        let end = past_closing(&chars, j);
        let list: String = chars[j + 1..end - 1].iter().collect();
        let mut params = Vec::new();
        let (mut depth, mut current) = (0i32, String::new());
        let mut prev = ' ';
        for c in list.chars() {
            match c {
                '(' | '[' | '{' | '<' => depth += 1,
                '>' if prev == '-' => {}
                ')' | ']' | '}' | '>' => depth -= 1,
                ',' if depth == 0 => {
                    params.push(std::mem::take(&mut current));
                    prev = c;
                    continue;
                }
                _ => {}
            }
            current.push(c);
            prev = c;
        }
        params.push(current);
        let count = params
            .iter()
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|p| !p.is_empty())
            .filter(|p| {
                let p = p.trim_start_matches('&').trim_start();
                let p = p
                    .split_once(' ')
                    .filter(|(l, _)| l.starts_with('\''))
                    .map_or(p, |(_, r)| r);
                let p = p.trim_start_matches("mut ").trim_start();
                !(p == "self" || p.starts_with("self:") || p.starts_with("self :"))
            })
            .count();
        out.push((name, line_of(code, i), count));
    }
    out
}

/// The lines of function `name` in masked code (the first such): where it starts, and how
/// many lines it takes, its signature and closing brace included.
fn function_lines(code: &str, name: &str) -> Option<(usize, usize)> {
    let chars: Vec<char> = code.chars().collect();
    let pattern: Vec<char> = format!("fn {name}").chars().collect();
    let at = (0..chars.len().saturating_sub(pattern.len())).find(|&i| {
        chars[i..i + pattern.len()] == pattern[..]
            && !i.checked_sub(1).is_some_and(|p| ident_char(chars[p]))
            && !chars.get(i + pattern.len()).is_some_and(|&c| ident_char(c))
    })?;
    let open = at + chars[at..].iter().position(|&c| c == '{')?;
    let end = past_closing(&chars, open);
    let line = |k: usize| chars[..k].iter().filter(|&&c| c == '\n').count() + 1;
    Some((line(at), line(end - 1) - line(at) + 1))
}

/// Where `shape` occurs in masked code, whitespace (line breaks too) aside: the line of each.
fn shapes(code: &str, shape: &str) -> Vec<usize> {
    let (mut squeezed, mut lines) = (String::new(), Vec::new());
    let mut line = 1;
    for c in code.chars() {
        if c == '\n' {
            line += 1;
        }
        if !c.is_whitespace() {
            squeezed.push(c);
            lines.push(line);
        }
    }
    let chars: Vec<char> = squeezed.chars().collect();
    let shape: Vec<char> = shape.chars().filter(|c| !c.is_whitespace()).collect();
    (0..(chars.len() + 1).saturating_sub(shape.len()))
        .filter(|&i| chars[i..i + shape.len()] == shape[..])
        .map(|i| lines[i])
        .collect()
}

#[test]
fn the_checks_see_what_they_look_for() {
    let code = mask(
        "use crate::pipeline::lines::{LineHook, KeyState};\n\
         fn f(&'a mut self, a: &str, b: impl FnMut() -> Fut<'f, T>, c: (u8, u8)) {}\n\
         fn g<T: Fn(u8) -> u8>(self, x: T) -> Option<Result<(), ()>> { lines::park(x) }\n\
         // lines::Open, in a comment\n",
    );
    assert_eq!(
        names_from_lines(&code),
        vec![
            ("LineHook".to_string(), 1),
            ("KeyState".to_string(), 1),
            ("park".to_string(), 3)
        ]
    );
    assert_eq!(
        parameters(&code),
        vec![("f".to_string(), 2, 3), ("g".to_string(), 3, 1)]
    );
    assert_eq!(words(&code, "KeyState"), vec![1]);
    assert_eq!(
        words(&code, "Open"),
        Vec::<usize>::new(),
        "comments are masked"
    );
    assert_eq!(function_lines(&code, "g"), Some((3, 1)));
    assert_eq!(shapes(&code, "Option<Result<"), vec![3]);
    assert_eq!(
        shapes("let a: Option<\n  Result<u8, ()>>;", "Option<Result<"),
        vec![1]
    );
    assert_eq!(shapes(&code, "(bool, bool)"), Vec::<usize>::new());
    assert_eq!(
        shapes("fn h() -> (bool,\n bool) {}", "(bool, bool)"),
        vec![1]
    );
}

#[test]
fn the_event_and_retry_paths_name_ordered_retries_only_through_the_hook() {
    let mut found = Vec::new();
    for file in ["pipeline/partition/event.rs", "pipeline/retry/steps.rs"] {
        let code = masked(file);
        for (name, line) in names_from_lines(&code) {
            if !HOOK.contains(&name.as_str()) {
                found.push(format!("src/{file}:{line} names lines::{name}"));
            }
        }
        for word in LINE_INTERNALS {
            for line in words(&code, word) {
                found.push(format!("src/{file}:{line} names {word}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the event and retry paths reach ordered retries through `LineHook` only (move the \
         step behind the hook in src/pipeline/lines/hook.rs):\n{}",
        found.join("\n")
    );
}

#[test]
fn no_function_of_the_event_path_takes_more_than_four_parameters() {
    let mut found = Vec::new();
    for file in ["pipeline/partition/event.rs", "pipeline/lines/hook.rs"] {
        for (name, line, count) in parameters(&masked(file)) {
            if count > MAX_PARAMETERS {
                found.push(format!("src/{file}:{line} {name} takes {count}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "over {MAX_PARAMETERS} parameters (pass a context struct):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_core_event_path_reads_in_one_screen() {
    let file = "pipeline/partition/event.rs";
    let code = masked(file);
    let (line, lines) = function_lines(&code, "process").expect("event.rs has its `process`");
    assert!(
        lines <= PROCESS_LINES,
        "src/{file}:{line} process is {lines} lines (at most {PROCESS_LINES}: admit → pace → \
         attempt → settle, with the line steps behind the hook)"
    );
    let total = code.lines().count();
    assert!(
        total <= EVENT_MODULE_LINES,
        "src/{file} is {total} lines (at most {EVENT_MODULE_LINES}): the line steps belong in \
         src/pipeline/lines/"
    );
}

#[test]
fn the_pipeline_says_what_it_means_without_nested_options_or_boolean_pairs() {
    let root = src();
    let mut files = Vec::new();
    rust_files(&root.join("pipeline"), &mut files);
    assert!(files.len() > 30, "found only {} files", files.len());
    let mut found = Vec::new();
    for path in &files {
        let code = mask(&std::fs::read_to_string(path).unwrap());
        let file = path.strip_prefix(&root).unwrap().display();
        for shape in ["Option<Result<", "(bool, bool)"] {
            for line in shapes(&code, shape) {
                found.push(format!("src/{file}:{line} has {shape}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "name what these mean (an enum, a struct with named fields):\n{}",
        found.join("\n")
    );
}

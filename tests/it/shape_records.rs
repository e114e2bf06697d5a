//! One way to change a record (issue 38): read from the sources the way `sizes.rs` reads
//! them (comments and strings masked first), so a regression fails here naming the file and
//! line.
//!
//! - **At most one compare-and-swap loop over records** in product code: the one in
//!   `azure::versioned` (`compare_and_swap`), which every record kind goes through. A
//!   *compare-and-swap loop* is a loop (`loop`, `for … in`, `while`) whose body
//!   1. writes a record: calls `.create(`, `.update(`, `.put(`, `.write(`, `.write_tagged(`,
//!      `.write_indexed(` or `.write_line(`, or a function whose name ends in `written(`, or
//!      passes an `etag` to a call; and
//!   2. goes round again when the write loses: names `Conflict`, asks `.lost(`, or is a loop
//!      of bounded rounds (`for _ in 0..`).
//!
//!   Product code is `src/` without the test bed (`bench/`, `cli/`, `demo/`, `emulator/`) and
//!   without `#[cfg(test)]` modules. No file is exempt.
//! - **No `(LedgerRecord, String)`** (a record and its ETag as an anonymous pair) anywhere in
//!   `src/` or `tests/`: a record read with its ETag is a `Versioned<LedgerRecord>`.
//! - **A record's state changes only through its transitions**: the fields `state`,
//!   `next_attempt_ms` and `dead_letter_reason` of `LedgerRecord` are not public (the
//!   compiler then refuses any assignment outside `src/ledger`), and product code outside
//!   `src/ledger` never uses the test bed's door around the transitions (`force_state`).

use std::path::{Path, PathBuf};

use crate::sizes::{closing, ident_char, line_of, mask, masked, sources, test_modules};

/// Test-bed directories of `src/`: not product code.
const TEST_BED: &[&str] = &["bench", "cli", "demo", "emulator"];

/// The one loop allowed.
const THE_LOOP: &str = "azure/versioned.rs";

/// `path` relative to `src/`, with `/` separators.
fn relative(root: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(root).unwrap();
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

fn product(rel: &str) -> bool {
    !TEST_BED.iter().any(|d| rel.starts_with(&format!("{d}/")))
}

/// Whether `text` has the word `word` at `at` (no identifier character either side).
fn word_at(text: &[char], at: usize, word: &str) -> bool {
    let w: Vec<char> = word.chars().collect();
    text.get(at..at + w.len()) == Some(&w[..])
        && !at.checked_sub(1).is_some_and(|p| ident_char(text[p]))
        && !text.get(at + w.len()).is_some_and(|&c| ident_char(c))
}

/// Whether `body` writes a record (condition 1 of the module documentation).
fn writes_a_record(body: &str) -> bool {
    let calls = [
        ".create(",
        ".update(",
        ".put(",
        ".write(",
        ".write_tagged(",
        ".write_indexed(",
        ".write_line(",
        "written(",
    ];
    let squeezed: String = body.chars().filter(|c| !c.is_whitespace()).collect();
    calls.iter().any(|c| squeezed.contains(c))
        || ["(etag", ",etag", "(&etag", ",&etag", "etag.as_deref()"]
            .iter()
            .any(|e| {
                squeezed.match_indices(e).any(|(i, m)| {
                    !squeezed[i + m.len()..]
                        .chars()
                        .next()
                        .is_some_and(ident_char)
                })
            })
}

/// Whether `body` goes round again when a write loses (condition 2), `header` being what
/// stands between the loop's keyword and its body.
fn retries_when_it_loses(header: &str, body: &str) -> bool {
    let bounded = {
        let h: String = header.chars().filter(|c| !c.is_whitespace()).collect();
        h.starts_with("_in0..")
    };
    bounded || body.contains("Conflict") || body.contains(".lost(")
}

/// The compare-and-swap loops of masked `code` outside `skip`: their first lines.
fn cas_loops(code: &[char], skip: &[(usize, usize)]) -> Vec<usize> {
    let mut found = Vec::new();
    for at in 0..code.len() {
        let Some(keyword) = ["loop", "for", "while"]
            .into_iter()
            .find(|k| word_at(code, at, k))
        else {
            continue;
        };
        if skip.iter().any(|&(a, b)| (a..=b).contains(&at)) {
            continue;
        }
        let after = at + keyword.len();
        let Some(open) = code[after..].iter().position(|&c| c == '{' || c == ';') else {
            continue;
        };
        let open = after + open;
        if code[open] == ';' {
            continue;
        }
        let header: String = code[after..open].iter().collect();
        // `impl Trait for Type {` and `for<'a>` are no loops; `loop` has no header.
        let is_loop = match keyword {
            "for" => header.split_whitespace().any(|w| w == "in"),
            "loop" => header.trim().is_empty(),
            _ => true,
        };
        if !is_loop {
            continue;
        }
        let body: String = code[open..=closing(code, open)].iter().collect();
        if writes_a_record(&body) && retries_when_it_loses(&header, &body) {
            found.push(line_of(code, at));
        }
    }
    found
}

#[test]
fn the_loop_definition_finds_hand_written_compare_and_swaps_and_nothing_else() {
    let cas = "fn change() { for _ in 0..16 { let (v, etag) = read(); match store.update(k, v, &etag) { Ok(_) => return, Err(StoreError::Conflict) => continue, Err(_) => return } } }";
    let code: Vec<char> = mask(cas).chars().collect();
    assert_eq!(cas_loops(&code, &[]), vec![1], "a hand-written loop");
    let planned = "fn s() {\n    for _ in 0..ROUNDS {\n        let plan = plan(&rec);\n        if let Some(done) = self.execute(plan, etag.as_deref()).await? { return done; }\n    }\n}";
    let code: Vec<char> = mask(planned).chars().collect();
    assert_eq!(
        cas_loops(&code, &[]),
        vec![2],
        "a loop of rounds writing with an ETag"
    );
    let not = "impl RecordKind for Json { fn write(&self) { self.store.update(k, b, e) } }\nfn sweep() { for l in listed { if let Err(StoreError::Conflict) = store.delete(&l.key, &l.etag).await {} } }\nfn f() { loop { tick().await; } }";
    let code: Vec<char> = mask(not).chars().collect();
    assert!(cas_loops(&code, &[]).is_empty(), "an impl, a sweep, a tick");
}

#[test]
fn at_most_one_compare_and_swap_loop_over_records_in_product_code() {
    let (root, files) = sources();
    let mut loops = Vec::new();
    for path in &files {
        let rel = relative(&root, path);
        if !product(&rel) {
            continue;
        }
        let code = masked(path);
        for line in cas_loops(&code, &test_modules(&code)) {
            loops.push(format!("src/{rel}:{line}"));
        }
    }
    let others: Vec<&String> = loops
        .iter()
        .filter(|l| !l.starts_with(&format!("src/{THE_LOOP}:")))
        .collect();
    assert!(
        loops.len() <= 1 && others.is_empty(),
        "compare-and-swap loops over records besides the one in src/{THE_LOOP} (use \
         azure::versioned::compare_and_swap with a RecordKind instead):\n{}",
        loops.join("\n")
    );
    assert_eq!(
        loops.len(),
        1,
        "the one loop is in src/{THE_LOOP}: {loops:?}"
    );
}

/// Every `.rs` file under `dir` of the crate (`src`, `tests`), test modules of their own
/// included.
fn all_files(dir: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut out = Vec::new();
    let mut dirs = vec![root];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out
}

/// The lines of `text` holding `(…LedgerRecord, …String)`, whatever the spacing and the
/// paths.
fn record_etag_pairs(text: &str) -> Vec<usize> {
    let squeezed: Vec<(usize, char)> = text
        .chars()
        .scan(1, |line, c| {
            let at = *line;
            if c == '\n' {
                *line += 1;
            }
            Some((at, c))
        })
        .filter(|(_, c)| !c.is_whitespace())
        .collect();
    let flat: String = squeezed.iter().map(|(_, c)| c).collect();
    let chars: Vec<char> = flat.chars().collect();
    let mut lines = Vec::new();
    for (i, _) in flat.match_indices("LedgerRecord,") {
        let i = flat[..i].chars().count();
        // `(` then a path (`crate::ledger::`) right before the name.
        let start = chars[..i]
            .iter()
            .rposition(|&c| !(ident_char(c) || c == ':'))
            .unwrap_or(0);
        let after: String = chars[i + "LedgerRecord,".len()..].iter().collect();
        let rest = after
            .strip_prefix("std::string::")
            .or_else(|| after.strip_prefix("::std::string::"))
            .unwrap_or(&after);
        if chars.get(start) == Some(&'(') && rest.starts_with("String)") {
            lines.push(squeezed[i].0);
        }
    }
    lines
}

#[test]
fn no_ledger_record_travels_with_its_etag_as_an_anonymous_pair() {
    assert_eq!(
        record_etag_pairs("fn f(\n  r: Option<( crate::ledger::LedgerRecord,\n String )>) {}"),
        vec![2]
    );
    assert!(record_etag_pairs("Versioned<LedgerRecord>, (LedgerRecord, u32)").is_empty());
    let crate_root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files: Vec<PathBuf> = all_files("src")
        .into_iter()
        .chain(all_files("tests"))
        .collect();
    assert!(files.len() > 150, "found only {} files", files.len());
    let mut found = Vec::new();
    for path in &files {
        let code: String = masked(path).into_iter().collect();
        let name = path.strip_prefix(crate_root).unwrap().display();
        for line in record_etag_pairs(&code) {
            found.push(format!("{name}:{line}"));
        }
    }
    assert!(
        found.is_empty(),
        "(LedgerRecord, String): use Versioned<LedgerRecord>:\n{}",
        found.join("\n")
    );
}

#[test]
fn a_records_state_changes_only_through_its_transitions() {
    let (root, files) = sources();
    // The three fields are not public: nothing outside `ledger` can assign them.
    let record = root.join("ledger").join("record.rs");
    let code = masked(&record);
    let text: String = code.iter().collect();
    let at = text
        .find("pub struct LedgerRecord")
        .expect("LedgerRecord in src/ledger/record.rs");
    let at = text[..at].chars().count();
    let open = at + code[at..].iter().position(|&c| c == '{').unwrap();
    let body: String = code[open..=closing(&code, open)].iter().collect();
    let mut public = Vec::new();
    for field in ["state", "next_attempt_ms", "dead_letter_reason"] {
        let line = body
            .lines()
            .find(|l| {
                l.split(':')
                    .next()
                    .is_some_and(|d| d.split_whitespace().last() == Some(field))
            })
            .unwrap_or_else(|| panic!("no field {field} in LedgerRecord"));
        let visibility = line.split(':').next().unwrap().trim();
        if visibility == format!("pub {field}") || visibility == format!("pub(crate) {field}") {
            public.push(format!("src/ledger/record.rs: `{}`", line.trim()));
        }
    }
    assert!(
        public.is_empty(),
        "a record's state fields are the ledger's (change them through schedule_retry, \
         deliver, dead_letter):\n{}",
        public.join("\n")
    );
    // Nor does product code outside the ledger open the test bed's door around them.
    let mut doors = Vec::new();
    for path in &files {
        let rel = relative(&root, path);
        if !product(&rel) || rel.starts_with("ledger/") {
            continue;
        }
        let code = masked(path);
        let tests = test_modules(&code);
        let text: String = code.iter().collect();
        for (i, _) in text.match_indices(".force_state(") {
            let at = text[..i].chars().count();
            if !tests.iter().any(|&(a, b)| (a..=b).contains(&at)) {
                doors.push(format!("src/{rel}:{}", line_of(&code, at)));
            }
        }
    }
    assert!(
        doors.is_empty(),
        "force_state is the tests' door, not product code's:\n{}",
        doors.join("\n")
    );
}

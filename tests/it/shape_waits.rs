//! Tests wait on events, not on the clock: `sleep(` appears in `tests/` only inside the
//! waiting helper (`Wait::until` in common.rs, behind `eventually` and `wait_for`) or on a
//! line marked `// simulated work` (a handler that takes 50 ms: the behaviour under test,
//! not a wait), and those stay a dozen at most. A fixed sleep before a "nothing happened"
//! assertion passes without checking anything on a slow machine: wait instead for evidence
//! that the code under test had its chance (checkpoint ticks, a later event, a health
//! change, a counter moving). Read from the sources with comments and strings masked (as
//! sizes.rs does), so a regression fails here naming the file and line.

use std::path::{Path, PathBuf};

use crate::sizes::{functions, mask, rust_files};

/// The marker a line of simulated work carries (a trailing comment).
const SIMULATED: &str = "// simulated work";
/// How many lines of simulated work may sleep.
const SIMULATED_AT_MOST: usize = 12;
/// The file and function of the one waiting helper.
const HELPER: (&str, &str) = ("tests/it/common.rs", "until");

/// What one file's `sleep(`s are: those in the helper, those marked as simulated work, and
/// the offending ones (`label:line: text`).
#[derive(Debug, Default, PartialEq)]
struct Sleeps {
    in_helper: usize,
    simulated: Vec<String>,
    offending: Vec<String>,
}

/// Sorts the `sleep(`s of `src` (the file `label`); `helper` names the function whose
/// sleeps are the waiting helper's, if this file holds it.
fn sleeps(label: &str, src: &str, helper: Option<&str>) -> Sleeps {
    let masked = mask(src);
    let code: Vec<char> = masked.chars().collect();
    let helper_lines: Vec<(usize, usize)> = functions(&code, &[])
        .into_iter()
        .filter(|(name, _, _)| Some(name.as_str()) == helper)
        .map(|(_, first, lines)| (first, first + lines - 1))
        .collect();
    let mut out = Sleeps::default();
    for (i, (code_line, raw)) in masked.lines().zip(src.lines()).enumerate() {
        let line = i + 1;
        for _ in code_line.matches("sleep(") {
            let at = format!("{label}:{line}: {}", raw.trim());
            if helper_lines.iter().any(|&(a, b)| (a..=b).contains(&line)) {
                out.in_helper += 1;
            } else if raw.contains(SIMULATED) {
                out.simulated.push(at);
            } else {
                out.offending.push(at);
            }
        }
    }
    out
}

/// `tests/` and its Rust files (dozens: a wrong path must not pass for a tidy one).
fn test_sources() -> (PathBuf, Vec<PathBuf>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(files.len() > 40, "found only {} files", files.len());
    (root, files)
}

#[test]
fn the_scan_tells_the_helper_simulated_work_and_a_fixed_wait_apart() {
    let src = "async fn until() {\n    tokio::time::sleep(d).await;\n}\n\
               async fn handle() {\n    tokio::time::sleep(d).await; // simulated work\n}\n\
               async fn negative() {\n    let _ = \"sleep(\"; // sleep( in a comment\n    \
               tokio::time::sleep(Duration::from_millis(800)).await;\n    assert!(nothing());\n}\n";
    let s = sleeps("x.rs", src, Some("until"));
    assert_eq!(s.in_helper, 1, "{s:?}");
    assert_eq!(s.simulated.len(), 1, "{s:?}");
    assert_eq!(
        s.offending,
        vec!["x.rs:9: tokio::time::sleep(Duration::from_millis(800)).await;".to_string()]
    );
    // Outside the helper's file, the helper's name excuses nothing.
    assert_eq!(sleeps("y.rs", src, None).offending.len(), 2);
}

#[test]
fn tests_sleep_only_in_the_waiting_helper_or_for_simulated_work() {
    let (root, files) = test_sources();
    let mut all = Sleeps::default();
    for path in &files {
        let label = format!("tests/{}", path.strip_prefix(&root).unwrap().display());
        let helper = (label == HELPER.0).then_some(HELPER.1);
        let s = sleeps(&label, &std::fs::read_to_string(path).unwrap(), helper);
        all.in_helper += s.in_helper;
        all.simulated.extend(s.simulated);
        all.offending.extend(s.offending);
    }
    assert!(
        all.in_helper >= 1,
        "no sleep found in {}'s `{}`: the waiting helper moved; update HELPER",
        HELPER.0,
        HELPER.1
    );
    assert!(
        all.offending.is_empty(),
        "a fixed wait in tests/ (wait with `eventually` for what the code under test does, or \
         mark simulated work `{SIMULATED}`):\n{}",
        all.offending.join("\n")
    );
    assert!(
        all.simulated.len() <= SIMULATED_AT_MOST,
        "more than {SIMULATED_AT_MOST} lines of simulated work sleep:\n{}",
        all.simulated.join("\n")
    );
}

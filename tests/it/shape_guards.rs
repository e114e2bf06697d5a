//! Guards are released by what owns them: at most [`HAND_PLACED`] hand-placed `drop(` calls
//! in `src/pipeline` outside its tests (a lock released by the end of its block, a token by
//! the task that holds it), so the order in which a guard goes is read from the code's shape,
//! not from a line to be kept in its place. Counted in the sources masked as `sizes.rs`
//! masks them (comments and strings count for nothing); `fn drop` (a `Drop` impl) is not a
//! call.

use std::path::Path;

use crate::sizes::{line_of, mask, masked, sources, test_modules};

/// The most hand-placed `drop(` calls `src/pipeline` may hold.
const HAND_PLACED: usize = 6;

/// The `drop(` calls of masked `code` outside `skip`: their lines.
fn drops(code: &[char], skip: &[(usize, usize)]) -> Vec<usize> {
    let word: Vec<char> = "drop(".chars().collect();
    let mut out = Vec::new();
    for at in 0..code.len().saturating_sub(word.len()) {
        if code[at..at + word.len()] != word[..]
            || skip.iter().any(|&(a, b)| (a..=b).contains(&at))
            || at
                .checked_sub(1)
                .is_some_and(|p| code[p].is_alphanumeric() || code[p] == '_' || code[p] == '.')
        {
            continue;
        }
        let before: String = code[at.saturating_sub(8)..at].iter().collect();
        if before.trim_end().ends_with("fn") {
            continue;
        }
        out.push(line_of(code, at));
    }
    out
}

fn found(path: &Path) -> Vec<usize> {
    let code = masked(path);
    drops(&code, &test_modules(&code))
}

#[test]
fn the_pipeline_releases_its_guards_by_their_owners() {
    let (root, files) = sources();
    let mut all = Vec::new();
    for f in files
        .iter()
        .filter(|f| f.starts_with(root.join("pipeline")))
    {
        for line in found(f) {
            all.push(format!(
                "{}:{line}",
                f.strip_prefix(&root).unwrap().display()
            ));
        }
    }
    assert!(
        all.len() <= HAND_PLACED,
        "{} hand-placed drop( calls in src/pipeline (at most {HAND_PLACED}): release the guard by \
         the block or the type that owns it:\n{}",
        all.len(),
        all.join("\n")
    );
}

#[test]
fn the_count_sees_calls_and_not_drop_impls_comments_strings_or_tests() {
    let src = "impl Drop for G {\n    fn drop(&mut self) {}\n}\n\
               fn f() {\n    let g = lock();\n    drop(g); // drop(x)\n    let _ = \"drop(y)\";\n    \
               std::mem::drop(h);\n    x.drop(z);\n}\n\
               #[cfg(test)]\nmod tests {\n    fn t() { drop(a); }\n}\n";
    let code: Vec<char> = mask(src).chars().collect();
    assert_eq!(drops(&code, &test_modules(&code)), vec![6, 8]);
}

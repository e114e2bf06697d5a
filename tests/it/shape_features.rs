//! Features that say what they are (issue 38): the operator's command line is a feature of its
//! own (`cli`), not the test bed's; what remains of `testbed` in the product's modules is the
//! few doors the tests need (at most [`TESTBED_GATES`]); and no `pub fn` of `src/` answers a
//! `String` for an error. Read from the sources as `sizes.rs` reads them (comments and strings
//! masked first, so a gate quoted in a comment counts for nothing), so a regression fails here
//! naming the file and line.

use std::path::Path;

use super::sizes::{mask, sources};

/// The most `feature = "testbed"` gates the product's modules may hold.
const TESTBED_GATES: usize = 20;

/// The test bed's own code, where `testbed` gates are its business: the emulators, the demo,
/// the bench, the command line (whose demo, emulator and bench subcommands are the test bed's),
/// and the binary. Everything else in `src/`, `lib.rs` included, is the product.
const TEST_BED: &[&str] = &["emulator/", "demo/", "bench/", "cli/", "main.rs"];

/// The 1-based line of every `feature = "NAME"` in `src` (code only: a `feature = "…"` in a
/// comment or inside a string is not a gate).
fn feature_gates(src: &str, name: &str) -> Vec<usize> {
    let code: Vec<char> = mask(src).chars().collect();
    let text: Vec<char> = src.chars().collect();
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut found = Vec::new();
    for i in 0..code.len() {
        if code[i..].len() < "feature".len()
            || code[i..i + "feature".len()].iter().collect::<String>() != "feature"
            || i.checked_sub(1).is_some_and(|p| ident(code[p]))
            || code.get(i + "feature".len()).is_some_and(|&c| ident(c))
        {
            continue;
        }
        let mut j = i + "feature".len();
        while code.get(j).is_some_and(|c| c.is_whitespace()) {
            j += 1;
        }
        if code.get(j) != Some(&'=') {
            continue;
        }
        j += 1;
        // The string literal is masked to spaces: stop at its quote in the source.
        while code.get(j).is_some_and(|c| c.is_whitespace()) && text.get(j) != Some(&'"') {
            j += 1;
        }
        // The string itself is masked: read it from the source at the same place.
        if text.get(j) != Some(&'"') {
            continue;
        }
        let value: String = text[j + 1..].iter().take_while(|&&c| c != '"').collect();
        if value == name {
            found.push(text[..i].iter().filter(|&&c| c == '\n').count() + 1);
        }
    }
    found
}

/// The 1-based lines of the `pub fn`s in `src` whose return type is `Result<_, String>`.
fn string_error_fns(src: &str) -> Vec<(usize, String)> {
    let code = mask(src);
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("pub ") {
        let start = from + at;
        from = start + 1;
        if code[..start]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        // `pub fn`, `pub async fn`, `pub const fn`, `pub unsafe fn`…
        let rest = &code[start + "pub ".len()..];
        let words: Vec<&str> = rest.split_whitespace().take(4).collect();
        let Some(fn_at) = words.iter().position(|w| *w == "fn") else {
            continue;
        };
        if !words[..fn_at]
            .iter()
            .all(|w| matches!(*w, "async" | "const" | "unsafe"))
        {
            continue;
        }
        // The signature: up to the body, the `;` of a declaration, or a `where`.
        let end = rest.find(['{', ';']).unwrap_or(rest.len());
        let signature = &rest[..end];
        let signature = signature
            .split_inclusive(char::is_whitespace)
            .take_while(|w| w.trim() != "where")
            .collect::<String>();
        let Some(arrow) = signature.rfind("->") else {
            continue;
        };
        let returns: String = signature[arrow + 2..].split_whitespace().collect();
        if let Some(args) = returns
            .strip_prefix("Result<")
            .or_else(|| returns.strip_prefix("std::result::Result<"))
        {
            let mut depth = 0i32;
            let mut error = None;
            for (k, c) in args.char_indices() {
                match c {
                    '<' | '(' | '[' => depth += 1,
                    '>' | ')' | ']' => depth -= 1,
                    ',' if depth == 0 => {
                        error = args[k + 1..].strip_suffix('>');
                        break;
                    }
                    _ => {}
                }
            }
            if matches!(error, Some("String" | "std::string::String")) {
                let line = code[..start].matches('\n').count() + 1;
                let name: String = words[fn_at + 1]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                found.push((line, name));
            }
        }
    }
    found
}

fn shown(root: &Path, path: &Path) -> String {
    format!("src/{}", path.strip_prefix(root).unwrap().display())
}

fn is_test_bed(root: &Path, path: &Path) -> bool {
    let rel = path
        .strip_prefix(root)
        .unwrap()
        .to_string_lossy()
        .replace('\\', "/");
    TEST_BED.iter().any(|t| rel == *t || rel.starts_with(t))
}

#[test]
fn the_readers_find_gates_and_string_errors_in_code_only() {
    let src = "#[cfg(any(test, feature = \"testbed\"))]\nfn a() {}\n\
               // #[cfg(feature = \"testbed\")]\n\
               #[cfg_attr(not(feature=\"testbed\"), allow(dead_code))]\n\
               #[cfg(feature = \"cli\")]\nconst S: &str = \"feature = \\\"testbed\\\"\";\n";
    assert_eq!(feature_gates(src, "testbed"), [1, 4]);
    assert_eq!(feature_gates(src, "cli"), [5]);
    let src = "pub fn a(s: &str) -> Result<u8, String> {\n}\n\
               pub async fn b(\n    x: u8,\n) -> Result<Vec<(u8, String)>, String>\nwhere\n{}\n\
               pub fn c() -> Result<String, Error> {}\n\
               fn d() -> Result<(), String> {}\n\
               pub(crate) fn e() -> Result<(), String> {}\n\
               // pub fn f() -> Result<(), String>\n\
               pub fn g() -> Result<(), BadLimit> {}\n";
    assert_eq!(
        string_error_fns(src),
        [(1, "a".to_string()), (3, "b".to_string())]
    );
}

/// At most [`TESTBED_GATES`] `feature = "testbed"` gates in the product's modules: the doors
/// the tests need, not the operator's commands (those are `cli`'s) nor code only unit tests
/// use (`cfg(test)`).
#[test]
fn the_product_holds_few_test_bed_gates() {
    let (root, files) = sources();
    let mut gates = Vec::new();
    for path in files.iter().filter(|p| !is_test_bed(&root, p)) {
        let src = std::fs::read_to_string(path).unwrap();
        for line in feature_gates(&src, "testbed") {
            gates.push(format!("{}:{line}", shown(&root, path)));
        }
    }
    assert!(
        gates.len() <= TESTBED_GATES,
        "{} test-bed gates in product modules (at most {TESTBED_GATES}: keep only the tests' \
         doors; the operator's commands are `cli`'s, unit tests' helpers `cfg(test)`):\n  {}",
        gates.len(),
        gates.join("\n  ")
    );
}

/// The operator's command line is a feature of its own: `cli` exists, the default enables it
/// with the test bed, the `hubguard` binary requires it and not `testbed`, `src/lib.rs`
/// declares the `cli` module under it, and in `src/cli/` only the test bed's subcommands
/// (demo, emulator, bench) are gated on `testbed`.
#[test]
fn the_command_line_is_its_own_feature() {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let manifest: toml::Table = std::fs::read_to_string(manifest_dir.join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let features = manifest["features"].as_table().expect("[features]");
    assert!(features.contains_key("cli"), "Cargo.toml: no `cli` feature");
    let default: Vec<&str> = features["default"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(
        default.contains(&"cli") && default.contains(&"testbed"),
        "Cargo.toml: default = {default:?} (both `cli` and `testbed`, so `cargo run -- demo` and \
         `cargo test` work as they are)"
    );
    let bins = manifest["bin"].as_array().expect("[[bin]]");
    let hubguard = bins
        .iter()
        .find(|b| b["name"].as_str() == Some("hubguard"))
        .expect("the hubguard binary");
    let required: Vec<&str> = hubguard
        .get("required-features")
        .and_then(|r| r.as_array())
        .map(|r| r.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        required,
        ["cli"],
        "Cargo.toml: the hubguard binary requires {required:?}: the operator's commands need \
         `cli`, not the test bed"
    );

    let src = manifest_dir.join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let code = mask(&lib);
    let cli_mod = code
        .find("pub mod cli;")
        .expect("src/lib.rs declares `pub mod cli;`");
    let cli_line = code[..cli_mod].matches('\n').count() + 1;
    assert!(
        feature_gates(&lib, "cli").contains(&(cli_line - 1)),
        "src/lib.rs:{cli_line}: `pub mod cli;` is not declared under `#[cfg(feature = \"cli\")]`"
    );

    // In the command line, `testbed` gates only the test bed's own subcommands.
    let mut wrong = Vec::new();
    let mut files = Vec::new();
    super::sizes::rust_files(&src.join("cli"), &mut files);
    assert!(
        files.len() >= 5,
        "found only {} files in src/cli",
        files.len()
    );
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for line in feature_gates(&text, "testbed") {
            // The item the gate is on: the next line that is not an attribute or a comment.
            let item = lines[line..]
                .iter()
                .map(|l| l.trim())
                .find(|l| !l.starts_with("#[") && !l.starts_with("//"))
                .unwrap_or("");
            let bed = [
                "Demo", "demo", "Emulator", "emulator", "Bench", "bench", "bed",
            ];
            if !bed.iter().any(|b| item.contains(b)) {
                wrong.push(format!("{}:{line}: {item}", shown(&src, path)));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the operator's commands gated on the test bed (gate them on `cli`, or not at all):\n  {}",
        wrong.join("\n  ")
    );
}

/// Errors are typed: no `pub fn` in `src/` returns `Result<_, String>` (give the error a type
/// whose `Display` says the same).
#[test]
fn no_pub_fn_returns_a_string_error() {
    let (root, files) = sources();
    let mut found = Vec::new();
    for path in &files {
        let src = std::fs::read_to_string(path).unwrap();
        for (line, name) in string_error_fns(&src) {
            found.push(format!("{}:{line} {name}", shown(&root, path)));
        }
    }
    assert!(
        found.is_empty(),
        "pub fns returning Result<_, String>:\n  {}",
        found.join("\n  ")
    );
}

//! A partition's state is one value, not a combination of maps (issue 38): no struct in
//! `src/` holds more than three maps keyed by partition. What it counts: per struct with
//! named fields, the fields whose type names a `HashMap<` or a `BTreeMap<` anywhere (wrapped
//! in a `Mutex`, an `Option` or not) and whose name or doc comment says "partition" — the
//! way the crate documents what a map is keyed by ("partition → …"). A fourth such map is
//! the "struct of maps" whose combination means a state: put what is known of a partition
//! in one value (a map of structs), as `checkpoint::lifecycle::Partition` does. Read from
//! the sources with comments and strings masked for the structure (see `sizes.rs`), so a
//! regression fails naming the file, the line and the struct.

use std::path::Path;

use crate::sizes::{closing, mask, rust_files};

/// The most maps keyed by partition a struct may hold.
const MAPS: usize = 3;

/// The fields of a masked struct body (between its braces) as ranges of it, split at
/// top-level commas; each range starts after the previous comma, so it holds the field's
/// doc comment too.
fn fields(body: &[char]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut from = 0;
    let mut depth = 0i32;
    for (i, &c) in body.iter().enumerate() {
        match c {
            '<' | '(' | '[' | '{' => depth += 1,
            // `->` in a function type is no closing bracket.
            '>' if i > 0 && body[i - 1] == '-' => {}
            '>' | ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(from..i);
                from = i + 1;
            }
            _ => {}
        }
    }
    out.push(from..body.len());
    out
}

/// Whether a field (its masked code, and its source with the doc comment) is a map keyed
/// by partition.
fn partition_map(code: &str, source: &str) -> bool {
    let Some((name, ty)) = code.split_once(':') else {
        return false;
    };
    let map = ty.contains("HashMap<") || ty.contains("BTreeMap<");
    let docs = source.lines().filter(|l| l.trim_start().starts_with("///"));
    let says = |t: &str| t.to_lowercase().contains("partition");
    map && (says(name) || docs.into_iter().any(says))
}

/// The structs in `source` (masked: `code`) holding more than [`MAPS`] maps keyed by
/// partition: (line, name, count).
fn crowded(source: &str, code: &str) -> Vec<(usize, String, usize)> {
    let chars: Vec<char> = code.chars().collect();
    let original: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = code[at..].find("struct ") {
        let start = at + i;
        at = start + 1;
        if code[..start].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[start + "struct ".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The body: a `{` before any `;` or `(` (a unit or tuple struct has none).
        let Some(brace) = rest.find(['{', ';', '(']) else {
            continue;
        };
        if !rest[brace..].starts_with('{') {
            continue;
        }
        let open = code[..start + "struct ".len() + brace].chars().count();
        let close = closing(&chars, open);
        let maps = fields(&chars[open + 1..close])
            .into_iter()
            .filter(|r| {
                let range = open + 1 + r.start..open + 1 + r.end;
                let code: String = chars[range.clone()].iter().collect();
                let source: String = original[range].iter().collect();
                partition_map(&code, &source)
            })
            .count();
        if maps > MAPS {
            let line = chars[..open].iter().filter(|&&c| c == '\n').count() + 1;
            out.push((line, name, maps));
        }
    }
    out
}

fn check(source: &str) -> Vec<(usize, String, usize)> {
    crowded(source, &mask(source))
}

#[test]
fn the_counter_sees_maps_keyed_by_partition_and_nothing_in_comments_or_strings() {
    let source = "/// struct Doc { partition_a: HashMap<u8, u8>, partition_b: HashMap<u8, u8>, partition_c: HashMap<u8, u8>, partition_d: HashMap<u8, u8> }\n\
         struct Other { a: HashMap<String, u8>, b: HashMap<String, u8>, c: BTreeMap<String, u8>, d: HashMap<String, u8> }\n\
         struct Fine { partitions: HashMap<String, (u8, u8)>, partition_b: Mutex<BTreeMap<u8, Vec<u8>>>, f: Box<dyn Fn(u8) -> u8>, partition_c: HashMap<u8, u8>, s: &'static str }\n\
         struct Tuple(HashMap<u8, u8>, HashMap<u8, u8>, HashMap<u8, u8>, HashMap<u8, u8>);\n\
         pub(super) struct FenceState {\n    /// partition → when this replica last claimed it.\n    claimed: HashMap<String, Instant>,\n    /// Partitions read, and what stops them.\n    reading: Option<HashMap<String, u8>>,\n    /// The hub's partitions.\n    ids: Vec<String>,\n    unowned_partitions: std::collections::BTreeMap<String, u8>,\n    /// partition → the asker.\n    giving: HashMap<String, (String, u8)>,\n    /// Keyed by record.\n    records: HashMap<String, u8>,\n}\n\
         const S: &str = \"struct Str { partition_a: HashMap<u8,u8>, partition_b: HashMap<u8,u8>, partition_c: HashMap<u8,u8>, partition_d: HashMap<u8,u8> }\";";
    assert_eq!(check(source), vec![(5, "FenceState".to_string(), 4)]);
}

#[test]
fn no_struct_holds_more_than_three_maps_keyed_by_partition() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(files.len() > 100, "found only {} files", files.len());
    let mut wrong = Vec::new();
    for path in &files {
        for (line, name, maps) in check(&std::fs::read_to_string(path).unwrap()) {
            let file = path.strip_prefix(&root).unwrap().display();
            wrong.push(format!(
                "src/{file}:{line} struct {name}: {maps} maps keyed by partition"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "more than {MAPS} maps keyed by partition in one struct (keep what is known of a partition in one value: a map of structs, not a struct of maps):\n{}",
        wrong.join("\n")
    );
}

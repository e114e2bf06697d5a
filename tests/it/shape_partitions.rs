//! A partition's state is one value, not a combination of maps (issue 38): no struct in
//! `src/pipeline/` has more than three map fields. What it counts: per struct with named
//! fields, the fields whose type names a `HashMap<` or a `BTreeMap<` anywhere (wrapped in a
//! `Mutex`, an `Option` or not) — in the pipeline, a map is keyed by partition, by record
//! key or by line, and a fourth one beside three others is the "struct of maps" this check
//! forbids: put what is known of one key in one value (a map of structs), as
//! `checkpoint::lifecycle::Partition` does. Read from the sources with comments and strings
//! masked (see `sizes.rs`), so a regression fails naming the file, the line and the struct.

use std::path::Path;

use crate::sizes::{mask, rust_files};

/// The most map fields a struct of the pipeline may have.
const MAPS: usize = 3;

/// The index of the bracket closing the one at `open` (`{`/`}`), in masked `code`.
fn closing(code: &[char], open: usize) -> usize {
    let mut depth = 0usize;
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

/// The fields of a struct body (between its braces), split at top-level commas.
fn fields(body: &[char]) -> Vec<String> {
    let mut out = Vec::new();
    let mut field = String::new();
    let mut depth = 0i32;
    for (i, &c) in body.iter().enumerate() {
        match c {
            '<' | '(' | '[' | '{' => depth += 1,
            // `->` in a function type is no closing bracket.
            '>' if i > 0 && body[i - 1] == '-' => {}
            '>' | ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut field));
                continue;
            }
            _ => {}
        }
        field.push(c);
    }
    out.push(field);
    out.into_iter().filter(|f| f.contains(':')).collect()
}

fn is_map(field: &str) -> bool {
    let ty = field.split_once(':').map_or("", |(_, t)| t);
    ty.contains("HashMap<") || ty.contains("BTreeMap<")
}

/// The structs in masked `code` with more than [`MAPS`] map fields: (line, name, count).
fn crowded(code: &str) -> Vec<(usize, String, usize)> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = code[at..].find("struct ") {
        let start = at + i;
        at = start + 1;
        if start > 0 && code[..start].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[start + "struct ".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The body: the first `{` before any `;` or `(` (a unit or tuple struct has none).
        let Some(brace) = rest.find(['{', ';', '(']) else {
            continue;
        };
        if !rest[brace..].starts_with('{') {
            continue;
        }
        let open = code[..start + "struct ".len() + brace].chars().count();
        let close = closing(&chars, open);
        let maps = fields(&chars[open + 1..close])
            .iter()
            .filter(|f| is_map(f))
            .count();
        if maps > MAPS {
            let line = chars[..open].iter().filter(|&&c| c == '\n').count() + 1;
            out.push((line, name, maps));
        }
    }
    out
}

#[test]
fn the_counter_sees_a_struct_of_maps_and_nothing_in_comments_or_strings() {
    let code = mask(
        "/// struct Doc { a: HashMap<u8, u8>, b: HashMap<u8, u8>, c: HashMap<u8, u8>, d: HashMap<u8, u8> }\n\
         struct Fine { a: HashMap<String, (u8, u8)>, b: Mutex<BTreeMap<u8, Vec<u8>>>, f: Box<dyn Fn(u8) -> u8>, c: HashMap<u8, u8>, s: &'static str }\n\
         struct Tuple(HashMap<u8, u8>, HashMap<u8, u8>, HashMap<u8, u8>, HashMap<u8, u8>);\n\
         pub(super) struct Crowded {\n    /// partition → a\n    a: HashMap<String, u8>,\n    b: Option<HashMap<String, u8>>,\n    c: std::collections::BTreeMap<String, u8>,\n    d: HashMap<String, (String, u8)>,\n}\n\
         const S: &str = \"struct Str { a: HashMap<u8,u8>, b: HashMap<u8,u8>, c: HashMap<u8,u8>, d: HashMap<u8,u8> }\";",
    );
    assert_eq!(crowded(&code), vec![(4, "Crowded".to_string(), 4)]);
}

#[test]
fn no_struct_of_the_pipeline_has_more_than_three_maps() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root.join("pipeline"), &mut files);
    assert!(files.len() > 30, "found only {} files", files.len());
    let mut wrong = Vec::new();
    for path in &files {
        let code = mask(&std::fs::read_to_string(path).unwrap());
        for (line, name, maps) in crowded(&code) {
            let file = path.strip_prefix(&root).unwrap().display();
            wrong.push(format!(
                "src/{file}:{line} struct {name}: {maps} map fields"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "more than {MAPS} map fields in one struct (keep one value per key: a map of structs, not a struct of maps):\n{}",
        wrong.join("\n")
    );
}
